//! The daemon's HTTP/1.1 server: a thread per connection, blocking I/O,
//! every read bounded in bytes and in time.
//!
//! Why our own and not tiny_http 0.12: it drained an unread body on drop
//! into `vec![0; remaining]` sized by the client's `Content-Length` (one
//! unauthenticated request aborted the daemon), read headers without a size
//! limit and connections without a read timeout, and could not be made
//! sound from outside. Heads are parsed by `httparse` (the parser hyper
//! uses); framing, limits and timeouts are ours:
//!
//! - a head is at most [`MAX_HEAD`] bytes and [`MAX_HEADERS`] headers, and
//!   must arrive within `head_timeout` of its first byte (431 / 408);
//! - a `Content-Length` over `max_body` is refused with 413 before a byte
//!   of the body is read or allocated, and the connection is closed;
//! - both `Content-Length` and `Transfer-Encoding`, duplicate
//!   `Content-Length`s, or a coding other than `chunked` are refused with
//!   400 and the connection closed (request smuggling behind a proxy);
//! - a body must keep coming (`read_timeout` per read) and arrive at
//!   [`MIN_BODY_RATE`] on average, else 408;
//! - at most `max_connections` connections in all and `max_per_ip` from one
//!   client address (503 beyond, written without waiting);
//! - a handler that panics ends only its own connection.

use super::shape::Shape;
use crate::sync::lock;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Largest request head (request line and headers) accepted.
pub const MAX_HEAD: usize = 32 * 1024;
/// Most header lines in one request.
pub const MAX_HEADERS: usize = 64;
/// A body must average at least this many bytes per second (on top of
/// `read_timeout` of grace), so a trickling client cannot hold its
/// connection for long.
pub const MIN_BODY_RATE: u64 = 64 * 1024;
/// An unread remainder this small is read and dropped to keep the
/// connection; anything bigger closes it.
const DRAIN_MAX: u64 = 64 * 1024;
/// Longest chunk-size or trailer line of a chunked body.
const MAX_CHUNK_LINE: usize = 1024;

/// Bounds of the server; [`Limits::from_config`] is the one place they
/// are set from the daemon's configuration and its endpoints.
#[derive(Debug, Clone)]
pub struct Limits {
    /// The largest body any route takes; a bigger `Content-Length` is
    /// refused before reading.
    pub max_body: u64,
    pub head_timeout: Duration,
    /// Keep-alive: how long a connection may sit between requests.
    pub idle_timeout: Duration,
    /// How long one read of a body may wait for a byte.
    pub read_timeout: Duration,
    pub write_timeout: Duration,
    pub max_connections: usize,
    pub max_per_ip: usize,
}

impl Limits {
    /// `max_body`: the largest body any endpoint reads
    /// ([`super::Endpoints::max_body`]).
    pub fn from_config(cfg: &crate::config::Config, max_body: usize) -> Limits {
        Limits {
            max_body: max_body as u64,
            head_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            read_timeout: Duration::from_secs(10),
            write_timeout: cfg.write_timeout,
            max_connections: cfg.max_connections,
            max_per_ip: cfg.max_connections_per_ip,
        }
    }
}

/// One request header, as received (names compare case-insensitively).
#[derive(Debug, Clone)]
pub struct Header {
    pub name: String,
    pub value: String,
}

impl Header {
    pub fn is(&self, name: &str) -> bool {
        self.name.eq_ignore_ascii_case(name)
    }
}

/// The connection a request came on; goes back to its connection thread
/// after the reply unless the connection must close.
struct Conn {
    stream: TcpStream,
    /// Bytes read past the previous head, not yet consumed.
    buf: Vec<u8>,
    pos: usize,
    peer: SocketAddr,
}

impl Conn {
    /// Reads what is there (buffered first), waiting at most until
    /// `deadline` and at most `idle` for one read.
    fn read_some(
        &mut self,
        out: &mut [u8],
        deadline: Instant,
        idle: Duration,
    ) -> io::Result<usize> {
        if self.pos < self.buf.len() {
            let n = out.len().min(self.buf.len() - self.pos);
            out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
            self.pos += n;
            return Ok(n);
        }
        self.read_socket(out, deadline, idle)
    }

