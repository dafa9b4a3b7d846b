//! `/v1`: explicit sessions, streaming exec, background processes, PTY and
//! binary file transfer.

use super::auth::Principal;
use super::errors::{ApiError, ApiResult};
use super::exec::{self, ExecBody};
use super::http::{json_body, ok_json, read_body, Reply};
use super::rest::{self, owner_for, stream_format};
use super::routes::Params;
use super::{validate, Ctx};
use crate::agent::{ClientError, Inbound};
use crate::config::parse_duration;
use crate::ops::EgressPolicy;
use crate::proto::{FileType, Request, Response, Signal};
use crate::session::{Session, SessionOptions};
use crate::sync::lock;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

fn own_session(ctx: &Arc<Ctx>, p: &Principal, params: &Params) -> ApiResult<Arc<Session>> {
    let id = params.get("session");
    validate::session_id(id)?;
    let owner = owner_for(p, params)?;
    ctx.mgr
        .get(&owner, id)
        .ok_or_else(|| ApiError::session_not_found(id))
}

/// A duration given as seconds (number) or a string like `30m`.
#[derive(Deserialize)]
#[serde(untagged)]
enum Dur {
    Secs(f64),
    Text(String),
}

impl Dur {
    fn get(&self, what: &str) -> ApiResult<Duration> {
        let d = match self {
            Dur::Secs(s) if s.is_finite() && *s > 0.0 && *s < 1e9 => Duration::from_secs_f64(*s),
            Dur::Secs(s) => return Err(ApiError::bad_request(format!("{what} {s} out of range"))),
            Dur::Text(t) => parse_duration(t).map_err(ApiError::bad_request)?,
        };
        if d.is_zero() {
            return Err(ApiError::bad_request(format!("{what} must be positive")));
        }
        Ok(d)
    }
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
    ttl: Option<Dur>,
    idle_timeout: Option<Dur>,
    env: Option<BTreeMap<String, String>>,
    egress: Option<EgressPolicy>,
}

pub fn create_session(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    _: &Params,
) -> ApiResult<Reply> {
    let b: CreateBody = json_body(req, ctx.cfg.max_body)?;
    let id = match b.id {
        Some(id) => id,
        None => {
            let r = crate::agent::random_u64()
                .map_err(|e| ApiError::internal(format!("making a session id: {e}")))?;
            format!("s-{:012x}", r & 0xffff_ffff_ffff)
        }
    };
    validate::session_id(&id)?;
    // The shape is checked (400 invalid_shape) by the session manager,
    // against the configured and host maxima, with the defaults filled in.
    if let Some(e) = &b.egress {
        crate::ops::validate::egress(e, &ctx.cfg)?;
    }
    if let Some(t) = &b.template {
        if t.is_empty() || t.len() > 64 {
            return Err(ApiError::bad_request(
                "template name must be 1-64 characters",
            ));
        }
    }
    let opts = SessionOptions {
        template: b.template,
        vcpus: b.vcpus,
        mem_mib: b.memory_mib,
        disk_mib: b.disk_mib,
        ttl: b.ttl.as_ref().map(|d| d.get("ttl")).transpose()?,
        idle_timeout: b
            .idle_timeout
            .as_ref()
            .map(|d| d.get("idleTimeout"))
            .transpose()?,
        env: validate::env(b.env.unwrap_or_default())?,
        egress: b.egress,
    };
    let (session, _) = ctx.mgr.get_or_create(&p.id, &id, opts, true)?;
    let wait = ctx.cfg.create_timeout;
    let mgr = ctx.mgr.clone();
    // Answer once the sandbox is up, so start failures are reported here.
    Ok(Reply::Later(Box::new(move || {
        let r = session
            .call(Request::Ping, wait)
            .map_err(ApiError::from)
            .and_then(|mut c| c.finish().map_err(|e| ApiError::from_agent(e, "ping")));
        match r {
            Ok(_) => Reply::Json(201, session.info()),
            Err(e) => {
                mgr.remove(&session.owner, &session.id, "failed to start", false);
                e.into()
            }
        }
    })))
}

pub fn list_sessions(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    _: &Params,
) -> ApiResult<Reply> {
    Ok(rest::sessions_json(ctx, p, Session::info))
}

pub fn get_session(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    ok_json(own_session(ctx, p, params)?.info())
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
    s.touch();
    ok_json(s.info())
}

/// The session's egress policy in force.
pub fn get_network(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    ok_json(network_state(&*own_session(ctx, p, params)?))
}

fn network_state(s: &Session) -> serde_json::Value {
    let e = lock(&s.egress).clone();
    json!({"sessionId": s.id, "egress": e})
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
    let wait = ctx.cfg.create_timeout;
    Ok(Reply::Later(Box::new(move || {
        // A session still starting gets its policy once it is up.
        let r = s
            .call(Request::Ping, wait)
            .map_err(ApiError::from)
            .and_then(|mut c| c.finish().map_err(|e| ApiError::from_agent(e, "ping")))
            .and_then(|_| s.set_egress(policy, wait).map_err(ApiError::from));
        match r {
            Ok(()) => Reply::Json(200, network_state(&s)),
            Err(e) => e.into(),
        }
    })))
}

