//! Stateful-session tools (issue #21): pause, resume, checkpoint, fork,
//! snapshots. Checks and errors are the operations layer's, as REST's.

use super::*;

pub(super) fn pause_session(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &session_id_in())?;
    let s = own_session(ctx, &session_id(a)?)?;
    ctx.host.ops.pause(&s).map_err(op_msg)?;
    Ok(session_json(&SessionView::of(&s)).into())
}

pub(super) fn resume_session(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &session_id_in())?;
    let s = own_session(ctx, &session_id(a)?)?;
    ctx.host.ops.resume(&s).map_err(op_msg)?;
    Ok(session_json(&SessionView::of(&s)).into())
}

pub(super) fn checkpoint_session(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &checkpoint_in())?;
    let id = session_id(a)?;
    let name = opt_str(a, "name")?;
    if let Some(n) = &name {
        validate::snapshot_name(n).map_err(op_msg)?;
    }
    let s = own_session(ctx, &id)?;
    Ok(ctx
        .host
        .ops
        .checkpoint(&s, name)
        .map_err(op_msg)?
        .json()
        .into())
}

pub(super) fn expose_port(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &expose_port_in())?;
    let id = session_id(a)?;
    let port = opt_u64(a, "port")?.ok_or("argument port is required")?;
    let port = u32::try_from(port).map_err(|_| "argument port: 1 to 65535")?;
    let ttl = opt_f64(a, "ttl")?
        .map(|t| {
            if t.is_finite() && t > 0.0 && t < 1e9 {
                Ok(Duration::from_secs_f64(t))
            } else {
                Err("argument ttl: seconds, positive")
            }
        })
        .transpose()?;
    let public = opt_bool(a, "public")?.unwrap_or(false);
    let s = own_session(ctx, &id)?;
    Ok(ctx
        .host
        .ops
        .expose_port(&s, port, ttl, public)
        .map_err(op_msg)?
        .json()
        .into())
}

pub(super) fn fork_session(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &fork_in())?;
    let id = session_id(a)?;
    let count = count_arg(a)?.ok_or("argument count is required")?;
    let s = own_session(ctx, &id)?;
    let f = ctx.host.ops.fork(&s, count).map_err(op_msg)?;
    let sessions = started(ctx, &f.sessions)?;
    Ok(json!({
        "sourceId": f.source.id,
        "pausedMs": f.paused_ms,
        "snapshotBytes": f.snapshot_bytes,
        "sessions": sessions,
    })
    .into())
}

pub(super) fn list_snapshots(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &empty_in())?;
    // The caller's own, as list_sessions.
    let v: Vec<Value> = ctx
        .host
        .ops
        .snapshots(ctx.caller, false)
        .iter()
        .map(SnapshotView::json)
        .collect();
    Ok(json!({ "snapshots": v }).into())
}

pub(super) fn delete_snapshot(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &snapshot_id_in())?;
    let sid = req_str(a, "snapshotId")?;
    validate::snapshot_id(&sid, "snapshotId").map_err(op_msg)?;
    ctx.host
        .ops
        .delete_snapshot(ctx.caller, &sid)
        .map_err(op_msg)?;
    Ok(json!({"snapshotId": sid, "deleted": true}).into())
}

/// `count` (fork, create from a snapshot): `1..=MAX_FORK`.
pub(super) fn count_arg(a: &Map<String, Value>) -> Result<Option<u32>, String> {
    opt_u64(a, "count")?
        .map(|n| validate::count(i64::try_from(n).unwrap_or(i64::MAX), "count"))
        .transpose()
        .map_err(op_msg)
}

/// Sessions a call started together, each waited for: its session's
/// fields, or for one that failed to start (and was removed) its id and
/// error; every one failed: that error.
pub(super) fn started(ctx: &ToolCtx, sessions: &[Arc<Session>]) -> Result<Vec<Value>, String> {
    for s in sessions {
        (ctx.created)(&s.id);
    }
    let each = ctx.host.ops.ready_each(sessions).map_err(op_msg)?;
    Ok(sessions
        .iter()
        .zip(each)
        .map(|(s, r)| match r {
            Ok(()) => session_json(&SessionView::of(s)),
            Err(e) => json!({"sessionId": s.id, "error": op_msg(e)}),
        })
        .collect())
}
