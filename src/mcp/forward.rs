//! `agent-sandbox mcp --url URL`: a stdio MCP server that forwards every
//! message to a running daemon's Streamable HTTP endpoint, so an agent
//! config run by an unprivileged user can share one sandbox host.
//!
//! Requests are posted concurrently (a long `execute` does not hold up
//! others); SSE answers are relayed event by event. When stdin closes the
//! MCP session is deleted, which cancels running calls and destroys the
//! sandboxes it created.

use super::jsonrpc::{self, RpcError};
use super::stdio::read_line;
use super::{is_modern, MAX_MESSAGE, META_VERSION};
use serde_json::Value;
use std::io::{BufReader, Read, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The API key: the first line of `file` (`--key-file`), else
/// `AGENT_SANDBOX_API_KEY`, else the first line of the file named by
/// `AGENT_SANDBOX_KEY_FILE` (agent configs set one of the two variables).
pub fn key_from(file: Option<&Path>) -> Result<Option<String>, String> {
    let read = |f: &Path| -> Result<Option<String>, String> {
        let s = std::fs::read_to_string(f)
            .map_err(|e| format!("read key file {}: {e}", f.display()))?;
        let k = s.lines().next().unwrap_or("").trim().to_string();
        if k.is_empty() {
            return Err(format!("key file {} is empty", f.display()));
        }
        Ok(Some(k))
    };
    if let Some(f) = file {
        return read(f);
    }
    if let Some(k) = std::env::var("AGENT_SANDBOX_API_KEY")
        .ok()
        .map(|k| k.trim().to_string())
        .filter(|k| !k.is_empty())
    {
        return Ok(Some(k));
    }
    match std::env::var_os("AGENT_SANDBOX_KEY_FILE").filter(|f| !f.is_empty()) {
        Some(f) => read(Path::new(&f)),
        None => Ok(None),
    }
}

/// `http://host:port` → `http://host:port/mcp`; a URL with a path is kept.
pub fn endpoint(url: &str) -> Result<String, String> {
    let rest = url.strip_prefix("http://").ok_or_else(|| {
        format!("--url {url:?}: only http:// is supported (use a loopback address)")
    })?;
    Ok(match rest.find('/') {
        None => format!("{url}/mcp"),
        Some(i) if &rest[i..] == "/" => format!("{}mcp", url),
        Some(_) => url.to_string(),
    })
}

type Out = Arc<Mutex<Box<dyn Write + Send>>>;

fn emit(out: &Out, v: &Value) {
    let mut line = serde_json::to_vec(v).unwrap_or_default();
    line.push(b'\n');
    let mut w = crate::sync::lock(out);
    let _ = w.write_all(&line).and_then(|_| w.flush());
}

struct State {
    url: String,
    key: Option<String>,
    agent: ureq::Agent,
    session: Mutex<Option<String>>,
    version: Mutex<Option<String>>,
    /// Sandboxes created under the stateless protocol (no MCP session to
    /// delete): destroyed when stdin closes.
    created: Mutex<std::collections::BTreeSet<String>>,
    cleaned: std::sync::atomic::AtomicBool,
}

impl State {
    fn post(&self, body: &[u8], msg: &Value) -> Result<ureq::http::Response<ureq::Body>, String> {
        let mut r = self
            .agent
            .post(&self.url)
            .header("Content-Type", "application/json")
            .header("Accept", "application/json, text/event-stream");
        if let Some(k) = &self.key {
            r = r.header("Authorization", &format!("Bearer {k}"));
        }
        let method = msg.get("method").and_then(Value::as_str).unwrap_or("");
        let meta_v = msg["params"]["_meta"][META_VERSION].as_str();
        match meta_v {
            Some(v) => {
                r = r
                    .header("MCP-Protocol-Version", v)
                    .header("Mcp-Method", method);
                if let Some(n) = msg["params"]["name"].as_str().filter(|_| is_modern(v)) {
                    if n.bytes().all(|b| b.is_ascii_graphic()) {
                        r = r.header("Mcp-Name", n);
                    }
                }
            }
            None => {
                if let Some(s) = crate::sync::lock(&self.session).as_deref() {
                    r = r.header("Mcp-Session-Id", s);
                }
                if let Some(v) = crate::sync::lock(&self.version).as_deref() {
                    r = r.header("MCP-Protocol-Version", v);
                }
            }
        }
        r.send(body).map_err(|e| format!("POST {}: {e}", self.url))
    }
}

/// Relays one answer: SSE events or a JSON body. Returns the last JSON
/// message seen (for `initialize`).
fn relay(
    resp: ureq::http::Response<ureq::Body>,
    id: Option<&Value>,
    out: &Out,
    seen: &dyn Fn(&Value),
) -> Option<Value> {
    let status = resp.status().as_u16();
    let ctype = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let reader = resp.into_body().into_reader();
    let mut last = None;
    if ctype.starts_with("text/event-stream") {
        let mut r = BufReader::new(reader);
        let mut data = String::new();
        loop {
            let line = match read_line(&mut r, MAX_MESSAGE * 2) {
                Ok(Some(Ok(l))) => String::from_utf8_lossy(&l).into_owned(),
                Ok(Some(Err(_))) => continue,
                _ => break,
            };
            if line.is_empty() {
                if !data.is_empty() {
                    if let Ok(v) = serde_json::from_str::<Value>(&data) {
                        seen(&v);
                        emit(out, &v);
                        last = Some(v);
                    }
                    data.clear();
                }
            } else if let Some(d) = line.strip_prefix("data:") {
                if !data.is_empty() {
                    data.push('\n');
                }
                data.push_str(d.strip_prefix(' ').unwrap_or(d));
            }
        }
        return last;
    }
    let mut body = Vec::new();
    let _ = reader.take(MAX_MESSAGE as u64 * 2).read_to_end(&mut body);
    if body.iter().all(u8::is_ascii_whitespace) {
        if status >= 400 {
            if let Some(id) = id {
                emit(
                    out,
                    &jsonrpc::error(
                        Some(id),
                        &RpcError::new(
                            jsonrpc::INTERNAL_ERROR,
                            format!("daemon answered HTTP {status}"),
                        ),
                    ),
                );
            }
        }
        return None;
    }
    match serde_json::from_slice::<Value>(&body) {
        Ok(v) if v.get("jsonrpc").is_some() => {
            // A transport error without our id (e.g. 401) still answers
            // the request that caused it.
            let mut v = v;
            if v.get("id").is_none() && v.get("error").is_some() {
                if let Some(id) = id {
                    v["id"] = id.clone();
                }
            }
            seen(&v);
            emit(out, &v);
            Some(v)
        }
        _ => {
            if let Some(id) = id {
                let text = String::from_utf8_lossy(&body)
                    .chars()
                    .take(500)
                    .collect::<String>();
                emit(
                    out,
                    &jsonrpc::error(
                        Some(id),
                        &RpcError::new(
                            jsonrpc::INTERNAL_ERROR,
                            format!("daemon answered HTTP {status}: {text}"),
                        ),
                    ),
                );
            }
            None
        }
    }
}

pub fn run<R: Read, W: Write + Send + 'static>(
    url: &str,
    key: Option<&str>,
    input: R,
    output: W,
) -> Result<(), String> {
    let url = endpoint(url)?;
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(Duration::from_secs(10)))
        .build()
        .into();
    let st = Arc::new(State {
        url: url.clone(),
        key: key.map(str::to_string),
        agent,
        session: Mutex::new(None),
        version: Mutex::new(None),
        created: Mutex::new(Default::default()),
        cleaned: Default::default(),
    });
    // SIGTERM/SIGINT (clients escalate to them when we are slow to exit)
    // clean up like EOF does.
    let st_sig = st.clone();
    let _ = std::thread::Builder::new()
        .name("mcp-signals".into())
        .spawn(move || {
            let sig = super::stdio::wait_signal();
            log::info!("mcp: signal {sig}: cleaning up");
            cleanup(&st_sig);
            std::process::exit(0);
        });
    let out: Out = Arc::new(Mutex::new(Box::new(output)));
    log::info!("mcp: forwarding stdio to {url}");
    let mut input = BufReader::new(input);
    loop {
        let line = match read_line(&mut input, MAX_MESSAGE) {
            Ok(Some(l)) => l,
            Ok(None) => break,
            Err(e) => return Err(format!("stdin: {e}")),
        };
        let Ok(line) = line else {
            emit(
                &out,
                &jsonrpc::error(
                    None,
                    &RpcError::invalid_request(format!(
                        "message exceeds the {MAX_MESSAGE}-byte limit"
                    )),
                ),
            );
            continue;
        };
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let msg: Value = match serde_json::from_slice(&line) {
            Ok(v) => v,
            Err(e) => {
                emit(
                    &out,
                    &jsonrpc::error(
                        None,
                        &RpcError::new(jsonrpc::PARSE_ERROR, format!("parse error: {e}")),
                    ),
                );
                continue;
            }
        };
        let id = msg.get("id").cloned().filter(|i| !i.is_null());
        let method = msg
            .get("method")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        // initialize and notifications go in order on this thread: later
        // messages need the session id, and a cancellation must follow
        // the request it names.
        if method == "initialize" || id.is_none() {
            match st.post(&line, &msg) {
                Ok(resp) => {
                    if let Some(s) = resp
                        .headers()
                        .get("mcp-session-id")
                        .and_then(|v| v.to_str().ok())
                    {
                        *crate::sync::lock(&st.session) = Some(s.to_string());
                    }
                    if let Some(v) = relay(resp, id.as_ref(), &out, &|_| {}) {
                        if let Some(pv) = v["result"]["protocolVersion"].as_str() {
                            *crate::sync::lock(&st.version) = Some(pv.to_string());
                        }
                    }
                }
                Err(e) => {
                    log::error!("mcp: {e}");
                    if let Some(id) = &id {
                        emit(
                            &out,
                            &jsonrpc::error(Some(id), &RpcError::new(jsonrpc::INTERNAL_ERROR, e)),
                        );
                    }
                }
            }
            continue;
        }
        let (st2, out2) = (st.clone(), out.clone());
        let spawned = std::thread::Builder::new()
            .name("mcp-forward".into())
            .spawn(move || match st2.post(&line, &msg) {
                Ok(resp) => {
                    let tool = msg["params"]["name"].as_str().unwrap_or("");
                    let stateless = msg["params"]["_meta"][META_VERSION].is_string()
                        && matches!(
                            tool,
                            "create_session" | "execute" | "reset_session" | "fork_session"
                        );
                    // Recorded before the answer reaches the client, which
                    // may close stdin as soon as it has it. A fork's copies
                    // (and a create's with `count`) are its `sessions`.
                    let seen = |v: &Value| {
                        if !stateless {
                            return;
                        }
                        let out = &v["result"]["structuredContent"];
                        let copies = out["sessions"].as_array().into_iter().flatten();
                        let ids = std::iter::once(&out["sessionId"])
                            .chain(copies.map(|c| &c["sessionId"]))
                            .filter_map(Value::as_str);
                        let mut created = crate::sync::lock(&st2.created);
                        for sid in ids {
                            created.insert(sid.to_string());
                        }
                    };
                    relay(resp, id.as_ref(), &out2, &seen);
                }
                Err(e) => {
                    log::error!("mcp: {e}");
                    if let Some(id) = &id {
                        emit(
                            &out2,
                            &jsonrpc::error(Some(id), &RpcError::new(jsonrpc::INTERNAL_ERROR, e)),
                        );
                    }
                }
            });
        if let Err(e) = spawned {
            log::error!("mcp: cannot start a forwarding thread: {e}");
        }
    }
    cleanup(&st);
    Ok(())
}

