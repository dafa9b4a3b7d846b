//! Processes over WebSocket (issue #26): a live terminal for browsers and
//! agents.
//!
//! - `GET /v1/sessions/:id/processes/:proc/ws` attaches to a process
//!   (`replay`, `encoding` as the output stream); the socket closing
//!   detaches, as an HTTP attach does.
//! - `GET /v1/sessions/:id/pty/ws?rows&cols&cwd&command&timeout` starts a
//!   PTY shell (`command`, default a login shell) in the foreground: the
//!   socket closing kills it, as a client leaving an HTTP exec stream does.
//! - `POST /v1/sessions/:id/ws-token` gives a one-connection ticket for
//!   browsers, which cannot set `Authorization` on a WebSocket: `?token=`.
//!
//! Server to client: text frames, each one of the objects the NDJSON
//! output stream sends (`started`, `stream`, `dropped`, `result` last,
//! `error`), then a close (1000). Client to server: binary frames are
//! stdin bytes; text frames are JSON `{"type": "stdin", "data"}`,
//! `{"type": "eof"}`, `{"type": "resize", "rows", "cols"}`,
//! `{"type": "signal", "signal"}`. A bad message gets an `error` object
//! and changes nothing.

use super::auth::Principal;
use super::errors::{ApiError, ApiResult};
use super::exec;
use super::http::{Params, Reply};
use super::v1::own_session;
use super::Ctx;
use crate::ops::exec::{ExecSpec, Input, Running};
use crate::ops::{procs, Session};
use crate::proto::{PtySize, Signal};
use crate::server::http::Shape;
use crate::server::ws::{self, Message, Reader, Writer};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

fn upgrade_key(req: &super::httpd::Request) -> ApiResult<String> {
    ws::check_upgrade(req).map_err(ApiError::bad_request)
}

fn size_param(params: &Params, name: &str, default: u16) -> ApiResult<u16> {
    match params.query(name) {
        None => Ok(default),
        Some(v) => v
            .parse::<u16>()
            .map_err(|_| ApiError::bad_request(format!("{name} {v:?}: want 1..=65535"))),
    }
}

/// `POST /v1/sessions/:id/ws-token`.
pub fn token(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let s = own_session(ctx, p, params)?;
    let t = ctx.ops.ws_ticket(p, &s)?;
    Ok(Reply::Json(
        201,
        json!({"token": t.token, "expiresAt": t.expires_at,
               "ttl": crate::ops::tickets::TTL.as_secs()}),
    ))
}

/// `GET /v1/sessions/:id/processes/:proc/ws`.
pub fn attach(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let key = upgrade_key(req)?;
    let proc = procs::proc_id(params.get("proc"))?;
    let replay = params.flag("replay", true)?;
    let enc = crate::ops::exec::encoding(params.query("encoding"))?;
    let s = own_session(ctx, p, params)?;
    let activity = s.activity();
    // Refused before the upgrade: an unknown process is a plain 404.
    let pty = ctx.ops.proc_info(&s, proc)?.pty;
    let running = ctx.ops.attach(&s, proc, true, replay)?;
    drop(activity);
    let ctx = ctx.clone();
    let t = Target {
        proc: Some(proc),
        pty,
    };
    Ok(Reply::Upgrade {
        accept: key,
        job: Box::new(move |r, w| serve(&ctx, &s, t, running, enc, None, r, w)),
    })
}

/// `GET /v1/sessions/:id/pty/ws`.
pub fn pty(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let key = upgrade_key(req)?;
    let rows = size_param(params, "rows", 24)?;
    let cols = size_param(params, "cols", 80)?;
    procs::check_size(rows, cols)?;
    let timeout = match params.query("timeout") {
        None => ctx.cfg.max_exec_timeout.as_millis() as u64,
        Some(v) => v
            .parse()
            .map_err(|_| ApiError::bad_request(format!("timeout {v:?}: milliseconds")))?,
    };
    let spec = ExecSpec {
        command: Some(
            params
                .query("command")
                .unwrap_or("if command -v bash >/dev/null; then exec bash -l; else exec sh -l; fi")
                .to_string(),
        ),
        cwd: params.query("cwd").map(str::to_string),
        pty: Some(PtySize { rows, cols }),
        timeout: Some(timeout),
        encoding: params.query("encoding").map(str::to_string),
        ..ExecSpec::default()
    };
    let mut prepared = spec.prepare(&ctx.cfg)?;
    // Its process id, for resizes and signals.
    prepared.req.notify_start = true;
    let enc = prepared.encoding;
    let t = prepared.timeout;
    let s = own_session(ctx, p, params)?;
    let started = ctx.ops.exec_in(&s, prepared)?;
    let ctx = ctx.clone();
    Ok(Reply::Upgrade {
        accept: key,
        job: Box::new(move |r, w| {
            let target = Target {
                proc: None,
                pty: true,
            };
            serve(&ctx, &s, target, started.running, enc, Some(t), r, w)
        }),
    })
}

