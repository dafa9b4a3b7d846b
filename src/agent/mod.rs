//! Host side of the guest protocol: one [`AgentClient`] per VM connection,
//! multiplexing any number of concurrent [`Call`]s over it.
//!
//! The guest is untrusted. Its frames are bounded (size, credit) and a
//! guest that breaks the protocol loses its connection, never host memory.

use crate::proto::{
    self, channel, encode_frame, encode_json, encode_window, DecodeError, ErrorBody, ErrorCode,
    Event, ExecRequest, ExitStatus, FileStat, Frame, Header, Hello, Kind, Request, Response,
    RestoreFixup, HEADER_LEN, INITIAL_WINDOW, MAX_DATA_CHUNK,
};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::collections::HashMap;
use std::io::{self, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The agent answered the request with an error.
    #[error("agent: {0}")]
    Agent(ErrorBody),
    #[error("agent connection closed: {0}")]
    Closed(String),
    #[error("agent protocol violation: {0}")]
    Protocol(String),
    #[error("timed out after {0:?} waiting for the agent")]
    Timeout(Duration),
    #[error("agent connection: {0}")]
    Io(#[from] io::Error),
}

pub type Result<T> = std::result::Result<T, ClientError>;

/// What a call receives, in order.
#[derive(Debug)]
pub enum Inbound {
    Data {
        channel: u16,
        bytes: Vec<u8>,
    },
    Eof {
        channel: u16,
    },
    Event(Event),
    /// Final.
    Response(Response),
    /// Final.
    Error(ErrorBody),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Credit the guest has granted us for sending on channel 0.
struct SendCredit {
    avail: Mutex<i64>,
    cv: Condvar,
}

struct Route {
    tx: Sender<Inbound>,
    send_credit: Arc<SendCredit>,
    /// Bytes the guest may still send us per output channel (1, 2). The
    /// reader subtracts, the consumer adds back as it grants.
    recv_credit: Arc<[AtomicI64; 2]>,
    /// Non-data bytes (events) received, bounded per call.
    event_bytes: u64,
}

/// Events per call are few and small (a start notice, listing batches);
/// more than this is a misbehaving guest.
const MAX_EVENT_BYTES_PER_CALL: u64 = 256 << 20;

struct Shared {
    writer: Mutex<UnixStream>,
    routes: Mutex<HashMap<u64, Route>>,
    next_id: AtomicU64,
    closed: AtomicBool,
    close_reason: Mutex<String>,
    /// Bytes received from the guest, for metrics.
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
}

impl Shared {
    fn send(&self, frame: &[u8]) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(ClientError::Closed(lock(&self.close_reason).clone()));
        }
        let mut w = lock(&self.writer);
        w.write_all(frame)
            .map_err(|e| ClientError::Closed(format!("write: {e}")))?;
        self.bytes_out
            .fetch_add(frame.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn close(&self, reason: String) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        *lock(&self.close_reason) = reason.clone();
        let _ = lock(&self.writer).shutdown(std::net::Shutdown::Both);
        let routes: Vec<Route> = lock(&self.routes).drain().map(|(_, r)| r).collect();
        for r in routes {
            let _ = r.tx.send(Inbound::Error(ErrorBody::new(
                ErrorCode::Unavailable,
                format!("agent connection closed: {reason}"),
            )));
            *lock(&r.send_credit.avail) = i64::MIN / 2;
            r.send_credit.cv.notify_all();
        }
    }
}

/// A connection to one guest agent.
#[derive(Clone)]
pub struct AgentClient {
    shared: Arc<Shared>,
    pub hello: Arc<Hello>,
}

impl AgentClient {
    /// Says hello and starts the reader thread. The stream may still hold
    /// bytes an earlier client left unread (virtio-serial keeps them), so
    /// the reply is found by scanning for a hello frame with our nonce.
    pub fn connect(stream: UnixStream, timeout: Duration) -> Result<AgentClient> {
        Self::connect_with(stream, timeout, false)
    }

    /// [`AgentClient::connect`], telling the agent whether the VM was just
    /// restored from a snapshot. If so the hello carries the fixup
    /// ([`restore_fixup`]); a version 2 agent applies it before it answers,
    /// an older one gets it as a separate [`Request::Restored`].
    pub fn connect_with(
        stream: UnixStream,
        timeout: Duration,
        restored: bool,
    ) -> Result<AgentClient> {
        let deadline = Instant::now() + timeout;
        let nonce = random_u64();
        // Taken last thing before the hello goes out: the guest clock is
        // set to it.
        let restored = if restored {
            Some(restore_fixup()?)
        } else {
            None
        };
        let hello = Hello {
            version: proto::PROTOCOL_VERSION,
            min_version: proto::MIN_PROTOCOL_VERSION,
            nonce,
            software: format!("agent-sandbox/{}", env!("CARGO_PKG_VERSION")),
            capabilities: Vec::new(),
            max_payload: proto::MAX_PAYLOAD as u32,
            restored: restored.clone(),
        };
        let mut w = stream.try_clone()?;
        w.write_all(&encode_json(Kind::Hello, proto::CONNECTION_ID, &hello))?;
        let mut r = stream.try_clone()?;
        r.set_read_timeout(Some(timeout))?;
        let reply = find_hello(&mut r, nonce, timeout)?;
        r.set_read_timeout(None)?;
        let shared = Arc::new(Shared {
            writer: Mutex::new(stream),
            routes: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            close_reason: Mutex::new(String::new()),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
        });
        let s2 = shared.clone();
        std::thread::Builder::new()
            .name("agent-reader".into())
            .spawn(move || {
                // Narrower than the session thread that connects.
                if let Err(e) =
                    crate::harden::install_current(crate::harden::ThreadKind::AgentReader)
                {
                    log::error!("agent-reader: {e}; stopping the process");
                    std::process::abort();
                }
                reader_loop(s2, r)
            })?;
        let client = AgentClient {
            shared,
            hello: Arc::new(reply),
        };
        if let Some(fix) = restored {
            if client.hello.version < 2 {
                let left = deadline.saturating_duration_since(Instant::now());
                let r = client.simple(
                    &Request::Restored {
                        unix_time_ns: fix.unix_time_ns,
                        entropy_hex: fix.entropy_hex,
                    },
                    left.max(Duration::from_secs(1)),
                );
                if let Err(e) = r {
                    client.close();
                    return Err(e);
                }
            }
        }
        Ok(client)
    }

    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    /// Closes the connection; every call in flight fails.
    pub fn close(&self) {
        self.shared.close("closed by host".into());
    }

    /// (bytes received, bytes sent) on this connection.
    pub fn traffic(&self) -> (u64, u64) {
        (
            self.shared.bytes_in.load(Ordering::Relaxed),
            self.shared.bytes_out.load(Ordering::Relaxed),
        )
    }

    /// Starts a request and returns its handle.
    pub fn call(&self, req: &Request) -> Result<Call> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = crossbeam_channel::unbounded();
        let send_credit = Arc::new(SendCredit {
            avail: Mutex::new(INITIAL_WINDOW as i64),
            cv: Condvar::new(),
        });
        let recv_credit = Arc::new([
            AtomicI64::new(INITIAL_WINDOW as i64),
            AtomicI64::new(INITIAL_WINDOW as i64),
        ]);
        lock(&self.shared.routes).insert(
            id,
            Route {
                tx,
                send_credit: send_credit.clone(),
                recv_credit: recv_credit.clone(),
                event_bytes: 0,
            },
        );
        let call = Call {
            id,
            shared: self.shared.clone(),
            rx,
            send_credit,
            recv_credit,
            unacked: [0; 2],
            done: false,
        };
        self.shared
            .send(&encode_json(Kind::Request, id, req))
            .map(|_| call)
    }

    /// Sends a request and waits for its final answer, discarding data.
    pub fn simple(&self, req: &Request, timeout: Duration) -> Result<Response> {
        let mut c = self.call(req)?;
        let deadline = Instant::now() + timeout;
        loop {
            match c.recv_deadline(deadline)? {
                Inbound::Response(r) => return Ok(r),
                Inbound::Error(e) => return Err(ClientError::Agent(e)),
                _ => {}
            }
        }
    }

    pub fn ping(&self, timeout: Duration) -> Result<Duration> {
        let t = Instant::now();
        self.simple(&Request::Ping, timeout)?;
        Ok(t.elapsed())
    }

    /// Runs a command to completion and collects its output (bounded by
    /// `max_output`; beyond it output is dropped and `truncated` set).
    pub fn exec(&self, req: ExecRequest, max_output: usize) -> Result<ExecOutput> {
        let timeout = req.timeout_ms.map(Duration::from_millis);
        let mut c = self.call(&Request::Exec(req))?;
        // The agent enforces the timeout; we only guard against a dead one.
        let deadline = timeout.map(|t| Instant::now() + t + Duration::from_secs(30));
        let mut out = ExecOutput::default();
        loop {
            let m = match deadline {
                Some(d) => c.recv_deadline(d)?,
                None => c.recv()?,
            };
            match m {
                Inbound::Data { channel, bytes } => {
                    let room = max_output.saturating_sub(out.stdout.len() + out.stderr.len());
                    let buf = if channel == channel::STDERR {
                        &mut out.stderr
                    } else {
                        &mut out.stdout
                    };
                    if bytes.len() > room {
                        out.truncated = true;
                    }
                    buf.extend_from_slice(&bytes[..bytes.len().min(room)]);
                }
                Inbound::Event(Event::Started { proc, pid }) => {
                    out.proc = proc;
                    out.pid = pid;
                }
                Inbound::Response(Response::Exited(st)) => {
                    out.status = st;
                    return Ok(out);
                }
                Inbound::Response(r) => {
                    return Err(ClientError::Protocol(format!("unexpected answer {r:?}")))
                }
                Inbound::Error(e) => return Err(ClientError::Agent(e)),
                _ => {}
            }
        }
    }

    pub fn write_file(&self, path: &str, data: &[u8], mode: Option<u32>) -> Result<u64> {
        let mut c = self.call(&Request::WriteFile {
            path: path.into(),
            mode,
            create_parents: true,
            append: false,
        })?;
        c.send_all(data)?;
        c.send_eof()?;
        match c.finish()? {
            Response::Written { bytes } => Ok(bytes),
            r => Err(ClientError::Protocol(format!("unexpected answer {r:?}"))),
        }
    }

    /// Reads a whole file, refusing more than `max` bytes.
    pub fn read_file(&self, path: &str, max: u64) -> Result<Vec<u8>> {
        let mut c = self.call(&Request::ReadFile {
            path: path.into(),
            offset: 0,
            len: Some(max.saturating_add(1)),
        })?;
        let mut out = Vec::new();
        loop {
            match c.recv()? {
                Inbound::Data { bytes, .. } => {
                    out.extend_from_slice(&bytes);
                    if out.len() as u64 > max {
                        return Err(ClientError::Agent(ErrorBody::new(
                            ErrorCode::Invalid,
                            format!("{path} is larger than {max} bytes"),
                        )));
                    }
                }
                Inbound::Response(_) => return Ok(out),
                Inbound::Error(e) => return Err(ClientError::Agent(e)),
                _ => {}
            }
        }
    }

    pub fn stat(&self, path: &str) -> Result<FileStat> {
        match self.simple(
            &Request::Stat { path: path.into() },
            Duration::from_secs(30),
        )? {
            Response::Stat(s) => Ok(s),
            r => Err(ClientError::Protocol(format!("unexpected answer {r:?}"))),
        }
    }

    pub fn list(
        &self,
        path: &str,
        recursive: bool,
        max: u64,
    ) -> Result<(Vec<proto::DirEntry>, bool)> {
        let mut c = self.call(&Request::List {
            path: path.into(),
            recursive,
            max_entries: Some(max),
        })?;
        let mut all = Vec::new();
        loop {
            match c.recv()? {
                Inbound::Event(Event::Entries { entries }) => all.extend(entries),
                Inbound::Response(Response::Listed { truncated, .. }) => {
                    return Ok((all, truncated))
                }
                Inbound::Response(r) => {
                    return Err(ClientError::Protocol(format!("unexpected answer {r:?}")))
                }
                Inbound::Error(e) => return Err(ClientError::Agent(e)),
                _ => {}
            }
        }
    }
}

