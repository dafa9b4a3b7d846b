//! The host <-> guest wire protocol. One definition, used by the agent and by
//! the host daemon. `docs/protocol.md` is the prose version of this file.
//!
//! A connection is a sequence of frames. Every frame has a fixed 16-byte
//! header followed by `len` payload bytes:
//!
//! ```text
//! 0      1      2        4          8                16
//! +------+------+--------+----------+----------------+---------
//! |magic | kind |channel | len (LE) | request id (LE)| payload
//! +------+------+--------+----------+----------------+---------
//! ```
//!
//! Control payloads (hello, request, response, event, error) are JSON;
//! `Data` payloads are raw bytes, so binary output and files are never
//! base64-encoded. Flow control is credit based per (request, channel).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, Read};

pub mod audit;
pub mod signal;
pub use audit::{ExecAudit, FileChange, FileChangeKind, ProcEvent, ProcEventKind};
pub use signal::Signal;

/// Protocol version spoken by this build. The hello exchange picks the
/// highest version both sides support.
///
/// Version 2: a hello arriving on an established connection starts a new
/// one (the reset virtio-serial lacks), and the host's hello may carry the
/// post-restore fixup ([`Hello::restored`]). A version 1 agent ignores the
/// field, so a host that asked for a fixup and got version 1 back must send
/// [`Request::Restored`] itself.
pub const PROTOCOL_VERSION: u32 = 2;
/// Oldest version this build still accepts.
pub const MIN_PROTOCOL_VERSION: u32 = 1;
/// First byte of every frame; a cheap guard against a desynchronised stream.
pub const MAGIC: u8 = 0xA5;
pub const HEADER_LEN: usize = 16;
/// Largest payload either side accepts. A bigger `len` is a fatal protocol
/// error: the stream cannot be trusted after it.
pub const MAX_PAYLOAD: usize = 1 << 20;
/// Largest `Data` payload a sender produces (receivers accept up to
/// `MAX_PAYLOAD`).
pub const MAX_DATA_CHUNK: usize = 256 * 1024;
/// Credit each side starts with for every (request, data channel). The
/// receiver tops it up with `Window` frames as it consumes data.
pub const INITIAL_WINDOW: u32 = 1 << 20;
/// Connection-level frames (hello, connection errors) use id 0.
pub const CONNECTION_ID: u64 = 0;
/// Default AF_VSOCK port the agent listens on.
pub const DEFAULT_VSOCK_PORT: u32 = 5000;
/// Name of the virtio-serial port the agent looks for.
pub const SERIAL_PORT_NAME: &str = "agent";
/// Line the agent prints on the console once it accepts connections.
pub const READY_LINE: &str = "SANDBOX-AGENT READY";

/// Data channels within one request.
pub mod channel {
    /// Host -> guest: process stdin, file contents being written.
    pub const STDIN: u16 = 0;
    /// Guest -> host: process stdout (and PTY output), file contents read.
    pub const STDOUT: u16 = 1;
    /// Guest -> host: process stderr.
    pub const STDERR: u16 = 2;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// Version negotiation, first frame in each direction (id 0, JSON [`Hello`]).
    Hello = 1,
    /// Host -> guest: start a request (JSON [`Request`]).
    Request = 2,
    /// Guest -> host: the request finished (JSON [`Response`]). Last frame of a request.
    Response = 3,
    /// Either way: the request failed (JSON [`ErrorBody`]). Last frame of a
    /// request; on id 0 a connection-level complaint that ends nothing.
    Error = 4,
    /// Raw bytes on `channel`. Consumes the receiver's credit.
    Data = 5,
    /// Host -> guest: end of the data on `channel` (no payload). The guest
    /// sends none: its final `Response` ends all of a request's output.
    Eof = 6,
    /// Receiver grants `u32 LE` more bytes of credit on `channel`.
    Window = 7,
    /// Host -> guest: abandon the request. The guest answers with an error
    /// `cancelled` (or the final response if it already finished).
    Cancel = 8,
    /// Guest -> host: progress of a running request (JSON [`Event`]).
    Event = 9,
}

impl Kind {
    pub fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Request,
            3 => Kind::Response,
            4 => Kind::Error,
            5 => Kind::Data,
            6 => Kind::Eof,
            7 => Kind::Window,
            8 => Kind::Cancel,
            9 => Kind::Event,
            _ => return None,
        })
    }
}

