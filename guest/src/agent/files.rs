//! File requests. Relative paths resolve under the workspace; absolute
//! paths are taken as they are (the VM boundary is the isolation, not path
//! checks inside it).

use super::mailbox::{Msg, Req};
use super::Agent;
use crate::proto::{
    channel, fill_data_header, limits, DirEntry, ErrorBody, ErrorCode, Event, FileStat, FileType,
    Response, HEADER_LEN, INITIAL_WINDOW, MAX_DATA_CHUNK,
};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

fn io_err(e: &io::Error, what: &str, path: &Path) -> ErrorBody {
    ErrorBody::from_io(e, &format!("{what} {}", path.display()))
}

fn path_arg(agent: &Agent, p: &str) -> Result<PathBuf, ErrorBody> {
    agent
        .resolve(p)
        .map_err(|m| ErrorBody::new(ErrorCode::Invalid, m))
}

fn file_type(ft: fs::FileType) -> FileType {
    if ft.is_symlink() {
        FileType::Symlink
    } else if ft.is_dir() {
        FileType::Dir
    } else if ft.is_file() {
        FileType::File
    } else {
        FileType::Other
    }
}

fn mtime_ms(m: &fs::Metadata) -> i64 {
    m.mtime() * 1000 + m.mtime_nsec() / 1_000_000
}

pub fn read_file(agent: &Agent, mut req: Req, path: &str, offset: u64, len: Option<u64>) {
    let path = match path_arg(agent, path) {
        Ok(p) => p,
        Err(e) => return req.fail(e),
    };
    let mut f = match File::open(&path) {
        Ok(f) => f,
        Err(e) => return req.fail(io_err(&e, "open", &path)),
    };
    let meta = match f.metadata() {
        Ok(m) => m,
        Err(e) => return req.fail(io_err(&e, "stat", &path)),
    };
    if meta.is_dir() {
        return req.fail(ErrorBody::new(
            ErrorCode::IsADirectory,
            format!("{} is a directory", path.display()),
        ));
    }
    if offset > 0 {
        if let Err(e) = f.seek(SeekFrom::Start(offset)) {
            return req.fail(io_err(&e, "seek", &path));
        }
    }
    let mut remaining = len.unwrap_or(u64::MAX);
    let mut credit = INITIAL_WINDOW as i64;
    let mut sent: u64 = 0;
    let mut buf = vec![0u8; HEADER_LEN + MAX_DATA_CHUNK];
    while remaining > 0 {
        while credit <= 0 {
            match req.rx.recv() {
                Ok(Msg::Window {
                    channel: channel::STDOUT,
                    credit: c,
                }) => credit += c as i64,
                Ok(Msg::Cancel) | Ok(Msg::Closed) | Err(_) => {
                    return req.fail(ErrorBody::new(ErrorCode::Cancelled, "read cancelled"))
                }
                Ok(_) => {}
            }
        }
        let want = (credit as u64).min(remaining).min(MAX_DATA_CHUNK as u64) as usize;
        let n = match f.read(&mut buf[HEADER_LEN..HEADER_LEN + want]) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return req.fail(io_err(&e, "read", &path)),
        };
        fill_data_header(&mut buf[..HEADER_LEN + n], req.id, channel::STDOUT);
        if !req.writer().send(&buf[..HEADER_LEN + n]) {
            return;
        }
        credit -= n as i64;
        remaining -= n as u64;
        sent += n as u64;
        // Notice a cancel without waiting for the credit to run out.
        while let Ok(m) = req.rx.try_recv() {
            match m {
                Msg::Window {
                    channel: channel::STDOUT,
                    credit: c,
                } => credit += c as i64,
                Msg::Cancel | Msg::Closed => {
                    return req.fail(ErrorBody::new(ErrorCode::Cancelled, "read cancelled"))
                }
                _ => {}
            }
        }
    }
    req.respond(&Response::Read {
        bytes: sent,
        size: meta.len(),
    });
}

/// Removes the temporary file unless the write completed.
struct TempGuard(Option<PathBuf>);
impl Drop for TempGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = fs::remove_file(p);
        }
    }
}

