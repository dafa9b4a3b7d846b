//! The protocol engine: version negotiation, the `initialize` and
//! `server/discover` handshakes, `tools/list`, `tools/call` with progress
//! and cancellation. Transports feed it classified messages and give it a
//! [`Sink`] for what it sends while a call runs.

use super::jsonrpc::{self, Incoming, RpcError};
use super::tools::{self, ToolCtx};
use super::{
    is_modern, Host, ALL_VERSIONS, HANDSHAKE_VERSIONS, LATEST_HANDSHAKE, MAX_INFLIGHT,
    META_SERVER_INFO, META_VERSION, V2026_07_28,
};
use crate::ops::Principal;
use crate::sync::lock;
use serde_json::{json, Map, Value};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A tool's answer as the audit record sees it: the session it names.
trait AuditAnswer {
    fn session_id(&self) -> Option<String>;
}

impl AuditAnswer for tools::ToolOut {
    fn session_id(&self) -> Option<String> {
        self.structured
            .get("sessionId")
            .and_then(Value::as_str)
            .map(String::from)
    }
}

/// Where a connection's outgoing messages go.
pub trait Sink: Send + Sync {
    /// Sends one message; false once the peer is gone.
    fn send(&self, msg: &Value) -> bool;
    /// Whether the peer is still there. Transports that can only tell by
    /// writing (an SSE stream) may write a keepalive here.
    fn alive(&self) -> bool {
        true
    }
}

/// What one client connection (stdio) or MCP session (HTTP) remembers.
pub struct Conn {
    /// Unique per connection: scopes request ids for cancellation.
    pub key: String,
    pub caller: Principal,
    /// Negotiated by `initialize`.
    pub version: Mutex<Option<String>>,
    /// Sandbox sessions created through this connection.
    pub created: Mutex<BTreeSet<String>>,
}

impl Conn {
    pub fn new(key: impl Into<String>, caller: Principal) -> Conn {
        Conn {
            key: key.into(),
            caller,
            version: Mutex::new(None),
            created: Mutex::new(BTreeSet::new()),
        }
    }
}

pub struct Engine {
    pub host: Host,
    inflight: Mutex<HashMap<(String, String), Arc<AtomicBool>>>,
    running: AtomicUsize,
}

struct Running<'a>(&'a AtomicUsize);
impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

pub fn server_info() -> Value {
    json!({"name": "agent-sandbox", "title": "agent-sandbox", "version": env!("CARGO_PKG_VERSION")})
}

const INSTRUCTIONS: &str = "Each sandbox session is a disposable Linux microVM. Create one with \
create_session (or let execute create it), run commands with execute, move files with write_file / \
read_file / list_files, run servers with start_process, and destroy_session when done.";

impl Engine {
    pub fn new(host: Host) -> Arc<Engine> {
        Arc::new(Engine {
            host,
            inflight: Mutex::new(HashMap::new()),
            running: AtomicUsize::new(0),
        })
    }

