//! Streamable HTTP transport at `/mcp` on the daemon.
//!
//! - `POST` carries one JSON-RPC message. Requests are answered with JSON,
//!   or, for `tools/call` when the client accepts `text/event-stream`, with
//!   an SSE stream (progress notifications, then the response); a client
//!   that closes that stream cancels the call. Notifications get 202.
//! - 2025-06-18 / 2025-11-25: `initialize` opens an MCP session named by
//!   the `Mcp-Session-Id` response header, which later requests must carry;
//!   `DELETE` ends it (and destroys the sandboxes it created).
//! - 2026-07-28: stateless. Each request carries its version in `_meta`,
//!   which must equal the `MCP-Protocol-Version` header; `Mcp-Method` /
//!   `Mcp-Name`, when sent, must match the body.
//! - `GET` (a server-initiated stream) is not offered: 405.
//! - Same API keys and session ownership as REST (`Authorization: Bearer`
//!   or `X-API-Key`, scope `exec`); requests with an `Origin` header are
//!   refused unless the origin is allowlisted (DNS-rebinding defence).

use super::jsonrpc::{self, Incoming, RpcError};
use super::server::{Conn, Engine, Sink};
use super::{is_modern, Host, ALL_VERSIONS, MAX_MESSAGE, META_VERSION};
use crate::config::Config;
use crate::ops::auth;
use crate::ops::{Principal, Scope};
use crate::server::http::{header, StreamWriter};
use crate::server::httpd::Request;
use crate::server::{Ctx, Endpoint};
use crate::session::Manager;
use crate::sync::lock;
use serde_json::Value;
use std::collections::HashMap;
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// MCP sessions (handshake versions) kept at once.
const MAX_MCP_SESSIONS: usize = 4096;

struct HttpSession {
    conn: Arc<Conn>,
    last: Mutex<Instant>,
}

/// The `/mcp` endpoint's state; one per daemon.
pub struct McpHttp {
    engine: Arc<Engine>,
    sessions: Mutex<HashMap<String, Arc<HttpSession>>>,
    origins: Vec<String>,
    idle: Duration,
}

impl McpHttp {
    pub fn new(mgr: Arc<Manager>, cfg: Arc<Config>) -> McpHttp {
        McpHttp {
            origins: cfg.mcp_allowed_origins.clone(),
            idle: cfg.idle_timeout,
            engine: Engine::new(Host { mgr, cfg }),
            sessions: Mutex::new(HashMap::new()),
        }
    }

    /// Ends MCP sessions idle past the idle timeout (and their sandboxes).
    fn expire(&self) {
        let old: Vec<Arc<HttpSession>> = {
            let mut m = lock(&self.sessions);
            let dead: Vec<String> = m
                .iter()
                // A session with a call still running is not idle.
                .filter(|(_, s)| lock(&s.last).elapsed() > self.idle && !self.engine.busy(&s.conn))
                .map(|(k, _)| k.clone())
                .collect();
            dead.iter().filter_map(|k| m.remove(k)).collect()
        };
        for s in old {
            self.engine.close(&s.conn, true, false);
        }
    }
}

/// True for the request targets this module serves.
pub use crate::server::is_mcp_path;

/// The endpoint the composition root hands the server for `/mcp`.
pub fn endpoint(ctx: &Arc<Ctx>) -> Arc<dyn Endpoint> {
    Arc::new(McpHttp::new(ctx.ops.mgr.clone(), ctx.cfg.clone()))
}

impl Endpoint for McpHttp {
    fn handle(&self, ctx: &Arc<Ctx>, req: Request) {
        handle(self, ctx, req)
    }

    fn max_body(&self, _: &Config) -> usize {
        MAX_MESSAGE
    }
}

/// Answers with a status, optional JSON body and extra headers.
fn reply(req: Request, status: u16, body: Option<&Value>, extra: &[(&str, String)]) {
    let data = body
        .map(|b| serde_json::to_vec(b).unwrap_or_default())
        .unwrap_or_default();
    let mut headers: Vec<(&str, &str)> = Vec::with_capacity(extra.len() + 1);
    if body.is_some() {
        headers.push(("Content-Type", "application/json"));
    }
    for (k, v) in extra {
        headers.push((k, v.as_str()));
    }
    req.respond(status, &headers, &data);
}

