//! Seed-compatible routes (`/exec/...`), health, metrics and admin keys.

use super::auth::{KeyRecord, Principal};
use super::errors::{ApiError, ApiResult};
use super::exec::{self, StreamFormat};
use super::http::{header, json_body, ok_json, Params, Reply};
use super::{validate, Ctx};
use crate::budget::Lease;
use crate::ops::keys;
use crate::ops::{files, SessionView};
use crate::ops::{Session, State};
use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// `GET /health`: the seed's `{status: "ok", uptime}` (uptime in
/// seconds), and ours beside it.
pub fn health(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    _: &Principal,
    _: &Params,
) -> ApiResult<Reply> {
    let up = ctx.started.elapsed();
    ok_json(json!({
        "status": "ok",
        "uptime": up.as_millis() as f64 / 1000.0,
        "version": env!("CARGO_PKG_VERSION"),
        "backend": ctx.ops.mgr.factory.backend(),
        "uptimeSeconds": up.as_secs(),
        "sessions": ctx.ops.mgr.count(),
        "host": crate::router::host(),
        "drain": ctx.ops.drain_state().state,
    }))
}

/// Set once the daemon can no longer start sandboxes (its spawner died);
/// `/ready` reports it until the daemon exits.
pub static NOT_READY: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// `GET /ready`: `{status: "ready" | "not_ready", checks}`, 200 or 503.
/// Ready when every check holds: `accepting` (not shutting down), `vmm`
/// (sandboxes can still be started), `images` (a template to start from),
/// `capacity` (a session can still be created), `serving` (not set to
/// drain: issue #28).
pub fn ready(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    _: &Principal,
    _: &Params,
) -> ApiResult<Reply> {
    let sessions = ctx.ops.mgr.count();
    // Paused sessions hold no sandbox and do not count against the
    // maximum (as admission counts): a host full of them takes creates.
    let running = ctx.ops.mgr.running_count();
    let max = ctx.cfg.max_sessions;
    let drain = ctx.ops.drain_state();
    let checks = [
        (
            "accepting",
            !(ctx.is_closing() || ctx.ops.mgr.is_closing()),
            "shutting down".to_string(),
        ),
        (
            "vmm",
            NOT_READY.get().is_none(),
            NOT_READY.get().cloned().unwrap_or_default(),
        ),
        (
            "images",
            !ctx.ops.mgr.factory.templates().is_empty(),
            "no templates available".to_string(),
        ),
        (
            "capacity",
            running < max,
            format!("at capacity ({running} of {max} sessions running)"),
        ),
        (
            "serving",
            !drain.draining,
            format!("{} ({sessions} sessions left)", drain.state),
        ),
    ];
    let failed: Vec<&str> = checks
        .iter()
        .filter(|(_, ok, _)| !ok)
        .map(|(_, _, why)| why.as_str())
        .collect();
    let ok = failed.is_empty();
    let named: serde_json::Map<String, Value> = checks
        .iter()
        .map(|(name, ok, _)| (name.to_string(), json!(ok)))
        .collect();
    let mut v = json!({
        "status": if ok { "ready" } else { "not_ready" },
        "checks": named,
        "ready": ok,
        "sessions": sessions,
        "maxSessions": max,
        "host": crate::router::host(),
        "drain": drain.state,
    });
    if !ok {
        v["reason"] = json!(failed.join("; "));
    }
    Ok(Reply::Json(if ok { 200 } else { 503 }, v))
}

pub fn metrics(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    _: &Principal,
    _: &Params,
) -> ApiResult<Reply> {
    Ok(Reply::Bytes(
        200,
        "application/openmetrics-text; version=1.0.0; charset=utf-8".into(),
        ctx.metrics.render().into_bytes(),
    ))
}

pub fn templates(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    _: &Principal,
    _: &Params,
) -> ApiResult<Reply> {
    ok_json(json!({"templates": ctx.ops.mgr.templates()}))
}

/// The sessions a caller sees (an admin key: all), each as `view` shows it.
pub fn sessions_json(ctx: &Ctx, p: &Principal, view: impl Fn(&SessionView) -> Value) -> Reply {
    let sessions: Vec<Value> = ctx.ops.list(p, true).iter().map(view).collect();
    Reply::Json(200, json!({"sessions": sessions}))
}