/// A client's control message.
#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "camelCase", deny_unknown_fields)]
enum Control {
    Stdin { data: String },
    Eof,
    Resize { rows: u16, cols: u16 },
    Signal { signal: Signal },
}

/// The process a socket serves: its id (once started) and whether it has
/// a PTY (its input is audited as keystrokes then).
struct Target {
    proc: Option<u64>,
    pty: bool,
}

/// Relays `running` to the socket on this thread; the client's messages
/// are read on another. Whichever side ends first ends the other.
#[allow(clippy::too_many_arguments)]
fn serve(
    ctx: &Arc<Ctx>,
    s: &Arc<Session>,
    target: Target,
    running: Running,
    enc: crate::ops::exec::Encoding,
    timeout: Option<Duration>,
    reader: Reader,
    w: Writer,
) {
    w.set_write_timeout(ctx.cfg.write_timeout);
    let input = running.input();
    let pty = target.pty;
    let proc = Arc::new(std::sync::Mutex::new(target.proc));
    let (ctx2, s2, w2, proc2) = (ctx.clone(), s.clone(), w.clone(), proc.clone());
    let spawned = std::thread::Builder::new()
        .name("ws-input".into())
        .stack_size(256 * 1024)
        .spawn(move || read_input(&ctx2, &s2, &proc2, pty, input, reader, &w2));
    if let Err(e) = spawned {
        log::error!("session {}: cannot start a websocket reader: {e}", s.id);
        w.close(1011, "no reader thread");
        w.shutdown();
        return;
    }
    let sink_w = w.clone();
    let mut emit = |v: &Value| {
        if v["type"] == "started" {
            if let Some(id) = v["procId"].as_u64() {
                *crate::sync::lock(&proc) = Some(id);
            }
        }
        let line = serde_json::to_string(v).unwrap_or_default();
        sink_w.text(&line).is_ok()
    };
    exec::relay_to(ctx, running, &mut emit, Shape::Nested, enc, timeout);
    // The end (the result was the last message), or the client is gone.
    w.close(1000, "");
    w.shutdown();
}

fn read_input(
    ctx: &Ctx,
    s: &Arc<Session>,
    proc: &std::sync::Mutex<Option<u64>>,
    pty: bool,
    input: Input,
    mut reader: Reader,
    w: &Writer,
) {
    // Input is recorded as the stdin op records it (keystrokes of a PTY).
    let audited = |data: &[u8], eof: bool| {
        if let Some(p) = *crate::sync::lock(proc) {
            ctx.ops.record_input(s, p, pty, data, eof);
        }
    };
    let refuse = |e: ApiError| {
        let mut v = e.body_as(Shape::Nested);
        v["type"] = json!("error");
        let _ = w.text(&v.to_string());
    };
    loop {
        let msg = match reader.recv() {
            Ok(m) => m,
            Err(_) => Message::Close,
        };
        let r: Result<(), ApiError> = match msg {
            Message::Close => {
                // The client left: a foreground command dies with it, an
                // attach detaches; the relay sees the end.
                input.cancel();
                return;
            }
            Message::Binary(b) => {
                audited(&b, false);
                input.send(&b).map_err(ApiError::from)
            }
            Message::Text(t) => match serde_json::from_str::<Control>(&t) {
                Err(e) => Err(ApiError::bad_request(format!(
                    "a message is JSON {{\"type\": \"stdin\"|\"eof\"|\"resize\"|\"signal\", ...}}: {e}"
                ))),
                Ok(Control::Stdin { data }) => {
                    audited(data.as_bytes(), false);
                    input.send(data.as_bytes()).map_err(ApiError::from)
                }
                Ok(Control::Eof) => {
                    audited(&[], true);
                    input.eof().map_err(ApiError::from)
                }
                Ok(Control::Resize { rows, cols }) => match *crate::sync::lock(proc) {
                    None => Err(ApiError::new(409, "conflict", "the process has not started yet")),
                    Some(p) => ctx
                        .ops
                        .resize(s, p, rows, cols)
                        .map_err(ApiError::from),
                },
                Ok(Control::Signal { signal }) => match *crate::sync::lock(proc) {
                    None => Err(ApiError::new(409, "conflict", "the process has not started yet")),
                    Some(p) => ctx.ops.signal(s, p, signal).map_err(ApiError::from),
                },
            },
        };
        if let Err(e) = r {
            refuse(e);
        }
    }
}