fn fail(req: Request, status: u16, id: Option<&Value>, e: RpcError, extra: &[(&str, String)]) {
    reply(req, status, Some(&jsonrpc::error(id, &e)), extra);
}

/// HTTP status for an answer: transport-level errors are 400; the
/// stateless protocol also maps invalid params to 400 and an unknown
/// method to 404 (as the reference SDK does).
fn status_for(resp: &Value, modern: bool) -> u16 {
    match resp["error"]["code"].as_i64() {
        Some(jsonrpc::PARSE_ERROR)
        | Some(jsonrpc::INVALID_REQUEST)
        | Some(jsonrpc::HEADER_MISMATCH)
        | Some(jsonrpc::UNSUPPORTED_PROTOCOL_VERSION) => 400,
        Some(jsonrpc::INVALID_PARAMS) if modern => 400,
        Some(jsonrpc::METHOD_NOT_FOUND) if modern => 404,
        _ => 200,
    }
}

/// The caller, by the daemon's one authentication; MCP needs `exec`.
/// Refusals as (status, message, Retry-After).
fn authenticate(ctx: &Ctx, req: &Request) -> Result<Principal, (u16, String, Option<u64>)> {
    let token = auth::token_from_headers(req.headers().iter().map(|h| (&*h.name, &*h.value)));
    let p = ctx
        .auth
        .authenticate(req.peer().map(|p| p.ip()), token)
        .map_err(|e| {
            let status = if e.is_throttle() { 429 } else { 401 };
            (status, e.to_string(), e.retry_after())
        })?;
    if !p.may(Scope::Exec) {
        return Err((403, "this key lacks the \"exec\" scope".into(), None));
    }
    Ok(p)
}

