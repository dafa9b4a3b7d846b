//! `/v1`: explicit sessions, streaming exec, background processes, PTY and
//! binary file transfer.

use super::auth::Principal;
use super::errors::{ApiError, ApiResult};
use super::exec;
use super::http::{json_body, ok_json, read_body, Params, Reply};
use super::rest::{self, stream_format};
use super::{validate, Ctx};
use crate::ops::network::NetworkView;
use crate::ops::sessions::Span;
use crate::ops::{
    files, procs, Ops, OpsError, OpsResult, Session, SessionSpec, SessionView, SnapshotView,
};
use crate::ops::{EgressPolicy, SecretSpec};
use crate::proto::Signal;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::Read;
use std::sync::Arc;

pub(super) fn own_session(
    ctx: &Arc<Ctx>,
    p: &Principal,
    params: &Params,
) -> ApiResult<Arc<Session>> {
    Ok(ctx
        .ops
        .find(p, params.query("owner"), params.get("session"))?)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CreateBody {
    id: Option<String>,
    template: Option<String>,
    #[serde(default, deserialize_with = "validate::opt_int")]
    vcpus: Option<u32>,
    #[serde(default, deserialize_with = "validate::opt_int")]
    memory_mib: Option<u32>,
    #[serde(default, deserialize_with = "validate::opt_int")]
    disk_mib: Option<u32>,
    /// Maximum lifetime (seconds or `2h`).
    ttl: Option<Span>,
    idle_timeout: Option<Span>,
    env: Option<BTreeMap<String, String>>,
    egress: Option<EgressPolicy>,
    /// `destroy` or `pause` (read here, so the 400 names the field).
    on_idle: Option<String>,
    paused_ttl: Option<Span>,
    /// Start from this checkpoint (issue #21).
    from_snapshot: Option<String>,
    /// Sessions to start (the answer is then a list).
    #[serde(default, deserialize_with = "validate::opt_int")]
    count: Option<i64>,
    /// Credentials the egress proxy injects (issue #25).
    secrets: Option<Vec<SecretSpec>>,
}

pub fn create_session(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    _: &Params,
) -> ApiResult<Reply> {
    let b: CreateBody = json_body(req, ctx.cfg.max_body)?;
    if let Some(sid) = &b.from_snapshot {
        validate::snapshot_id(sid, "fromSnapshot")?;
    }
    let count = b.count.map(|n| validate::count(n, "count")).transpose()?;
    let spec = SessionSpec {
        id: b.id,
        template: b.template,
        vcpus: b.vcpus,
        memory_mib: b.memory_mib,
        disk_mib: b.disk_mib,
        ttl: b.ttl,
        idle_timeout: b.idle_timeout,
        env: b.env.unwrap_or_default(),
        egress: b.egress,
        on_idle: b.on_idle.as_deref().map(validate::on_idle).transpose()?,
        paused_ttl: b.paused_ttl,
        from_snapshot: b.from_snapshot,
        count,
        secrets: b.secrets.unwrap_or_default(),
    };
    let ops = ctx.ops.clone();
    if count.is_none() && spec.from_snapshot.is_none() {
        let session = ctx.ops.create(p, spec)?;
        // Answer once the sandbox is up, so start failures are reported here.
        return Ok(Reply::Later(Box::new(move || match ops.ready(&session) {
            Ok(()) => Reply::Json(201, SessionView::of(&session).json()),
            Err(e) => ApiError::from(e).into(),
        })));
    }
    let sessions = ctx.ops.create_many(p, spec)?;
    Ok(later_json(201, move || {
        let list = ready_list(&ops, &sessions)?;
        if count.is_some() {
            return Ok(json!({ "sessions": list }));
        }
        // One session from a snapshot: answered as a create of one.
        list.into_iter()
            .next()
            .ok_or_else(|| ApiError::internal("no session was started"))
    }))
}

/// `{"sessions": [...]}` of copies started together, each waited for: a
/// session's view, or for one that failed to start (and was removed) its
/// id and error. Every one failed: that error (as a create of one).
fn ready_list(ops: &Ops, sessions: &[Arc<Session>]) -> ApiResult<Vec<Value>> {
    let each = ops.ready_each(sessions)?;
    Ok(sessions
        .iter()
        .zip(each)
        .map(|(s, r)| match r {
            Ok(()) => SessionView::of(s).json(),
            Err(e) => {
                let e = ApiError::from(e);
                json!({"id": s.id, "sessionId": s.id, "error": {"code": e.code, "message": e.message}})
            }
        })
        .collect())
}

/// Work for a long-request thread (a checkpoint, a fork, a start): `Ok`
/// answers `status` with the JSON.
fn later_json(status: u16, op: impl FnOnce() -> ApiResult<Value> + Send + 'static) -> Reply {
    Reply::Later(Box::new(move || match op() {
        Ok(v) => Reply::Json(status, v),
        Err(e) => e.into(),
    }))
}

pub fn list_sessions(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    _: &Params,
) -> ApiResult<Reply> {
    Ok(rest::sessions_json(ctx, p, SessionView::json))
}

pub fn get_session(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    ok_json(SessionView::of(&*own_session(ctx, p, params)?).json())
}

pub fn delete_session(
    ctx: &Arc<Ctx>,
    r: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    rest::delete_session(ctx, r, p, params)
}

pub fn keepalive(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let s = own_session(ctx, p, params)?;
    ok_json(ctx.ops.keepalive(&s).json())
}

/// The session's egress policy in force.
pub fn get_network(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    ok_json(NetworkView::of(&*own_session(ctx, p, params)?).json())
}

/// Replace the egress policy of a running session. Answers once the new
/// rules are installed and read back; on failure the old policy stays.
pub fn set_network(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let policy: EgressPolicy = json_body(req, ctx.cfg.max_body)?;
    crate::ops::validate::egress(&policy, &ctx.cfg)?;
    let s = own_session(ctx, p, params)?;
    let ops = ctx.ops.clone();
    Ok(Reply::Later(Box::new(move || {
        match ops.set_network(&s, policy) {
            Ok(v) => Reply::Json(200, v.json()),
            Err(e) => ApiError::from(e).into(),
        }
    })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PortBody {
    #[serde(deserialize_with = "validate::int")]
    port: i64,
    ttl: Option<Span>,
    public: Option<bool>,
}

/// Open a guest port to the outside: its preview URLs (issue #26).
pub fn expose_port(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let b: PortBody = json_body(req, ctx.cfg.max_body)?;
    let s = own_session(ctx, p, params)?;
    let port = u32::try_from(b.port)
        .map_err(|_| ApiError::bad_request(format!("port {}: 1 to 65535", b.port)))?;
    let ttl = b.ttl.map(|t| t.get("ttl")).transpose()?;
    let v = ctx
        .ops
        .expose_port(&s, port, ttl, b.public.unwrap_or(false))?;
    Ok(Reply::Json(201, v.json()))
}

pub fn list_ports(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let s = own_session(ctx, p, params)?;
    let list: Vec<Value> = ctx.ops.ports(&s).iter().map(|v| v.json()).collect();
    ok_json(json!({"sessionId": s.id, "ports": list}))
}

pub fn close_port(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let s = own_session(ctx, p, params)?;
    let raw = params.get("port");
    let port: u32 = raw
        .parse()
        .map_err(|_| ApiError::bad_request(format!("port {raw:?}: 1 to 65535")))?;
    if ctx.ops.close_port(&s, port)? {
        ok_json(json!({"sessionId": s.id, "port": port, "closed": true}))
    } else {
        Err(ApiError::new(
            404,
            "not_found",
            format!("port {port} of session {} is not open", s.id),
        ))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SecretsBody {
    secrets: Vec<SecretSpec>,
}

/// Replace the session's injected secrets (`{"secrets": []}`: none).
/// Answers once the proxy has them (a paused session: at its resume).
pub fn set_secrets(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let b: SecretsBody = json_body(req, ctx.cfg.max_body)?;
    let s = own_session(ctx, p, params)?;
    let ops = ctx.ops.clone();
    Ok(later_json(200, move || {
        let list = ops.set_secrets(&s, b.secrets)?;
        Ok(json!({"sessionId": s.id, "secrets": list}))
    }))
}

/// The session's injected secrets: names, hosts, placeholders (never a value).
pub fn get_secrets(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let s = own_session(ctx, p, params)?;
    ok_json(json!({"sessionId": s.id, "secrets": s.secrets_info()}))
}

pub fn exec(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let body: crate::ops::exec::ExecSpec = json_body(req, ctx.cfg.max_body)?;
    if body.template.is_some() {
        return Err(ApiError::bad_request(
            "template is chosen when the session is created (POST /v1/sessions)",
        ));
    }
    let fmt = stream_format(req, params)?;
    let prepared = body.prepare(&ctx.cfg)?;
    let started = ctx
        .ops
        .exec(p, params.query("owner"), params.get("session"), prepared)?;
    Ok(rest::stream_or_buffer(ctx, fmt, started))
}

/// `POST /v1/run`: one program in a fresh sandbox, destroyed after
/// (see [`crate::ops::run`]).
pub fn run(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    _: &Params,
) -> ApiResult<Reply> {
    // Read like a file upload: `code` has its own limit, named in the 400.
    let body = read_body(req, ctx.cfg.max_file.max(ctx.cfg.max_body))?;
    let v: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    let r = crate::ops::run::RunRequest::parse(&v, &ctx.cfg)?;
    let (ops, p, max) = (ctx.ops.clone(), p.clone(), ctx.cfg.max_output);
    Ok(Reply::Later(Box::new(move || {
        match ops.run(&p, r, max, &|| false) {
            Ok(r) => Reply::Json(200, r.json()),
            Err(e) => ApiError::from(e).into(),
        }
    })))
}

fn proc_id(params: &Params) -> ApiResult<u64> {
    Ok(procs::proc_id(params.get("proc"))?)
}

/// A process operation on a long-request thread; `f` makes the 200
/// answer's JSON.
fn later<T: 'static>(
    op: impl FnOnce() -> OpsResult<T> + Send + 'static,
    f: fn(T) -> Value,
) -> Reply {
    Reply::Later(Box::new(move || match op() {
        Ok(v) => Reply::Json(200, f(v)),
        // An answer that does not fit is shown, not refused (as always).
        Err(OpsError::UnexpectedAnswer(a)) => Reply::Json(200, json!({"unexpected": a})),
        Err(e) => ApiError::from(e).into(),
    }))
}

pub fn list_procs(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let s = own_session(ctx, p, params)?;
    let ops = ctx.ops.clone();
    Ok(later(
        move || ops.procs(&s),
        |l| json!({"processes": l.iter().map(procs::proc_json).collect::<Vec<_>>()}),
    ))
}

/// `GET .../processes/:proc`: one process, as the list shows it.
pub fn get_proc(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let proc = proc_id(params)?;
    let s = own_session(ctx, p, params)?;
    let ops = ctx.ops.clone();
    Ok(later(
        move || ops.proc_info(&s, proc),
        |i| procs::proc_json(&i),
    ))
}

/// `DELETE .../processes`: SIGKILL every process in the sandbox (every
/// exec and whatever it left running); files and the session stay.
pub fn kill_all(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let s = own_session(ctx, p, params)?;
    let ops = ctx.ops.clone();
    Ok(later(
        move || ops.kill_all(&s),
        |k| json!({"killed": k.processes, "remaining": k.remaining}),
    ))
}

pub fn attach(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let proc = proc_id(params)?;
    let replay = params.flag("replay", true)?;
    let enc = exec::encoding(params.query("encoding"))?;
    let fmt = stream_format(req, params)?.unwrap_or(exec::StreamFormat::Ndjson);
    let s = own_session(ctx, p, params)?;
    let activity = s.activity();
    // An unknown process is a 404 up front, not a stream that fails later.
    ctx.ops.proc_info(&s, proc)?;
    let running = ctx.ops.attach(&s, proc, false, replay)?;
    drop(activity);
    let ctx = ctx.clone();
    Ok(Reply::Stream {
        content_type: fmt.content_type(),
        headers: Vec::new(),
        job: Box::new(move |w| exec::relay(&ctx, running, w, fmt, enc, None)),
    })
}

pub fn stdin(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let proc = proc_id(params)?;
    let eof = params.flag("eof", false)?;
    let data = read_body(req, ctx.cfg.max_file)?;
    let s = own_session(ctx, p, params)?;
    let ops = ctx.ops.clone();
    Ok(Reply::Later(Box::new(move || {
        match ops.stdin(&s, proc, &data, eof) {
            Ok(()) => Reply::Json(200, json!({"bytes": data.len(), "eof": eof})),
            Err(e) => ApiError::from(e).into(),
        }
    })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SignalBody {
    /// Absent or null: SIGTERM.
    #[serde(default)]
    pub(crate) signal: Option<Signal>,
}

pub fn signal(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let proc = proc_id(params)?;
    let b: SignalBody = json_body(req, ctx.cfg.max_body)?;
    let sig = b.signal.unwrap_or(Signal::TERM);
    let s = own_session(ctx, p, params)?;
    let ops = ctx.ops.clone();
    Ok(later(
        move || ops.signal(&s, proc, sig),
        |()| json!({"success": true}),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResizeBody {
    #[serde(deserialize_with = "validate::int")]
    rows: u16,
    #[serde(deserialize_with = "validate::int")]
    cols: u16,
}

pub fn resize(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let proc = proc_id(params)?;
    let b: ResizeBody = json_body(req, ctx.cfg.max_body)?;
    procs::check_size(b.rows, b.cols)?;
    let s = own_session(ctx, p, params)?;
    let ops = ctx.ops.clone();
    Ok(later(
        move || ops.resize(&s, proc, b.rows, b.cols),
        |()| json!({"success": true}),
    ))
}

fn path_param(params: &Params, name: &str) -> ApiResult<String> {
    let p = params
        .query(name)
        .ok_or_else(|| ApiError::bad_request(format!("query parameter {name} is required")))?;
    validate::path(p, name)?;
    Ok(p.to_string())
}

pub fn download(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let path = path_param(params, "path")?;
    let s = own_session(ctx, p, params)?;
    let mut lease = ctx.ops.reply_lease()?;
    let max = ctx.cfg.max_file as u64;
    let wait = ctx.cfg.create_timeout;
    Ok(Reply::Later(Box::new(move || {
        let _a = s.activity();
        match files::read(&s, &mut lease, &path, max, wait) {
            Ok(data) => Reply::Bytes(200, "application/octet-stream".into(), data),
            Err(e) => ApiError::from(e).into(),
        }
    })))
}

pub fn upload(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let path = path_param(params, "path")?;
    let mode = match params.query("mode") {
        None => None,
        Some(m) => Some(
            u32::from_str_radix(m, 8)
                .ok()
                .filter(|&m| m <= 0o7777)
                .ok_or_else(|| ApiError::bad_request(format!("mode {m:?}: want octal like 644")))?,
        ),
    };
    let max = ctx.cfg.max_file;
    if req.body_length().is_some_and(|n| n > max) {
        return Err(ApiError::new(
            413,
            "body_too_large",
            format!("file exceeds {max} bytes"),
        ));
    }
    let s = own_session(ctx, p, params)?;
    let _a = s.activity();
    let file = files::create(&s, &path, mode, ctx.cfg.create_timeout)?;
    // Stream the body straight into the guest; the guest renames into place
    // only after EOF, so a failed upload leaves no half file.
    let mut body = req.as_reader().take(max as u64 + 1);
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0usize;
    loop {
        let n = body.read(&mut buf).map_err(super::http::body_error)?;
        if n == 0 {
            break;
        }
        total += n;
        if total > max {
            file.cancel();
            return Err(ApiError::new(
                413,
                "body_too_large",
                format!("file exceeds {max} bytes"),
            ));
        }
        file.send(&buf[..n])?;
    }
    let bytes = file.finish()?;
    Ok(Reply::Json(201, json!({"path": path, "bytes": bytes})))
}

/// A file operation on a long-request thread, the session in use
/// meanwhile; `Ok` answers 200 with `f`'s JSON.
fn file_op<T: 'static>(
    s: Arc<Session>,
    op: impl FnOnce(&Session) -> OpsResult<T> + Send + 'static,
    f: fn(T) -> Value,
) -> Reply {
    Reply::Later(Box::new(move || {
        let _a = s.activity();
        match op(&s) {
            Ok(v) => Reply::Json(200, f(v)),
            Err(e) => ApiError::from(e).into(),
        }
    }))
}

fn success(_: ()) -> Value {
    json!({"success": true})
}

pub fn stat(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let path = path_param(params, "path")?;
    let s = own_session(ctx, p, params)?;
    let wait = ctx.cfg.create_timeout;
    Ok(file_op(
        s,
        move |s| files::stat(s, &path, wait),
        // A struct of strings and numbers: cannot fail.
        |st| serde_json::to_value(st).unwrap_or_default(),
    ))
}

pub fn list_files(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let path = params.query("path").unwrap_or(".").to_string();
    validate::path(&path, "path")?;
    let recursive = params.flag("recursive", false)?;
    let s = own_session(ctx, p, params)?;
    let lease = ctx.ops.reply_lease()?;
    let wait = ctx.cfg.create_timeout;
    let max_reply = ctx.cfg.max_json_reply();
    Ok(Reply::Later(Box::new(move || {
        let _a = s.activity();
        rest::list_reply(&s, lease, &path, recursive, wait, max_reply, files::V1_DIR)
    })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MkdirBody {
    path: String,
    parents: Option<bool>,
}

pub fn mkdir(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let b: MkdirBody = json_body(req, ctx.cfg.max_body)?;
    validate::path(&b.path, "path")?;
    let s = own_session(ctx, p, params)?;
    let wait = ctx.cfg.create_timeout;
    let parents = b.parents.unwrap_or(true);
    Ok(file_op(
        s,
        move |s| files::mkdir(s, &b.path, parents, wait),
        success,
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveBody {
    path: String,
    recursive: Option<bool>,
}

pub fn remove(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let b: RemoveBody = json_body(req, ctx.cfg.max_body)?;
    validate::path(&b.path, "path")?;
    let s = own_session(ctx, p, params)?;
    let wait = ctx.cfg.create_timeout;
    let recursive = b.recursive.unwrap_or(false);
    Ok(file_op(
        s,
        move |s| files::remove(s, &b.path, recursive, wait),
        success,
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RenameBody {
    from: String,
    to: String,
    overwrite: Option<bool>,
}

pub fn rename(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let b: RenameBody = json_body(req, ctx.cfg.max_body)?;
    validate::path(&b.from, "from")?;
    validate::path(&b.to, "to")?;
    let s = own_session(ctx, p, params)?;
    let wait = ctx.cfg.create_timeout;
    let overwrite = b.overwrite.unwrap_or(true);
    Ok(file_op(
        s,
        move |s| files::rename(s, &b.from, &b.to, overwrite, wait),
        success,
    ))
}

// ---- stateful sessions (issue #21) -------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckpointBody {
    name: Option<String>,
}

/// `POST /v1/sessions/:id/snapshots`: the running session's whole state as
/// a new snapshot of the caller's; the session runs on.
pub fn checkpoint(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let b: CheckpointBody = json_body(req, ctx.cfg.max_body)?;
    if let Some(n) = &b.name {
        validate::snapshot_name(n)?;
    }
    let s = own_session(ctx, p, params)?;
    let ops = ctx.ops.clone();
    Ok(later_json(201, move || {
        Ok(ops.checkpoint(&s, b.name)?.json())
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ForkBody {
    #[serde(default, deserialize_with = "validate::opt_int")]
    count: Option<i64>,
}

/// `POST /v1/sessions/:id/fork`: a checkpoint and `count` sessions started
/// from it, answered once each is ready (as a create of several).
pub fn fork(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let b: ForkBody = json_body(req, ctx.cfg.max_body)?;
    let count = b
        .count
        .ok_or_else(|| ApiError::bad_request("count is required"))?;
    let count = validate::count(count, "count")?;
    let s = own_session(ctx, p, params)?;
    let ops = ctx.ops.clone();
    Ok(later_json(201, move || {
        let f = ops.fork(&s, count)?;
        Ok(json!({
            "sourceId": f.source.id,
            "pausedMs": f.paused_ms,
            "snapshotBytes": f.snapshot_bytes,
            "sessions": ready_list(&ops, &f.sessions)?,
        }))
    }))
}

/// `POST /v1/sessions/:id/pause`: its state saved and its VMM stopped; the
/// answer is the paused session.
pub fn pause(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    state_change(ctx, p, params, Ops::pause)
}

/// `POST /v1/sessions/:id/resume`: restored where it was (a running
/// session: nothing to do).
pub fn resume(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    state_change(ctx, p, params, Ops::resume)
}

/// Pause or resume (`change`), answered with the session as it is then.
fn state_change(
    ctx: &Arc<Ctx>,
    p: &Principal,
    params: &Params,
    change: fn(&Ops, &Arc<Session>) -> OpsResult<()>,
) -> ApiResult<Reply> {
    let s = own_session(ctx, p, params)?;
    let ops = ctx.ops.clone();
    Ok(later_json(200, move || {
        change(&ops, &s)?;
        Ok(SessionView::of(&s).json())
    }))
}

/// The caller's snapshots; an admin key's list has every key's (as
/// `GET /v1/sessions`).
pub fn list_snapshots(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    _: &Params,
) -> ApiResult<Reply> {
    let list: Vec<Value> = ctx
        .ops
        .snapshots(p, true)
        .iter()
        .map(SnapshotView::json)
        .collect();
    ok_json(json!({ "snapshots": list }))
}

fn snapshot_param(params: &Params) -> ApiResult<&str> {
    let sid = params.get("snapshot");
    validate::snapshot_id(sid, "snapshot")?;
    Ok(sid)
}

pub fn get_snapshot(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let sid = snapshot_param(params)?;
    ok_json(ctx.ops.snapshot(p, sid)?.json())
}

/// `DELETE /v1/snapshots/:sid`: 200 as a session's delete; sessions
/// started from it run on. An unknown snapshot is 404.
pub fn delete_snapshot(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let sid = snapshot_param(params)?.to_string();
    let (ops, p) = (ctx.ops.clone(), p.clone());
    // Removing its files can take a moment: not on an API worker thread.
    Ok(later_json(200, move || {
        ops.delete_snapshot(&p, &sid)?;
        Ok(json!({"deleted": true, "success": true, "snapshotId": sid}))
    }))
}

/// `GET /v1/sessions/:id/audit`: the session's audit records as NDJSON
/// (rotated files, then the current one; `follow=true` keeps streaming).
/// `Audit-Head: <seq> <hash>` is the last record written when the request
/// came: a copy that ends before it was cut short.
pub fn audit(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let follow = params.flag("follow", false)?;
    let a = ctx
        .ops
        .audit_files(p, params.query("owner"), params.get("session"))?;
    let mut headers = Vec::new();
    if let Some((seq, hash)) = &a.head {
        headers.push(("Audit-Head", format!("{seq} {hash}")));
    }
    let ctx = ctx.clone();
    Ok(Reply::Stream {
        content_type: "application/x-ndjson",
        headers,
        job: Box::new(move |w| ctx.ops.audit_stream(&a, follow, &mut |b| w.send(b))),
    })
}

/// `POST /v1/templates` (admin): starts building a template from an image
/// or a Dockerfile; 202 at once with the build's status (`buildId`).
pub fn create_template(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    _: &Params,
) -> ApiResult<Reply> {
    let b: crate::ops::templates::TemplateBuildRequest = json_body(req, ctx.cfg.max_body)?;
    let view = ctx.ops.template_build(p, b)?;
    Ok(Reply::Json(
        202,
        serde_json::to_value(view).unwrap_or_default(),
    ))
}

/// `GET /v1/templates/builds/:build` (admin): steps, bytes, log tail; ends
/// `ready` or `failed` with the builder's error.
pub fn get_template_build(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let view = ctx.ops.template_build_status(p, params.get("build"))?;
    ok_json(serde_json::to_value(view).unwrap_or_default())
}

/// `DELETE /v1/templates/:template` (admin): a template built from an
/// image; 409 while sessions use it, and for a built-in one.
pub fn delete_template(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let name = params.get("template").to_string();
    let (ops, p) = (ctx.ops.clone(), p.clone());
    // Removing the image and snapshots can take a moment.
    Ok(later_json(200, move || {
        ops.template_delete(&p, &name)?;
        Ok(json!({"deleted": true, "success": true, "name": name}))
    }))
}

/// `GET /v1/admin/drain` (admin): `{state: serving|draining|drained,
/// draining, sessions, host}`.
pub fn get_drain(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    _: &Principal,
    _: &Params,
) -> ApiResult<Reply> {
    ok_json(serde_json::to_value(ctx.ops.drain_state()).unwrap_or_default())
}

/// `POST /v1/admin/drain` (admin): no new sessions from now on; the ones
/// here run until they end.
pub fn start_drain(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    _: &Principal,
    _: &Params,
) -> ApiResult<Reply> {
    ok_json(serde_json::to_value(ctx.ops.drain(true)).unwrap_or_default())
}

/// `DELETE /v1/admin/drain` (admin): take new sessions again.
pub fn end_drain(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    _: &Principal,
    _: &Params,
) -> ApiResult<Reply> {
    ok_json(serde_json::to_value(ctx.ops.drain(false)).unwrap_or_default())
}
