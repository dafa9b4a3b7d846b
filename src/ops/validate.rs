//! Input checks every front end's requests pass (one definition each).

use super::{EgressPolicy, OpsError, OpsResult};
use crate::config::Config;
use std::collections::BTreeMap;

pub fn session_id(id: &str) -> OpsResult<()> {
    if crate::session::valid_session_id(id) {
        Ok(())
    } else {
        Err(OpsError::InvalidSessionId { id: truncate(id) })
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}

/// A guest path: non-empty, bounded, no NUL. Relative paths are taken
/// relative to the session's workspace by the agent. `what` names the
/// field in the error.
pub fn path(p: &str, what: &str) -> OpsResult<()> {
    let why = if p.is_empty() {
        "is empty"
    } else if p.len() > crate::proto::limits::MAX_PATH {
        "is too long"
    } else if p.contains('\0') {
        "contains a NUL byte"
    } else {
        return Ok(());
    };
    Err(OpsError::InvalidPath {
        path: what.to_string(),
        why,
    })
}

/// An egress policy as this daemon's network would apply it (see
/// [`EgressPolicy::validate`]): REST and MCP check it here before a
/// session is created or its policy replaced.
pub fn egress(p: &EgressPolicy, cfg: &Config) -> OpsResult<()> {
    p.validate(cfg.network.as_ref())
        .map_err(OpsError::BadRequest)
}

pub fn env(env: BTreeMap<String, String>) -> OpsResult<BTreeMap<String, String>> {
    if env.len() > crate::proto::limits::MAX_ENV {
        return Err(OpsError::BadRequest(
            "too many environment variables".into(),
        ));
    }
    for (k, v) in &env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(OpsError::BadRequest(format!(
                "invalid environment variable {:?}",
                truncate(k)
            )));
        }
    }
    Ok(env)
}