pub fn write_file(
    agent: &Agent,
    mut req: Req,
    path: &str,
    mode: Option<u32>,
    create_parents: bool,
    append: bool,
) {
    let path = match path_arg(agent, path) {
        Ok(p) => p,
        Err(e) => return req.fail(e),
    };
    if let Some(m) = mode {
        if m > 0o7777 {
            return req.fail(ErrorBody::new(
                ErrorCode::Invalid,
                format!("mode {m:o} is not a permission mode"),
            ));
        }
    }
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return req.fail(ErrorBody::new(
            ErrorCode::Invalid,
            format!("{} names no file", path.display()),
        ));
    };
    if create_parents {
        if let Err(e) = fs::create_dir_all(parent) {
            return req.fail(io_err(&e, "create directory", parent));
        }
    }
    if path.is_dir() {
        return req.fail(ErrorBody::new(
            ErrorCode::IsADirectory,
            format!("{} is a directory", path.display()),
        ));
    }
    let explicit_mode = mode.is_some();
    // Keep an existing file's mode unless one was given.
    let mode = mode.unwrap_or_else(|| {
        fs::metadata(&path)
            .map(|m| m.permissions().mode() & 0o7777)
            .unwrap_or(0o644)
    });
    let mut guard = TempGuard(None);
    let opened = if append {
        OpenOptions::new()
            .append(true)
            .create(true)
            .mode(mode)
            .open(&path)
    } else {
        let tmp = parent.join(format!(
            ".{}.sbx-{}-{}",
            name.to_string_lossy(),
            std::process::id(),
            req.id
        ));
        let r = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp);
        if r.is_ok() {
            guard.0 = Some(tmp);
        }
        r
    };
    let mut f = match opened {
        Ok(f) => f,
        Err(e) => return req.fail(io_err(&e, "create", &path)),
    };
    let mut written: u64 = 0;
    let mut unacked: u32 = 0;
    loop {
        match req.rx.recv() {
            Ok(Msg::Data {
                channel: channel::STDIN,
                bytes,
            }) => {
                if let Err(e) = f.write_all(&bytes) {
                    return req.fail(io_err(&e, "write", &path));
                }
                written += bytes.len() as u64;
                unacked += bytes.len() as u32;
                // Hand credit back in batches: fewer frames, same pipeline depth.
                if unacked >= INITIAL_WINDOW / 4 {
                    req.writer().window(req.id, channel::STDIN, unacked);
                    unacked = 0;
                }
            }
            Ok(Msg::Eof {
                channel: channel::STDIN,
            }) => break,
            Ok(Msg::Cancel) | Ok(Msg::Closed) | Err(_) => {
                return req.fail(ErrorBody::new(ErrorCode::Cancelled, "write cancelled"))
            }
            Ok(_) => {}
        }
    }
    if explicit_mode || guard.0.is_some() {
        // The umask trims the mode at create; set exactly what was meant.
        let _ = f.set_permissions(fs::Permissions::from_mode(mode));
    }
    drop(f);
    if let Some(tmp) = guard.0.take() {
        if let Err(e) = fs::rename(&tmp, &path) {
            let _ = fs::remove_file(&tmp);
            return req.fail(io_err(&e, "rename into place", &path));
        }
    }
    req.respond(&Response::Written { bytes: written });
}

pub fn stat(agent: &Agent, mut req: Req, path: &str) {
    let path = match path_arg(agent, path) {
        Ok(p) => p,
        Err(e) => return req.fail(e),
    };
    match fs::symlink_metadata(&path) {
        Ok(m) => {
            let link_target = if m.file_type().is_symlink() {
                fs::read_link(&path)
                    .ok()
                    .map(|t| t.to_string_lossy().into_owned())
            } else {
                None
            };
            req.respond(&Response::Stat(FileStat {
                path: path.to_string_lossy().into_owned(),
                file_type: file_type(m.file_type()),
                size: m.len(),
                mode: m.permissions().mode() & 0o7777,
                mtime_ms: mtime_ms(&m),
                link_target,
            }))
        }
        Err(e) => req.fail(io_err(&e, "stat", &path)),
    }
}

const LIST_BATCH: usize = 512;