pub fn exec(
    ctx: &Arc<Ctx>,
    req: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let body: ExecBody = json_body(req, ctx.cfg.max_body)?;
    if body.template.is_some() {
        return Err(ApiError::bad_request(
            "template is chosen when the session is created (POST /v1/sessions)",
        ));
    }
    let fmt = stream_format(req, params)?;
    let prepared = body.prepare(ctx)?;
    let session = own_session(ctx, p, params)?;
    rest::run_exec(ctx, fmt, prepared, session)
}

/// `POST /v1/run`: one program in a fresh sandbox, destroyed after
/// (see [`super::run`]).
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
    let r = super::run::RunRequest::parse(&v, &ctx.cfg)?;
    let (mgr, owner, max) = (ctx.mgr.clone(), p.id.clone(), ctx.cfg.max_output);
    Ok(Reply::Later(Box::new(move || {
        match super::run::run(&mgr, &owner, r, max, &|| false) {
            Ok(v) => Reply::Json(200, v),
            Err(e) => e.into(),
        }
    })))
}

fn proc_id(params: &Params) -> ApiResult<u64> {
    let s = params.get("proc");
    s.parse::<u64>()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| ApiError::bad_request(format!("invalid process id {s:?}")))
}

/// A small request to the agent, sent and waited for on a long-request
/// thread; `f` makes the 200 answer's JSON.
fn simple(
    session: Arc<Session>,
    req: Request,
    wait: Duration,
    what: &'static str,
    f: fn(Response) -> Value,
) -> Reply {
    Reply::Later(Box::new(move || {
        let _a = session.activity();
        let r = session
            .call(req, wait)
            .map_err(ApiError::from)
            .and_then(|mut c| c.finish().map_err(|e| ApiError::from_agent(e, what)));
        match r {
            Ok(resp) => Reply::Json(200, f(resp)),
            Err(e) => e.into(),
        }
    }))
}

