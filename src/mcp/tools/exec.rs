//! Command and process tools: execute, run_code, start/read/write/kill
//! processes, kill_all.

use super::*;

pub(super) fn exec_spec(
    ctx: &ToolCtx,
    a: &Map<String, Value>,
    background: bool,
) -> Result<Prepared, String> {
    let command = req_str(a, "command")?;
    if command.is_empty() {
        return Err("command must not be empty".into());
    }
    let args: Option<Vec<String>> = match a.get("args") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            serde_json::from_value(v.clone())
                .map_err(|_| "argument args must be an array of strings".to_string())?,
        ),
    };
    let spec = ExecSpec {
        command: Some(command),
        args,
        cwd: opt_str(a, "cwd")?,
        env: Some(opt_env(a)?),
        timeout: opt_u64(a, "timeout")?,
        background: Some(background),
        tag: opt_str(a, "tag")?,
        secrets: match a.get("secrets") {
            None => None,
            Some(v) => Some(crate::ops::secrets::Secrets::from_json(v.clone())?),
        },
        ..Default::default()
    };
    let mut p = spec.prepare(&ctx.host.ops.cfg).map_err(op_msg)?;
    // No process id in MCP's answers: the guest need not report it.
    p.req.notify_start = false;
    Ok(p)
}

pub(super) fn execute(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &execute_in())?;
    let id = match opt_str(a, "sessionId")? {
        Some(id) => {
            validate::session_id(&id).map_err(op_msg)?;
            id
        }
        None => new_id()?,
    };
    let template = opt_str(a, "template")?;
    let (s, created) = ctx
        .host
        .ops
        .open(ctx.caller, &id, template)
        .map_err(op_msg)?;
    if created {
        (ctx.created)(&id);
    }
    let prepared = exec_spec(ctx, a, false)?;
    let timeout = prepared.timeout;
    let t0 = Instant::now();
    let mut running = ctx.host.ops.exec_in(&s, prepared).map_err(op_msg)?.running;
    running.set_what("execute");
    let deadline = Instant::now() + timeout + Duration::from_secs(30);
    // Kept well inside one message (clients bound what they buffer).
    let mut output = Captured::new(ctx.host.ops.cfg.max_output.min(crate::mcp::MAX_MESSAGE / 2));
    let mut seen = 0u64;
    let status = loop {
        if (ctx.stop)() {
            // Cancel in the guest and wait (briefly) for the process to be
            // gone, so a cancelled command never outlives its call.
            running.cancel();
            let end = Instant::now() + Duration::from_secs(5);
            while Instant::now() < end {
                match running.poll(Duration::from_millis(50)) {
                    Ok(Some(ExecEvent::Exited(_) | ExecEvent::Background { .. })) | Err(_) => break,
                    _ => {}
                }
            }
            ctx.host
                .ops
                .mgr
                .metrics
                .exec_done("cancelled", t0.elapsed());
            return Err("cancelled".into());
        }
        if Instant::now() > deadline {
            return Err(format!("no answer from the sandbox within {timeout:?}"));
        }
        match running.poll(Duration::from_millis(100)) {
            Ok(Some(ExecEvent::Output { stream, bytes })) => {
                seen += bytes.len() as u64;
                if let Some(p) = ctx.progress {
                    let text: String = String::from_utf8_lossy(&bytes).chars().take(2000).collect();
                    p(seen as f64, text);
                }
                output.push(stream, &bytes);
            }
            Ok(Some(ExecEvent::Exited(st))) => break st,
            Ok(Some(ExecEvent::Background { proc, pid })) => {
                return Err(format!(
                    "unexpected agent answer {:?}",
                    Response::Started { proc, pid }
                ))
            }
            Ok(_) => {}
            Err(e) => return Err(op_msg(e)),
        }
    };
    let took = t0.elapsed();
    ctx.host
        .ops
        .mgr
        .metrics
        .exec_done(ops_exec::outcome(&status), took);
    let mut v = json!({
        "sessionId": id,
        "exitCode": ops_exec::exit_code(&status),
        "signal": status.signal.map(Signal::name_of),
        "timedOut": status.timed_out,
        "stdout": String::from_utf8_lossy(&output.stdout),
        "stderr": String::from_utf8_lossy(&output.stderr),
        "truncated": output.truncated,
        "duration": took.as_millis() as u64,
    });
    for (k, x) in ops_exec::usage_fields(&status) {
        v[k] = x;
    }
    Ok(v.into())
}

pub(super) fn run_code(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    let cfg = &ctx.host.ops.cfg;
    let r = crate::ops::run::RunRequest::parse(&Value::Object(a.clone()), cfg)
        .map_err(|e| e.message())?;
    // Kept well inside one message (clients bound what they buffer).
    let max = cfg.max_output.min(crate::mcp::MAX_MESSAGE / 2);
    let p = ctx.caller.clone();
    let r = ctx
        .host
        .ops
        .run(&p, r, max, ctx.stop)
        .map_err(|e| e.message())?;
    Ok(r.json().into())
}

pub(super) fn start_process(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &start_process_in())?;
    let id = session_id(a)?;
    let s = own_session(ctx, &id)?;
    let prepared = exec_spec(ctx, a, true)?;
    let mut running = ctx.host.ops.exec_in(&s, prepared).map_err(op_msg)?.running;
    running.set_what("start process");
    loop {
        match running.next(None).map_err(op_msg)? {
            ExecEvent::Background { proc, pid } => {
                return Ok(json!({"sessionId": id, "procId": proc, "pid": pid}).into())
            }
            ExecEvent::Exited(st) => {
                return Err(format!(
                    "unexpected agent answer {:?}",
                    Response::Exited(st)
                ))
            }
            _ => {}
        }
    }
}

