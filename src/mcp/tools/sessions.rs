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
    let on_idle = opt_str(a, "onIdle")?
        .map(|m| validate::on_idle(&m))
        .transpose()
        .map_err(op_msg)?;
    let paused_ttl = match a.get("pausedTtl") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            serde_json::from_value::<Span>(v.clone())
                .map_err(|_| "argument pausedTtl must be seconds or text like 30m")?,
        ),
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
        on_idle,
        paused_ttl,
        from_snapshot: opt_str(a, "fromSnapshot")?,
        count: count_arg(a)?,
        secrets: match a.get("secrets") {
            None | Some(Value::Null) => Vec::new(),
            // The error names the field, never a value.
            Some(v) => serde_json::from_value(v.clone())
                .map_err(|e| format!("argument secrets: {}", e.to_string().replace('"', "'")))?,
        },
    };
    if let Some(sid) = &spec.from_snapshot {
        validate::snapshot_id(sid, "fromSnapshot").map_err(op_msg)?;
    }
    if spec.count.is_none() && spec.from_snapshot.is_none() {
        let s = ctx.host.ops.create(ctx.caller, spec).map_err(op_msg)?;
        (ctx.created)(&s.id);
        ctx.host.ops.ready(&s).map_err(op_msg)?;
        return Ok(session_json(&SessionView::of(&s)).into());
    }
    // From a snapshot, or several: the first session that started is the
    // answer's own fields (as a create of one), `sessions` lists them all.
    let many = spec.count.is_some();
    let list = ctx.host.ops.create_many(ctx.caller, spec).map_err(op_msg)?;
    let each = started(ctx, &list)?;
    let mut out = each
        .iter()
        .find(|v| v.get("error").is_none())
        .cloned()
        .ok_or("no session was started")?;
    if many {
        out["sessions"] = Value::Array(each);
    }
    Ok(out.into())
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
