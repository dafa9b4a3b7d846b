//! The HTTP API: parse, validate, authenticate and authorize, then hand a
//! typed command to the operations layer.
//!
//! Threads: our HTTP server (`httpd`) reads and answers each connection on
//! a thread of its own (bounded in all and per client address). Anything
//! that can take long (a command, a file transfer, a stream) runs on a
//! thread of its own, at most `max_streams` at once (503 beyond).

pub mod auth;
pub mod errors;
pub mod exec;
pub mod http;
pub mod rest;
pub mod routes;
pub mod v1;
pub mod validate;
pub mod ws;

/// The HTTP server is the `server` module's; these paths stay for the
/// handlers that name them.
pub use crate::server::{httpd, Ctx};

use crate::config::Config;
use crate::metrics::Metrics;
use crate::ops::{Ops, SandboxFactory};
use crate::server::{Endpoint, Endpoints, LongGuard, MakeEndpoint};
use auth::{Auth, Principal};
use errors::ApiError;
use http::{respond, Reply, StreamWriter};
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The REST front end as the server's endpoint: the route table.
pub struct Rest;

impl Endpoint for Rest {
    fn handle(&self, ctx: &Arc<Ctx>, req: httpd::Request) {
        handle(ctx, req)
    }

    /// Bodies of JSON requests and file uploads.
    fn max_body(&self, cfg: &Config) -> usize {
        cfg.max_body.max(cfg.max_file)
    }
}

pub struct Server {
    pub ctx: Arc<Ctx>,
    http: Arc<httpd::Server>,
    acceptor: Option<JoinHandle<()>>,
}

impl Server {
    /// [`start_with`](Self::start_with) the REST front end alone (`/mcp`
    /// answers 404); the daemon adds MCP (`crate::start_daemon`).
    pub fn start(cfg: Config, factory: Arc<dyn SandboxFactory>) -> Result<Server, String> {
        Self::start_with(cfg, factory, None)
    }