    /// Reads from the socket itself (the buffer is the caller's concern).
    fn read_socket(
        &mut self,
        out: &mut [u8],
        deadline: Instant,
        idle: Duration,
    ) -> io::Result<usize> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "read deadline passed",
            ));
        }
        self.stream
            .set_read_timeout(Some(left.min(idle).max(Duration::from_millis(1))))?;
        match self.stream.read(out) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no data within the read timeout",
            )),
            r => r,
        }
    }

    fn read_byte(&mut self, deadline: Instant, idle: Duration) -> io::Result<u8> {
        let mut b = [0u8; 1];
        match self.read_some(&mut b, deadline, idle)? {
            0 => Err(io::ErrorKind::UnexpectedEof.into()),
            _ => Ok(b[0]),
        }
    }
}

#[derive(Debug)]
enum Body {
    Empty,
    Length { left: u64 },
    Chunked(Chunked),
}

#[derive(Debug)]
struct Chunked {
    /// Data bytes left in the current chunk.
    left: u64,
    /// Data bytes read so far (bounded by `max_body`).
    total: u64,
    done: bool,
    /// The CRLF after a chunk's data is still to be read.
    need_crlf: bool,
}

/// A request with its connection. Answer it with [`Request::respond`] or
/// take the socket with [`Request::into_writer`]; dropping it unanswered
/// closes the connection.
pub struct Request {
    method: String,
    url: String,
    http10: bool,
    headers: Vec<Header>,
    body: Body,
    declared: Option<u64>,
    expect_continue: bool,
    keep_alive: bool,
    conn: Option<Conn>,
    back: Option<SyncSender<Conn>>,
    limits: Arc<Limits>,
    /// When the body must have arrived in full.
    body_deadline: Instant,
    /// The body was not read to its end, or reading it failed.
    body_broken: bool,
    /// A body read ahead (for the audit log) and handed out again first.
    replay: Option<io::Cursor<Vec<u8>>>,
}