pub fn list(agent: &Agent, mut req: Req, path: &str, recursive: bool, max: Option<u64>) {
    let root = match path_arg(agent, path) {
        Ok(p) => p,
        Err(e) => return req.fail(e),
    };
    let max = max
        .unwrap_or(limits::MAX_LIST_ENTRIES)
        .min(limits::MAX_LIST_ENTRIES);
    match fs::metadata(&root) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return req.fail(ErrorBody::new(
                ErrorCode::NotADirectory,
                format!("{} is not a directory", root.display()),
            ))
        }
        Err(e) => return req.fail(io_err(&e, "list", &root)),
    }
    let mut stack = vec![PathBuf::new()];
    let mut batch = Vec::with_capacity(LIST_BATCH);
    let mut count: u64 = 0;
    let mut truncated = false;
    'walk: while let Some(rel) = stack.pop() {
        let dir = root.join(&rel);
        let rd = match fs::read_dir(&dir) {
            Ok(rd) => rd,
            // The top level must be readable; below it, skip what we can't.
            Err(e) if rel.as_os_str().is_empty() => return req.fail(io_err(&e, "list", &dir)),
            Err(_) => continue,
        };
        let mut names: Vec<_> = rd.filter_map(Result::ok).collect();
        names.sort_by_key(|e| e.file_name());
        for ent in names {
            if count >= max {
                truncated = true;
                break 'walk;
            }
            let Ok(m) = ent.metadata() else { continue };
            let relpath = rel.join(ent.file_name());
            let ft = file_type(m.file_type());
            if recursive && ft == FileType::Dir {
                stack.push(relpath.clone());
            }
            batch.push(DirEntry {
                path: relpath.to_string_lossy().into_owned(),
                file_type: ft,
                size: m.len(),
                mode: m.permissions().mode() & 0o7777,
                mtime_ms: mtime_ms(&m),
            });
            count += 1;
            if batch.len() == LIST_BATCH {
                let entries = std::mem::take(&mut batch);
                if !req.event(&Event::Entries { entries }) {
                    return;
                }
                if matches!(req.rx.try_recv(), Ok(Msg::Cancel) | Ok(Msg::Closed)) {
                    return req.fail(ErrorBody::new(ErrorCode::Cancelled, "list cancelled"));
                }
            }
        }
    }
    if !batch.is_empty() {
        req.event(&Event::Entries { entries: batch });
    }
    req.respond(&Response::Listed { count, truncated });
}

pub fn mkdir(agent: &Agent, mut req: Req, path: &str, parents: bool, mode: Option<u32>) {
    let path = match path_arg(agent, path) {
        Ok(p) => p,
        Err(e) => return req.fail(e),
    };
    let mut b = fs::DirBuilder::new();
    b.recursive(parents).mode(mode.unwrap_or(0o755) & 0o7777);
    match b.create(&path) {
        Ok(()) => req.respond(&Response::Ok),
        Err(e) => req.fail(io_err(&e, "mkdir", &path)),
    }
}

pub fn remove(agent: &Agent, mut req: Req, path: &str, recursive: bool) {
    let path = match path_arg(agent, path) {
        Ok(p) => p,
        Err(e) => return req.fail(e),
    };
    if path == Path::new("/") {
        return req.fail(ErrorBody::new(ErrorCode::Invalid, "refusing to remove /"));
    }
    let r = match fs::symlink_metadata(&path) {
        Ok(m) if m.is_dir() && recursive => fs::remove_dir_all(&path),
        Ok(m) if m.is_dir() => fs::remove_dir(&path),
        Ok(_) => fs::remove_file(&path),
        Err(e) => Err(e),
    };
    match r {
        Ok(()) => req.respond(&Response::Ok),
        Err(e) => req.fail(io_err(&e, "remove", &path)),
    }
}

pub fn rename(agent: &Agent, mut req: Req, from: &str, to: &str, overwrite: bool) {
    let (from, to) = match (path_arg(agent, from), path_arg(agent, to)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => return req.fail(e),
    };
    let r = if overwrite {
        fs::rename(&from, &to)
    } else {
        renameat2_noreplace(&from, &to)
    };
    match r {
        Ok(()) => req.respond(&Response::Ok),
        Err(e) => req.fail(io_err(&e, &format!("rename {} to", from.display()), &to)),
    }
}

fn renameat2_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let a = std::ffi::CString::new(from.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let b = std::ffi::CString::new(to.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: both paths are valid NUL-terminated strings.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
