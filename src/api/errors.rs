//! API errors, with the matching HTTP status, in the shape of the API the
//! request addressed: `/v1` (and everything else) answers
//! `{"error": {"code", "message"}}`; the seed routes answer as the seed
//! does, `{"error": "<message>", "code"}` (a seed client shows `error`).

use crate::ops::error::AgentFailure;
use crate::ops::OpsError;
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
}

/// The status and code of an agent failure. Agent-side errors about the
/// user's input (missing file, bad path) are the client's problem (4xx);
/// a dead agent connection is ours (502/503).
fn agent_status(f: AgentFailure) -> (u16, &'static str) {
    match f {
        AgentFailure::Refused(code) => match code {
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
        AgentFailure::Timeout => (504, "timeout"),
        AgentFailure::Closed => (503, "sandbox_unavailable"),
        // The guest answered with more than the host accepts.
        AgentFailure::OverBudget => (502, "guest_reply_too_large"),
        AgentFailure::Other => (502, "agent_error"),
    }
}

/// The status of a session-layer refusal, by its code.
fn session_status(code: &str) -> u16 {
    match code {
        "unavailable" | "at_capacity" | "draining" | "session_failed" => 503,
        "session_exists" | "egress_not_applied" | "session_busy" | "snapshot_unrestorable" => 409,
        "not_supported" => 501,
        "invalid_shape" | "unknown_template" => 400,
        // (No Retry-After: the quota frees only when the key ends a
        // session.)
        "quota_exceeded" => 429,
        "session_closed" => 410,
        "session_start_timeout" | "timeout" => 504,
        // `internal`: a worker thread that did not start.
        _ => 500,
    }
}

/// The one mapping of an operation's error to HTTP.
impl From<OpsError> for ApiError {
    fn from(e: OpsError) -> ApiError {
        use OpsError as E;
        let message = e.to_string();
        if let Some(f) = e.agent_failure() {
            let (status, code) = agent_status(f);
            return ApiError::new(status, code, message);
        }
        if let E::Budget(b) = e {
            return b.into();
        }
        let retry_after = e.retry_after();
        let status = match &e {
            E::Budget(_) => 500, // answered above
            E::Session(_) => session_status(e.code()),
            E::SessionNotFound { .. }
            | E::ProcessNotFound { .. }
            | E::KeyNotFound { .. }
            | E::SnapshotNotFound { .. }
            | E::BuildNotFound { .. }
            | E::TemplateNotFound { .. } => 404,
            E::InvalidSessionId { .. }
            | E::InvalidPath { .. }
            | E::BadRequest(_)
            | E::TimeoutTooLong { .. } => 400,
            E::Cancelled(_)
            | E::KeyRevoked { .. }
            | E::SessionBusy { .. }
            | E::SnapshotUnrestorable { .. }
            | E::TemplateBusy { .. } => 409,
            E::NotSupported(_) => 501,
            E::CheckpointFailed { no_space: true, .. } => 507,
            E::CheckpointFailed { .. } => 500,
            E::Timeout(_) => 504,
            E::Agent { .. } | E::UnexpectedAnswer(_) => 502,
            E::Forbidden(_) => 403,
            E::FileTooLarge { .. } => 413,
            E::Internal(_) => 500,
        };
        let mut a = ApiError::new(status, e.code(), message);
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

    /// Every kind of operation error keeps its REST status, code,
    /// `Retry-After` and message.
    #[test]
    fn rest_mapping_of_every_error() {
        let got: Vec<String> = crate::ops::error::samples()
            .into_iter()
            .map(|e| {
                let m = e.message();
                let a = ApiError::from(e);
                assert_eq!(a.message, m);
                format!("{} {} {:?} {}", a.status, a.code, a.retry_after, a.message)
            })
            .collect();
        let want = [
            "404 session_not_found None no session \"s1\"",
            "404 key_not_found None no key \"k1\"",
            "409 key_revoked None key \"k1\" is revoked; create a new key instead",
            "400 invalid_session_id None session id \"a b\" is invalid: use 1-64 characters of A-Z a-z 0-9 _ -",
            "400 invalid_path None path must be absolute",
            "400 bad_request None limits.vcpus must be 1..=64",
            "400 bad_request None timeout 9 ms exceeds the maximum of 5 ms",
            "404 process_not_found None no process 3 in session \"s1\"",
            "409 cancelled None the run was cancelled",
            "504 timeout None no answer",
            "403 forbidden None owner= needs an admin key",
            "413 file_too_large None /x is larger than 10 bytes",
            "502 agent_error None unexpected answer \"Pong\"",
            "500 internal None thread",
            "404 snapshot_not_found None no snapshot \"snap-1\"",
            "409 session_busy None session \"s1\" is busy: a command is running",
            "501 not_supported None no checkpoints",
            "409 snapshot_unrestorable None snapshot \"snap-1\" cannot be restored on this host: other QEMU",
            "507 checkpoint_failed None checkpoint of session \"s1\" failed: write /x: no space",
            "500 checkpoint_failed None checkpoint of session \"s1\" failed: qmp",
            "404 build_not_found None no template build \"b1\"",
            "404 template_not_found None no template \"t\"",
            "409 template_busy None template \"t\": 2 sessions use it",
            "413 reply_too_large None the JSON reply would be 10 bytes, over the 5-byte limit; list less",
            "503 reply_memory_exhausted Some(1) the daemon is holding 1 of its 2 bytes for replies in flight; this one needs 3 more: retry shortly",
            "503 unavailable Some(1) the server is shutting down",
            "409 session_exists None session \"s1\" already exists",
            "400 invalid_shape None vcpus 0 outside 1..=64",
            "400 unknown_template None unknown template \"t\" (see GET /exec/templates)",
            "429 quota_exceeded None key k1 may run 1 session",
            "503 at_capacity Some(5) the server runs its maximum of 3 sessions; delete one or retry later",
            "500 internal None session \"s1\": spawn worker thread: EAGAIN",
            "503 session_failed None session \"s1\" failed to start: boot",
            "410 session_closed None session \"s1\" was closed",
            "504 session_start_timeout None session \"s1\" did not become ready within 2s",
            "504 timeout None session \"s1\": egress change timed out",
            "409 egress_not_applied None nft",
            "400 invalid None start request: no such file",
            "503 sandbox_unavailable None start request: gone",
            "404 file_not_found None read /x: no such file",
            "409 already_exists None read /x: no such file",
            "403 permission_denied None read /x: no such file",
            "400 not_a_directory None read /x: no such file",
            "400 is_a_directory None read /x: no such file",
            "409 directory_not_empty None read /x: no such file",
            "400 invalid None read /x: no such file",
            "400 spawn_failed None read /x: no such file",
            "507 no_space None read /x: no such file",
            "409 cancelled None read /x: no such file",
            "503 sandbox_unavailable None read /x: no such file",
            "422 guest_io_error None read /x: no such file",
            "502 agent_error None read /x: no such file",
            "504 timeout None exec: no answer after 1.5s",
            "503 sandbox_unavailable None exec: gone",
            "502 guest_reply_too_large None exec: too many",
            "502 agent_error None exec: agent protocol violation: bad frame",
            "502 agent_error None exec: agent connection: reset",
            "504 timeout None start request: no answer after 1.5s",
            "503 sandbox_unavailable None start request: gone",
            "502 guest_reply_too_large None start request: too many",
            "502 agent_error None start request: agent protocol violation: bad frame",
            "502 agent_error None start request: agent connection: reset",
        ];
        assert_eq!(got, want);
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
}