impl Request {
    pub fn method(&self) -> &str {
        &self.method
    }
    pub fn url(&self) -> &str {
        &self.url
    }
    pub fn headers(&self) -> &[Header] {
        &self.headers
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|h| h.is(name))
            .map(|h| h.value.as_str())
    }
    pub fn is_http10(&self) -> bool {
        self.http10
    }
    /// The client's address.
    pub fn peer(&self) -> Option<SocketAddr> {
        self.conn.as_ref().map(|c| c.peer)
    }
    /// The declared `Content-Length` (none for chunked or empty bodies).
    pub fn body_length(&self) -> Option<usize> {
        self.declared
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
    }
    /// The body, bounded by its framing, `max_body` and the body deadline.
    pub fn as_reader(&mut self) -> &mut dyn Read {
        self
    }

    /// `body` (read from this request by the dispatcher) is what the
    /// handler reads next, before anything left on the connection.
    pub fn replay_body(&mut self, body: Vec<u8>) {
        self.replay = Some(io::Cursor::new(body));
    }

    fn body_done(&self) -> bool {
        match &self.body {
            Body::Empty => true,
            Body::Length { left } => *left == 0,
            Body::Chunked(c) => c.done,
        }
    }

    /// Sends a complete reply.
    pub fn respond(mut self, status: u16, headers: &[(&str, &str)], body: &[u8]) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let reuse = self.keep_alive && !self.body_broken && self.drain(&mut conn);
        let mut head = format!("HTTP/1.1 {status} {}\r\n", reason(status));
        for (k, v) in headers {
            // Values come from our own code; refuse to emit a header
            // that could split the response.
            if k.bytes().chain(v.bytes()).any(|b| b == b'\r' || b == b'\n') {
                continue;
            }
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        let head_only = self.method == "HEAD";
        head.push_str(crate::router::host_header_line());
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
        if !reuse {
            head.push_str("Connection: close\r\n");
        } else if self.http10 {
            head.push_str("Connection: keep-alive\r\n");
        }
        head.push_str("\r\n");
        let mut out = head.into_bytes();
        if !head_only {
            out.extend_from_slice(body);
        }
        let ok = conn
            .stream
            .write_all(&out)
            .and_then(|_| conn.stream.flush())
            .is_ok();
        if ok && reuse {
            if let Some(back) = self.back.take() {
                let _ = back.send(conn);
                return;
            }
        }
        // The unread rest of a body we know the size of (bounded by
        // max_body at the head), else a little.
        let rest = match &self.body {
            Body::Length { left } if !self.expect_continue => *left,
            Body::Chunked(c) if !c.done => LINGER_REFUSED,
            _ => 0,
        };
        linger_close(conn, rest);
    }

    /// The raw socket and the bytes the client sent after the head, for a
    /// connection that changes protocol (a WebSocket); no timeouts left.
    pub fn into_upgraded(mut self) -> Option<(TcpStream, Vec<u8>)> {
        let c = self.conn.take()?;
        let _ = c.stream.set_read_timeout(None);
        let _ = c.stream.set_write_timeout(None);
        let left = c.buf.get(c.pos..).map(<[u8]>::to_vec).unwrap_or_default();
        Some((c.stream, left))
    }

    /// The raw socket, for a reply the caller writes itself (a stream).
    /// The connection closes when the writer is dropped.
    pub fn into_writer(mut self) -> Box<dyn Write + Send> {
        match self.conn.take() {
            Some(c) => Box::new(c.stream),
            None => Box::new(io::sink()),
        }
    }

    /// Reads and drops a small unread body so the connection can be kept.
    fn drain(&mut self, conn: &mut Conn) -> bool {
        let left = match &self.body {
            Body::Empty => return true,
            Body::Length { left } => *left,
            Body::Chunked(c) => {
                return c.done;
            }
        };
        if left == 0 {
            return true;
        }
        // A client that waits for 100 Continue never sent the body.
        if self.expect_continue || left > DRAIN_MAX {
            return false;
        }
        let deadline = Instant::now() + self.limits.read_timeout;
        let mut left = left;
        let mut buf = [0u8; 8192];
        while left > 0 {
            let want = buf.len().min(left as usize);
            match conn.read_some(&mut buf[..want], deadline, self.limits.read_timeout) {
                Ok(0) | Err(_) => return false,
                Ok(n) => left -= n as u64,
            }
        }
        self.body = Body::Length { left: 0 };
        true
    }

    fn body_err(&mut self, e: io::Error) -> io::Error {
        self.body_broken = true;
        e
    }

    fn read_chunked(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let (deadline, idle, max) = (
            self.body_deadline,
            self.limits.read_timeout,
            self.limits.max_body,
        );
        let Some(conn) = self.conn.as_mut() else {
            return Ok(0);
        };
        let Body::Chunked(c) = &mut self.body else {
            return Ok(0);
        };
        loop {
            if c.done {
                return Ok(0);
            }
            if c.left > 0 {
                let want = out.len().min(c.left.min(usize::MAX as u64) as usize);
                let n = conn.read_some(&mut out[..want], deadline, idle)?;
                if n == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                c.left -= n as u64;
                if c.left == 0 {
                    c.need_crlf = true;
                }
                return Ok(n);
            }
            if c.need_crlf {
                let line = read_line(conn, deadline, idle)?;
                if !line.is_empty() {
                    return Err(invalid("chunk data not followed by CRLF"));
                }
                c.need_crlf = false;
            }
            let line = read_line(conn, deadline, idle)?;
            let size = line.split(|b| *b == b';').next().unwrap_or_default();
            let size = std::str::from_utf8(size)
                .ok()
                .map(str::trim)
                .filter(|s| !s.is_empty() && s.len() <= 15)
                .and_then(|s| u64::from_str_radix(s, 16).ok())
                .ok_or_else(|| invalid("bad chunk size"))?;
            if size == 0 {
                // Trailers, up to the blank line; read and ignored.
                let mut n = 0;
                while !read_line(conn, deadline, idle)?.is_empty() {
                    n += 1;
                    if n > MAX_HEADERS {
                        return Err(invalid("too many trailers"));
                    }
                }
                c.done = true;
                return Ok(0);
            }
            c.total = c.total.saturating_add(size);
            if c.total > max {
                return Err(invalid(format!("chunked body exceeds {max} bytes")));
            }
            c.left = size;
        }
    }

    fn send_continue(&mut self) -> io::Result<()> {
        if self.expect_continue {
            self.expect_continue = false;
            if let Some(c) = self.conn.as_mut() {
                c.stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
            }
        }
        Ok(())
    }
}