pub(super) fn req_proc(a: &Map<String, Value>) -> Result<u64, String> {
    opt_u64(a, "procId")?
        .filter(|&p| p > 0)
        .ok_or_else(|| "argument procId is required (a positive integer)".to_string())
}

pub(super) fn read_process(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &read_process_in())?;
    let id = session_id(a)?;
    let proc = req_proc(a)?;
    let offset = opt_u64(a, "offset")?.unwrap_or(0);
    let wait_ms = opt_u64(a, "waitMs")?.unwrap_or(200).min(60_000);
    let s = own_session(ctx, &id)?;
    // The agent replays a background process's buffer from its absolute
    // start; we skip what the caller already has.
    let mut running = ctx
        .host
        .ops
        .attach(&s, proc, false, true)
        .map_err(|e| e.message())?;
    running.set_what(format!("process {proc}"));
    let end = Instant::now() + Duration::from_millis(wait_ms);
    let mut pos = 0u64;
    let mut dropped = 0u64;
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let cap = (crate::mcp::MAX_MESSAGE / 4) as u64;
    let mut exit = None;
    loop {
        if (ctx.stop)() {
            return Err("cancelled".into());
        }
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match running.poll(left.min(Duration::from_millis(100))) {
            Ok(None) => {}
            Ok(Some(ExecEvent::Dropped { bytes })) => {
                let lost_end = pos + bytes;
                if lost_end > offset {
                    dropped += lost_end - offset.max(pos);
                }
                pos = lost_end;
            }
            Ok(Some(ExecEvent::Output { stream, bytes })) => {
                let n = bytes.len() as u64;
                if pos + n > offset {
                    let start = pos.max(offset);
                    let piece = &bytes[(start - pos) as usize..];
                    let total = (out.len() + err.len()) as u64;
                    let take = (piece.len() as u64).min(cap.saturating_sub(total)) as usize;
                    let buf = match stream {
                        ops_exec::Stream::Stderr => &mut err,
                        ops_exec::Stream::Stdout => &mut out,
                    };
                    buf.extend_from_slice(&piece[..take]);
                    if take < piece.len() {
                        // The rest is left for the next read.
                        pos = start + take as u64;
                        break;
                    }
                }
                pos += n;
            }
            Ok(Some(ExecEvent::Exited(st))) => {
                exit = Some(st);
                break;
            }
            Ok(Some(ExecEvent::Background { .. })) | Err(OpsError::UnexpectedAnswer(_)) => break,
            Ok(Some(ExecEvent::Started { .. })) => {}
            Err(e) => return Err(e.message()),
        }
    }
    drop(running);
    let (code, signal) = match &exit {
        Some(st) => (
            json!(ops_exec::exit_code(st)),
            json!(st.signal.map(Signal::name_of)),
        ),
        None => (Value::Null, Value::Null),
    };
    Ok(json!({
        "procId": proc,
        "stdout": String::from_utf8_lossy(&out),
        "stderr": String::from_utf8_lossy(&err),
        "nextOffset": pos.max(offset),
        "dropped": dropped,
        "running": exit.is_none(),
        "exitCode": code,
        "signal": signal,
    })
    .into())
}

pub(super) fn write_process(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &write_process_in())?;
    let id = session_id(a)?;
    let proc = req_proc(a)?;
    let input = opt_str(a, "input")?.unwrap_or_default();
    let eof = opt_bool(a, "eof")?.unwrap_or(false);
    let s = own_session(ctx, &id)?;
    let mut running = ctx
        .host
        .ops
        .attach(&s, proc, true, false)
        .map_err(|e| e.message())?;
    running.set_what("write stdin");
    running
        .send_input(input.as_bytes(), eof)
        .map_err(|e| e.message())?;
    // An unknown process fails at once.
    if let Err(e) = running.poll(Duration::from_millis(20)) {
        if e.is_agent_refusal() {
            return Err(e.with_what(format!("process {proc}")).message());
        }
    }
    ctx.host.ops.audit_input(&s, proc, input.as_bytes(), eof);
    Ok(json!({"procId": proc, "bytes": input.len(), "eof": eof}).into())
}

/// `kill_process`'s `signal` as REST's `POST .../signal` reads it (the one
/// [`Signal`] table); absent or null: SIGTERM.
pub(crate) fn signal_arg(v: Option<&Value>) -> Result<Signal, String> {
    match v {
        None | Some(Value::Null) => Ok(Signal::TERM),
        Some(v) => Signal::deserialize(v).map_err(|e| e.to_string()),
    }
}

pub(super) fn kill_all_processes(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &session_id_in())?;
    let id = session_id(a)?;
    let s = own_session(ctx, &id)?;
    // REST's wording throughout, an odd answer too ("unexpected answer").
    let k = ctx.host.ops.kill_all(&s).map_err(|e| e.message())?;
    Ok(json!({"killed": k.processes, "remaining": k.remaining}).into())
}

pub(super) fn kill_process(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &kill_process_in())?;
    let id = session_id(a)?;
    let proc = req_proc(a)?;
    let sig = signal_arg(a.get("signal"))?;
    let s = own_session(ctx, &id)?;
    ctx.host
        .ops
        .signal(&s, proc, sig)
        .map_err(|e| e.with_what(format!("signal process {proc}")).message())?;
    Ok(json!({"procId": proc, "signal": sig.number(), "success": true}).into())
}

pub(super) fn get_process(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &get_process_in())?;
    let s = own_session(ctx, &session_id(a)?)?;
    let p = ctx
        .host
        .ops
        .proc_info(&s, req_proc(a)?)
        .map_err(|e| e.message())?;
    Ok(procs::proc_json(&p).into())
}
