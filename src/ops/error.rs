//! The one error type of the operations layer. Each variant says what went
//! wrong in the client's terms; the front ends map it at the edge (REST:
//! status + `code`, `api::errors`; MCP: a tool error or JSON-RPC error).
//! Errors of the layers below keep their own types and are carried here.

use crate::agent::ClientError;
use crate::budget::BudgetError;
use crate::session::SessionError;

pub type OpsResult<T> = Result<T, OpsError>;

#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// No session of that id among the caller's.
    #[error("no session {id:?}")]
    SessionNotFound { id: String },
    /// No API key of that id.
    #[error("no key {id:?}")]
    KeyNotFound { id: String },
    #[error("session id {id:?} is invalid: use 1-64 characters of A-Z a-z 0-9 _ -")]
    InvalidSessionId { id: String },
    /// A guest path the daemon refuses before it reaches the guest (`path`
    /// is the name of the field, e.g. `path` or `from`).
    #[error("{path} {why}")]
    InvalidPath { path: String, why: &'static str },
    /// A request field with a bad value (the message names the field).
    #[error("{0}")]
    BadRequest(String),
    /// What the caller's key may not do.
    #[error("{0}")]
    Forbidden(String),
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Budget(#[from] BudgetError),
    /// The agent refused or failed `what` (its own error code is kept).
    #[error("{what}: {source}")]
    Agent { what: String, source: ClientError },
    /// Our fault: a thread that did not start, a reply that did not
    /// serialize.
    #[error("{0}")]
    Internal(String),
}

impl OpsError {
    /// The agent's failure of `what`.
    pub fn agent(what: impl Into<String>) -> impl FnOnce(ClientError) -> OpsError {
        let what = what.into();
        move |source| OpsError::Agent { what, source }
    }

    /// The transport-neutral error code (REST `code`; the front ends add
    /// a status). Agent failures are coded by the front end's mapping of
    /// the agent's own code.
    pub fn code(&self) -> &'static str {
        match self {
            OpsError::SessionNotFound { .. } => "session_not_found",
            OpsError::KeyNotFound { .. } => "key_not_found",
            OpsError::InvalidSessionId { .. } => "invalid_session_id",
            OpsError::InvalidPath { .. } => "invalid_path",
            OpsError::BadRequest(_) => "bad_request",
            OpsError::Forbidden(_) => "forbidden",
            OpsError::Session(e) => e.code(),
            OpsError::Budget(e) => e.code(),
            OpsError::Agent { .. } => "agent_error",
            OpsError::Internal(_) => "internal",
        }
    }
}
