//! Reading tool arguments and mapping operation errors to tool errors:
//! the one place MCP words an `OpsError`.

use super::*;

pub(super) fn opt_str(a: &Map<String, Value>, k: &str) -> Result<Option<String>, String> {
    match a.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(format!(
            "argument {k} must be a string, not {}",
            crate::mcp::jsonrpc::type_name(v)
        )),
    }
}

pub(super) fn req_str(a: &Map<String, Value>, k: &str) -> Result<String, String> {
    opt_str(a, k)?.ok_or_else(|| format!("argument {k} is required"))
}

pub(super) fn opt_u64(a: &Map<String, Value>, k: &str) -> Result<Option<u64>, String> {
    match a.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("argument {k} must be a non-negative integer")),
    }
}

pub(super) fn opt_f64(a: &Map<String, Value>, k: &str) -> Result<Option<f64>, String> {
    match a.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|f| f.is_finite() && *f > 0.0 && *f < 1e9)
            .map(Some)
            .ok_or_else(|| format!("argument {k} must be a positive number")),
    }
}

pub(super) fn opt_bool(a: &Map<String, Value>, k: &str) -> Result<Option<bool>, String> {
    match a.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(format!("argument {k} must be a boolean")),
    }
}

pub(super) fn opt_env(a: &Map<String, Value>) -> Result<BTreeMap<String, String>, String> {
    let env: BTreeMap<String, String> = match a.get("env") {
        None | Some(Value::Null) => BTreeMap::new(),
        Some(v) => serde_json::from_value(v.clone())
            .map_err(|_| "argument env must be an object of strings".to_string())?,
    };
    validate::env(env).map_err(op_msg)
}

/// Rejects arguments the schema does not name (a typo should not be ignored).
pub(super) fn known_only(a: &Map<String, Value>, schema: &Value) -> Result<(), String> {
    let props = &schema["properties"];
    for k in a.keys() {
        if props.get(k).is_none() {
            let names: Vec<&String> = props
                .as_object()
                .map(|m| m.keys().collect())
                .unwrap_or_default();
            return Err(format!(
                "unknown argument {k:?} (expected one of {names:?})"
            ));
        }
    }
    Ok(())
}

/// An operation's error as the tools have always worded it; everything
/// else reads as REST's message ([`OpsError::message`]).
pub(super) fn op_msg(e: impl Into<OpsError>) -> String {
    match e.into() {
        OpsError::SessionNotFound { id } => format!(
            "no session {id:?} (create one with create_session, or list them with list_sessions)"
        ),
        OpsError::TimeoutTooLong { max, .. } => {
            format!("timeout exceeds the maximum of {max} ms")
        }
        OpsError::UnexpectedAnswer(a) => format!("unexpected agent answer {a}"),
        other => other.message(),
    }
}

pub(super) fn session_id(a: &Map<String, Value>) -> Result<String, String> {
    let id = req_str(a, "sessionId")?;
    validate::session_id(&id).map_err(op_msg)?;
    Ok(id)
}

pub(super) fn own_session(ctx: &ToolCtx, id: &str) -> Result<Arc<Session>, String> {
    ctx.host.ops.find(ctx.caller, None, id).map_err(op_msg)
}

pub(super) fn wait(ctx: &ToolCtx) -> Duration {
    ctx.host.ops.cfg.create_timeout
}

/// A session as the tools show it (a paused one with its checkpoint's
/// size and times).
pub(super) fn session_json(v: &SessionView) -> Value {
    let mut j = json!({
        "sessionId": v.session_id,
        "template": v.template,
        "state": v.state,
        "vcpus": v.vcpus,
        "memoryMib": v.memory_mib,
        "diskMib": v.disk_mib,
        "createdAt": v.created_at,
        "expiresAt": v.expires_at,
    });
    for (k, f) in [
        ("snapshotBytes", v.snapshot_bytes),
        ("pausedAt", v.paused_at),
        ("pausedExpiresAt", v.paused_expires_at),
    ] {
        if let Some(n) = f {
            j[k] = json!(n);
        }
    }
    j
}

pub(super) fn new_id() -> Result<String, String> {
    ops_sessions::new_id().map_err(op_msg)
}

// ---- handlers ---------------------------------------------------------------

/// `egress` as a mode or a policy object (checked by the operation).
pub(super) fn egress(v: Option<&Value>) -> Result<Option<EgressPolicy>, String> {
    let p = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(m)) => {
            let mode: EgressMode = serde_json::from_value(Value::String(m.clone()))
                .map_err(|_| format!("egress {m:?}: want internet, none, allowlist or denylist"))?;
            EgressPolicy {
                mode,
                ..Default::default()
            }
        }
        Some(o) => serde_json::from_value(o.clone()).map_err(|e| format!("egress: {e}"))?,
    };
    Ok(Some(p))
}
