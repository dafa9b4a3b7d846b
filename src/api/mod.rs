//! The HTTP API: parse, validate, authenticate and authorize, then hand a
//! typed command to the session layer.
//!
//! Threads: tiny_http reads requests on its own connection threads; a fixed
//! pool of `http_workers` threads routes them and answers quick requests.
//! Anything that can take long (a command, a file transfer, a stream) runs
//! on a thread of its own, at most `max_streams` at once (503 beyond), so
//! slow work never starves the workers.

pub mod auth;
pub mod errors;
pub mod exec;
pub mod http;
pub mod metrics;
pub mod rest;
pub mod routes;
pub mod v1;
pub mod validate;

use crate::config::Config;
use crate::sandbox::SandboxFactory;
use crate::session::{reaper, Manager};
use auth::{KeyStore, Principal, RateLimiter};
use errors::ApiError;
use http::{respond, Reply, StreamWriter};
use metrics::Metrics;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Everything a handler needs.
pub struct Ctx {
    pub cfg: Arc<Config>,
    pub mgr: Arc<Manager>,
    pub keys: Arc<KeyStore>,
    pub limiter: RateLimiter,
    pub metrics: Arc<Metrics>,
    pub started: Instant,
    closing: AtomicBool,
    /// Deferred/streaming requests running now.
    long_running: AtomicUsize,
    /// The MCP endpoint (`/mcp`).
    pub mcp: crate::mcp::http::McpHttp,
}

impl Ctx {
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }
}

pub struct Server {
    pub ctx: Arc<Ctx>,
    http: Arc<Listening>,
    addr: SocketAddr,
    workers: Vec<JoinHandle<()>>,
    reaper: Option<(crossbeam_channel::Sender<()>, JoinHandle<()>)>,
}