impl Read for Request {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if let Some(r) = &mut self.replay {
            let n = r.read(out)?;
            if n > 0 || out.is_empty() {
                return Ok(n);
            }
            self.replay = None;
        }
        if out.is_empty() || self.body_done() || self.conn.is_none() {
            return Ok(0);
        }
        if self.body_broken {
            return Err(invalid("the request body could not be read"));
        }
        if let Err(e) = self.send_continue() {
            return Err(self.body_err(e));
        }
        let r = match &mut self.body {
            Body::Empty => Ok(0),
            Body::Length { left } => {
                let want = out.len().min((*left).min(usize::MAX as u64) as usize);
                let (deadline, idle) = (self.body_deadline, self.limits.read_timeout);
                match self.conn.as_mut() {
                    Some(c) => match c.read_some(&mut out[..want], deadline, idle) {
                        Ok(0) => Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the client closed before sending the whole body",
                        )),
                        Ok(n) => {
                            *left -= n as u64;
                            Ok(n)
                        }
                        Err(e) => Err(e),
                    },
                    None => Ok(0),
                }
            }
            Body::Chunked(_) => self.read_chunked(out),
        };
        r.map_err(|e| self.body_err(e))
    }
}

fn invalid(m: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, m.into())
}

/// One CRLF-terminated line (without it), at most [`MAX_CHUNK_LINE`].
fn read_line(conn: &mut Conn, deadline: Instant, idle: Duration) -> io::Result<Vec<u8>> {
    let mut line = Vec::new();
    loop {
        match conn.read_byte(deadline, idle)? {
            b'\n' => {
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return Ok(line);
            }
            b => {
                if line.len() >= MAX_CHUNK_LINE {
                    return Err(invalid("chunk line too long"));
                }
                line.push(b);
            }
        }
    }
}

/// Longest a closing connection keeps reading (and dropping) what its
/// client still sends, so the client reads our reply instead of a reset.
const LINGER_TIME: Duration = Duration::from_secs(30);
/// A lingering client that pauses this long is cut off.
const LINGER_IDLE: Duration = Duration::from_secs(2);
/// What a connection refused at its head is read for at most.
const LINGER_REFUSED: u64 = 1 << 20;

/// Half-closes, then reads and drops up to `max` bytes the client still
/// sends (within [`LINGER_TIME`], pauses under [`LINGER_IDLE`]), so our
/// reply is not lost to a reset. A stack buffer: nothing is allocated.
fn linger_close(conn: Conn, max: u64) {
    let mut s = conn.stream;
    let _ = s.flush();
    if s.shutdown(Shutdown::Write).is_err() || max == 0 {
        return;
    }
    let end = Instant::now() + LINGER_TIME;
    let mut buf = [0u8; 8192];
    let mut total = 0u64;
    while total < max {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() || s.set_read_timeout(Some(left.min(LINGER_IDLE))).is_err() {
            return;
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => total += n as u64,
        }
    }
}

pub fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        406 => "Not Acceptable",
        408 => "Request Timeout",
        409 => "Conflict",
        410 => "Gone",
        411 => "Length Required",
        413 => "Content Too Large",
        414 => "URI Too Long",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Content",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Status",
    }
}

/// Handles one request; called on the connection's thread.
pub type Handler = Arc<dyn Fn(Request) + Send + Sync>;

/// Counts connections in all and per client address.
#[derive(Default)]
struct Slots {
    total: AtomicUsize,
    per_ip: Mutex<HashMap<IpAddr, usize>>,
}

struct Slot {
    slots: Arc<Slots>,
    ip: IpAddr,
}