/// A decoded header. `kind` is kept raw so that an unknown kind can be
/// answered with an error frame instead of tearing the connection down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: u8,
    pub channel: u16,
    pub len: u32,
    pub id: u64,
}

#[derive(Debug)]
pub enum DecodeError {
    /// First byte was not [`MAGIC`]: the stream is out of sync.
    BadMagic(u8),
    /// Payload length above [`MAX_PAYLOAD`].
    TooLarge(u32),
    /// The peer closed the stream in the middle of a frame.
    Truncated,
    Io(io::Error),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::BadMagic(b) => write!(f, "bad frame magic 0x{b:02x}"),
            DecodeError::TooLarge(n) => {
                write!(
                    f,
                    "frame payload of {n} bytes exceeds the {MAX_PAYLOAD}-byte limit"
                )
            }
            DecodeError::Truncated => write!(f, "stream ended inside a frame"),
            DecodeError::Io(e) => write!(f, "read failed: {e}"),
        }
    }
}

impl std::error::Error for DecodeError {}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = MAGIC;
        b[1] = self.kind;
        b[2..4].copy_from_slice(&self.channel.to_le_bytes());
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, DecodeError> {
        if b[0] != MAGIC {
            return Err(DecodeError::BadMagic(b[0]));
        }
        let len = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        if len as usize > MAX_PAYLOAD {
            return Err(DecodeError::TooLarge(len));
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[8..16]);
        Ok(Header {
            kind: b[1],
            channel: u16::from_le_bytes([b[2], b[3]]),
            len,
            id: u64::from_le_bytes(id),
        })
    }
}

/// One frame with its payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub header: Header,
    pub payload: Vec<u8>,
}

impl Frame {
    pub fn kind(&self) -> Option<Kind> {
        Kind::from_u8(self.header.kind)
    }
}

/// Serialise a frame into one buffer (one `write` on the wire).
pub fn encode_frame(kind: Kind, id: u64, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    let h = Header {
        kind: kind as u8,
        channel,
        len: payload.len() as u32,
        id,
    };
    out.extend_from_slice(&h.encode());
    out.extend_from_slice(payload);
    out
}

/// A JSON control frame.
pub fn encode_json<T: Serialize>(kind: Kind, id: u64, value: &T) -> Vec<u8> {
    // Serialising our own plain data types cannot fail.
    let body = serde_json::to_vec(value).unwrap_or_default();
    encode_frame(kind, id, 0, &body)
}

pub fn encode_window(id: u64, channel: u16, credit: u32) -> Vec<u8> {
    encode_frame(Kind::Window, id, channel, &credit.to_le_bytes())
}

/// Data frames are built in place: callers read straight into the payload
/// area of a buffer that already has room for the header, then call this to
/// fill the header in. Saves a copy per chunk on the streaming path.
pub fn fill_data_header(buf: &mut [u8], id: u64, channel: u16) {
    let len = (buf.len() - HEADER_LEN) as u32;
    let h = Header {
        kind: Kind::Data as u8,
        channel,
        len,
        id,
    };
    buf[..HEADER_LEN].copy_from_slice(&h.encode());
}

/// Blocking frame reader over any byte stream.
pub struct FrameReader<R> {
    inner: R,
}

impl<R: Read> FrameReader<R> {
    pub fn new(inner: R) -> Self {
        FrameReader { inner }
    }

    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    /// Next frame; `Ok(None)` on a clean end of stream between frames.
    pub fn read_frame(&mut self) -> Result<Option<Frame>, DecodeError> {
        let mut hb = [0u8; HEADER_LEN];
        match read_full(&mut self.inner, &mut hb)? {
            0 => return Ok(None),
            n if n < HEADER_LEN => return Err(DecodeError::Truncated),
            _ => {}
        }
        let header = Header::decode(&hb)?;
        let mut payload = vec![0u8; header.len as usize];
        if read_full(&mut self.inner, &mut payload)? < payload.len() {
            return Err(DecodeError::Truncated);
        }
        Ok(Some(Frame { header, payload }))
    }
}

/// Read until `buf` is full or EOF; returns bytes read.
fn read_full<R: Read>(r: &mut R, buf: &mut [u8]) -> Result<usize, DecodeError> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(DecodeError::Io(e)),
        }
    }
    Ok(got)
}

