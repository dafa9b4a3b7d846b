//! API errors, with the matching HTTP status, in the shape of the API the
//! request addressed: `/v1` (and everything else) answers
//! `{"error": {"code", "message"}}`; the seed routes answer as the seed
//! does, `{"error": "<message>", "code"}` (a seed client shows `error`).

use crate::agent::ClientError;
use crate::proto::ErrorCode;
pub use crate::server::http::Shape;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: u16,
    pub code: &'static str,
    pub message: String,
    /// Seconds, for 429/503.
    pub retry_after: Option<u64>,
    /// The `Allow` header of a 405 (RFC 9110: the methods the path has).
    pub allow: Option<String>,
}

impl ApiError {
    pub fn new(status: u16, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
            retry_after: None,
            allow: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        Self::new(400, "bad_request", message)
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        Self::new(404, "not_found", message)
    }

    pub fn session_not_found(id: &str) -> ApiError {
        Self::new(404, "session_not_found", format!("no session {id:?}"))
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        Self::new(500, "internal", message)
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        let mut e = Self::new(503, "unavailable", message);
        e.retry_after = Some(1);
        e
    }

    /// The v1 shape (also the stream error lines of v1 and MCP).
    pub fn body(&self) -> serde_json::Value {
        self.body_as(Shape::Nested)
    }

    pub fn body_as(&self, shape: Shape) -> serde_json::Value {
        shape.body(self.code, &self.message)
    }

    /// Maps an agent failure. Agent-side errors about the user's input
    /// (missing file, bad path) are the client's problem (4xx); a dead
    /// agent connection is ours (502/503).
    pub fn from_agent(e: ClientError, what: &str) -> ApiError {
        match e {
            ClientError::Agent(b) => {
                let (status, code) = match b.code {
                    ErrorCode::NotFound => (404, "file_not_found"),
                    ErrorCode::AlreadyExists => (409, "already_exists"),
                    ErrorCode::PermissionDenied => (403, "permission_denied"),
                    ErrorCode::NotADirectory => (400, "not_a_directory"),
                    ErrorCode::IsADirectory => (400, "is_a_directory"),
                    ErrorCode::DirectoryNotEmpty => (409, "directory_not_empty"),
                    ErrorCode::Invalid => (400, "invalid"),
                    ErrorCode::SpawnFailed => (400, "spawn_failed"),
                    ErrorCode::NoSpace => (507, "no_space"),
                    ErrorCode::Cancelled => (409, "cancelled"),
                    ErrorCode::Unavailable => (503, "sandbox_unavailable"),
                    // An I/O error inside the guest comes from what the
                    // user did there (a device path, a full pipe, ...).
                    ErrorCode::Io => (422, "guest_io_error"),
                    _ => (502, "agent_error"),
                };
                ApiError::new(status, code, format!("{what}: {}", b.message))
            }
            ClientError::Timeout(d) => {
                ApiError::new(504, "timeout", format!("{what}: no answer after {d:.1?}"))
            }
            ClientError::Closed(m) => {
                ApiError::new(503, "sandbox_unavailable", format!("{what}: {m}"))
            }
            // The guest answered with more than the host accepts.
            ClientError::OverBudget(m) => {
                ApiError::new(502, "guest_reply_too_large", format!("{what}: {m}"))
            }
            other => ApiError::new(502, "agent_error", format!("{what}: {other}")),
        }
    }
}

/// The one mapping of an operation's error to HTTP.
impl From<crate::ops::OpsError> for ApiError {
    fn from(e: crate::ops::OpsError) -> ApiError {
        use crate::ops::OpsError as E;
        let status = match &e {
            E::Session(_) | E::Budget(_) | E::Agent { .. } => 0,
            E::SessionNotFound { .. } | E::KeyNotFound { .. } => 404,
            E::InvalidSessionId { .. } | E::InvalidPath { .. } | E::BadRequest(_) => 400,
            E::Forbidden(_) => 403,
            E::Internal(_) => 500,
        };
        match e {
            E::Session(s) => s.into(),
            E::Budget(b) => b.into(),
            E::Agent { what, source } => ApiError::from_agent(source, &what),
            other => ApiError::new(status, other.code(), other.to_string()),
        }
    }
}

impl From<crate::session::SessionError> for ApiError {
    fn from(e: crate::session::SessionError) -> ApiError {
        use crate::session::SessionError as E;
        let (status, retry_after) = match &e {
            E::ShuttingDown => (503, Some(1)),
            E::Exists { .. } | E::EgressNotApplied(_) => (409, None),
            E::InvalidShape(_) | E::UnknownTemplate { .. } => (400, None),
            // No Retry-After: the quota frees only when the key ends a
            // session.
            E::QuotaExceeded(_) => (429, None),
            E::AtCapacity { .. } => (503, Some(5)),
            E::Thread { .. } => (500, None),
            E::Failed { .. } => (503, None),
            E::Closed { .. } => (410, None),
            E::StartTimeout { .. } | E::EgressTimeout { .. } => (504, None),
            E::Agent(_) => (502, None),
        };
        if let E::Agent(a) = e {
            return ApiError::from_agent(a, "start request");
        }
        let mut a = ApiError::new(status, e.code(), e.to_string());
        a.retry_after = retry_after;
        a
    }
}

/// 401 for no valid key, 429 with `Retry-After` for too many attempts.
impl From<crate::ops::auth::AuthError> for ApiError {
    fn from(e: crate::ops::auth::AuthError) -> ApiError {
        let status = if e.is_throttle() { 429 } else { 401 };
        let mut a = ApiError::new(status, e.code(), e.to_string());
        a.retry_after = e.retry_after();
        a
    }
}

impl From<crate::budget::BudgetError> for ApiError {
    fn from(e: crate::budget::BudgetError) -> ApiError {
        use crate::budget::BudgetError;
        let status = match e {
            BudgetError::TooLarge { .. } => 413,
            BudgetError::Exhausted { .. } => 503,
        };
        let mut a = ApiError::new(status, e.code(), e.to_string());
        if status == 503 {
            a.retry_after = Some(1);
        }
        a
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status, self.code, self.message)
    }
}

impl std::error::Error for ApiError {}

pub type ApiResult<T> = Result<T, ApiError>;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn seed_paths_get_the_seed_shape() {
        for t in [
            "/exec",
            "/exec/",
            "/exec/s/execute?format=ndjson",
            "/exec/templates",
            "/admin/keys/k1/revoke",
            "/health",
            "/ready?x=1",
        ] {
            assert_eq!(Shape::for_target(t), Shape::Seed, "{t}");
        }
        for t in ["/v1/sessions", "/metrics", "/", "/executor", "/mcp", ""] {
            assert_eq!(Shape::for_target(t), Shape::Nested, "{t}");
        }
        let e = ApiError::not_found("no such thing");
        assert_eq!(
            e.body_as(Shape::Seed),
            json!({"error": "no such thing", "code": "not_found"})
        );
        assert_eq!(e.body()["error"]["message"], "no such thing");
    }
}
