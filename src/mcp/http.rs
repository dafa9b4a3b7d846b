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
use crate::ops::{Ops, Principal, Scope};
use crate::server::http::{header, StreamWriter};
use crate::server::httpd::Request;
use crate::server::{Ctx, Endpoint};
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
    /// The endpoint over the daemon's operations.
    pub fn new(ops: &Arc<Ops>) -> McpHttp {
        let cfg = &ops.cfg;
        McpHttp {
            origins: cfg.mcp_allowed_origins.clone(),
            idle: cfg.idle_timeout,
            engine: Engine::new(Host::new(ops.clone())),
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
    Arc::new(McpHttp::new(&ctx.ops))
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

/// A request refused before the engine saw it: its status, JSON-RPC
/// error (with the request's id when known) and extra headers.
struct Refusal {
    status: u16,
    id: Option<Value>,
    error: RpcError,
    extra: Vec<(&'static str, String)>,
}

/// One step of [`handle`]: what it found, or the answer that ends it
/// (boxed: the rare path).
type Step<T> = Result<T, Box<Refusal>>;

impl Refusal {
    fn new(status: u16, error: RpcError) -> Box<Refusal> {
        Box::new(Refusal {
            status,
            id: None,
            error,
            extra: Vec::new(),
        })
    }

    fn id(mut self: Box<Self>, id: Option<&Value>) -> Box<Refusal> {
        self.id = id.cloned();
        self
    }

    fn header(mut self: Box<Self>, name: &'static str, value: impl Into<String>) -> Box<Refusal> {
        self.extra.push((name, value.into()));
        self
    }

    fn send(self, req: Request) {
        fail(req, self.status, self.id.as_ref(), self.error, &self.extra)
    }
}

/// The caller, by the daemon's one authentication; MCP needs `exec`.
fn authenticate(ctx: &Ctx, req: &Request) -> Step<Principal> {
    let refuse = |status: u16, m: String, retry: Option<u64>| {
        let r = Refusal::new(status, RpcError::new(-32001, m));
        match retry {
            Some(s) => r.header("Retry-After", s.to_string()),
            None => r.header("WWW-Authenticate", "Bearer"),
        }
    };
    let token = auth::token_from_headers(req.headers().iter().map(|h| (&*h.name, &*h.value)));
    let p = ctx
        .auth
        .authenticate(req.peer().map(|p| p.ip()), token)
        .map_err(|e| {
            let status = if e.is_throttle() { 429 } else { 401 };
            refuse(status, e.to_string(), e.retry_after())
        })?;
    if !p.may(Scope::Exec) {
        return Err(refuse(
            403,
            "this key lacks the \"exec\" scope".into(),
            None,
        ));
    }
    Ok(p)
}

/// Answers one request for `/mcp`.
fn handle(st: &McpHttp, ctx: &Arc<Ctx>, mut req: Request) {
    let method = req.method().to_ascii_uppercase();
    let caller = match admit(st, ctx, &req, &method) {
        Ok(c) => c,
        Err(r) => return r.send(req),
    };
    st.expire();
    let sid = header(&req, "mcp-session-id").map(str::to_string);
    if method == "DELETE" {
        return end_session(st, &caller, sid, req);
    }
    // POST: one JSON-RPC message.
    let msg = match read_message(&mut req) {
        Ok(m) => m,
        Err(r) => return r.send(req),
    };
    let env = match envelope(&req, &msg) {
        Ok(Some(e)) => e,
        // A response to nothing we sent.
        Ok(None) => return reply(req, 202, None, &[]),
        Err(r) => return r.send(req),
    };
    let (conn, new_session) = match connection(st, &caller, &env, sid.as_deref()) {
        Ok(c) => c,
        Err(r) => return r.send(req),
    };
    let Some(id) = env.id.clone() else {
        st.engine.handle(&conn, msg, &NullSink);
        return reply(req, 202, None, &[]);
    };
    if env.method == "tools/call" && runnable(&msg) {
        return call_tool(st, conn, id, msg, &env, req);
    }
    answer(st, &conn, msg, new_session, env.modern, req)
}

/// Origin, method, caller and whether the server still takes requests.
fn admit(st: &McpHttp, ctx: &Ctx, req: &Request, method: &str) -> Step<Principal> {
    if let Some(origin) = header(req, "origin") {
        if !st.origins.iter().any(|o| o == origin || o == "*") {
            log::warn!("mcp: refused a request from origin {origin:?}");
            return Err(Refusal::new(
                403,
                RpcError::invalid_request(format!(
                    "origin {origin:?} is not allowed (see --mcp-allowed-origin)"
                )),
            ));
        }
    }
    if !matches!(method, "POST" | "DELETE") {
        let msg = if method == "GET" {
            "this server offers no server-initiated stream; POST messages instead"
        } else {
            "use POST (messages) or DELETE (end an MCP session)"
        };
        return Err(
            Refusal::new(405, RpcError::invalid_request(msg)).header("Allow", "POST, DELETE")
        );
    }
    let caller = authenticate(ctx, req)?;
    if ctx.is_closing() {
        return Err(Refusal::new(
            503,
            RpcError::new(jsonrpc::SERVER_BUSY, "the server is shutting down"),
        )
        .header("Retry-After", "1"));
    }
    Ok(caller)
}

/// `DELETE`: ends the caller's MCP session `sid` and the sandboxes it made.
fn end_session(st: &McpHttp, caller: &Principal, sid: Option<String>, req: Request) {
    let Some(sid) = sid else {
        return Refusal::new(
            400,
            RpcError::invalid_request("DELETE needs an Mcp-Session-Id header"),
        )
        .send(req);
    };
    let s = {
        let mut m = lock(&st.sessions);
        match m.get(&sid) {
            Some(s) if s.conn.caller.id == caller.id => m.remove(&sid),
            _ => None,
        }
    };
    match s {
        Some(s) => {
            st.engine.close(&s.conn, true, false);
            reply(req, 200, None, &[])
        }
        None => Refusal::new(404, RpcError::invalid_request("no such MCP session")).send(req),
    }
}

/// The body, at most [`MAX_MESSAGE`] bytes, as one JSON-RPC message.
fn read_message(req: &mut Request) -> Step<Incoming> {
    if req.body_length().is_some_and(|n| n > MAX_MESSAGE) {
        return Err(too_large());
    }
    let mut body = Vec::new();
    if let Err(e) = req
        .as_reader()
        .take(MAX_MESSAGE as u64 + 1)
        .read_to_end(&mut body)
    {
        return Err(Refusal::new(
            400,
            RpcError::invalid_request(format!("reading the body: {e}")),
        ));
    }
    if body.len() > MAX_MESSAGE {
        return Err(too_large());
    }
    jsonrpc::parse(&body).map_err(|(id, e)| Refusal::new(400, e).id(id.as_ref()))
}

/// What the transport needs of a message: its id, method, protocol
/// generation and whether the client takes an SSE answer.
struct Envelope {
    id: Option<Value>,
    method: String,
    /// Stateless (2026-07-28).
    modern: bool,
    sse_ok: bool,
}

/// The message's envelope, its headers checked against its body; `None`
/// for a response.
fn envelope(req: &Request, msg: &Incoming) -> Step<Option<Envelope>> {
    let accept = header(req, "accept").unwrap_or("").to_ascii_lowercase();
    let sse_ok = accept.contains("text/event-stream");
    let hdr_version = header(req, "mcp-protocol-version");
    let (id, mname, params) = match msg {
        Incoming::Request { id, method, params } => (Some(id.clone()), method.clone(), params),
        Incoming::Notification { method, params } => (None, method.clone(), params),
        Incoming::Response => return Ok(None),
    };
    // Stateless (2026-07-28) when the body says so.
    let meta_version = params
        .get("_meta")
        .and_then(|m| m.get(META_VERSION))
        .and_then(Value::as_str);
    let modern = meta_version.is_some() || mname == "server/discover";
    let mismatch =
        |m: String| Refusal::new(400, RpcError::new(jsonrpc::HEADER_MISMATCH, m)).id(id.as_ref());
    if let Some(mv) = meta_version {
        if (is_modern(mv) || hdr_version.is_some()) && hdr_version != Some(mv) {
            return Err(mismatch(format!(
                "MCP-Protocol-Version header {:?} does not match _meta {mv:?}",
                hdr_version.map(str::to_string)
            )));
        }
        if let Some(m) = header(req, "mcp-method") {
            if m != mname {
                return Err(mismatch(format!(
                    "Mcp-Method header {m:?} does not match the body's {mname:?}"
                )));
            }
        }
        if let Some(n) = header(req, "mcp-name") {
            let body_name = params.get("name").and_then(Value::as_str).unwrap_or("");
            if n != body_name {
                return Err(mismatch(format!(
                    "Mcp-Name header {n:?} does not match the body's {body_name:?}"
                )));
            }
        }
    } else if let Some(v) = hdr_version {
        if !ALL_VERSIONS.contains(&v) {
            return Err(Refusal::new(400, super::server::unsupported_version(v)).id(id.as_ref()));
        }
    }
    Ok(Some(Envelope {
        id,
        method: mname,
        modern,
        sse_ok,
    }))
}

/// The MCP session an `initialize` opens: its id and connection state,
/// kept only if the handshake succeeds.
type NewSession = Option<(String, Arc<Conn>)>;

/// Which connection state the message belongs to (and the session an
/// `initialize` opens).
fn connection(
    st: &McpHttp,
    caller: &Principal,
    env: &Envelope,
    sid: Option<&str>,
) -> Step<(Arc<Conn>, NewSession)> {
    if env.method == "initialize" && !env.modern {
        if lock(&st.sessions).len() >= MAX_MCP_SESSIONS {
            return Err(Refusal::new(
                503,
                RpcError::new(jsonrpc::SERVER_BUSY, "too many MCP sessions"),
            )
            .id(env.id.as_ref())
            .header("Retry-After", "5"));
        }
        let mut b = [0u8; 16];
        if let Err(e) = crate::harden::random::secure_random(&mut b) {
            return Err(Refusal::new(
                500,
                RpcError::new(jsonrpc::INTERNAL_ERROR, format!("making a session id: {e}")),
            ));
        }
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        // `m-<host>-<hex>` behind a router: its requests come back here.
        let sid = crate::router::tagged_or_bare(crate::router::MCP_SESSION, hex);
        let conn = Arc::new(Conn::new(format!("http:{sid}"), caller.clone()));
        return Ok((conn.clone(), Some((sid, conn))));
    }
    if env.modern || sid.is_none() && env.id.is_none() {
        // Stateless requests, and session-less notifications (a
        // cancellation from a stateless client), share one scope per key.
        let conn = Conn::new(format!("key:{}", caller.id), caller.clone());
        return Ok((Arc::new(conn), None));
    }
    let Some(sid) = sid else {
        return Err(Refusal::new(400, RpcError::invalid_request(
            "missing Mcp-Session-Id header: send initialize first (or use protocol version 2026-07-28 with _meta)"))
            .id(env.id.as_ref()));
    };
    match lock(&st.sessions).get(sid) {
        Some(s) if s.conn.caller.id == caller.id => {
            *lock(&s.last) = Instant::now();
            Ok((s.conn.clone(), None))
        }
        _ => Err(Refusal::new(
            404,
            RpcError::invalid_request("unknown or expired MCP session; initialize again"),
        )
        .id(env.id.as_ref())),
    }
}

/// A `tools/call` that will run: a known tool with object (or no)
/// arguments. One that will fail its params check is answered at once
/// instead, as JSON with its HTTP status, not on a stream.
fn runnable(msg: &Incoming) -> bool {
    let Incoming::Request { params, .. } = msg else {
        return false;
    };
    params
        .get("name")
        .and_then(Value::as_str)
        .and_then(super::tools::find)
        .is_some()
        && matches!(
            params.get("arguments"),
            None | Some(Value::Null) | Some(Value::Object(_))
        )
}

/// Runs a tool call on a thread of its own, answering on an SSE stream
/// (progress, then the response) when the client takes one, else as JSON.
fn call_tool(
    st: &McpHttp,
    conn: Arc<Conn>,
    id: Value,
    msg: Incoming,
    env: &Envelope,
    req: Request,
) {
    // Refuse before starting a thread when the engine is full.
    if st.engine.running() >= super::MAX_INFLIGHT {
        return Refusal::new(503, Engine::busy_error())
            .id(Some(&id))
            .header("Retry-After", "1")
            .send(req);
    }
    let engine = st.engine.clone();
    let (sse_ok, modern) = (env.sse_ok, env.modern);
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
}

/// Any other request, answered now; a successful `initialize` keeps its
/// MCP session and names it in `Mcp-Session-Id`.
fn answer(
    st: &McpHttp,
    conn: &Arc<Conn>,
    msg: Incoming,
    new_session: NewSession,
    modern: bool,
    req: Request,
) {
    let r = st.engine.handle(conn, msg, &NullSink);
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

fn too_large() -> Box<Refusal> {
    Refusal::new(
        413,
        RpcError::invalid_request(format!("message exceeds the {MAX_MESSAGE}-byte limit")),
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
