//! Host side of the guest protocol: one [`AgentClient`] per VM connection,
//! multiplexing any number of concurrent [`Call`]s over it.
//!
//! Reading is leader/follower: whoever holds the read token (the
//! connection's input buffer) reads the socket and routes every frame to
//! its call's channel. A caller waiting for its own call takes the token
//! when it is free and reads itself, so the reply wakes it straight from
//! the socket, with no hop through another thread (the exec round trip is
//! the product's hot path). A background reader holds the token while no
//! caller wants it (idle connections must still notice a closed socket,
//! and Window frames must reach blocked writers); it yields the token as
//! soon as a caller asks, through an eventfd.
//!
//! The guest is untrusted. Its frames are bounded (size, credit) and a
//! guest that breaks the protocol loses its connection, never host memory.

use crate::proto::{
    self, channel, encode_frame, encode_json, encode_window, DecodeError, ErrorBody, ErrorCode,
    Event, ExecRequest, ExitStatus, FileStat, Frame, Header, Hello, Kind, Request, Response,
    RestoreFixup, HEADER_LEN, INITIAL_WINDOW, MAX_DATA_CHUNK,
};
use crate::sync::{lock, wait_timeout};
use crossbeam_channel::{Receiver, Sender, TryRecvError};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub mod guestlog;

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
    /// The guest's answer went over a host-side budget (entries, bytes):
    /// the call was ended, the connection lives on.
    #[error("agent reply refused: {0}")]
    OverBudget(String),
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
    /// Final, made by the host: the guest's reply went over a budget.
    /// [`Call`] turns it into [`ClientError::OverBudget`]; callers never
    /// receive it.
    OverBudget(String),
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
    /// Directory entries received, and how many the request asked for at
    /// most (a `List`'s `max_entries`).
    entries: u64,
    max_entries: u64,
}

/// Event JSON one call may bring. Events are a start notice and listing
/// batches: 32 MiB is 100k entries of 300-byte paths. Past it the call is
/// ended ([`ClientError::OverBudget`]), so a guest can make the host hold
/// at most this much per call however it inflates a listing.
pub const MAX_EVENT_BYTES_PER_CALL: u64 = 32 << 20;

struct Shared {
    writer: Mutex<UnixStream>,
    routes: Mutex<HashMap<u64, Route>>,
    next_id: AtomicU64,
    closed: AtomicBool,
    close_reason: Mutex<String>,
    /// Asked when the connection closes: why the VM went, if known.
    close_note: Mutex<Option<CloseNote>>,
    /// Bytes received from the guest, for metrics.
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    /// The read token: a one-slot channel holding the [`Input`] while
    /// nobody reads. Callers and the background reader take it from here.
    token_tx: Sender<Input>,
    token_rx: Receiver<Input>,
    /// Callers waiting for a message or the token. While non-zero the
    /// background reader neither takes the token nor keeps it.
    want: AtomicUsize,
    want_lock: Mutex<()>,
    want_cv: Condvar,
    /// The background reader holds the token (so a caller must ask).
    bg_holding: AtomicBool,
    /// Writers blocked on send credit: only a reader brings it (Window
    /// frames), so the background reader takes the token at once for them.
    credit_waiters: AtomicUsize,
    /// Wakes the background reader out of its poll to yield the token.
    yield_fd: OwnedFd,
    /// Throttles the log lines this guest's connection errors cause.
    log_bucket: guestlog::LogBucket,
}