/// Incremental decoder over an in-memory buffer: returns the next frame and
/// how many bytes it used, or `None` when more input is needed. Used by the
/// fuzz target and by anything that reads in large chunks.
pub fn decode_frame(buf: &[u8]) -> Result<Option<(Frame, usize)>, DecodeError> {
    if buf.len() < HEADER_LEN {
        if !buf.is_empty() && buf[0] != MAGIC {
            return Err(DecodeError::BadMagic(buf[0]));
        }
        return Ok(None);
    }
    let mut hb = [0u8; HEADER_LEN];
    hb.copy_from_slice(&buf[..HEADER_LEN]);
    let header = Header::decode(&hb)?;
    let total = HEADER_LEN + header.len as usize;
    if buf.len() < total {
        return Ok(None);
    }
    Ok(Some((
        Frame {
            header,
            payload: buf[HEADER_LEN..total].to_vec(),
        },
        total,
    )))
}

// ---------------------------------------------------------------------------
// Control messages
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Hello {
    /// Highest version the sender speaks (in the agent's reply: the version chosen).
    pub version: u32,
    /// Lowest version the sender accepts.
    pub min_version: u32,
    /// Echoed by the agent so the host can find its own answer in a stream
    /// that may still hold bytes written for an earlier client.
    pub nonce: u64,
    /// Software name and version, e.g. `sandbox-agent/0.1.0`.
    pub software: String,
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// Largest payload the sender accepts.
    pub max_payload: u32,
    /// Host -> agent only (version >= 2): the VM was just restored from a
    /// snapshot. The agent applies the fixup before it answers, so the
    /// hello reply means "clock set, RNG reseeded, neighbours flushed";
    /// a failed fixup is answered with a connection error instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored: Option<RestoreFixup>,
}

/// What a restored guest needs from the host: the saved guest resumes with
/// the wall clock and RNG state of the moment it was saved.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RestoreFixup {
    /// Wall clock to set, nanoseconds since the Unix epoch.
    pub unix_time_ns: u64,
    /// Hex-encoded random bytes to mix into the kernel RNG (at most 4096).
    pub entropy_hex: String,
    /// The VMM translates guest code as it first runs (QEMU's TCG): a
    /// restored guest's first exec pays for translating the whole
    /// fork/exec/exit path. Asks the agent to run one throwaway exec if the
    /// host sends nothing for [`limits::WARM_UP_IDLE_MS`] after the hello, so a
    /// command sent after that finds the path translated. Off under KVM,
    /// where nothing is translated.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub warm_up: bool,
}

/// The agent honours [`ExecRequest::memory_max`] and `cpu_max_us`; a host
/// sends them only to an agent that announces it (an older one would
/// ignore them and run the command unlimited).
pub const CAP_EXEC_LIMITS: &str = "exec.limits";

/// The agent honours [`ExecRequest::audit`]: the exec's process tree and
/// file changes come back in [`ExitStatus::audit`]. An older agent ignores
/// the flag (and sends no audit), so a host that needs the record checks
/// for this first.
pub const CAP_EXEC_AUDIT: &str = "exec.audit";