impl Server {
    /// Sweeps orphans, opens the key file, binds and starts serving.
    pub fn start(cfg: Config, factory: Arc<dyn SandboxFactory>) -> Result<Server, String> {
        if !cfg.auth && !cfg.listen.ip().is_loopback() {
            return Err(format!(
                "refusing to run without authentication on {}: --no-auth is only allowed on a \
                 loopback address",
                cfg.listen
            ));
        }
        let cfg = Arc::new(cfg);
        let keys = Arc::new(KeyStore::open(&cfg.key_file)?);
        match factory.sweep_orphans() {
            Ok(0) => {}
            Ok(n) => log::warn!("orphan sweep removed {n} leftover resource(s) of an earlier run"),
            Err(e) => log::error!("orphan sweep failed: {e}"),
        }
        let metrics = Arc::new(Metrics::new());
        let mgr = Manager::new(cfg.clone(), factory, metrics.clone());
        mgr.pool
            .start()
            .map_err(|e| format!("start pool thread: {e}"))?;
        raise_fd_limit();
        // On an Http thread: tiny_http's accept and connection threads
        // inherit the filter of the thread that creates the server.
        let first = {
            let (addr, wt) = (cfg.listen, cfg.write_timeout);
            crate::harden::thread::spawn(
                crate::harden::ThreadKind::Http,
                std::thread::Builder::new().name("http-listen".into()),
                move || listen(addr, wt),
            )
            .map_err(|e| format!("start http listener thread: {e}"))?
            .join()
            .map_err(|_| "http listener thread panicked".to_string())??
        };
        let addr = first
            .server_addr()
            .to_ip()
            .ok_or_else(|| "listening socket has no IP address".to_string())?;
        let http = Arc::new(Listening {
            addr,
            write_timeout: cfg.write_timeout,
            current: std::sync::Mutex::new(Arc::new(first)),
        });
        let ctx = Arc::new(Ctx {
            limiter: RateLimiter::new(cfg.rate_per_sec, cfg.rate_burst),
            cfg: cfg.clone(),
            mgr: mgr.clone(),
            keys,
            metrics,
            started: Instant::now(),
            closing: AtomicBool::new(false),
            long_running: AtomicUsize::new(0),
            mcp: crate::mcp::http::McpHttp::new(mgr.clone(), cfg.clone()),
        });
        let (stop_tx, stop_rx) = crossbeam_channel::bounded(1);
        let reaper = reaper::spawn(mgr, stop_rx).map_err(|e| format!("start reaper: {e}"))?;
        let mut workers = Vec::new();
        for i in 0..cfg.http_workers.max(1) {
            let ctx = ctx.clone();
            let http = http.clone();
            let h = crate::harden::thread::spawn(
                crate::harden::ThreadKind::Http,
                std::thread::Builder::new().name(format!("http-{i}")),
                move || worker_loop(ctx, http),
            )
            .map_err(|e| format!("start http worker: {e}"))?;
            workers.push(h);
        }
        {
            let ctx = ctx.clone();
            let http = http.clone();
            crate::harden::thread::spawn(
                crate::harden::ThreadKind::Http,
                std::thread::Builder::new().name("http-watchdog".into()),
                move || watchdog(ctx, http),
            )
            .map_err(|e| format!("start http watchdog: {e}"))?;
        }
        Ok(Server {
            ctx,
            http,
            addr,
            workers,
            reaper: Some((stop_tx, reaper)),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Graceful stop: refuse new work, end every session (which cancels
    /// the commands still running in them), wait for the streams to close.
    pub fn shutdown(mut self) {
        self.ctx.closing.store(true, Ordering::Release);
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
        if let Some((tx, h)) = self.reaper.take() {
            let _ = tx.send(());
            let _ = h.join();
        }
        self.ctx.mgr.shutdown();
        let end = Instant::now() + Duration::from_secs(5);
        while self.ctx.long_running.load(Ordering::Acquire) > 0 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(self.http);
    }
}

/// The tiny_http server in use. tiny_http's accept thread ends for good on
/// an accept error (it reports it) or panics when it cannot duplicate a
/// socket (EMFILE, reported by nobody). Either way its listening socket is
/// closed; the workers (on a reported error) or the watchdog (on a refused
/// probe connection) then start a new server on the same address, so the
/// API does not silently go deaf.
struct Listening {
    addr: SocketAddr,
    write_timeout: Duration,
    current: std::sync::Mutex<Arc<tiny_http::Server>>,
}

impl Listening {
    fn get(&self) -> Arc<tiny_http::Server> {
        match self.current.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    fn replace_dead(&self, dead: &Arc<tiny_http::Server>) {
        let mut cur = match self.current.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if !Arc::ptr_eq(&cur, dead) {
            return; // another worker already did it
        }
        // Give the old accept thread time to drop its socket, and an fd
        // shortage time to ease.
        std::thread::sleep(Duration::from_millis(200));
        match listen(self.addr, self.write_timeout) {
            Ok(s) => {
                log::warn!("http: listening again on {}", self.addr);
                *cur = Arc::new(s);
            }
            Err(e) => log::error!("http: cannot listen again on {}: {e}", self.addr),
        }
    }
}

/// Probes the listener every 2 s; a refused connection means tiny_http's
/// accept thread is gone.
fn watchdog(ctx: Arc<Ctx>, http: Arc<Listening>) {
    while !ctx.is_closing() {
        std::thread::sleep(Duration::from_secs(2));
        let srv = http.get();
        match std::net::TcpStream::connect_timeout(&http.addr, Duration::from_secs(1)) {
            // Closed at once: tiny_http reads EOF and ends that connection.
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                if ctx.is_closing() {
                    return;
                }
                log::error!("http: listener on {} is gone; restarting it", http.addr);
                ctx.metrics.error("accept");
                http.replace_dead(&srv);
            }
            Err(_) => {}
        }
    }
}

fn listen(addr: SocketAddr, write_timeout: Duration) -> Result<tiny_http::Server, String> {
    let listener =
        std::net::TcpListener::bind(addr).map_err(|e| format!("listen on {addr}: {e}"))?;
    // Inherited by every accepted connection (Linux copies socket options
    // on accept): a client that stops reading a stream is dropped, which
    // cancels its command. (A read timeout cannot be set this way: it
    // would also make accept() time out, which ends tiny_http's accept
    // thread.)
    set_write_timeout(&listener, write_timeout)
        .map_err(|e| format!("SO_SNDTIMEO on {addr}: {e}"))?;
    tiny_http::Server::from_listener(listener, None).map_err(|e| format!("serve on {addr}: {e}"))
}

fn set_write_timeout(l: &std::net::TcpListener, d: Duration) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let tv = libc::timeval {
        tv_sec: d.as_secs() as libc::time_t,
        tv_usec: d.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: valid fd, pointer and length for a timeval option.
    let r = unsafe {
        libc::setsockopt(
            l.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            &tv as *const libc::timeval as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Connections, sandboxes and agent sockets all take descriptors; the
/// default soft limit (1024) is low for a server.
fn raise_fd_limit() {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain getrlimit/setrlimit on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) == 0 && rl.rlim_cur < rl.rlim_max {
            rl.rlim_cur = rl.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &rl);
        }
    }
}

fn worker_loop(ctx: Arc<Ctx>, http: Arc<Listening>) {
    while !ctx.is_closing() {
        let srv = http.get();
        match srv.recv_timeout(Duration::from_millis(200)) {
            Ok(Some(req)) => handle(&ctx, req),
            Ok(None) => {}
            Err(e) => {
                log::error!("http: accept failed ({e}); restarting the listener");
                ctx.metrics.error("accept");
                http.replace_dead(&srv);
            }
        }
    }
}

fn status_class(s: u16) -> String {
    format!("{}xx", s / 100)
}

fn handle(ctx: &Arc<Ctx>, mut req: tiny_http::Request) {
    if ctx.is_closing() {
        let e = ApiError::unavailable("the server is shutting down");
        let ra = e.retry_after;
        return respond(req, e.into(), ra);
    }
    // With mcp_http off, /mcp falls through to the router: 404.
    if ctx.cfg.mcp_http && crate::mcp::http::is_mcp_path(req.url()) {
        return crate::mcp::http::handle(ctx, req);
    }
    let (reply, retry_after) = match route(ctx, &mut req) {
        Ok(r) => (r, None),
        Err(e) => {
            if e.status >= 500 {
                ctx.metrics.error(e.code);
            }
            let ra = e.retry_after;
            (Reply::from(e), ra)
        }
    };
    finish(ctx, req, reply, retry_after);
}

fn count(ctx: &Ctx, status: u16) {
    ctx.metrics
        .http_requests
        .get_or_create(&vec![("class", status_class(status))])
        .inc();
}

/// Decrements the long-running count when the thread's work ends.
struct LongGuard(Arc<Ctx>);
impl Drop for LongGuard {
    fn drop(&mut self) {
        self.0.long_running.fetch_sub(1, Ordering::AcqRel);
    }
}

fn finish(ctx: &Arc<Ctx>, req: tiny_http::Request, reply: Reply, retry_after: Option<u64>) {
    match reply {
        r @ (Reply::Later(_) | Reply::Stream { .. }) => {
            let n = ctx.long_running.fetch_add(1, Ordering::AcqRel);
            let guard = LongGuard(ctx.clone());
            if n >= ctx.cfg.max_streams {
                drop(guard);
                let e = ApiError::unavailable(format!(
                    "too many long-running requests in flight ({}); retry shortly",
                    ctx.cfg.max_streams
                ));
                count(ctx, e.status);
                return respond(req, e.into(), Some(1));
            }
            let ctx2 = ctx.clone();
            let spawned = std::thread::Builder::new()
                .name("long-request".into())
                .stack_size(512 * 1024)
                .spawn(move || {
                    let _guard = guard;
                    match r {
                        Reply::Later(job) => {
                            let out = job();
                            let status = match &out {
                                Reply::Json(s, _) | Reply::Bytes(s, _, _) | Reply::Empty(s) => *s,
                                _ => 500,
                            };
                            count(&ctx2, status);
                            respond(req, out, None)
                        }
                        Reply::Stream { content_type, job } => {
                            count(&ctx2, 200);
                            let mut w = StreamWriter::start(req, content_type);
                            job(&mut w);
                            w.finish();
                        }
                        _ => {}
                    }
                });
            if let Err(e) = spawned {
                // The request moved into the closure that failed to start;
                // the client sees the connection close.
                log::error!("cannot start a request thread: {e}");
                ctx.metrics.error("thread_spawn");
            }
        }
        r => {
            let status = match &r {
                Reply::Json(s, _) | Reply::Bytes(s, _, _) | Reply::Empty(s) => *s,
                _ => 500,
            };
            count(ctx, status);
            respond(req, r, retry_after)
        }
    }
}

/// Finds the route, authenticates, authorizes, rate-limits and calls it.
fn route(ctx: &Arc<Ctx>, req: &mut tiny_http::Request) -> Result<Reply, ApiError> {
    let target = http::parse_target(req.url())?;
    let method = req.method().as_str().to_ascii_uppercase();
    let (route, params) = routes::find(&method, &target)?;
    let principal = match route.scope {
        None => Principal::anonymous(),
        Some(scope) => {
            let p = authenticate(ctx, req)?;
            // Admin keys may do everything.
            if !p.has(scope) && !p.is_admin() {
                return Err(ApiError::new(
                    403,
                    "forbidden",
                    format!("this key lacks the {scope:?} scope"),
                ));
            }
            p
        }
    };
    (route.handler)(ctx, req, &principal, &params)
}

fn authenticate(ctx: &Ctx, req: &tiny_http::Request) -> Result<Principal, ApiError> {
    if !ctx.cfg.auth {
        return Ok(Principal::anonymous());
    }
    let Some(token) = auth::token_from_headers(req.headers()) else {
        return Err(ApiError::new(
            401,
            "unauthorized",
            "an API key is required (Authorization: Bearer <key> or X-API-Key: <key>)",
        ));
    };
    let Some(rec) = ctx.keys.verify(&token) else {
        return Err(ApiError::new(
            401,
            "unauthorized",
            "invalid or revoked API key",
        ));
    };
    ctx.limiter.check(&rec)?;
    Ok(Principal {
        id: rec.id,
        scopes: rec.scopes,
    })
}