/// A session as the seed lists it: `state` is `creating`, `active` or
/// `destroying`, `lastActivityAt`, `ownerId` and `templateName` beside our
/// own fields (times in ms since the epoch).
pub fn seed_session(s: &SessionView) -> Value {
    let mut v = s.json();
    let state = match s.phase {
        State::Starting => "creating",
        // The seed knows no paused state; its next exec resumes it.
        State::Ready | State::Paused => "active",
        // A failed session is on its way out.
        State::Failed(_) | State::Closing => "destroying",
    };
    v["state"] = json!(state);
    v["lastActivityAt"] = v["lastUsedAt"].clone();
    v["ownerId"] = json!(s.owner);
    v["templateName"] = json!(s.template);
    v
}

pub fn list_sessions(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    _: &Params,
) -> ApiResult<Reply> {
    Ok(sessions_json(ctx, p, seed_session))
}

/// The caller's session `id`, created on first use when `create` is set.
pub fn session(
    ctx: &Arc<Ctx>,
    p: &Principal,
    id: &str,
    create: Option<Option<String>>,
) -> ApiResult<Arc<Session>> {
    Ok(match create {
        Some(template) => ctx.ops.open(p, id, template)?.0,
        None => ctx.ops.session(&p.id, id)?,
    })
}

/// Streaming requested by `Accept` or `?format=`.
pub fn stream_format(
    req: &super::httpd::Request,
    params: &Params,
) -> ApiResult<Option<StreamFormat>> {
    match params.query("format") {
        Some("ndjson") => return Ok(Some(StreamFormat::Ndjson)),
        Some("sse") => return Ok(Some(StreamFormat::Sse)),
        Some("json") => return Ok(None),
        Some(f) => {
            return Err(ApiError::bad_request(format!(
                "format={f:?}: want json, ndjson or sse"
            )))
        }
        None => {}
    }
    let accept = header(req, "accept").unwrap_or("").to_ascii_lowercase();
    Ok(if accept.contains("application/x-ndjson") {
        Some(StreamFormat::Ndjson)
    } else if accept.contains("text/event-stream") {
        Some(StreamFormat::Sse)
    } else {
        None
    })
}

/// Runs a validated command in `session`.
pub fn run_exec(
    ctx: &Arc<Ctx>,
    fmt: Option<StreamFormat>,
    prepared: crate::ops::exec::Prepared,
    session: Arc<Session>,
) -> ApiResult<Reply> {
    let started = ctx.ops.exec_in(&session, prepared)?;
    Ok(stream_or_buffer(ctx, fmt, started))
}

/// A started command's answer: buffered JSON, or a live stream in `fmt`.
pub fn stream_or_buffer(
    ctx: &Arc<Ctx>,
    fmt: Option<StreamFormat>,
    started: crate::ops::exec::Started,
) -> Reply {
    let ctx = ctx.clone();
    match fmt {
        None => Reply::Later(Box::new(move || exec::buffered(ctx, started))),
        Some(fmt) => Reply::Stream {
            content_type: fmt.content_type(),
            headers: Vec::new(),
            job: Box::new(move |w| {
                let timeout = (!started.background).then_some(started.timeout);
                exec::relay(&ctx, started.running, w, fmt, started.encoding, timeout)
            }),
        },
    }
}

