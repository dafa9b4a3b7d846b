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
        // Before anything makes an id: ids carry the host (issue #28).
        crate::router::set_host(cfg.host_id.clone());
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
    let mut audit = None;
    let (reply, retry_after, allow) = match route(ctx, &mut req, &mut audit) {
        Ok(r) => (r, None, None),
        Err(e) => {
            if e.status >= 500 {
                ctx.metrics.error(e.code);
            }
            let (ra, allow) = (e.retry_after, e.allow.clone());
            (Reply::from(e), ra, allow)
        }
    };
    finish(ctx, req, reply, retry_after, allow.as_deref(), audit);
}

/// The `api` audit record of a request about a session: who (key id),
/// which route (its template), the path's and query's parameters (the
/// body's are in the operation's own records: `exec`, `session`), and
/// the answer's status and error code.
struct ApiAudit {
    owner: String,
    key: String,
    session: Option<String>,
    method: String,
    route: &'static str,
    params: serde_json::Map<String, serde_json::Value>,
}

impl ApiAudit {
    fn record(self, ctx: &Ctx, reply: &Reply) {
        let status = reply.status();
        let (code, session) = match reply {
            Reply::Error(e) => (Some(e.code), self.session),
            // A create names its session only in the answer.
            Reply::Json(_, v) => (
                None,
                self.session
                    .or_else(|| v.get("id").and_then(|i| i.as_str()).map(String::from)),
            ),
            _ => (None, self.session),
        };
        let Some(session) = session else { return };
        ctx.ops.audit().record(
            &self.owner,
            &session,
            "api",
            serde_json::json!({
                "via": "rest", "key": self.key, "method": self.method, "route": self.route,
                "params": self.params, "status": status, "error": code,
            }),
        );
    }

    /// Streams answer 200 at their start.
    fn record_status(self, ctx: &Ctx, status: u16) {
        self.record(ctx, &Reply::Empty(status))
    }
}

/// A JSON body's parameters for the record (`ops::audit::audited`: no
/// secret values, env values or file contents), read ahead and handed to
/// the handler again. Bodies that are file contents or stdin (uploads,
/// the seed write, stdin) are not read here: their size is the header's.
fn audited_body(
    ctx: &Ctx,
    req: &mut httpd::Request,
    pattern: &str,
) -> Result<Option<serde_json::Value>, ApiError> {
    let raw = pattern.ends_with("/files/content")
        || pattern.ends_with("/stdin")
        || pattern == "/exec/{session}/write";
    let json =
        http::header(req, "content-type").is_none_or(|c| c.to_ascii_lowercase().contains("json"));
    let m = req.method().to_ascii_uppercase();
    if raw || !json || !(m == "POST" || m == "PUT" || m == "PATCH") {
        return Ok(req
            .body_length()
            .filter(|n| *n > 0)
            .map(|n| serde_json::json!({"leftOut": true, "bytes": n})));
    }
    let body = http::read_body(req, ctx.cfg.max_body)?;
    let shown = match serde_json::from_slice::<serde_json::Value>(&body) {
        Ok(serde_json::Value::Object(o)) => Some(crate::ops::audit::audited(&o).into()),
        Ok(_) | Err(_) if body.iter().all(u8::is_ascii_whitespace) => None,
        // The handler answers a bad body; the record says only its size.
        _ => Some(serde_json::json!({"unparsed": true, "bytes": body.len()})),
    };
    req.replay_body(body);
    Ok(shown)
}

/// Query parameters that may carry a secret are left out of the record.
fn audited_params(params: &http::Params) -> serde_json::Map<String, serde_json::Value> {
    let mut m = serde_json::Map::new();
    for (k, v) in &params.path {
        if *k != "session" {
            m.insert(k.to_string(), v.clone().into());
        }
    }
    for (k, v) in &params.query {
        let secret = ["token", "secret", "key", "password", "value"]
            .iter()
            .any(|w| k.to_ascii_lowercase().contains(w));
        let shown = if secret { "****".into() } else { v.clone() };
        m.insert(k.clone(), shown.into());
    }
    m
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
    audit: Option<ApiAudit>,
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
                let reply = Reply::Error(e);
                if let Some(a) = audit {
                    a.record(ctx, &reply);
                }
                let Reply::Error(e) = reply else { return };
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
                            if let Some(a) = audit {
                                a.record(&ctx2, &out);
                            }
                            // A deferred 503 (a budget or capacity ran
                            // out meanwhile) is worth a retry shortly.
                            let retry = match &out {
                                Reply::Error(e) if e.retry_after.is_some() => e.retry_after,
                                _ => (status == 503).then_some(1),
                            };
                            respond(req, out, retry, None)
                        }
                        Reply::Stream {
                            content_type,
                            headers,
                            job,
                        } => {
                            count(&ctx2, 200);
                            if let Some(a) = audit {
                                a.record_status(&ctx2, 200);
                            }
                            let mut w = StreamWriter::start_with(req, content_type, &headers);
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
            if let Some(a) = audit {
                a.record(ctx, &r);
            }
            respond(req, r, retry_after, allow)
        }
    }
}

/// Finds the route, authenticates, authorizes, rate-limits and calls it.
fn route(
    ctx: &Arc<Ctx>,
    req: &mut httpd::Request,
    audit: &mut Option<ApiAudit>,
) -> Result<Reply, ApiError> {
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
    let session = params.path.get("session").cloned();
    let creates = route.pattern == "/v1/sessions" && method == "POST";
    if ctx.ops.audit().is_enabled() && (session.is_some() || creates) {
        let owner = match params.query("owner") {
            Some(o) if principal.is_admin() => o.to_string(),
            _ => principal.id.clone(),
        };
        let mut shown = audited_params(&params);
        if let Some(body) = audited_body(ctx, req, route.pattern)? {
            shown.insert("body".into(), body);
        }
        *audit = Some(ApiAudit {
            owner,
            key: principal.id.clone(),
            session,
            method: method.clone(),
            route: route.pattern,
            params: shown,
        });
    }
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