#[derive(Debug, Default, Clone)]
pub struct ExecOutput {
    pub proc: u64,
    pub pid: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub status: ExitStatus,
    pub truncated: bool,
}

/// One request in flight. Dropping an unfinished call cancels it.
pub struct Call {
    pub id: u64,
    shared: Arc<Shared>,
    rx: Receiver<Inbound>,
    send_credit: Arc<SendCredit>,
    recv_credit: Arc<[AtomicI64; 2]>,
    unacked: [u32; 2],
    done: bool,
}

impl Call {
    fn on_recv(&mut self, m: Inbound) -> Result<Inbound> {
        match &m {
            Inbound::Data { channel, bytes } if (1..=2).contains(channel) => {
                let i = *channel as usize - 1;
                self.unacked[i] += bytes.len() as u32;
                // Grant in batches; the pipeline never runs dry because we
                // top up at a quarter of the window.
                if self.unacked[i] >= INITIAL_WINDOW / 4 {
                    let n = std::mem::take(&mut self.unacked[i]);
                    self.recv_credit[i].fetch_add(n as i64, Ordering::AcqRel);
                    let _ = self.shared.send(&encode_window(self.id, *channel, n));
                }
            }
            Inbound::Response(_) | Inbound::Error(_) => self.done = true,
            _ => {}
        }
        Ok(m)
    }