    /// Sweeps orphans, opens the key file, binds and starts serving REST
    /// and, given `mcp` (made once the shared state exists), `/mcp`.
    pub fn start_with(
        cfg: Config,
        factory: Arc<dyn SandboxFactory>,
        mcp: Option<MakeEndpoint>,
    ) -> Result<Server, String> {
        if !cfg.auth && !cfg.listen.ip().is_loopback() {
            return Err(format!(
                "refusing to run without authentication on {}: --no-auth is only allowed on a \
                 loopback address",
                cfg.listen
            ));
        }
        let cfg = Arc::new(cfg);
        let auth = Auth::from_config(&cfg)?;
        match factory.sweep_orphans() {
            Ok(0) => {}
            Ok(n) => log::warn!("orphan sweep removed {n} leftover resource(s) of an earlier run"),
            Err(e) => log::error!("orphan sweep failed: {e}"),
        }
        let metrics = Arc::new(Metrics::new());
        let ops = Ops::start(cfg.clone(), factory, metrics.clone())?;
        raise_fd_limit();
        let listener = std::net::TcpListener::bind(cfg.listen)
            .map_err(|e| format!("listen on {}: {e}", cfg.listen))?;
        let addr = listener
            .local_addr()
            .map_err(|e| format!("listening socket {}: {e}", cfg.listen))?;
        let http = Arc::new(httpd::Server::new(addr, metrics.http_conn.clone()));
        let ctx = Arc::new(Ctx::new(cfg.clone(), ops, auth, metrics));
        let endpoints = Endpoints {
            rest: Arc::new(Rest),
            mcp: mcp.map(|make| make(&ctx)),
        };
        // On an Http thread: the connection threads it starts inherit its
        // seccomp filter.
        let acceptor = {
            let http = http.clone();
            let limits = httpd::Limits::from_config(&cfg, endpoints.max_body(&cfg));
            let handler = endpoints.handler(ctx.clone());
            crate::harden::thread::spawn(
                crate::harden::ThreadKind::Http,
                std::thread::Builder::new().name("http-accept".into()),
                move || httpd::run(listener, limits, handler, &http),
            )
            .map_err(|e| format!("start http acceptor: {e}"))?
        };
        if let Some(a) = cfg.preview_listen {
            crate::server::preview::start(ctx.clone(), a)?;
        }
        if cfg.auth {
            let ctx = ctx.clone();
            crate::harden::thread::spawn(
                crate::harden::ThreadKind::Http,
                std::thread::Builder::new().name("key-watch".into()),
                move || watch_keys(&ctx),
            )
            .map_err(|e| format!("start key watcher: {e}"))?;
        }
        Ok(Server {
            ctx,
            http,
            acceptor: Some(acceptor),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.http.addr
    }

    /// Graceful stop: refuse new work, end every session (which cancels
    /// the commands still running in them), wait for the streams to close.
    pub fn shutdown(mut self) {
        self.ctx.close();
        self.http.stop();
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
        self.ctx.ops.shutdown();
        let end = Instant::now() + Duration::from_secs(5);
        while self.ctx.long_running() > 0 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Ends the sessions of keys revoked or deleted behind the API's back
/// (`agent-sandbox keys revoke` edits the key file): their access is gone,
/// as when the API revokes them. Checked every second.
fn watch_keys(ctx: &Ctx) {
    while !ctx.is_closing() {
        std::thread::sleep(Duration::from_secs(1));
        crate::ops::keys::end_sessions_of_unusable(&ctx.auth.keys, &ctx.ops);
    }
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

fn status_class(s: u16) -> String {
    format!("{}xx", s / 100)
}

fn handle(ctx: &Arc<Ctx>, mut req: httpd::Request) {
    if ctx.is_closing() {
        let e = ApiError::unavailable("the server is shutting down");
        let ra = e.retry_after;
        return respond(req, e.into(), ra, None);
    }
    let (reply, retry_after, allow) = match route(ctx, &mut req) {
        Ok(r) => (r, None, None),
        Err(e) => {
            if e.status >= 500 {
                ctx.metrics.error(e.code);
            }
            let (ra, allow) = (e.retry_after, e.allow.clone());
            (Reply::from(e), ra, allow)
        }
    };
    finish(ctx, req, reply, retry_after, allow.as_deref());
}

fn count(ctx: &Ctx, status: u16) {
    ctx.metrics
        .http_requests
        .get_or_create(&vec![("class", status_class(status))])
        .inc();
}

fn finish(
    ctx: &Arc<Ctx>,
    req: httpd::Request,
    reply: Reply,
    retry_after: Option<u64>,
    allow: Option<&str>,
) {
    match reply {
        r @ (Reply::Later(_) | Reply::Stream { .. } | Reply::Upgrade { .. }) => {
            // Counted until the thread's work ends.
            let (guard, n) = LongGuard::start(ctx);
            if n >= ctx.cfg.max_streams {
                drop(guard);
                let e = ApiError::unavailable(format!(
                    "too many long-running requests in flight ({}); retry shortly",
                    ctx.cfg.max_streams
                ));
                count(ctx, e.status);
                return respond(req, e.into(), Some(1), None);
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
                            let status = out.status();
                            count(&ctx2, status);
                            // A deferred 503 (a budget or capacity ran
                            // out meanwhile) is worth a retry shortly.
                            let retry = match &out {
                                Reply::Error(e) if e.retry_after.is_some() => e.retry_after,
                                _ => (status == 503).then_some(1),
                            };
                            respond(req, out, retry, None)
                        }
                        Reply::Stream { content_type, job } => {
                            count(&ctx2, 200);
                            let mut w = StreamWriter::start(req, content_type);
                            job(&mut w);
                            w.finish();
                        }
                        Reply::Upgrade { accept, job } => {
                            count(&ctx2, 101);
                            let Some((stream, left)) = req.into_upgraded() else {
                                return;
                            };
                            match crate::server::ws::accept(stream, left, &accept) {
                                Ok((r, w)) => job(r, w),
                                Err(e) => log::debug!("websocket handshake: {e}"),
                            }
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
            let status = r.status();
            count(ctx, status);
            respond(req, r, retry_after, allow)
        }
    }
}

/// Finds the route, authenticates, authorizes, rate-limits and calls it.
fn route(ctx: &Arc<Ctx>, req: &mut httpd::Request) -> Result<Reply, ApiError> {
    let target = http::parse_target(req.url())?;
    let method = req.method().to_ascii_uppercase();
    let (route, params) = routes::find(&method, &target)?;
    let principal = match route.scope {
        None => Principal::anonymous(),
        Some(scope) => {
            let p = match ws_ticket(ctx, req, &target, &params) {
                Some(p) => p,
                None => authenticate(ctx, req)?,
            };
            if !p.may(scope) {
                return Err(ApiError::new(
                    403,
                    "forbidden",
                    format!("this key lacks the {:?} scope", scope.as_str()),
                ));
            }
            p
        }
    };
    (route.handler)(ctx, req, &principal, &params)
}

/// A browser's WebSocket brings a ticket (`?token=`, `ops::tickets`)
/// instead of a key; only WebSocket routes take one, only without a key.
fn ws_ticket(
    ctx: &Ctx,
    req: &httpd::Request,
    target: &http::Target,
    params: &http::Params,
) -> Option<Principal> {
    let token = params.query("token")?;
    if !target.path.ends_with("/ws")
        || req.header("authorization").is_some()
        || req.header("x-api-key").is_some()
    {
        return None;
    }
    ctx.ops.redeem_ws_ticket(params.get("session"), token)
}

fn authenticate(ctx: &Ctx, req: &httpd::Request) -> Result<Principal, ApiError> {
    let token = auth::token_from_headers(req.headers().iter().map(|h| (&*h.name, &*h.value)));
    Ok(ctx.auth.authenticate(req.peer().map(|p| p.ip()), token)?)
}
