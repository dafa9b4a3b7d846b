//! File operations on a session's sandbox: read, write, stat, list,
//! mkdir, remove, rename. Each takes the session (found with
//! [`super::Ops::find`] or [`super::Ops::session`]), checks its paths and
//! answers typed; the front ends shape the reply. Replies built from guest
//! data lease their memory from the caller's [`Lease`] as they grow.

use super::{validate, Ops, OpsError, OpsResult};
use crate::agent::{Call, ClientError, Inbound};
use crate::budget::Lease;
use crate::proto::{DirEntry, Event, FileStat, FileType, Request, Response};
use crate::session::Session;
use base64::Engine;
use serde::Serialize;
use std::time::{Duration, Instant};

impl Ops {
    /// The reply-memory lease a request built from guest data starts with
    /// (refused while the daemon-wide budget is spent).
    pub fn reply_lease(&self) -> OpsResult<Lease> {
        Ok(self.mgr.replies.admit()?)
    }
}

/// Writes `data` to `path` (parents created), in one piece: the guest
/// renames into place only after EOF. Answers the bytes written.
pub fn write(
    session: &Session,
    path: &str,
    data: &[u8],
    mode: Option<u32>,
    wait: Duration,
) -> OpsResult<u64> {
    let w = create(session, path, mode, wait)?;
    w.send(data)?;
    w.finish()
}

/// A file being written piece by piece (an upload streamed from a request
/// body). The guest renames it into place only at [`FileWriter::finish`],
/// so one abandoned (dropped or cancelled) leaves no half file.
pub struct FileWriter {
    call: Call,
    path: String,
}

/// Starts writing `path` (parents created; `mode` or the default).
pub fn create(
    session: &Session,
    path: &str,
    mode: Option<u32>,
    wait: Duration,
) -> OpsResult<FileWriter> {
    validate::path(path, "path")?;
    let call = session.call(
        Request::WriteFile {
            path: path.to_string(),
            mode,
            create_parents: true,
            append: false,
        },
        wait,
    )?;
    Ok(FileWriter {
        call,
        path: path.to_string(),
    })
}

impl FileWriter {
    fn failed(&self) -> impl FnOnce(ClientError) -> OpsError {
        OpsError::agent(format!("write {}", self.path))
    }

    /// The next piece of the file.
    pub fn send(&self, data: &[u8]) -> OpsResult<()> {
        self.call.send_all(data).map_err(self.failed())
    }

    /// Gives up: the guest discards what it got.
    pub fn cancel(self) {
        let _ = self.call.cancel();
    }

    /// The file is complete: answers the bytes written.
    pub fn finish(mut self) -> OpsResult<u64> {
        let r = self.call.send_eof().and_then(|_| self.call.finish());
        match r {
            Ok(Response::Written { bytes }) => Ok(bytes),
            Ok(other) => Err(OpsError::unexpected(other)),
            Err(e) => Err(self.failed()(e)),
        }
    }
}

/// Reads a whole file through the session (bounded by `max`), the memory
/// it takes leased from `lease` as it grows. The guest has `wait` for each
/// piece: one that stalls cannot hold the lease for ever.
pub fn read(
    session: &Session,
    lease: &mut Lease,
    path: &str,
    max: u64,
    wait: Duration,
) -> OpsResult<Vec<u8>> {
    validate::path(path, "path")?;
    let mut call = session.call(
        Request::ReadFile {
            path: path.to_string(),
            offset: 0,
            len: Some(max.saturating_add(1)),
        },
        wait,
    )?;
    let failed = |e| OpsError::agent(format!("read {path}"))(e);
    let mut out: Vec<u8> = Vec::new();
    loop {
        match call.recv_deadline(Instant::now() + wait) {
            Ok(Inbound::Data { bytes, .. }) => {
                let len = out.len() + bytes.len();
                if len as u64 > max {
                    return Err(OpsError::FileTooLarge {
                        path: path.to_string(),
                        max,
                    });
                }
                if len > out.capacity() {
                    // Doubling, but never past `max`: what is leased is
                    // what is allocated.
                    let cap = (out.capacity() * 2).clamp(len, max as usize);
                    lease.hold(cap as u64)?;
                    out.reserve_exact(cap - out.len());
                }
                out.extend_from_slice(&bytes);
            }
            Ok(Inbound::Response(_)) => return Ok(out),
            Ok(Inbound::Error(e)) => return Err(failed(ClientError::Agent(e))),
            Ok(_) => {}
            Err(e) => return Err(failed(e)),
        }
    }
}

/// A file's content as a read answers it.
#[derive(Serialize)]
pub struct FileContent<'a> {
    pub path: &'a str,
    pub content: String,
    pub encoding: &'static str,
    pub size: usize,
}

/// `data` as text when it is UTF-8 and base64 is not asked for, else as
/// base64 (its memory leased first).
pub fn content<'a>(
    lease: &mut Lease,
    path: &'a str,
    data: Vec<u8>,
    want_b64: bool,
) -> OpsResult<FileContent<'a>> {
    let size = data.len();
    let (content, encoding) = match (want_b64, String::from_utf8(data)) {
        (false, Ok(s)) => (s, "utf8"),
        (_, r) => {
            let data = r.map(String::into_bytes).unwrap_or_else(|e| e.into_bytes());
            lease.grow(base64_len(size) as u64)?;
            let b64 = base64::engine::general_purpose::STANDARD.encode(&data);
            drop(data);
            lease.shrink_to(b64.len() as u64);
            (b64, "base64")
        }
    };
    Ok(FileContent {
        path,
        content,
        encoding,
        size,
    })
}