/// Destroys what stateless calls created and ends the MCP session (which
/// cancels its calls and destroys its sandboxes). Runs once.
fn cleanup(st: &State) {
    if st.cleaned.swap(true, std::sync::atomic::Ordering::AcqRel) {
        return;
    }
    let created: Vec<String> = std::mem::take(&mut *crate::sync::lock(&st.created))
        .into_iter()
        .collect();
    for (i, sid) in created.iter().enumerate() {
        let msg = serde_json::json!({"jsonrpc": "2.0", "id": format!("forward-cleanup-{i}"),
            "method": "tools/call", "params": {"name": "destroy_session", "arguments": {"sessionId": sid},
            "_meta": {META_VERSION: super::V2026_07_28, "io.modelcontextprotocol/clientCapabilities": {}}}});
        let body = serde_json::to_vec(&msg).unwrap_or_default();
        match st.post(&body, &msg) {
            Ok(r) => {
                let _ = r.into_body().into_reader().read_to_end(&mut Vec::new());
            }
            Err(e) => log::warn!("mcp: destroy {sid}: {e}"),
        }
    }
    let sid = crate::sync::lock(&st.session).clone();
    if let Some(sid) = sid {
        let mut r = st.agent.delete(&st.url).header("Mcp-Session-Id", &sid);
        if let Some(k) = &st.key {
            r = r.header("Authorization", &format!("Bearer {k}"));
        }
        if let Err(e) = r.call() {
            log::warn!("mcp: DELETE session: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            endpoint("http://127.0.0.1:3000").unwrap(),
            "http://127.0.0.1:3000/mcp"
        );
        assert_eq!(
            endpoint("http://127.0.0.1:3000/").unwrap(),
            "http://127.0.0.1:3000/mcp"
        );
        assert_eq!(endpoint("http://h:1/x/mcp").unwrap(), "http://h:1/x/mcp");
        assert!(endpoint("https://h").is_err());
    }
}