    /// Calls running now (all connections).
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Acquire)
    }

    /// Whether any call of `conn` is still running.
    pub fn busy(&self, conn: &Conn) -> bool {
        lock(&self.inflight).keys().any(|k| k.0 == conn.key)
    }

    /// The error for a call refused because too many run.
    pub fn busy_error() -> RpcError {
        RpcError::new(
            jsonrpc::SERVER_BUSY,
            format!("too many tool calls in flight (at most {MAX_INFLIGHT}); retry shortly"),
        )
    }

    /// The protocol version a request is made under: the one in its
    /// `_meta` (stateless 2026-07-28 envelope), else the one the
    /// connection negotiated, else the newest handshake version.
    pub fn version_of(
        &self,
        conn: &Conn,
        method: &str,
        params: &Map<String, Value>,
    ) -> Result<String, RpcError> {
        if let Some(v) = params.get("_meta").and_then(|m| m.get(META_VERSION)) {
            let v = v.as_str().ok_or_else(|| {
                RpcError::invalid_params(format!("_meta.{META_VERSION} must be a string"))
            })?;
            if !is_modern(v) {
                return Err(unsupported_version(v));
            }
            return Ok(v.to_string());
        }
        if method == "server/discover" {
            return Ok(V2026_07_28.to_string());
        }
        Ok(lock(&conn.version)
            .clone()
            .unwrap_or_else(|| LATEST_HANDSHAKE.to_string()))
    }

    /// Handles one message; returns the response to send, if any.
    pub fn handle(&self, conn: &Conn, msg: Incoming, sink: &dyn Sink) -> Option<Value> {
        match msg {
            Incoming::Request { id, method, params } => {
                self.request(conn, &id, &method, &params, sink)
            }
            Incoming::Notification { method, params } => {
                self.notification(conn, &method, &params);
                None
            }
            Incoming::Response => None,
        }
    }

    pub fn request(
        &self,
        conn: &Conn,
        id: &Value,
        method: &str,
        params: &Map<String, Value>,
        sink: &dyn Sink,
    ) -> Option<Value> {
        let version = match self.version_of(conn, method, params) {
            Ok(v) => v,
            Err(e) => return Some(jsonrpc::error(Some(id), &e)),
        };
        let r = match method {
            "initialize" => self.initialize(conn, params),
            "server/discover" => Ok(discover()),
            "ping" => Ok(json!({})),
            "tools/list" => Ok(self.tools_list(&version)),
            "tools/call" => match self.tools_call(conn, &version, id, params, sink) {
                Ok(Some(v)) => Ok(v),
                // Cancelled: the spec says not to answer.
                Ok(None) => return None,
                Err(e) => Err(e),
            },
            "logging/setLevel" if !is_modern(&version) => Ok(json!({})),
            _ => Err(RpcError::new(
                jsonrpc::METHOD_NOT_FOUND,
                format!("method {method:?} not found"),
            )),
        };
        Some(match r {
            Ok(mut v) => {
                if is_modern(&version) {
                    decorate_modern(&mut v);
                }
                jsonrpc::response(id, v)
            }
            Err(e) => jsonrpc::error(Some(id), &e),
        })
    }

    pub fn notification(&self, conn: &Conn, method: &str, params: &Map<String, Value>) {
        if method == "notifications/cancelled" {
            if let Some(id) = params.get("requestId") {
                let key = (conn.key.clone(), jsonrpc::id_key(id));
                if let Some(flag) = lock(&self.inflight).get(&key) {
                    log::info!("mcp: request {id} cancelled by the client");
                    flag.store(true, Ordering::Release);
                }
            }
        }
        // notifications/initialized and anything else: nothing to do.
    }

    fn initialize(&self, conn: &Conn, params: &Map<String, Value>) -> Result<Value, RpcError> {
        let asked = params
            .get("protocolVersion")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                RpcError::invalid_params("initialize needs params.protocolVersion (a string)")
            })?;
        // The client's version if we speak it, else our newest (the
        // client then decides whether it can go on).
        let chosen = if HANDSHAKE_VERSIONS.contains(&asked) {
            asked
        } else {
            LATEST_HANDSHAKE
        };
        *lock(&conn.version) = Some(chosen.to_string());
        Ok(json!({
            "protocolVersion": chosen,
            "capabilities": {"tools": {"listChanged": false}},
            "serverInfo": server_info(),
            "instructions": INSTRUCTIONS,
        }))
    }

    fn tools_list(&self, version: &str) -> Value {
        let tools: Vec<Value> = tools::TOOLS.iter().map(|t| t.definition()).collect();
        let mut v = json!({"tools": tools});
        if is_modern(version) {
            // The list is fixed for a build: anyone may cache it.
            v["cacheScope"] = json!("public");
            v["ttlMs"] = json!(300_000);
        }
        v
    }

    fn tools_call(
        &self,
        conn: &Conn,
        _version: &str,
        id: &Value,
        params: &Map<String, Value>,
        sink: &dyn Sink,
    ) -> Result<Option<Value>, RpcError> {
        let name = params
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| RpcError::invalid_params("tools/call needs params.name (a string)"))?;
        let empty = Map::new();
        let args = match params.get("arguments") {
            None | Some(Value::Null) => &empty,
            Some(Value::Object(m)) => m,
            Some(other) => {
                return Err(RpcError::invalid_params(format!(
                    "params.arguments must be an object, not {}",
                    jsonrpc::type_name(other)
                )))
            }
        };
        let tool = tools::find(name).ok_or_else(|| {
            RpcError::invalid_params(format!("unknown tool {name:?} (see tools/list)"))
        })?;
        let token = params
            .get("_meta")
            .and_then(|m| m.get("progressToken"))
            .filter(|t| t.is_string() || t.is_i64() || t.is_u64())
            .cloned();
        if self.running.fetch_add(1, Ordering::AcqRel) >= MAX_INFLIGHT {
            self.running.fetch_sub(1, Ordering::AcqRel);
            return Err(Self::busy_error());
        }
        let _running = Running(&self.running);
        let flag = Arc::new(AtomicBool::new(false));
        let key = (conn.key.clone(), jsonrpc::id_key(id));
        lock(&self.inflight).insert(key.clone(), flag.clone());
        let stop = || flag.load(Ordering::Acquire) || !sink.alive();
        let progress = |p: f64, message: String| {
            if let Some(t) = &token {
                sink.send(&jsonrpc::notification(
                    "notifications/progress",
                    json!({"progressToken": t, "progress": p, "message": message}),
                ));
            }
        };
        let created = |sid: &str| {
            lock(&conn.created).insert(sid.to_string());
        };
        let ctx = ToolCtx {
            host: &self.host,
            caller: &conn.caller,
            stop: &stop,
            progress: token.as_ref().map(|_| &progress as &dyn Fn(f64, String)),
            created: &created,
        };
        let t0 = std::time::Instant::now();
        // A bug in one tool must not take the server down.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (tool.run)(&ctx, args)))
            .unwrap_or_else(|_| Err(format!("internal error in tool {name}")));
        lock(&self.inflight).remove(&key);
        log::info!(
            "mcp: {} {name} {} in {:?}",
            conn.caller.id,
            if r.is_ok() { "ok" } else { "failed" },
            t0.elapsed()
        );
        self.audit_call(&conn.caller, name, args, &r, flag.load(Ordering::Acquire));
        if flag.load(Ordering::Acquire) {
            return Ok(None);
        }
        Ok(Some(match r {
            Ok(out) => {
                let text = serde_json::to_string(&out.structured).unwrap_or_default();
                let mut content = vec![json!({"type": "text", "text": text})];
                content.extend(out.extra);
                json!({"content": content, "structuredContent": out.structured, "isError": false})
            }
            Err(m) => json!({"content": [{"type": "text", "text": m}], "isError": true}),
        }))
    }

    /// The `api` audit record of a tool call about a session (its
    /// `sessionId`, or the one a create answered with): the tool, its
    /// arguments without secret values, env values or file content, and
    /// whether it failed.
    fn audit_call<T: AuditAnswer>(
        &self,
        caller: &Principal,
        name: &str,
        args: &Map<String, Value>,
        r: &Result<T, String>,
        cancelled: bool,
    ) {
        let log = self.host.ops.audit();
        if !log.is_enabled() {
            return;
        }
        let session = args
            .get("sessionId")
            .and_then(Value::as_str)
            .map(String::from)
            .or_else(|| r.as_ref().ok().and_then(|o| o.session_id()));
        let Some(session) = session else { return };
        let owner = match args.get("owner").and_then(Value::as_str) {
            Some(o) if caller.is_admin() => o.to_string(),
            _ => caller.id.clone(),
        };
        let shown = crate::ops::audit::audited(args);
        log.record(
            &owner,
            &session,
            "api",
            json!({
                "via": "mcp", "key": caller.id, "tool": name, "params": shown,
                "ok": r.is_ok(), "cancelled": cancelled, "error": r.as_ref().err(),
            }),
        );
    }

    /// The connection is gone: stop its calls; with `destroy`, also end the
    /// sandbox sessions it created (with `wait`, returning once they are
    /// gone: a process about to exit must not leave them half-destroyed).
    pub fn close(&self, conn: &Conn, destroy: bool, wait: bool) {
        for (k, flag) in lock(&self.inflight).iter() {
            if k.0 == conn.key {
                flag.store(true, Ordering::Release);
            }
        }
        if destroy {
            let ids: Vec<String> = std::mem::take(&mut *lock(&conn.created))
                .into_iter()
                .collect();
            for id in ids {
                self.host
                    .ops
                    .mgr
                    .remove(&conn.caller.id, &id, "MCP client went away", wait);
            }
        }
    }
}

pub fn unsupported_version(v: &str) -> RpcError {
    RpcError::new(
        jsonrpc::UNSUPPORTED_PROTOCOL_VERSION,
        format!("protocol version {v:?} is not supported"),
    )
    .with_data(json!({"requested": v, "supported": ALL_VERSIONS}))
}

fn discover() -> Value {
    json!({
        "supportedVersions": ALL_VERSIONS,
        "capabilities": {"tools": {"listChanged": false}},
        "instructions": INSTRUCTIONS,
        "cacheScope": "public",
        "ttlMs": 300_000,
    })
}

/// 2026-07-28 results carry `resultType` and name the server in `_meta`.
fn decorate_modern(v: &mut Value) {
    if let Value::Object(m) = v {
        m.insert("resultType".into(), json!("complete"));
        let meta = m.entry("_meta").or_insert_with(|| json!({}));
        if let Value::Object(meta) = meta {
            meta.insert(META_SERVER_INFO.into(), server_info());
        }
    }
}
