//! Input checks shared by the handlers.

use super::errors::{ApiError, ApiResult};
use std::collections::BTreeMap;

pub fn session_id(id: &str) -> ApiResult<()> {
    if crate::session::valid_session_id(id) {
        Ok(())
    } else {
        Err(ApiError::new(
            400,
            "invalid_session_id",
            format!(
                "session id {:?} is invalid: use 1-64 characters of A-Z a-z 0-9 _ -",
                truncate(id)
            ),
        ))
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}

/// A guest path: non-empty, bounded, no NUL. Relative paths are taken
/// relative to the session's workspace by the agent.
pub fn path(p: &str, what: &str) -> ApiResult<()> {
    if p.is_empty() {
        return Err(ApiError::new(
            400,
            "invalid_path",
            format!("{what} is empty"),
        ));
    }
    if p.len() > crate::proto::limits::MAX_PATH {
        return Err(ApiError::new(
            400,
            "invalid_path",
            format!("{what} is too long"),
        ));
    }
    if p.contains('\0') {
        return Err(ApiError::new(
            400,
            "invalid_path",
            format!("{what} contains a NUL byte"),
        ));
    }
    Ok(())
}

pub fn env(env: BTreeMap<String, String>) -> ApiResult<BTreeMap<String, String>> {
    if env.len() > crate::proto::limits::MAX_ENV {
        return Err(ApiError::bad_request("too many environment variables"));
    }
    for (k, v) in &env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(ApiError::bad_request(format!(
                "invalid environment variable {:?}",
                truncate(k)
            )));
        }
    }
    Ok(env)
}
