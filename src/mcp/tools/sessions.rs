//! Session tools: create, list, ping, reset, destroy, templates.

use super::*;

pub(super) fn create_session(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &create_session_in())?;
    let id = opt_str(a, "sessionId")?;
    if let Some(id) = &id {
        validate::session_id(id).map_err(op_msg)?;
    }
    let template = opt_str(a, "template")?;
    let empty = Map::new();
    let limits = match a.get("limits") {
        None | Some(Value::Null) => &empty,
        Some(Value::Object(m)) => m,
        Some(_) => return Err("argument limits must be an object".into()),
    };
    known_only(limits, &create_session_in()["properties"]["limits"])?;
    // Within what any request may ask; the session manager then checks the
    // configured and host maxima.
    let range = |k: &str, r: &std::ops::RangeInclusive<u32>| -> Result<Option<u32>, String> {
        opt_u64(limits, k)?
            .map(|v| check_range(&format!("limits.{k}"), v, r).map_err(op_msg))
            .transpose()
    };
    let spec = SessionSpec {
        id,
        template,
        vcpus: range("vcpus", &VCPUS)?,
        memory_mib: range("memoryMib", &MEM_MIB)?,
        disk_mib: range("diskMib", &DISK_MIB)?,
        ttl: opt_f64(limits, "ttl")?.map(Span::Secs),
        idle_timeout: opt_f64(limits, "idleTimeout")?.map(Span::Secs),
        env: opt_env(a)?,
        egress: egress(a.get("egress"))?,
        ..Default::default()
    };
    let s = ctx.host.ops.create(ctx.caller, spec).map_err(op_msg)?;
    (ctx.created)(&s.id);
    ctx.host.ops.ready(&s).map_err(op_msg)?;
    Ok(session_json(&SessionView::of(&s)).into())
}

/// Validates seed-style arguments as a command ([`ExecSpec::prepare`]).
pub(super) fn list_templates(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &empty_in())?;
    Ok(json!({"templates": ctx.host.ops.mgr.templates()}).into())
}

pub(super) fn ping(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &ping_in())?;
    let version = env!("CARGO_PKG_VERSION");
    match opt_str(a, "sessionId")? {
        None => Ok(json!({"ok": true, "version": version}).into()),
        Some(id) => {
            validate::session_id(&id).map_err(op_msg)?;
            let s = own_session(ctx, &id)?;
            let t = Instant::now();
            ctx.host.ops.ping(&s).map_err(op_msg)?;
            Ok(json!({"ok": true, "sessionId": id, "version": version,
                      "latencyMs": t.elapsed().as_secs_f64() * 1000.0})
            .into())
        }
    }
}

pub(super) fn reset_session(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &session_id_in())?;
    let id = session_id(a)?;
    let old = own_session(ctx, &id)?;
    let s = ctx.host.ops.reset(old, "reset by MCP").map_err(op_msg)?;
    (ctx.created)(&id);
    ctx.host.ops.ready(&s).map_err(op_msg)?;
    Ok(session_json(&SessionView::of(&s)).into())
}

pub(super) fn list_sessions(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &empty_in())?;
    let v: Vec<Value> = ctx
        .host
        .ops
        .list(ctx.caller, false)
        .iter()
        .map(session_json)
        .collect();
    Ok(json!({"sessions": v}).into())
}

pub(super) fn destroy_session(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &session_id_in())?;
    let id = session_id(a)?;
    if !ctx.host.ops.delete(&ctx.caller.id, &id, "destroyed by MCP") {
        return Err(format!("no session {id:?}"));
    }
    Ok(json!({"sessionId": id, "destroyed": true}).into())
}