impl Shared {
    /// Makes the background reader's poll return.
    fn poke(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: an 8-byte write to our eventfd. It can only fail when the
        // counter is saturated, and then the reader is awake anyway.
        unsafe { libc::write(self.yield_fd.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    fn want_begin(&self) {
        self.want.fetch_add(1, Ordering::SeqCst);
        if self.bg_holding.load(Ordering::SeqCst) {
            self.poke();
        }
    }

    fn want_end(&self) {
        if self.want.fetch_sub(1, Ordering::SeqCst) == 1 {
            // Under the lock, so the background reader cannot miss it
            // between its check and its wait.
            drop(lock(&self.want_lock));
            self.want_cv.notify_all();
        }
    }

    /// Hands the read token back (there is one, so the slot is free).
    fn put_token(&self, input: Input) {
        let _ = self.token_tx.try_send(input);
    }

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
        let note = lock(&self.close_note).as_ref().and_then(|f| f());
        let reason = match note {
            Some(n) => format!("{reason}; {n}"),
            None => reason,
        };
        *lock(&self.close_reason) = reason.clone();
        let n = self.log_bucket.take_suppressed();
        if n > 0 {
            log::warn!("agent connection closed; {n} guest log lines were suppressed");
        }
        let _ = lock(&self.writer).shutdown(std::net::Shutdown::Both);
        self.poke();
        drop(lock(&self.want_lock));
        self.want_cv.notify_all();
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

/// Why a VM's agent connection closed, when its VMM knows (e.g. killed at
/// its cgroup memory limit); `None` when nothing is known.
pub type CloseNote = Box<dyn Fn() -> Option<String> + Send>;

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
        Self::connect_with(stream, timeout, Started::Fresh)
    }

    /// [`AgentClient::connect`], telling the agent whether the VM was just
    /// restored from a snapshot. If so the hello carries the fixup
    /// ([`restore_fixup`]); a version 2 agent applies it before it answers,
    /// an older one gets it as a separate [`Request::Restored`].
    pub fn connect_with(
        stream: UnixStream,
        timeout: Duration,
        start: Started,
    ) -> Result<AgentClient> {
        let deadline = Instant::now() + timeout;
        let nonce = random_u64()?;
        // Taken last thing before the hello goes out: the guest clock is
        // set to it.
        let restored = match start {
            Started::Restored { warm_up } => Some(restore_fixup(warm_up)?),
            Started::Fresh => None,
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
        let (reply, early) = find_hello(&mut r, nonce, timeout)?;
        r.set_read_timeout(None)?;
        // SAFETY: plain syscall; the result is checked.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(ClientError::Io(io::Error::new(
                io::Error::last_os_error().kind(),
                format!(
                    "eventfd for the agent reader: {}",
                    io::Error::last_os_error()
                ),
            )));
        }
        // SAFETY: a fresh descriptor we own.
        let yield_fd = unsafe { OwnedFd::from_raw_fd(efd) };
        let (token_tx, token_rx) = crossbeam_channel::bounded(1);
        let shared = Arc::new(Shared {
            writer: Mutex::new(stream),
            routes: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            close_reason: Mutex::new(String::new()),
            close_note: Mutex::new(None),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            token_tx,
            token_rx,
            want: AtomicUsize::new(0),
            want_lock: Mutex::new(()),
            want_cv: Condvar::new(),
            bg_holding: AtomicBool::new(false),
            credit_waiters: AtomicUsize::new(0),
            yield_fd,
            log_bucket: guestlog::LogBucket::default(),
        });
        let mut input = Input::new(r);
        // Frames that came in the same read as the hello: the reader routes
        // them first.
        input.buf = early;
        shared.put_token(input);
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
                background_reader(s2)
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
    /// `note` is asked once the connection closes (the VM gone): its
    /// answer is added to the reason every caller sees.
    pub fn set_close_note(&self, note: CloseNote) {
        *lock(&self.shared.close_note) = Some(note);
    }

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
        // An agent without the capability would ignore the fields and run
        // the command unlimited: refused here instead.
        if let Request::Exec(e) = req {
            let limited = e.memory_max.is_some() || e.cpu_max_us.is_some();
            if limited
                && !self
                    .hello
                    .capabilities
                    .iter()
                    .any(|c| c == proto::CAP_EXEC_LIMITS)
            {
                return Err(ClientError::Agent(proto::ErrorBody::new(
                    proto::ErrorCode::Invalid,
                    format!(
                        "the guest agent ({}) cannot limit one command (no exec.limits capability): rebuild the guest images",
                        self.hello.software
                    ),
                )));
            }
        }
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
        // Only a listing brings entries, at most as many as it asked for.
        let max_entries = match req {
            Request::List { max_entries, .. } => max_entries
                .unwrap_or(proto::limits::MAX_LIST_ENTRIES)
                .min(proto::limits::MAX_LIST_ENTRIES),
            _ => 0,
        };
        lock(&self.shared.routes).insert(
            id,
            Route {
                tx,
                send_credit: send_credit.clone(),
                recv_credit: recv_credit.clone(),
                event_bytes: 0,
                entries: 0,
                max_entries,
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
            sent: Instant::now(),
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
    /// When the request was sent: a timeout says how long it went unanswered.
    sent: Instant,
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
            Inbound::OverBudget(why) => {
                self.done = true;
                // The host ended the call: tell the guest to stop too.
                let _ = self.cancel();
                return Err(ClientError::OverBudget(why.clone()));
            }
            _ => {}
        }
        Ok(m)
    }