pub fn execute(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let mut body: crate::ops::exec::ExecSpec = json_body(req, ctx.cfg.max_body)?;
    // The seed routes stay as they were: `secrets` is a /v1 (and MCP)
    // field, ignored here like any other unknown one.
    body.secrets = None;
    if body.background.unwrap_or(false) || body.pty.is_some() {
        return Err(ApiError::bad_request(
            "background and pty are /v1 features (POST /v1/sessions/{id}/exec)",
        ));
    }
    // Validate everything before a session is created for it.
    validate::session_id(params.get("session"))?;
    let fmt = stream_format(req, params)?;
    let template = body.template.clone();
    let prepared = body.prepare(&ctx.cfg)?;
    let session = session(ctx, p, params.get("session"), Some(template))?;
    run_exec(ctx, fmt, prepared, session)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WriteBody {
    path: String,
    content: String,
    encoding: Option<String>,
    mode: Option<u32>,
}

pub fn write(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let max = ctx.cfg.max_file.max(ctx.cfg.max_body);
    let body: WriteBody = json_body(req, max)?;
    validate::path(&body.path, "path")?;
    let data = match exec::encoding(body.encoding.as_deref())? {
        exec::Encoding::Utf8 => body.content.into_bytes(),
        exec::Encoding::Base64 => base64::engine::general_purpose::STANDARD
            .decode(body.content.as_bytes())
            .map_err(|e| ApiError::bad_request(format!("content is not base64: {e}")))?,
    };
    if body.mode.is_some_and(|m| m > 0o7777) {
        return Err(ApiError::bad_request("mode must be at most 0o7777"));
    }
    let session = session(ctx, p, params.get("session"), Some(None))?;
    let activity = session.activity();
    let path = body.path;
    let mode = body.mode;
    let wait = ctx.cfg.create_timeout;
    Ok(Reply::Later(Box::new(move || {
        let _a = activity;
        match files::write(&session, &path, &data, mode, wait) {
            Ok(n) => Reply::Json(
                200,
                json!({"bytesWritten": n, "success": true, "path": path, "bytes": n}),
            ),
            Err(e) => ApiError::from(e).into(),
        }
    })))
}

pub fn read(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let path = params
        .query("path")
        .ok_or_else(|| ApiError::bad_request("query parameter path is required"))?
        .to_string();
    validate::path(&path, "path")?;
    let want_b64 = exec::encoding(params.query("encoding"))? == exec::Encoding::Base64;
    let session = session(ctx, p, params.get("session"), None)?;
    // Before the request waits for anything: a full budget is a 503 with
    // Retry-After now, not a failure half-way.
    let mut lease = ctx.ops.reply_lease()?;
    let activity = session.activity();
    let max = ctx.cfg.max_file as u64;
    let max_reply = ctx.cfg.max_json_reply();
    let wait = ctx.cfg.create_timeout;
    Ok(Reply::Later(Box::new(move || {
        let _a = activity;
        let r = files::read(&session, &mut lease, &path, max, wait)
            .map_err(ApiError::from)
            .and_then(|data| {
                let hint = format!(
                    "read it with ?encoding=base64, or as raw bytes from \
                 GET /v1/sessions/{}/files/content?path=...",
                    session.id
                );
                file_reply(&mut lease, &path, data, want_b64, max_reply, &hint)
            });
        r.unwrap_or_else(Reply::from)
    })))
}

/// [`files::content`] as a JSON reply, sized before it is built
/// ([`super::http::json_reply`]): text that escapes past `max_reply` is refused
/// with 413 and `hint`.
fn file_reply(
    lease: &mut Lease,
    path: &str,
    data: Vec<u8>,
    want_b64: bool,
    max_reply: usize,
    hint: &str,
) -> ApiResult<Reply> {
    let out = files::content(lease, path, data, want_b64)?;
    super::http::json_reply(lease, 200, &out, max_reply, hint)
}

pub fn files(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let path = params.query("path").unwrap_or(".").to_string();
    validate::path(&path, "path")?;
    let recursive = params.flag("recursive", false)?;
    let session = session(ctx, p, params.get("session"), None)?;
    let lease = ctx.ops.reply_lease()?;
    let activity = session.activity();
    let wait = ctx.cfg.create_timeout;
    let max_reply = ctx.cfg.max_json_reply();
    Ok(Reply::Later(Box::new(move || {
        let _a = activity;
        list_reply(
            &session,
            lease,
            &path,
            recursive,
            wait,
            max_reply,
            files::SEED_DIR,
        )
    })))
}

/// A listing as a JSON reply (both APIs serve the same shape but for what
/// they call a directory, `dir`).
pub fn list_reply(
    session: &Session,
    mut lease: Lease,
    path: &str,
    recursive: bool,
    wait: std::time::Duration,
    max_reply: usize,
    dir: &'static str,
) -> Reply {
    files::list(session, &mut lease, path, recursive, wait)
        .map_err(ApiError::from)
        .and_then(|mut l| {
            if dir != files::V1_DIR {
                for f in l.files.iter_mut().filter(|f| f.file_type == files::V1_DIR) {
                    f.file_type = dir;
                }
            }
            super::http::json_reply(
                &mut lease,
                200,
                &l,
                max_reply,
                "list a subdirectory, or without recursive",
            )
        })
        .unwrap_or_else(Reply::from)
}

pub fn delete_session(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let id = params.get("session");
    validate::session_id(id)?;
    let owner = ctx.ops.owner_for(p, params.query("owner"))?;
    // As the seed: 200 either way, `destroyed` says whether there was one.
    let gone = |id: &str| {
        Reply::Json(
            200,
            json!({"destroyed": false, "success": false, "sessionId": id}),
        )
    };
    if ctx.ops.session(&owner, id).is_err() {
        return Ok(gone(id));
    }
    // Destroying a VM can take a moment: not on an API worker thread.
    let ops = ctx.ops.clone();
    let id = id.to_string();
    Ok(Reply::Later(Box::new(move || {
        if ops.delete(&owner, &id, "deleted by request") {
            Reply::Json(
                200,
                json!({"destroyed": true, "success": true, "sessionId": id}),
            )
        } else {
            gone(&id)
        }
    })))
}

// ---- admin keys -----------------------------------------------------------

/// `{record, ...record}`: the seed reads `record`; our earlier clients
/// read the same fields at the top level.
fn with_record(ctx: &Ctx, rec: &KeyRecord, extra: Value) -> Value {
    let public = rec.public(keys::rate_defaults(&ctx.cfg));
    let mut v = public.clone();
    v["record"] = public;
    if let (Some(v), Value::Object(extra)) = (v.as_object_mut(), extra) {
        v.extend(extra);
    }
    v
}

pub fn list_keys(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    _: &Principal,
    _: &Params,
) -> ApiResult<Reply> {
    let d = keys::rate_defaults(&ctx.cfg);
    let list: Vec<Value> = keys::list(&ctx.auth.keys)
        .iter()
        .map(|k| k.public(d))
        .collect();
    ok_json(json!({"keys": list}))
}

/// `rateLimit` as an object.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RateLimitIn {
    requests_per_second: Option<f64>,
    burst: Option<f64>,
}