impl Slots {
    fn take(self: &Arc<Self>, ip: IpAddr, limits: &Limits) -> Result<Slot, &'static str> {
        let mut m = lock(&self.per_ip);
        if self.total.load(Ordering::Acquire) >= limits.max_connections {
            return Err("too many connections");
        }
        let n = m.entry(ip).or_insert(0);
        if *n >= limits.max_per_ip {
            return Err("too many connections from this address");
        }
        *n += 1;
        self.total.fetch_add(1, Ordering::AcqRel);
        Ok(Slot {
            slots: self.clone(),
            ip,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut m = lock(&self.slots.per_ip);
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
        self.slots.total.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Counters the server exports (defined with the other metrics).
pub use crate::metrics::HttpConnStats as Stats;

/// A running server: accepts until `stop` is set.
pub struct Server {
    pub addr: SocketAddr,
    pub stats: Stats,
    stop: Arc<AtomicBool>,
    slots: Arc<Slots>,
}

impl Server {
    pub fn new(addr: SocketAddr, stats: Stats) -> Server {
        Server {
            addr,
            stats,
            stop: Arc::new(AtomicBool::new(false)),
            slots: Arc::new(Slots::default()),
        }
    }
    /// Connections open now.
    pub fn connections(&self) -> usize {
        self.slots.total.load(Ordering::Acquire)
    }
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// Serves `listener` on the calling thread until `server.stop()`; each
/// open connection has a thread of its own (started from here, so it
/// inherits the caller's seccomp filter; idle ones are reused).
pub fn run(listener: TcpListener, limits: Limits, handler: Handler, server: &Server) {
    let limits = Arc::new(limits);
    let mut last_err = Instant::now() - Duration::from_secs(60);
    // Rendezvous: a send succeeds only into a thread waiting for work.
    let (hand_off, jobs) = crossbeam_channel::bounded::<Job>(0);
    let idle = Arc::new(AtomicUsize::new(0));
    while !server.stop.load(Ordering::Acquire) {
        if !wait_readable(&listener, 200) {
            continue;
        }
        let (stream, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) => {
                // EMFILE and friends: never fatal; back off a moment.
                if last_err.elapsed() > Duration::from_secs(5) {
                    log::error!("http: accept on {}: {e}", server.addr);
                    last_err = Instant::now();
                }
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let slot = match server.slots.take(peer.ip(), &limits) {
            Ok(s) => s,
            Err(why) => {
                server.stats.refused_connections.inc();
                refuse(stream, why);
                continue;
            }
        };
        // An idle connection thread takes it, else a new one starts.
        let job = Job { stream, peer, slot };
        let job = match hand_off.try_send(job) {
            Ok(()) => continue,
            Err(crossbeam_channel::TrySendError::Full(j))
            | Err(crossbeam_channel::TrySendError::Disconnected(j)) => j,
        };
        let w = Worker {
            limits: limits.clone(),
            handler: handler.clone(),
            stats: server.stats.clone(),
            idle: idle.clone(),
            jobs: jobs.clone(),
        };
        let spawned = std::thread::Builder::new()
            .name("http-conn".into())
            .stack_size(512 * 1024)
            .spawn(move || w.run(job));
        if let Err(e) = spawned {
            log::error!("http: cannot start a connection thread: {e}");
        }
    }
}

/// A connection the acceptor hands to a connection thread.
struct Job {
    stream: TcpStream,
    peer: SocketAddr,
    slot: Slot,
}

/// Idle connection threads kept for the next connections indefinitely;
/// more than these end after [`IDLE_EXIT`] without work. (Reuse saves a
/// thread start per connection.)
const KEEP_IDLE: usize = 8;
const IDLE_EXIT: Duration = Duration::from_secs(10);

/// A connection thread: serves one connection, then waits for the next.
struct Worker {
    limits: Arc<Limits>,
    handler: Handler,
    stats: Stats,
    idle: Arc<AtomicUsize>,
    jobs: crossbeam_channel::Receiver<Job>,
}

impl Worker {
    fn run(self, first: Job) {
        let mut job = first;
        loop {
            self.stats.open_connections.inc();
            let Job { stream, peer, slot } = job;
            connection(
                stream,
                peer,
                self.limits.clone(),
                self.handler.clone(),
                &self.stats,
            );
            drop(slot);
            self.stats.open_connections.dec();
            let n = self.idle.fetch_add(1, Ordering::AcqRel) + 1;
            let next = if n <= KEEP_IDLE {
                self.jobs.recv().ok()
            } else {
                self.jobs.recv_timeout(IDLE_EXIT).ok()
            };
            self.idle.fetch_sub(1, Ordering::AcqRel);
            match next {
                Some(j) => job = j,
                // The server stopped (the acceptor is gone) or no work came.
                None => return,
            }
        }
    }
}

fn wait_readable(l: &TcpListener, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd: l.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd on our stack, count 1.
    let r = unsafe { libc::poll(&mut p, 1, ms) };
    r > 0
}

/// Answers a connection over the limits without waiting on it.
fn refuse(stream: TcpStream, why: &str) {
    let body = format!(r#"{{"error":{{"code":"too_many_connections","message":"{why}"}}}}"#);
    let msg = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut s = stream;
    if s.set_nonblocking(true).is_ok() {
        let _ = s.write(msg.as_bytes());
    }
}

/// Writes a reply to a request we could not parse, then closes.
/// `shape`: the error shape of the API the target addresses (the v1 one
/// while no target was read).
fn reject(mut conn: Conn, status: u16, code: &str, message: &str, linger: u64, shape: Shape) {
    let body = shape.body(code, message).to_string();
    let msg = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        reason(status),
        body.len()
    );
    let _ = conn.stream.write_all(msg.as_bytes());
    linger_close(conn, linger);
}

enum Head {
    Request(Box<Request>),
    /// The client closed or went idle between requests.
    Closed,
    /// Refused: the reply was written and the connection closed.
    Rejected,
}

fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    limits: Arc<Limits>,
    handler: Handler,
    stats: &Stats,
) {
    let _ = stream.set_nodelay(true);
    if stream
        .set_write_timeout(Some(limits.write_timeout))
        .is_err()
    {
        return;
    }
    let mut conn = Conn {
        stream,
        buf: Vec::new(),
        pos: 0,
        peer,
    };
    loop {
        let (tx, rx) = sync_channel(1);
        let req = match read_head(conn, &limits, tx) {
            Head::Request(r) => *r,
            Head::Closed => return,
            Head::Rejected => {
                stats.bad_requests.inc();
                return;
            }
        };
        if catch_unwind(AssertUnwindSafe(|| handler(req))).is_err() {
            // The request (and its connection) were dropped while
            // unwinding: the client sees the connection close.
            stats.handler_panics.inc();
            log::error!(
                "http: a request handler panicked (client {peer}); its connection was closed"
            );
            return;
        }
        // The reply may be sent later from another thread; the connection
        // comes back when it was, unless it must close.
        match rx.recv() {
            Ok(c) => conn = c,
            Err(_) => return,
        }
    }
}

fn read_head(mut conn: Conn, limits: &Arc<Limits>, back: SyncSender<Conn>) -> Head {
    // Drop what the previous request consumed.
    if conn.pos > 0 {
        conn.buf.drain(..conn.pos);
        conn.pos = 0;
    }
    let mut deadline = Instant::now() + limits.idle_timeout;
    let mut started = false;
    let mut scanned = 0;
    let end = loop {
        // Skip blank lines before a request line (RFC 9112 2.2).
        while !started && conn.buf.first().is_some_and(|b| *b == b'\r' || *b == b'\n') {
            conn.buf.remove(0);
        }
        if !started && !conn.buf.is_empty() {
            started = true;
            deadline = Instant::now() + limits.head_timeout;
        }
        if let Some(i) = find_end(&conn.buf, scanned) {
            break i;
        }
        scanned = conn.buf.len().saturating_sub(3);
        if conn.buf.len() > MAX_HEAD {
            reject(
                conn,
                431,
                "header_too_large",
                &format!("request head exceeds {MAX_HEAD} bytes"),
                LINGER_REFUSED,
                Shape::Nested,
            );
            return Head::Rejected;
        }
        let mut chunk = [0u8; 4096];
        let want = chunk.len().min(MAX_HEAD + 1 - conn.buf.len());
        match conn.read_socket(
            &mut chunk[..want],
            deadline,
            limits.idle_timeout.max(limits.head_timeout),
        ) {
            Ok(0) => return Head::Closed,
            Ok(n) => conn.buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::TimedOut && started => {
                reject(
                    conn,
                    408,
                    "request_timeout",
                    "the request head did not arrive in time",
                    0,
                    Shape::Nested,
                );
                return Head::Rejected;
            }
            Err(_) => return Head::Closed,
        }
    };
    let (method, url, http10, headers) = match parse_head(&conn.buf[..end]) {
        Ok(h) => h,
        Err((status, code, msg)) => {
            reject(conn, status, code, &msg, LINGER_REFUSED, Shape::Nested);
            return Head::Rejected;
        }
    };
    let shape = Shape::for_target(&url);
    let fail = |conn: Conn, status: u16, code: &str, msg: String| {
        reject(conn, status, code, &msg, LINGER_REFUSED, shape);
        Head::Rejected
    };
    conn.pos = end;

    // Framing (RFC 9112 6): exactly one way to find the body's end.
    let lengths: Vec<&Header> = headers.iter().filter(|h| h.is("content-length")).collect();
    let te: Vec<&Header> = headers
        .iter()
        .filter(|h| h.is("transfer-encoding"))
        .collect();
    if !te.is_empty() && !lengths.is_empty() {
        return fail(
            conn,
            400,
            "bad_request",
            "both Content-Length and Transfer-Encoding".into(),
        );
    }
    if lengths.len() > 1 {
        return fail(
            conn,
            400,
            "bad_request",
            "more than one Content-Length".into(),
        );
    }
    let mut declared = None;
    let body = if let Some(h) = lengths.first() {
        let v = h.value.as_str();
        let n = (!v.is_empty() && v.len() <= 20 && v.bytes().all(|b| b.is_ascii_digit()))
            .then(|| v.parse::<u64>().ok())
            .flatten();
        let Some(n) = n else {
            return fail(
                conn,
                400,
                "bad_request",
                format!("invalid Content-Length {v:?}"),
            );
        };
        if n > limits.max_body {
            return fail(
                conn,
                413,
                "body_too_large",
                format!(
                    "request body of {n} bytes exceeds {} bytes",
                    limits.max_body
                ),
            );
        }
        declared = Some(n);
        if n == 0 {
            Body::Empty
        } else {
            Body::Length { left: n }
        }
    } else if !te.is_empty() {
        if http10 || te.len() > 1 || !te[0].value.eq_ignore_ascii_case("chunked") {
            return fail(
                conn,
                400,
                "bad_request",
                format!(
                    "unsupported Transfer-Encoding {:?} (only chunked)",
                    te[0].value
                ),
            );
        }
        Body::Chunked(Chunked {
            left: 0,
            total: 0,
            done: false,
            need_crlf: false,
        })
    } else {
        Body::Empty
    };
    let conn_hdr = headers
        .iter()
        .filter(|h| h.is("connection"))
        .map(|h| h.value.to_ascii_lowercase())
        .collect::<Vec<_>>()
        .join(",");
    let keep_alive = if http10 {
        conn_hdr.contains("keep-alive")
    } else {
        !conn_hdr.contains("close")
    };
    let expect_continue = !matches!(body, Body::Empty)
        && headers
            .iter()
            .any(|h| h.is("expect") && h.value.eq_ignore_ascii_case("100-continue"));
    let grace = limits.read_timeout.max(Duration::from_secs(1)) * 3;
    let body_deadline = Instant::now()
        + grace
        + Duration::from_secs(declared.unwrap_or(limits.max_body) / MIN_BODY_RATE);
    Head::Request(Box::new(Request {
        method,
        url,
        http10,
        headers,
        body,
        declared,
        expect_continue,
        keep_alive,
        conn: Some(conn),
        back: Some(back),
        limits: limits.clone(),
        body_deadline,
        body_broken: false,
        replay: None,
    }))
}

type ParsedHead = (String, String, bool, Vec<Header>);

/// Method, target, HTTP/1.0?, headers; or the status, code and message to
/// refuse it with.
fn parse_head(buf: &[u8]) -> Result<ParsedHead, (u16, &'static str, String)> {
    let mut hs = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut hs);
    match parsed.parse(buf) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => {
            return Err((400, "bad_request", "incomplete request head".into()))
        }
        Err(httparse::Error::TooManyHeaders) => {
            return Err((
                431,
                "header_too_large",
                format!("more than {MAX_HEADERS} header lines"),
            ))
        }
        Err(e) => return Err((400, "bad_request", format!("malformed request head: {e}"))),
    }
    let mut headers = Vec::with_capacity(parsed.headers.len());
    for h in parsed.headers.iter() {
        let Ok(value) = std::str::from_utf8(h.value) else {
            return Err((
                400,
                "bad_request",
                format!("header {} is not UTF-8", h.name),
            ));
        };
        headers.push(Header {
            name: h.name.to_string(),
            value: value.trim().to_string(),
        });
    }
    Ok((
        parsed.method.unwrap_or("").to_string(),
        parsed.path.unwrap_or("").to_string(),
        parsed.version == Some(0),
        headers,
    ))
}

/// The end of a head (index after its blank line), searching from `from`.
fn find_end(buf: &[u8], from: usize) -> Option<usize> {
    let from = from.min(buf.len());
    buf[from..]
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| from + i + 4)
        .or_else(|| {
            // Bare-LF heads, which httparse also accepts.
            buf[from..]
                .windows(2)
                .position(|w| w == b"\n\n")
                .map(|i| from + i + 2)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_end() {
        assert_eq!(find_end(b"GET / HTTP/1.1\r\n\r\nxx", 0), Some(18));
        assert_eq!(find_end(b"GET / HTTP/1.1\r\nA: b\r\n", 0), None);
        assert_eq!(find_end(b"GET / HTTP/1.1\n\n", 0), Some(16));
    }
}