    pub fn recv(&mut self) -> Result<Inbound> {
        if self.done {
            return Err(ClientError::Closed("call already finished".into()));
        }
        let m = self
            .rx
            .recv()
            .map_err(|_| ClientError::Closed("agent connection closed".into()))?;
        self.on_recv(m)
    }

    pub fn recv_deadline(&mut self, deadline: Instant) -> Result<Inbound> {
        if self.done {
            return Err(ClientError::Closed("call already finished".into()));
        }
        match self.rx.recv_deadline(deadline) {
            Ok(m) => self.on_recv(m),
            Err(RecvTimeoutError::Timeout) => Err(ClientError::Timeout(
                deadline.saturating_duration_since(Instant::now()),
            )),
            Err(RecvTimeoutError::Disconnected) => {
                Err(ClientError::Closed("agent connection closed".into()))
            }
        }
    }

    /// Like `recv` with a timeout; `Ok(None)` when nothing arrived in time.
    pub fn recv_timeout(&mut self, t: Duration) -> Result<Option<Inbound>> {
        match self.recv_deadline(Instant::now() + t) {
            Ok(m) => Ok(Some(m)),
            Err(ClientError::Timeout(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Waits for the final answer, discarding data and events.
    pub fn finish(&mut self) -> Result<Response> {
        loop {
            match self.recv()? {
                Inbound::Response(r) => return Ok(r),
                Inbound::Error(e) => return Err(ClientError::Agent(e)),
                _ => {}
            }
        }
    }

    /// A handle for feeding this call's input from another thread.
    pub fn sender(&self) -> CallSender {
        CallSender {
            id: self.id,
            shared: self.shared.clone(),
            send_credit: self.send_credit.clone(),
        }
    }

    pub fn send_all(&self, data: &[u8]) -> Result<()> {
        self.sender().send_all(data)
    }

    pub fn send_eof(&self) -> Result<()> {
        self.sender().send_eof()
    }

    pub fn cancel(&self) -> Result<()> {
        self.sender().cancel()
    }
}

/// The sending half of a [`Call`]: stdin / file data, EOF, cancel.
#[derive(Clone)]
pub struct CallSender {
    pub id: u64,
    shared: Arc<Shared>,
    send_credit: Arc<SendCredit>,
}

impl CallSender {
    /// Sends bytes on channel 0, blocking while the agent's window is shut.
    pub fn send_all(&self, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            let n = self.take_credit(data.len().min(MAX_DATA_CHUNK))?;
            self.shared.send(&encode_frame(
                Kind::Data,
                self.id,
                channel::STDIN,
                &data[..n],
            ))?;
            data = &data[n..];
        }
        Ok(())
    }

    fn take_credit(&self, want: usize) -> Result<usize> {
        let mut avail = lock(&self.send_credit.avail);
        loop {
            if self.shared.closed.load(Ordering::Acquire) {
                return Err(ClientError::Closed(lock(&self.shared.close_reason).clone()));
            }
            if *avail > 0 {
                let n = (*avail as usize).min(want);
                *avail -= n as i64;
                return Ok(n);
            }
            let (g, _) = self
                .send_credit
                .cv
                .wait_timeout(avail, Duration::from_secs(1))
                .map_err(|_| ClientError::Closed("poisoned".into()))?;
            avail = g;
        }
    }

    pub fn send_eof(&self) -> Result<()> {
        self.shared
            .send(&encode_frame(Kind::Eof, self.id, channel::STDIN, &[]))
    }

    pub fn cancel(&self) -> Result<()> {
        self.shared
            .send(&encode_frame(Kind::Cancel, self.id, 0, &[]))
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.cancel();
            // Keep the route until the agent's final frame arrives so that
            // data still in flight is accounted for; the reader removes it.
        }
    }
}

fn reader_loop(shared: Arc<Shared>, stream: UnixStream) {
    let mut r = proto::FrameReader::new(BufReader::with_capacity(256 * 1024, stream));
    let reason = loop {
        match r.read_frame() {
            Ok(Some(f)) => {
                shared
                    .bytes_in
                    .fetch_add((HEADER_LEN + f.payload.len()) as u64, Ordering::Relaxed);
                if let Err(e) = route(&shared, f) {
                    break e;
                }
            }
            Ok(None) => break "agent closed the connection".to_string(),
            Err(e) => break format!("{e}"),
        }
    };
    log::debug!("agent reader stopping: {reason}");
    shared.close(reason);
}

/// Delivers one guest frame. An error closes the connection.
fn route(shared: &Shared, f: Frame) -> std::result::Result<(), String> {
    let id = f.header.id;
    let Some(kind) = f.kind() else {
        return Err(format!("unknown frame kind {}", f.header.kind));
    };
    if id == proto::CONNECTION_ID {
        if kind == Kind::Error {
            let e: ErrorBody = serde_json::from_slice(&f.payload)
                .map_err(|e| format!("bad connection error frame: {e}"))?;
            log::warn!("agent reports: {e}");
        }
        return Ok(());
    }
    let mut routes = lock(&shared.routes);
    // Frames for calls that are gone are stale, not an attack.
    let Some(rt) = routes.get_mut(&id) else {
        return Ok(());
    };
    let msg = match kind {
        Kind::Data => {
            let ch = f.header.channel;
            if !(1..=2).contains(&ch) {
                return Err(format!("data on channel {ch} from the agent"));
            }
            let left = rt.recv_credit[ch as usize - 1]
                .fetch_sub(f.payload.len() as i64, Ordering::AcqRel)
                - f.payload.len() as i64;
            if left < 0 {
                return Err(format!(
                    "call {id}: agent sent beyond its window on channel {ch}"
                ));
            }
            Inbound::Data {
                channel: ch,
                bytes: f.payload,
            }
        }
        Kind::Eof => Inbound::Eof {
            channel: f.header.channel,
        },
        Kind::Window => {
            let b: [u8; 4] = f
                .payload
                .as_slice()
                .try_into()
                .map_err(|_| "window payload must be 4 bytes".to_string())?;
            let n = u32::from_le_bytes(b) as i64;
            let mut a = lock(&rt.send_credit.avail);
            *a = (*a + n).min(u32::MAX as i64);
            rt.send_credit.cv.notify_all();
            return Ok(());
        }
        Kind::Event => {
            rt.event_bytes += f.payload.len() as u64;
            if rt.event_bytes > MAX_EVENT_BYTES_PER_CALL {
                return Err(format!("call {id}: too many events"));
            }
            Inbound::Event(
                serde_json::from_slice(&f.payload).map_err(|e| format!("bad event: {e}"))?,
            )
        }
        Kind::Response => {
            let r = serde_json::from_slice(&f.payload).map_err(|e| format!("bad response: {e}"))?;
            let rt = routes.remove(&id);
            if let Some(rt) = rt {
                let _ = rt.tx.send(Inbound::Response(r));
            }
            return Ok(());
        }
        Kind::Error => {
            let e = serde_json::from_slice(&f.payload).map_err(|e| format!("bad error: {e}"))?;
            let rt = routes.remove(&id);
            if let Some(rt) = rt {
                let _ = rt.tx.send(Inbound::Error(e));
            }
            return Ok(());
        }
        Kind::Hello | Kind::Request | Kind::Cancel => {
            return Err(format!("agent sent a {kind:?} frame"));
        }
    };
    let _ = rt.tx.send(msg);
    Ok(())
}

/// Reads until a hello frame carrying `nonce` arrives, skipping anything
/// else, byte by byte if the stream is out of frame sync.
fn find_hello<R: Read>(r: &mut R, nonce: u64, timeout: Duration) -> Result<Hello> {
    let deadline = Instant::now() + timeout;
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        // Try to find a hello at each offset.
        let mut start = 0;
        while start + HEADER_LEN <= buf.len() {
            let mut hb = [0u8; HEADER_LEN];
            hb.copy_from_slice(&buf[start..start + HEADER_LEN]);
            match Header::decode(&hb) {
                Ok(h) if h.kind == Kind::Hello as u8 && h.id == 0 && h.len <= 64 * 1024 => {
                    let end = start + HEADER_LEN + h.len as usize;
                    if end > buf.len() {
                        break; // need more bytes
                    }
                    if let Ok(hello) =
                        serde_json::from_slice::<Hello>(&buf[start + HEADER_LEN..end])
                    {
                        if hello.nonce == nonce {
                            if end != buf.len() {
                                return Err(ClientError::Protocol(
                                    "agent sent frames before answering hello".into(),
                                ));
                            }
                            return Ok(hello);
                        }
                    }
                    start += 1;
                }
                Ok(h) if h.kind == Kind::Error as u8 && h.id == 0 => {
                    let end = start + HEADER_LEN + h.len as usize;
                    if end > buf.len() {
                        break;
                    }
                    if let Ok(e) =
                        serde_json::from_slice::<ErrorBody>(&buf[start + HEADER_LEN..end])
                    {
                        return Err(ClientError::Agent(e));
                    }
                    start += 1;
                }
                _ => start += 1,
            }
        }
        buf.drain(..start);
        if buf.len() > 1 << 20 {
            return Err(ClientError::Protocol("no hello in the first MiB".into()));
        }
        if Instant::now() >= deadline {
            return Err(ClientError::Timeout(timeout));
        }
        match r.read(&mut chunk) {
            Ok(0) => return Err(ClientError::Closed("closed before hello".into())),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(ClientError::Timeout(timeout))
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ClientError::Io(e)),
        }
    }
}

/// The fixup a guest needs right after a snapshot restore: the host's wall
/// clock now and 32 fresh random bytes.
pub fn restore_fixup() -> io::Result<RestoreFixup> {
    let unix_time_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut entropy = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut entropy))
        .map_err(|e| io::Error::new(e.kind(), format!("read /dev/urandom: {e}")))?;
    Ok(RestoreFixup {
        unix_time_ns,
        entropy_hex: entropy.iter().map(|b| format!("{b:02x}")).collect(),
    })
}

/// A nonce, not a secret: it only has to differ between connections.
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok()
    {
        return u64::from_le_bytes(b);
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ ((std::process::id() as u64) << 32)
}

impl From<DecodeError> for ClientError {
    fn from(e: DecodeError) -> Self {
        ClientError::Protocol(e.to_string())
    }
}