    pub fn recv(&mut self) -> Result<Inbound> {
        self.wait(None)
    }

    pub fn recv_deadline(&mut self, deadline: Instant) -> Result<Inbound> {
        self.wait(Some(deadline))
    }

    /// The next message: from the channel if someone else read it, else
    /// read off the socket by this thread once it holds the read token.
    fn wait(&mut self, deadline: Option<Instant>) -> Result<Inbound> {
        if self.done {
            return Err(ClientError::Closed("call already finished".into()));
        }
        let closed = || ClientError::Closed("agent connection closed".into());
        loop {
            match self.rx.try_recv() {
                Ok(m) => return self.on_recv(m),
                Err(TryRecvError::Disconnected) => return Err(closed()),
                Err(TryRecvError::Empty) => {}
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(ClientError::Timeout(self.sent.elapsed()));
            }
            let shared = self.shared.clone();
            shared.want_begin();
            let got = match deadline {
                None => crossbeam_channel::select! {
                    recv(self.rx) -> m => Got::Msg(m.ok()),
                    recv(shared.token_rx) -> t => Got::Token(t.ok()),
                },
                Some(d) => crossbeam_channel::select! {
                    recv(self.rx) -> m => Got::Msg(m.ok()),
                    recv(shared.token_rx) -> t => Got::Token(t.ok()),
                    default(d.saturating_duration_since(Instant::now())) => Got::Timeout,
                },
            };
            if !matches!(got, Got::Token(Some(_))) {
                shared.want_end();
            }
            match got {
                Got::Msg(Some(m)) => return self.on_recv(m),
                Got::Msg(None) => return Err(closed()),
                Got::Token(Some(mut input)) => {
                    // Still counted in `want` while leading: the
                    // background reader's grace starts when we are done.
                    lead(&shared, &mut input, &self.rx, deadline);
                    shared.put_token(input);
                    shared.want_end();
                    // Loop: the message is in the channel, or the deadline
                    // passed, or the connection closed (an error is queued).
                }
                Got::Token(None) => return Err(closed()),
                Got::Timeout => return Err(ClientError::Timeout(self.sent.elapsed())),
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
            self.shared.credit_waiters.fetch_add(1, Ordering::SeqCst);
            drop(lock(&self.shared.want_lock));
            self.shared.want_cv.notify_all();
            let r = self
                .send_credit
                .cv
                .wait_timeout(avail, Duration::from_secs(1));
            self.shared.credit_waiters.fetch_sub(1, Ordering::SeqCst);
            let (g, _) = r.map_err(|_| ClientError::Closed("poisoned".into()))?;
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

enum Got {
    Msg(Option<Inbound>),
    Token(Option<Input>),
    Timeout,
}

/// Bytes read from the guest and not yet decoded: whoever holds it (the
/// read token) is the only reader of the socket.
struct Input {
    stream: UnixStream,
    buf: Vec<u8>,
    /// Decoded up to here.
    start: usize,
}

/// One read takes up to this much (a Data frame is at most 256 KiB).
const READ_CHUNK: usize = 512 * 1024;

impl Input {
    fn new(stream: UnixStream) -> Input {
        Input {
            stream,
            buf: Vec::with_capacity(READ_CHUNK),
            start: 0,
        }
    }

    /// The next complete frame already buffered.
    fn decode(&mut self) -> std::result::Result<Option<Frame>, String> {
        match proto::decode_frame(&self.buf[self.start..]) {
            Ok(Some((f, n))) => {
                self.start += n;
                if self.start == self.buf.len() {
                    self.buf.clear();
                    self.start = 0;
                }
                Ok(Some(f))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    }

    /// One read(2) of what the socket has (the caller polled it
    /// readable, and nobody else reads it); `Ok(0)` at end of stream.
    fn fill(&mut self) -> io::Result<usize> {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.reserve(READ_CHUNK);
        let spare = self.buf.spare_capacity_mut();
        // SAFETY: reads at most spare.len() bytes into the vector's spare
        // capacity; only the bytes the kernel wrote are then marked valid.
        let n = unsafe {
            libc::read(
                self.stream.as_raw_fd(),
                spare.as_mut_ptr().cast(),
                spare.len(),
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = n as usize;
        // SAFETY: the kernel initialised n bytes past the old length.
        unsafe { self.buf.set_len(self.buf.len() + n) };
        Ok(n)
    }

    /// Routes every buffered frame. An error closes the connection.
    fn route_buffered(&mut self, shared: &Shared) -> bool {
        loop {
            match self.decode() {
                Ok(Some(f)) => {
                    shared
                        .bytes_in
                        .fetch_add((HEADER_LEN + f.payload.len()) as u64, Ordering::Relaxed);
                    if let Err(e) = route(shared, f) {
                        shared.close(e);
                        return false;
                    }
                }
                Ok(None) => return true,
                Err(e) => {
                    shared.close(e);
                    return false;
                }
            }
        }
    }

    /// Reads once after `poll` said the socket is readable. False once
    /// the connection is over.
    fn read_more(&mut self, shared: &Shared) -> bool {
        match self.fill() {
            Ok(0) => {
                shared.close("agent closed the connection".into());
                false
            }
            Ok(_) => true,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
                ) =>
            {
                true
            }
            Err(e) => {
                shared.close(format!("read: {e}"));
                false
            }
        }
    }
}

/// poll(2) on `fds` for input; EINTR counts as nothing ready.
fn poll_in(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<usize> {
    let ms = match timeout {
        None => -1,
        // Round up: a 0.4 ms wait must not become a busy loop.
        Some(d) => d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32,
    };
    // SAFETY: fds is a valid slice of pollfd.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(e);
    }
    Ok(n as usize)
}

fn pollfd(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// A caller holding the read token: reads and routes frames until one
/// lands in its own channel `rx`, the deadline passes or the connection
/// ends.
fn lead(shared: &Shared, input: &mut Input, rx: &Receiver<Inbound>, deadline: Option<Instant>) {
    loop {
        if !input.route_buffered(shared) || !rx.is_empty() {
            return;
        }
        if shared.closed.load(Ordering::Acquire) {
            return;
        }
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        if left == Some(Duration::ZERO) {
            return;
        }
        let mut fds = [pollfd(input.stream.as_raw_fd())];
        match poll_in(&mut fds, left) {
            Ok(0) => continue,
            Ok(_) => {
                if !input.read_more(shared) {
                    return;
                }
            }
            Err(e) => {
                shared.close(format!("poll: {e}"));
                return;
            }
        }
    }
}

/// How long the read token may lie unused before the background reader
/// takes it: this bounds how late a frame for a call nobody is waiting on
/// (or the end of the connection) is noticed.
const READER_GRACE: Duration = Duration::from_millis(2);

/// Holds the read token while no caller wants it, so frames for calls
/// nobody is waiting on (Window credit, data of a busy consumer) and the
/// end of the connection are handled promptly.
fn background_reader(shared: Arc<Shared>) {
    loop {
        {
            // Wait while callers want the token, then a grace period: a
            // caller that comes back for its next message (the next exec of
            // a sequence, the next chunk of a stream) takes the token
            // without waking this thread twice. Writers waiting for credit
            // end the grace at once.
            let mut g = lock(&shared.want_lock);
            let mut idle_since: Option<Instant> = None;
            loop {
                if shared.closed.load(Ordering::Acquire) {
                    break;
                }
                let wait = if shared.want.load(Ordering::SeqCst) > 0 {
                    idle_since = None;
                    // The timeout only guards against a lost wake-up.
                    Duration::from_millis(100)
                } else if shared.credit_waiters.load(Ordering::SeqCst) > 0 {
                    break;
                } else {
                    let since = *idle_since.get_or_insert_with(Instant::now);
                    match READER_GRACE.checked_sub(since.elapsed()) {
                        Some(left) if !left.is_zero() => left,
                        _ => break,
                    }
                };
                g = wait_timeout(&shared.want_cv, g, wait);
            }
        }
        if shared.closed.load(Ordering::Acquire) {
            break;
        }
        let Ok(mut input) = shared.token_rx.recv() else {
            break;
        };
        shared.bg_holding.store(true, Ordering::SeqCst);
        loop {
            if !input.route_buffered(&shared) || shared.closed.load(Ordering::Acquire) {
                break;
            }
            // Checked after `bg_holding` is set: a caller that raised
            // `want` before that is seen here, one after it pokes us.
            if shared.want.load(Ordering::SeqCst) > 0 {
                break;
            }
            let mut fds = [
                pollfd(input.stream.as_raw_fd()),
                pollfd(shared.yield_fd.as_raw_fd()),
            ];
            match poll_in(&mut fds, None) {
                Ok(_) => {
                    if fds[1].revents != 0 {
                        let mut b = [0u8; 8];
                        // SAFETY: an 8-byte read from our eventfd.
                        unsafe {
                            libc::read(shared.yield_fd.as_raw_fd(), b.as_mut_ptr().cast(), 8)
                        };
                    }
                    if fds[0].revents != 0 && !input.read_more(&shared) {
                        break;
                    }
                }
                Err(e) => {
                    shared.close(format!("poll: {e}"));
                    break;
                }
            }
        }
        shared.bg_holding.store(false, Ordering::SeqCst);
        shared.put_token(input);
    }
    log::debug!(
        "agent reader stopping: {}",
        lock(&shared.close_reason).as_str()
    );
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
            // Guest text: escaped, cut and rate-limited (see guestlog).
            if let Some(n) = shared.log_bucket.admit() {
                log::warn!(
                    "agent reports: {}{}",
                    guestlog::untrusted(&e.to_string()),
                    guestlog::suppressed_note(n)
                );
            }
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
                end_over_budget(
                    &mut routes,
                    id,
                    format!(
                        "the agent sent more than {MAX_EVENT_BYTES_PER_CALL} bytes of events \
                         for one request"
                    ),
                );
                return Ok(());
            }
            let ev: Event =
                serde_json::from_slice(&f.payload).map_err(|e| format!("bad event: {e}"))?;
            if let Event::Entries { entries } = &ev {
                rt.entries += entries.len() as u64;
                if rt.entries > rt.max_entries {
                    let max = rt.max_entries;
                    end_over_budget(
                        &mut routes,
                        id,
                        format!("the agent sent more than the {max} entries asked for"),
                    );
                    return Ok(());
                }
            }
            Inbound::Event(ev)
        }
        Kind::Response => {
            let mut r: Response =
                serde_json::from_slice(&f.payload).map_err(|e| format!("bad response: {e}"))?;
            // An audit record comes from the guest: held to the documented
            // limits whatever the agent did (the frame limit already caps
            // its size in memory).
            if let Response::Exited(ExitStatus { audit: Some(a), .. }) = &mut r {
                a.bound();
            }
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

/// Ends call `id` because its guest went over a budget: the caller gets
/// [`ClientError::OverBudget`], later frames of the call are dropped as
/// stale. The connection and other calls are untouched.
fn end_over_budget(routes: &mut HashMap<u64, Route>, id: u64, why: String) {
    if let Some(rt) = routes.remove(&id) {
        let _ = rt.tx.send(Inbound::OverBudget(why));
    }
}

/// Reads until a hello frame carrying `nonce` arrives, skipping anything
/// else, byte by byte if the stream is out of frame sync. Returns the hello
/// and the bytes read past it (frames the agent sent right after it, read
/// in the same chunk), which belong to the connection.
fn find_hello<R: Read>(r: &mut R, nonce: u64, timeout: Duration) -> Result<(Hello, Vec<u8>)> {
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
                            // Bounded: `buf` holds at most 1 MiB + a chunk.
                            let rest = buf.split_off(end);
                            return Ok((hello, rest));
                        }
                    }
                    start += 1;
                }
                Ok(h) if h.kind == Kind::Error as u8 && h.id == 0 => {
                    let end = start + HEADER_LEN + h.len as usize;
                    if end > buf.len() {
                        break;
                    }
                    if let Ok(mut e) =
                        serde_json::from_slice::<ErrorBody>(&buf[start + HEADER_LEN..end])
                    {
                        // Ends up in the daemon's log (session start failed).
                        e.message = guestlog::untrusted(&e.message).to_string();
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

/// How the VM behind a new connection started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Started {
    /// Booted, or already greeted once: the hello carries no fixup.
    Fresh,
    /// Just restored from a snapshot: the hello carries the clock and
    /// entropy fixup, and `warm_up` ([`RestoreFixup::warm_up`]).
    Restored { warm_up: bool },
}

/// The fixup a guest needs right after a snapshot restore: the host's wall
/// clock now and 32 fresh random bytes (and whether to warm up, see
/// [`RestoreFixup::warm_up`]).
pub fn restore_fixup(warm_up: bool) -> io::Result<RestoreFixup> {
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
        warm_up,
    })
}

/// Key material, nonces and ids: one CSPRNG reader, in `harden`, that
/// every layer may use.
pub use crate::harden::random::{random_u64, secure_random};

impl From<DecodeError> for ClientError {
    fn from(e: DecodeError) -> Self {
        ClientError::Protocol(e.to_string())
    }
}
