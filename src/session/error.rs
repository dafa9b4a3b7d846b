//! What the session layer can refuse or fail with. Typed here, where it
//! arises; the front ends give it an HTTP status or a JSON-RPC error
//! (through `ops::OpsError`).

use crate::agent::ClientError;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("session {id:?} already exists")]
    Exists { id: String },
    /// A shape field outside its range or over a maximum (the message
    /// names the field and the bound).
    #[error("{0}")]
    InvalidShape(String),
    #[error("unknown template {name:?} (see GET /exec/templates)")]
    UnknownTemplate { name: String },
    /// The key's quota is used up (the message names the quota).
    #[error("{0}")]
    QuotaExceeded(String),
    #[error("the server runs its maximum of {max} sessions; delete one or retry later")]
    AtCapacity { max: usize },
    /// The host drains (issue #28): it takes no new sessions.
    #[error("this host is draining: it takes no new sessions; create the session on another host")]
    Draining,
    #[error("session {id:?}: spawn worker thread: {why}")]
    Thread { id: String, why: String },
    #[error("session {id:?} failed to start: {why}")]
    Failed { id: String, why: String },
    #[error("session {id:?} was closed")]
    Closed { id: String },
    #[error("session {id:?} did not become ready within {wait:?}")]
    StartTimeout { id: String, wait: Duration },
    #[error("session {id:?}: egress change timed out")]
    EgressTimeout { id: String },
    #[error("{0}")]
    EgressNotApplied(String),
    /// A pause, checkpoint or fork while a command runs (it would be cut
    /// off), or while another state change is under way.
    #[error("session {id:?} is busy: {why}")]
    Busy { id: String, why: String },
    /// What the backend cannot do (local-process: checkpoints).
    #[error("{0}")]
    Unsupported(String),
    /// A checkpoint this host cannot restore.
    #[error("checkpoint of session {id:?} cannot be restored on this host: {why}")]
    Unrestorable { id: String, why: String },
    /// Writing a checkpoint failed; the session runs on.
    #[error("checkpoint of session {id:?} failed: {why}")]
    CheckpointFailed {
        id: String,
        why: String,
        no_space: bool,
    },
    /// Starting the request on the agent failed.
    #[error("start request: {0}")]
    Agent(ClientError),
}

impl SessionError {
    /// The error code clients see (REST `code`, MCP error data).
    pub fn code(&self) -> &'static str {
        match self {
            SessionError::ShuttingDown => "unavailable",
            SessionError::Exists { .. } => "session_exists",
            SessionError::InvalidShape(_) => "invalid_shape",
            SessionError::UnknownTemplate { .. } => "unknown_template",
            SessionError::QuotaExceeded(_) => "quota_exceeded",
            SessionError::AtCapacity { .. } => "at_capacity",
            SessionError::Draining => "draining",
            SessionError::Thread { .. } => "internal",
            SessionError::Failed { .. } => "session_failed",
            SessionError::Closed { .. } => "session_closed",
            SessionError::StartTimeout { .. } => "session_start_timeout",
            SessionError::EgressTimeout { .. } => "timeout",
            SessionError::EgressNotApplied(_) => "egress_not_applied",
            SessionError::Busy { .. } => "session_busy",
            SessionError::Unsupported(_) => "not_supported",
            SessionError::Unrestorable { .. } => "snapshot_unrestorable",
            SessionError::CheckpointFailed { .. } => "checkpoint_failed",
            SessionError::Agent(_) => "agent_error",
        }
    }
}