/// Capabilities the agent announces in its hello.
pub const CAPABILITIES: &[&str] = &[
    "exec",
    "exec.pty",
    "exec.background",
    "exec.uid",
    CAP_EXEC_LIMITS,
    // ExitStatus::usage / oom_killed.
    "exec.usage",
    CAP_EXEC_AUDIT,
    "files",
    "restore",
    "shutdown",
];

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Ping,
    Exec(ExecRequest),
    /// Stream a background process's output (buffered, then live) and
    /// optionally feed its stdin through this request's channel 0.
    Attach {
        proc: u64,
        #[serde(default)]
        stdin: bool,
        /// Replay the output still held in the process's buffer first.
        #[serde(default = "yes")]
        replay: bool,
    },
    /// Send a signal to a process's whole process group.
    Signal {
        proc: u64,
        /// A number in [`signal::RANGE`].
        signal: i32,
    },
    /// Change the PTY size of a process started with a PTY.
    Resize {
        proc: u64,
        rows: u16,
        cols: u16,
    },
    /// Close a background process's stdin.
    CloseStdin {
        proc: u64,
    },
    ListProcs,
    /// SIGKILL every user process: every exec, foreground or background,
    /// and whatever they left running (detached, daemonized, other uids).
    /// Files stay. Answered with [`Response::Killed`] once they are gone,
    /// or after `limits::KILL_ALL_WAIT_MS` with what is left.
    KillAll,
    ReadFile {
        path: String,
        #[serde(default)]
        offset: u64,
        /// Bytes to read; absent means to the end of the file.
        #[serde(default)]
        len: Option<u64>,
    },
    /// Contents follow as `Data` on channel 0, ended by `Eof`. The file is
    /// written to a temporary name and renamed over `path` at the end, so a
    /// reader never sees half a file.
    WriteFile {
        path: String,
        #[serde(default)]
        mode: Option<u32>,
        #[serde(default = "yes")]
        create_parents: bool,
        #[serde(default)]
        append: bool,
    },
    Stat {
        path: String,
    },
    /// Entries arrive as `Event::Entries` batches, then `Response::Listed`.
    List {
        path: String,
        #[serde(default)]
        recursive: bool,
        #[serde(default)]
        max_entries: Option<u64>,
    },
    Mkdir {
        path: String,
        #[serde(default = "yes")]
        parents: bool,
        #[serde(default)]
        mode: Option<u32>,
    },
    Remove {
        path: String,
        #[serde(default)]
        recursive: bool,
    },
    Rename {
        from: String,
        to: String,
        #[serde(default = "yes")]
        overwrite: bool,
    },
    /// Sent right after a snapshot restore by version 1 hosts; version 2
    /// hosts put the same fields in their hello ([`Hello::restored`]),
    /// which saves a round trip.
    Restored {
        /// Wall clock to set, nanoseconds since the Unix epoch.
        unix_time_ns: u64,
        /// Hex-encoded random bytes to mix into the kernel RNG.
        entropy_hex: String,
    },
    /// End the VM. The agent reboots the kernel, which makes Firecracker
    /// (`reboot=k`) and QEMU (`-no-reboot`) exit; `poweroff` uses a real
    /// power-off instead, for VMMs with ACPI.
    Shutdown {
        #[serde(default)]
        poweroff: bool,
    },
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ExecRequest {
    /// Program and arguments. Exactly one of `argv` and `shell` is set.
    #[serde(default)]
    pub argv: Vec<String>,
    /// A command line run by `/bin/sh -c`.
    #[serde(default)]
    pub shell: Option<String>,
    /// Added to (or, with `clear_env`, replacing) the agent's environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub clear_env: bool,
    /// Working directory; relative paths resolve under the workspace.
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub uid: Option<u32>,
    #[serde(default)]
    pub gid: Option<u32>,
    /// Keep stdin open for `Data` on channel 0; otherwise stdin is /dev/null.
    #[serde(default)]
    pub stdin: bool,
    /// Run on a pseudo-terminal of this size; output then all arrives on channel 1.
    #[serde(default)]
    pub pty: Option<PtySize>,
    /// Kill the process group with SIGKILL after this long.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Detach: answer `Started` at once and keep the process running, its
    /// output kept in a bounded buffer for `Attach`.
    #[serde(default)]
    pub background: bool,
    /// Label for listings.
    #[serde(default)]
    pub tag: Option<String>,
    /// Send `Event::Started {proc, pid}` when the process is running (always
    /// sent for PTY processes, which need the id for `resize`). Off by
    /// default: an event per exec costs the host a wake-up on the hot path.
    #[serde(default)]
    pub notify_start: bool,
    /// `memory.max` of this exec's own cgroup, in bytes; the agent's
    /// per-exec maximum still applies (the lower wins). Going over it is
    /// an OOM kill of the exec's processes ([`ExitStatus::oom_killed`]).
    /// Needs per-exec cgroups (the agent as the VM's init): an agent
    /// without them refuses the exec rather than run it unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_max: Option<u64>,
    /// `cpu.max` quota of this exec's cgroup: µs of CPU time per
    /// [`limits::CPU_PERIOD_US`] period (one core = the period). Same
    /// requirement as `memory_max`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_max_us: Option<u64>,
    /// Record what the exec did in the guest (process tree, file changes)
    /// and return it in [`ExitStatus::audit`]. Foreground execs only. Off:
    /// nothing is tracked and nothing costs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub audit: bool,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct PtySize {
    pub rows: u16,
    pub cols: u16,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The process of an `Exec` is running.
    Started { proc: u64, pid: i32 },
    /// A batch of entries of a `List` request.
    Entries { entries: Vec<DirEntry> },
    /// An attached reader fell behind a background process's buffer and
    /// missed this many bytes of output.
    Dropped { bytes: u64 },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Response {
    Pong {
        uptime_ms: u64,
    },
    /// Final answer of `Exec` (foreground) and `Attach`.
    Exited(ExitStatus),
    /// Final answer of a background `Exec`.
    Started {
        proc: u64,
        pid: i32,
    },
    Procs {
        procs: Vec<ProcInfo>,
    },
    /// Final answer of `ReadFile` (after the data and `Eof`).
    Read {
        bytes: u64,
        size: u64,
    },
    Written {
        bytes: u64,
    },
    Stat(FileStat),
    Listed {
        count: u64,
        truncated: bool,
    },
    /// Answer of `KillAll`: user processes found, and still there when the
    /// agent stopped waiting (0 unless one was stuck in the kernel).
    Killed {
        processes: u64,
        remaining: u64,
    },
    Ok,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExitStatus {
    /// Exit code if the process exited normally.
    pub code: Option<i32>,
    /// Signal number if it was killed by a signal.
    pub signal: Option<i32>,
    #[serde(default)]
    pub timed_out: bool,
    pub duration_us: u64,
    /// What the command's processes used, measured when it ended. Absent
    /// from agents older than this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<ResourceUsage>,
    /// The kernel's OOM killer ended it: its cgroup counted an `oom_kill`
    /// (`memory.events`). Only known with per-exec cgroups.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub oom_killed: bool,
    /// What the exec did, for an exec run with [`ExecRequest::audit`].
    /// Reported by the agent inside the guest: see `docs/security.md` for
    /// what it can be trusted for. Bounded ([`audit`] limits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<ExecAudit>,
}

/// Resources one exec used, from its own cgroup when it has one.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ResourceUsage {
    /// Peak memory in bytes: the cgroup's `memory.peak` (every process of
    /// the exec together, page cache included), or without a cgroup the
    /// largest `ru_maxrss` of the process and the descendants it reaped.
    pub memory_peak_bytes: u64,
    /// CPU time in µs: the cgroup's `cpu.stat` `usage_usec`, or without
    /// one `ru_utime + ru_stime` of the process and its reaped descendants.
    pub cpu_usec: u64,
    pub source: UsageSource,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum UsageSource {
    /// The exec's own cgroup (the agent as the VM's init).
    #[default]
    Cgroup,
    /// `wait4`-style rusage of the reaped process (no per-exec cgroup).
    Rusage,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ProcInfo {
    pub proc: u64,
    pub pid: i32,
    pub argv: Vec<String>,
    pub tag: Option<String>,
    pub background: bool,
    pub pty: bool,
    pub started_unix_ms: u64,
    pub exit: Option<ExitStatus>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FileType {
    File,
    Dir,
    Symlink,
    Other,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileStat {
    pub path: String,
    #[serde(rename = "type")]
    pub file_type: FileType,
    pub size: u64,
    pub mode: u32,
    pub mtime_ms: i64,
    #[serde(default)]
    pub link_target: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DirEntry {
    /// Path relative to the listed directory.
    pub path: String,
    #[serde(rename = "type")]
    pub file_type: FileType,
    pub size: u64,
    pub mode: u32,
    pub mtime_ms: i64,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Frame or message malformed, or a rule of the protocol broken.
    Protocol,
    /// Message well-formed but its values are not acceptable.
    Invalid,
    UnknownKind,
    DuplicateId,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    NotADirectory,
    IsADirectory,
    DirectoryNotEmpty,
    /// The program could not be started.
    SpawnFailed,
    Cancelled,
    /// The connection closed or the agent is going down.
    Unavailable,
    NoSpace,
    Io,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
    /// For connection-level errors about one request id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<u64>,
}

impl ErrorBody {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorBody {
            code,
            message: message.into(),
            id: None,
        }
    }

    pub fn from_io(err: &io::Error, what: &str) -> Self {
        let code = match err.raw_os_error() {
            Some(libc::ENOENT) => ErrorCode::NotFound,
            Some(libc::EEXIST) => ErrorCode::AlreadyExists,
            Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => {
                ErrorCode::PermissionDenied
            }
            Some(libc::ENOTDIR) => ErrorCode::NotADirectory,
            Some(libc::EISDIR) => ErrorCode::IsADirectory,
            Some(libc::ENOTEMPTY) => ErrorCode::DirectoryNotEmpty,
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => ErrorCode::NoSpace,
            Some(libc::EINVAL) | Some(libc::ENAMETOOLONG) => ErrorCode::Invalid,
            _ => ErrorCode::Io,
        };
        ErrorBody::new(code, format!("{what}: {err}"))
    }
}

impl fmt::Display for ErrorBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let code = serde_json::to_value(self.code)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        write!(f, "{code}: {}", self.message)
    }
}

impl std::error::Error for ErrorBody {}

/// Limits on request contents, checked by the agent before acting.
pub mod limits {
    pub const MAX_ARGS: usize = 4096;
    pub const MAX_ENV: usize = 4096;
    pub const MAX_PATH: usize = 4096;
    pub const MAX_LIST_ENTRIES: u64 = 1_000_000;
    /// Output a background process keeps for later `Attach`, per process.
    pub const BACKGROUND_BUFFER: usize = 1 << 20;
    /// Exited background processes remembered for listing.
    pub const MAX_FINISHED_PROCS: usize = 256;
    /// How long `KillAll` waits for the killed processes to be gone.
    pub const KILL_ALL_WAIT_MS: u64 = 5_000;
    /// How long the host must stay silent after a restore hello before the
    /// agent runs its warm-up exec
    /// ([`super::RestoreFixup::warm_up`]). A host that sends its first
    /// command at once gets no warm-up competing with it.
    pub const WARM_UP_IDLE_MS: u64 = 25;
    /// A warm-up exec still running after this is killed.
    pub const WARM_UP_TIMEOUT_MS: u64 = 10_000;
    /// The `cpu.max` period of an exec's cgroup ([`super::ExecRequest::cpu_max_us`]).
    pub const CPU_PERIOD_US: u64 = 100_000;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let h = Header {
            kind: Kind::Data as u8,
            channel: 2,
            len: 77,
            id: 0x0102_0304_0506_0708,
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn oversize_and_bad_magic_rejected() {
        let mut b = Header {
            kind: 2,
            channel: 0,
            len: (MAX_PAYLOAD + 1) as u32,
            id: 1,
        }
        .encode();
        assert!(matches!(Header::decode(&b), Err(DecodeError::TooLarge(_))));
        b[0] = 0;
        assert!(matches!(Header::decode(&b), Err(DecodeError::BadMagic(0))));
    }

    #[test]
    fn incremental_decode() {
        let f = encode_frame(Kind::Data, 9, 1, b"hello");
        assert!(decode_frame(&f[..10]).unwrap().is_none());
        let (frame, used) = decode_frame(&f).unwrap().unwrap();
        assert_eq!(used, f.len());
        assert_eq!(frame.payload, b"hello");
        assert_eq!(frame.kind(), Some(Kind::Data));
    }

    #[test]
    fn request_json_shape() {
        let r: Request =
            serde_json::from_str(r#"{"op":"exec","argv":["true"],"timeout_ms":5}"#).unwrap();
        match r {
            Request::Exec(e) => {
                assert_eq!(e.argv, vec!["true"]);
                assert_eq!(e.timeout_ms, Some(5));
            }
            other => panic!("unexpected {other:?}"),
        }
        let w: Request = serde_json::from_str(r#"{"op":"write_file","path":"a"}"#).unwrap();
        assert!(matches!(
            w,
            Request::WriteFile {
                create_parents: true,
                ..
            }
        ));
        let k: Request = serde_json::from_str(r#"{"op":"kill_all"}"#).unwrap();
        assert!(matches!(k, Request::KillAll));
        let a = serde_json::to_value(Response::Killed {
            processes: 3,
            remaining: 0,
        })
        .unwrap();
        assert_eq!(
            a,
            serde_json::json!({"result": "killed", "processes": 3, "remaining": 0})
        );
    }
}
