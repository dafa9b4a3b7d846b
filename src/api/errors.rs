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
        let message = format!("{what}: {}", crate::ops::error::agent_detail(&e));
        let (status, code) = match e {
            ClientError::Agent(b) => match b.code {
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
            },
            ClientError::Timeout(_) => (504, "timeout"),
            ClientError::Closed(_) => (503, "sandbox_unavailable"),
            // The guest answered with more than the host accepts.
            ClientError::OverBudget(_) => (502, "guest_reply_too_large"),
            _ => (502, "agent_error"),
        };
        ApiError::new(status, code, message)
    }
}

/// The one mapping of an operation's error to HTTP.
impl From<crate::ops::OpsError> for ApiError {
    fn from(e: crate::ops::OpsError) -> ApiError {
        use crate::ops::OpsError as E;
        let status = match &e {
            E::Session(_) | E::Budget(_) | E::Agent { .. } => 0,
            E::SessionNotFound { .. } | E::ProcessNotFound { .. } | E::KeyNotFound { .. } => 404,
            E::InvalidSessionId { .. }
            | E::InvalidPath { .. }
            | E::BadRequest(_)
            | E::TimeoutTooLong { .. } => 400,
            E::Cancelled(_) | E::KeyRevoked { .. } => 409,
            E::Timeout(_) => 504,
            E::UnexpectedAnswer(_) => 502,
            E::Forbidden(_) => 403,
            E::FileTooLarge { .. } => 413,
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

    /// MCP words an operation's error with `OpsError::message`: the same
    /// text REST puts in `message`.
    #[test]
    fn ops_messages_are_the_rest_messages() {
        use crate::ops::OpsError as E;
        use crate::proto::ErrorBody;
        let refusal = || {
            ClientError::Agent(ErrorBody {
                code: ErrorCode::NotFound,
                message: "no such process".into(),
                id: None,
            })
        };
        let cases = [
            E::SessionNotFound { id: "x".into() },
            E::TimeoutTooLong { ms: 9, max: 5 },
            E::ProcessNotFound {
                proc: 3,
                session: "x".into(),
            },
            E::UnexpectedAnswer("Pong".into()),
            E::Cancelled("the run was cancelled".into()),
            E::agent("stdin")(refusal()),
            E::agent("exec")(ClientError::Timeout(std::time::Duration::from_millis(1500))),
            E::agent("exec")(ClientError::Closed("gone".into())),
            E::Session(crate::session::SessionError::Agent(refusal())),
            E::Session(crate::session::SessionError::ShuttingDown),
        ];
        for e in cases {
            let m = e.message();
            assert_eq!(ApiError::from(e).message, m);
        }
    }

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

    /// MCP shows an operation's error as its `Display`: the message REST
    /// answers with for the same error.
    #[test]
    fn ops_errors_read_as_rest_messages() {
        use crate::ops::OpsError;
        use crate::proto::ErrorBody;
        use crate::session::SessionError;
        use std::time::Duration;
        fn agent(code: ErrorCode) -> ClientError {
            ClientError::Agent(ErrorBody {
                code,
                message: "no such file".into(),
                id: None,
            })
        }
        let cases: Vec<fn() -> OpsError> = vec![
            || OpsError::agent("read /x")(agent(ErrorCode::NotFound)),
            || OpsError::agent("ping")(ClientError::Timeout(Duration::from_millis(1500))),
            || OpsError::agent("list .")(ClientError::Closed("gone".into())),
            || OpsError::agent("list .")(ClientError::OverBudget("too many".into())),
            || OpsError::agent("stat")(ClientError::Protocol("bad frame".into())),
            || SessionError::Agent(agent(ErrorCode::Invalid)).into(),
            || SessionError::Agent(ClientError::Closed("gone".into())).into(),
            || SessionError::AtCapacity { max: 3 }.into(),
            || OpsError::FileTooLarge {
                path: "/x".into(),
                max: 10,
            },
            || OpsError::unexpected("Pong"),
            || OpsError::SessionNotFound { id: "s1".into() },
            || crate::budget::too_large(10, 5, "list less").into(),
        ];
        for make in cases {
            let shown = make().to_string();
            let rest = ApiError::from(make());
            assert_eq!(shown, rest.message, "{rest}");
        }
        let e = ApiError::from(OpsError::FileTooLarge {
            path: "/x".into(),
            max: 10,
        });
        assert_eq!((e.status, e.code), (413, "file_too_large"));
        let e = ApiError::from(OpsError::unexpected("Pong"));
        assert_eq!((e.status, e.code), (502, "agent_error"));
        assert_eq!(e.message, "unexpected answer \"Pong\"");
    }
}