/// Answers one request for `/mcp`.
fn handle(st: &McpHttp, ctx: &Arc<Ctx>, mut req: Request) {
    if let Some(origin) = header(&req, "origin").map(str::to_string) {
        if !st.origins.iter().any(|o| *o == origin || o == "*") {
            log::warn!("mcp: refused a request from origin {origin:?}");
            return fail(
                req,
                403,
                None,
                RpcError::invalid_request(format!(
                    "origin {origin:?} is not allowed (see --mcp-allowed-origin)"
                )),
                &[],
            );
        }
    }
    let method = req.method().to_ascii_uppercase();
    if !matches!(method.as_str(), "POST" | "DELETE") {
        let allow = [("Allow", "POST, DELETE".to_string())];
        let msg = if method == "GET" {
            "this server offers no server-initiated stream; POST messages instead"
        } else {
            "use POST (messages) or DELETE (end an MCP session)"
        };
        return fail(req, 405, None, RpcError::invalid_request(msg), &allow);
    }
    let caller = match authenticate(ctx, &req) {
        Ok(c) => c,
        Err((status, m, retry)) => {
            let mut extra = vec![("WWW-Authenticate", "Bearer".to_string())];
            if let Some(r) = retry {
                extra = vec![("Retry-After", r.to_string())];
            }
            return fail(req, status, None, RpcError::new(-32001, m), &extra);
        }
    };
    if ctx.is_closing() {
        return fail(
            req,
            503,
            None,
            RpcError::new(jsonrpc::SERVER_BUSY, "the server is shutting down"),
            &[("Retry-After", "1".into())],
        );
    }
    st.expire();
    let sid = header(&req, "mcp-session-id").map(str::to_string);
    if method == "DELETE" {
        let Some(sid) = sid else {
            return fail(
                req,
                400,
                None,
                RpcError::invalid_request("DELETE needs an Mcp-Session-Id header"),
                &[],
            );
        };
        let s = {
            let mut m = lock(&st.sessions);
            match m.get(&sid) {
                Some(s) if s.conn.caller.id == caller.id => m.remove(&sid),
                _ => None,
            }
        };
        return match s {
            Some(s) => {
                st.engine.close(&s.conn, true, false);
                reply(req, 200, None, &[])
            }
            None => fail(
                req,
                404,
                None,
                RpcError::invalid_request("no such MCP session"),
                &[],
            ),
        };
    }
    // POST: one JSON-RPC message.
    if req.body_length().is_some_and(|n| n > MAX_MESSAGE) {
        return too_large(req);
    }
    let mut body = Vec::new();
    if let Err(e) = req
        .as_reader()
        .take(MAX_MESSAGE as u64 + 1)
        .read_to_end(&mut body)
    {
        return fail(
            req,
            400,
            None,
            RpcError::invalid_request(format!("reading the body: {e}")),
            &[],
        );
    }
    if body.len() > MAX_MESSAGE {
        return too_large(req);
    }
    let msg = match jsonrpc::parse(&body) {
        Ok(m) => m,
        Err((id, e)) => return fail(req, 400, id.as_ref(), e, &[]),
    };
    let accept = header(&req, "accept").unwrap_or("").to_ascii_lowercase();
    let sse_ok = accept.contains("text/event-stream");
    let hdr_version = header(&req, "mcp-protocol-version").map(str::to_string);
    let (id, mname, params) = match &msg {
        Incoming::Request { id, method, params } => (Some(id.clone()), method.clone(), params),
        Incoming::Notification { method, params } => (None, method.clone(), params),
        Incoming::Response => return reply(req, 202, None, &[]),
    };
    // Stateless (2026-07-28) when the body says so.
    let meta_version = params
        .get("_meta")
        .and_then(|m| m.get(META_VERSION))
        .and_then(Value::as_str)
        .map(str::to_string);
    let modern = meta_version.is_some() || mname == "server/discover";
    if let Some(mv) = &meta_version {
        if (is_modern(mv) || hdr_version.is_some()) && hdr_version.as_deref() != Some(mv.as_str()) {
            return mismatch(
                req,
                id.as_ref(),
                format!("MCP-Protocol-Version header {hdr_version:?} does not match _meta {mv:?}"),
            );
        }
        if let Some(m) = header(&req, "mcp-method").map(str::to_string) {
            if m != mname {
                return mismatch(
                    req,
                    id.as_ref(),
                    format!("Mcp-Method header {m:?} does not match the body's {mname:?}"),
                );
            }
        }
        if let Some(n) = header(&req, "mcp-name").map(str::to_string) {
            let body_name = params.get("name").and_then(Value::as_str).unwrap_or("");
            if n != body_name {
                return mismatch(
                    req,
                    id.as_ref(),
                    format!("Mcp-Name header {n:?} does not match the body's {body_name:?}"),
                );
            }
        }
    } else if let Some(v) = &hdr_version {
        if !ALL_VERSIONS.contains(&v.as_str()) {
            return fail(
                req,
                400,
                id.as_ref(),
                super::server::unsupported_version(v),
                &[],
            );
        }
    }
    // Which connection state the message belongs to.
    let mut new_session = None;
    let conn: Arc<Conn> = if mname == "initialize" && !modern {
        if lock(&st.sessions).len() >= MAX_MCP_SESSIONS {
            return fail(
                req,
                503,
                id.as_ref(),
                RpcError::new(jsonrpc::SERVER_BUSY, "too many MCP sessions"),
                &[("Retry-After", "5".into())],
            );
        }
        let mut b = [0u8; 16];
        if let Err(e) = crate::harden::random::secure_random(&mut b) {
            return fail(
                req,
                500,
                None,
                RpcError::new(jsonrpc::INTERNAL_ERROR, format!("making a session id: {e}")),
                &[],
            );
        }
        let sid: String = b.iter().map(|x| format!("{x:02x}")).collect();
        let conn = Arc::new(Conn::new(format!("http:{sid}"), caller.clone()));
        new_session = Some((sid, conn.clone()));
        conn
    } else if modern || sid.is_none() && id.is_none() {
        // Stateless requests, and session-less notifications (a
        // cancellation from a stateless client), share one scope per key.
        Arc::new(Conn::new(format!("key:{}", caller.id), caller.clone()))
    } else {
        let Some(sid) = &sid else {
            return fail(req, 400, id.as_ref(), RpcError::invalid_request(
                "missing Mcp-Session-Id header: send initialize first (or use protocol version 2026-07-28 with _meta)"), &[]);
        };
        match lock(&st.sessions).get(sid) {
            Some(s) if s.conn.caller.id == caller.id => {
                *lock(&s.last) = Instant::now();
                s.conn.clone()
            }
            _ => {
                return fail(
                    req,
                    404,
                    id.as_ref(),
                    RpcError::invalid_request("unknown or expired MCP session; initialize again"),
                    &[],
                )
            }
        }
    };
    let Some(id) = id else {
        st.engine.handle(&conn, msg, &NullSink);
        return reply(req, 202, None, &[]);
    };
    // A call that will fail its params check is answered at once below, as
    // JSON with its HTTP status, instead of on a stream.
    let runnable = params
        .get("name")
        .and_then(Value::as_str)
        .and_then(super::tools::find)
        .is_some()
        && matches!(
            params.get("arguments"),
            None | Some(Value::Null) | Some(Value::Object(_))
        );
    if mname == "tools/call" && runnable {
        // Refuse before starting a thread when the engine is full.
        if st.engine.running() >= super::MAX_INFLIGHT {
            return fail(
                req,
                503,
                Some(&id),
                Engine::busy_error(),
                &[("Retry-After", "1".into())],
            );
        }
        let engine = st.engine.clone();
        let spawned = std::thread::Builder::new()
            .name("mcp-http-call".into())
            .spawn(move || {
                let Incoming::Request { method, params, .. } = msg else {
                    return;
                };
                if sse_ok {
                    let w = StreamWriter::start(req, "text/event-stream");
                    let sink = SseSink {
                        w: Mutex::new((w, Instant::now())),
                        gone: AtomicBool::new(false),
                    };
                    if let Some(r) = engine.request(&conn, &id, &method, &params, &sink) {
                        sink.send(&r);
                    }
                    if let Ok(m) = sink.w.into_inner() {
                        m.0.finish();
                    }
                } else {
                    match engine.request(&conn, &id, &method, &params, &NullSink) {
                        Some(r) => reply(req, status_for(&r, modern), Some(&r), &[]),
                        None => reply(req, 202, None, &[]),
                    }
                }
            });
        if let Err(e) = spawned {
            log::error!("mcp: cannot start a call thread: {e}");
        }
        return;
    }
    let r = st.engine.handle(&conn, msg, &NullSink);
    let mut extra = Vec::new();
    if let Some((sid, conn)) = new_session {
        let ok = r.as_ref().is_some_and(|r| r.get("result").is_some());
        if ok {
            lock(&st.sessions).insert(
                sid.clone(),
                Arc::new(HttpSession {
                    conn,
                    last: Mutex::new(Instant::now()),
                }),
            );
            extra.push(("Mcp-Session-Id", sid));
        }
    }
    match r {
        Some(r) => reply(req, status_for(&r, modern), Some(&r), &extra),
        None => reply(req, 202, None, &extra),
    }
}