pub fn list_procs(
    ctx: &Arc<Ctx>,
    _: &mut super::httpd::Request,
    p: &Principal,
    params: &Params,
) -> ApiResult<Reply> {
    let s = own_session(ctx, p, params)?;
    let wait = ctx.cfg.create_timeout;
    Ok(simple(
        s,
        Request::ListProcs,
        wait,
        "list processes",
        |r| match r {
            Response::Procs { procs } => {
                let v: Vec<Value> = procs
                    .into_iter()
                    .map(|p| {
                        json!({
                            "procId": p.proc, "pid": p.pid, "argv": p.argv, "tag": p.tag,
                            "background": p.background, "pty": p.pty,
                            "startedAt": p.started_unix_ms,
                            "running": p.exit.is_none(),
                            "exitCode": p.exit.as_ref().and_then(|e| e.code),
                            "signal": p.exit.as_ref().and_then(|e| e.signal).map(Signal::name_of),
                        })
                    })
                    .collect();
                json!({"processes": v})
            }
            other => json!({"unexpected": format!("{other:?}")}),
        },
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
    let wait = ctx.cfg.create_timeout;
    Ok(simple(
        s,
        Request::KillAll,
        wait,
        "kill all processes",
        |r| match r {
            Response::Killed {
                processes,
                remaining,
            } => json!({"killed": processes, "remaining": remaining}),
            other => json!({"unexpected": format!("{other:?}")}),
        },
    ))
}

/// An unknown process is a 404 up front, not a stream that fails later.
fn ensure_proc(ctx: &Ctx, s: &Session, proc: u64) -> ApiResult<()> {
    let known = s
        .call(Request::ListProcs, ctx.cfg.create_timeout)
        .map_err(ApiError::from)
        .and_then(|mut c| {
            c.finish()
                .map_err(|e| ApiError::from_agent(e, "list processes"))
        })?;
    match known {
        Response::Procs { procs } if procs.iter().any(|p| p.proc == proc) => Ok(()),
        _ => Err(ApiError::new(
            404,
            "process_not_found",
            format!("no process {proc} in session {:?}", s.id),
        )),
    }
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
    ensure_proc(ctx, &s, proc)?;
    let call = s.call(
        Request::Attach {
            proc,
            stdin: false,
            replay,
        },
        ctx.cfg.create_timeout,
    )?;
    let ctx = ctx.clone();
    Ok(Reply::Stream {
        content_type: fmt.content_type(),
        job: Box::new(move |w| {
            let _a = activity;
            exec::relay(&ctx, call, w, fmt, enc, None)
        }),
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
    let wait = ctx.cfg.create_timeout;
    let ctx = ctx.clone();
    Ok(Reply::Later(Box::new(move || {
        let _a = s.activity();
        if let Err(e) = ensure_proc(&ctx, &s, proc) {
            return e.into();
        }
        let r = s
            .call(
                Request::Attach {
                    proc,
                    stdin: true,
                    replay: false,
                },
                wait,
            )
            .map_err(ApiError::from)
            .and_then(|call| {
                call.send_all(&data)
                    .and_then(|_| if eof { call.send_eof() } else { Ok(()) })
                    .map_err(|e| ApiError::from_agent(e, "stdin"))?;
                // A quick look for an immediate failure (unknown process).
                let mut call = call;
                match call.recv_timeout(Duration::from_millis(20)) {
                    Ok(Some(Inbound::Error(e))) => {
                        Err(ApiError::from_agent(ClientError::Agent(e), "stdin"))
                    }
                    Ok(_) => Ok(()),
                    Err(e) => Err(ApiError::from_agent(e, "stdin")),
                }
                // Dropping the call detaches; the process keeps running.
            });
        match r {
            Ok(()) => Reply::Json(200, json!({"bytes": data.len(), "eof": eof})),
            Err(e) => e.into(),
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
    let sig = b.signal.unwrap_or(Signal::TERM).number();
    let s = own_session(ctx, p, params)?;
    let wait = ctx.cfg.create_timeout;
    Ok(simple(
        s,
        Request::Signal { proc, signal: sig },
        wait,
        "signal",
        |_| json!({"success": true}),
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
    if b.rows == 0 || b.cols == 0 {
        return Err(ApiError::bad_request("rows and cols must be positive"));
    }
    let s = own_session(ctx, p, params)?;
    let wait = ctx.cfg.create_timeout;
    Ok(simple(
        s,
        Request::Resize {
            proc,
            rows: b.rows,
            cols: b.cols,
        },
        wait,
        "resize",
        |_| json!({"success": true}),
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
    let mut lease = ctx.mgr.replies.admit()?;
    let max = ctx.cfg.max_file as u64;
    let wait = ctx.cfg.create_timeout;
    Ok(Reply::Later(Box::new(move || {
        let _a = s.activity();
        match rest::read_file(&s, &mut lease, &path, max, wait) {
            Ok(data) => Reply::Bytes(200, "application/octet-stream".into(), data),
            Err(e) => e.into(),
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
    let mut call = s.call(
        Request::WriteFile {
            path: path.clone(),
            mode,
            create_parents: true,
            append: false,
        },
        ctx.cfg.create_timeout,
    )?;
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
            let _ = call.cancel();
            return Err(ApiError::new(
                413,
                "body_too_large",
                format!("file exceeds {max} bytes"),
            ));
        }
        call.send_all(&buf[..n])
            .map_err(|e| ApiError::from_agent(e, &format!("write {path}")))?;
    }
    call.send_eof()
        .map_err(|e| ApiError::from_agent(e, &format!("write {path}")))?;
    match call.finish() {
        Ok(Response::Written { bytes }) => {
            Ok(Reply::Json(201, json!({"path": path, "bytes": bytes})))
        }
        Ok(other) => Err(ApiError::new(
            502,
            "agent_error",
            format!("unexpected answer {other:?}"),
        )),
        Err(e) => Err(ApiError::from_agent(e, &format!("write {path}"))),
    }
}

fn type_name(t: FileType) -> &'static str {
    match t {
        FileType::File => "file",
        FileType::Dir => "directory",
        FileType::Symlink => "symlink",
        FileType::Other => "other",
    }
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
    Ok(simple(
        s,
        Request::Stat { path },
        wait,
        "stat",
        |r| match r {
            Response::Stat(st) => json!({
                "path": st.path, "type": type_name(st.file_type), "size": st.size,
                "mode": st.mode, "mtime": st.mtime_ms, "linkTarget": st.link_target,
            }),
            other => json!({"unexpected": format!("{other:?}")}),
        },
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
    let lease = ctx.mgr.replies.admit()?;
    let wait = ctx.cfg.create_timeout;
    let max_reply = ctx.cfg.max_json_reply();
    Ok(Reply::Later(Box::new(move || {
        let _a = s.activity();
        rest::list_reply(&s, lease, &path, recursive, wait, max_reply, rest::V1_DIR)
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
    let r = Request::Mkdir {
        path: b.path,
        parents: b.parents.unwrap_or(true),
        mode: None,
    };
    Ok(simple(s, r, wait, "mkdir", |_| json!({"success": true})))
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
    let r = Request::Remove {
        path: b.path,
        recursive: b.recursive.unwrap_or(false),
    };
    Ok(simple(s, r, wait, "remove", |_| json!({"success": true})))
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
    let r = Request::Rename {
        from: b.from,
        to: b.to,
        overwrite: b.overwrite.unwrap_or(true),
    };
    Ok(simple(s, r, wait, "rename", |_| json!({"success": true})))
}