/// `rateLimit`: `{requestsPerSecond?, burst?}`, or a bare number of
/// requests per second; as (rate, burst).
fn rate_limit(v: Value) -> ApiResult<(Option<f64>, Option<f64>)> {
    match v {
        Value::Null => Ok((None, None)),
        Value::Number(n) => Ok((n.as_f64(), None)),
        v @ Value::Object(_) => {
            let r: RateLimitIn = serde_json::from_value(v)
                .map_err(|e| ApiError::bad_request(format!("rateLimit: {e}")))?;
            Ok((r.requests_per_second, r.burst))
        }
        other => Err(ApiError::bad_request(format!(
            "rateLimit: want a number (requests per second) or {{requestsPerSecond, burst}}, \
             not {other}"
        ))),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct CreateKey {
    /// Required, as in the seed's `{name, scopes?, ...}`: an empty body
    /// makes no key.
    name: String,
    /// Default: `["exec"]`.
    scopes: Option<Vec<String>>,
    rate_limit: Option<Value>,
    /// Ms since the epoch; null or absent: never.
    expires_at: Option<u64>,
    rate: Option<f64>,
    burst: Option<f64>,
}

pub fn create_key(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    _: &Principal,
    _: &Params,
) -> ApiResult<Reply> {
    let body: CreateKey = json_body(req, ctx.cfg.max_body)?;
    let scopes = keys::scopes(body.scopes)?;
    let (rate, burst) = match body.rate_limit {
        None => (body.rate, body.burst),
        Some(_) if body.rate.is_some() || body.burst.is_some() => {
            return Err(ApiError::bad_request(
                "give rateLimit or rate/burst, not both",
            ))
        }
        Some(v) => rate_limit(v)?,
    };
    let new = keys::NewKey {
        name: body.name,
        scopes,
        rate,
        burst,
        expires_at: body.expires_at,
    };
    let k = keys::create(&ctx.auth.keys, new)?;
    Ok(Reply::Json(
        201,
        with_record(ctx, &k.record, json!({"key": k.token})),
    ))
}

pub fn revoke_key(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    _: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let rec = keys::revoke(&ctx.auth.keys, &ctx.ops, params.get("key"))?;
    ok_json(with_record(ctx, &rec, json!({"revoked": true})))
}

pub fn rotate_key(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    _: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let k = keys::rotate(&ctx.auth.keys, params.get("key"))?;
    ok_json(with_record(ctx, &k.record, json!({"key": k.token})))
}

pub fn delete_key(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    _: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let id = params.get("key");
    keys::delete(&ctx.auth.keys, &ctx.ops, id)?;
    ok_json(json!({"deleted": true, "id": id}))
}