fn too_large(req: Request) {
    fail(
        req,
        413,
        None,
        RpcError::invalid_request(format!("message exceeds the {MAX_MESSAGE}-byte limit")),
        &[],
    )
}

fn mismatch(req: Request, id: Option<&Value>, m: String) {
    fail(
        req,
        400,
        id,
        RpcError::new(jsonrpc::HEADER_MISMATCH, m),
        &[],
    )
}

struct NullSink;
impl Sink for NullSink {
    fn send(&self, _: &Value) -> bool {
        true
    }
}

/// Events on one POST's SSE stream. A failed write means the client left:
/// the engine then stops the call.
struct SseSink {
    w: Mutex<(StreamWriter, Instant)>,
    gone: AtomicBool,
}

impl Sink for SseSink {
    fn send(&self, msg: &Value) -> bool {
        let line = serde_json::to_string(msg).unwrap_or_default();
        let mut g = lock(&self.w);
        let ok =
            g.0.send(format!("event: message\ndata: {line}\n\n").as_bytes());
        g.1 = Instant::now();
        if !ok {
            self.gone.store(true, Ordering::Release);
        }
        ok
    }

    fn alive(&self) -> bool {
        if self.gone.load(Ordering::Acquire) {
            return false;
        }
        let mut g = lock(&self.w);
        // Only a write tells whether the peer is still there.
        if g.1.elapsed() >= Duration::from_millis(500) {
            g.1 = Instant::now();
            if !g.0.send(b": keepalive\n\n") {
                self.gone.store(true, Ordering::Release);
                return false;
            }
        }
        true
    }
}