/// Length of the padded base64 of `n` bytes.
pub fn base64_len(n: usize) -> usize {
    n.div_ceil(3) * 4
}

fn type_name(t: FileType) -> &'static str {
    match t {
        FileType::File => "file",
        FileType::Dir => "directory",
        FileType::Symlink => "symlink",
        FileType::Other => "other",
    }
}

/// What a listing calls a directory: the seed says `dir`, v1 and MCP
/// `directory`.
pub const SEED_DIR: &str = "dir";
pub const V1_DIR: &str = "directory";

/// One entry of a listing as the API shows it (serialized as is: a
/// `Value` per entry costs ten times the entry).
#[derive(Serialize)]
pub struct EntryOut {
    path: String,
    name: String,
    #[serde(rename = "type")]
    pub file_type: &'static str,
    size: u64,
    mode: u32,
    mtime: i64,
}

impl From<DirEntry> for EntryOut {
    fn from(e: DirEntry) -> EntryOut {
        EntryOut {
            name: e.path.rsplit('/').next().unwrap_or(&e.path).to_string(),
            file_type: type_name(e.file_type),
            size: e.size,
            mode: e.mode,
            mtime: e.mtime_ms,
            path: e.path,
        }
    }
}

#[derive(Serialize)]
pub struct Listing {
    pub path: String,
    pub files: Vec<EntryOut>,
    pub truncated: bool,
}

/// Entries a listing asks the guest for; the agent client ends the call
/// if the guest sends more (and bounds their bytes).
pub const MAX_LIST_ENTRIES: u64 = 100_000;

/// Lists `path` through the session, the memory it takes leased from
/// `lease`. The guest has `wait` for each batch.
pub fn list(
    session: &Session,
    lease: &mut Lease,
    path: &str,
    recursive: bool,
    wait: Duration,
) -> OpsResult<Listing> {
    validate::path(path, "path")?;
    let mut call = session.call(
        Request::List {
            path: path.to_string(),
            recursive,
            max_entries: Some(MAX_LIST_ENTRIES),
        },
        wait,
    )?;
    let failed = |e| OpsError::agent(format!("list {path}"))(e);
    let mut files: Vec<EntryOut> = Vec::new();
    let mut held = 0u64;
    loop {
        match call.recv_deadline(Instant::now() + wait) {
            Ok(Inbound::Event(Event::Entries { entries })) => {
                // Two strings and the fixed fields per entry.
                held += entries
                    .iter()
                    .map(|e| 2 * e.path.len() as u64 + 96)
                    .sum::<u64>();
                lease.hold(held)?;
                files.extend(entries.into_iter().map(EntryOut::from))
            }
            Ok(Inbound::Response(Response::Listed { truncated, .. })) => {
                return Ok(Listing {
                    path: path.to_string(),
                    files,
                    truncated,
                })
            }
            Ok(Inbound::Response(r)) => return Err(OpsError::unexpected(r)),
            Ok(Inbound::Error(e)) => return Err(failed(ClientError::Agent(e))),
            Ok(_) => {}
            Err(e) => return Err(failed(e)),
        }
    }
}

/// What `stat` answers.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Stat {
    pub path: String,
    #[serde(rename = "type")]
    pub file_type: &'static str,
    pub size: u64,
    pub mode: u32,
    pub mtime: i64,
    pub link_target: Option<String>,
}

impl From<FileStat> for Stat {
    fn from(st: FileStat) -> Stat {
        Stat {
            path: st.path,
            file_type: type_name(st.file_type),
            size: st.size,
            mode: st.mode,
            mtime: st.mtime_ms,
            link_target: st.link_target,
        }
    }
}

/// A small request to the agent, sent and waited for; `what` names it in
/// an error.
fn simple(session: &Session, req: Request, wait: Duration, what: &str) -> OpsResult<Response> {
    session
        .call(req, wait)?
        .finish()
        .map_err(OpsError::agent(what))
}

pub fn stat(session: &Session, path: &str, wait: Duration) -> OpsResult<Stat> {
    validate::path(path, "path")?;
    let req = Request::Stat {
        path: path.to_string(),
    };
    match simple(session, req, wait, "stat")? {
        Response::Stat(st) => Ok(st.into()),
        other => Err(OpsError::unexpected(other)),
    }
}

pub fn mkdir(session: &Session, path: &str, parents: bool, wait: Duration) -> OpsResult<()> {
    validate::path(path, "path")?;
    let req = Request::Mkdir {
        path: path.to_string(),
        parents,
        mode: None,
    };
    simple(session, req, wait, "mkdir").map(drop)
}

pub fn remove(session: &Session, path: &str, recursive: bool, wait: Duration) -> OpsResult<()> {
    validate::path(path, "path")?;
    let req = Request::Remove {
        path: path.to_string(),
        recursive,
    };
    simple(session, req, wait, "remove").map(drop)
}

pub fn rename(
    session: &Session,
    from: &str,
    to: &str,
    overwrite: bool,
    wait: Duration,
) -> OpsResult<()> {
    validate::path(from, "from")?;
    validate::path(to, "to")?;
    let req = Request::Rename {
        from: from.to_string(),
        to: to.to_string(),
        overwrite,
    };
    simple(session, req, wait, "rename").map(drop)
}
