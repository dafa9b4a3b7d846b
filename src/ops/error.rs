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
    /// A revoked key cannot be given a new secret.
    #[error("key {id:?} is revoked; create a new key instead")]
    KeyRevoked { id: String },
    #[error("session id {id:?} is invalid: use 1-64 characters of A-Z a-z 0-9 _ -")]
    InvalidSessionId { id: String },
    /// A guest path the daemon refuses before it reaches the guest (`path`
    /// is the name of the field, e.g. `path` or `from`).
    #[error("{path} {why}")]
    InvalidPath { path: String, why: &'static str },
    /// A request field with a bad value (the message names the field).
    #[error("{0}")]
    BadRequest(String),
    /// A command's timeout over the configured maximum.
    #[error("timeout {ms} ms exceeds the maximum of {max} ms")]
    TimeoutTooLong { ms: u64, max: u64 },
    /// No process `proc` in the session's sandbox.
    #[error("no process {proc} in session {session:?}")]
    ProcessNotFound { proc: u64, session: String },
    /// The caller (or its client going away) stopped the operation.
    #[error("{0}")]
    Cancelled(String),
    /// The guest did not answer in time (the message says what).
    #[error("{0}")]
    Timeout(String),
    /// What the caller's key may not do.
    #[error("{0}")]
    Forbidden(String),
    /// A file read over its limit (`max` bytes).
    #[error("{path} is larger than {max} bytes")]
    FileTooLarge { path: String, max: u64 },
    /// Displayed as the front ends word it: a failure to start the request
    /// on the agent reads like [`OpsError::Agent`].
    #[error("{}", session_message(.0))]
    Session(#[from] SessionError),
    #[error(transparent)]
    Budget(#[from] BudgetError),
    /// The agent refused or failed `what` (its own error code is kept).
    #[error("{what}: {}", agent_detail(source))]
    Agent { what: String, source: ClientError },
    /// The agent answered with a response that does not fit the request
    /// (its debug form).
    #[error("unexpected answer {0}")]
    UnexpectedAnswer(String),
    /// Our fault: a thread that did not start, a reply that did not
    /// serialize.
    #[error("{0}")]
    Internal(String),
}

/// What a client is told about an agent failure, after the name of what
/// failed (REST `message`, MCP error text): the agent's own message, not
/// our wrapping of it.
pub fn agent_detail(e: &ClientError) -> String {
    match e {
        ClientError::Agent(b) => b.message.clone(),
        ClientError::Timeout(d) => format!("no answer after {d:.1?}"),
        ClientError::Closed(m) | ClientError::OverBudget(m) => m.clone(),
        other => other.to_string(),
    }
}

fn session_message(e: &SessionError) -> String {
    match e {
        SessionError::Agent(a) => format!("start request: {}", agent_detail(a)),
        other => other.to_string(),
    }
}

/// What a client is told of an agent failure of `what`.
pub fn agent_message(e: &ClientError, what: &str) -> String {
    format!("{what}: {}", agent_detail(e))
}

impl OpsError {
    /// An answer of the wrong kind from the agent.
    pub fn unexpected(answer: impl std::fmt::Debug) -> OpsError {
        OpsError::UnexpectedAnswer(format!("{answer:?}"))
    }

    /// What a client is told: REST's `message`, MCP's tool error text (the
    /// error's Display, which words agent failures the front ends' way).
    pub fn message(&self) -> String {
        self.to_string()
    }

    /// The agent's failure of `what`.
    pub fn agent(what: impl Into<String>) -> impl FnOnce(ClientError) -> OpsError {
        let what = what.into();
        move |source| OpsError::Agent { what, source }
    }

    /// The same error, an agent failure named `what` instead (a front
    /// end that words its steps its own way).
    pub fn with_what(self, what: impl Into<String>) -> OpsError {
        match self {
            OpsError::Agent { source, .. } => OpsError::Agent {
                what: what.into(),
                source,
            },
            other => other,
        }
    }

    /// The guest refused the request (an error answer), as opposed to a
    /// connection or time failure.
    pub fn is_agent_refusal(&self) -> bool {
        matches!(
            self,
            OpsError::Agent {
                source: ClientError::Agent(_),
                ..
            }
        )
    }

    /// The transport-neutral error code (REST `code`; the front ends add
    /// a status). Agent failures are coded by the front end's mapping of
    /// the agent's own code.
    pub fn code(&self) -> &'static str {
        match self {
            OpsError::SessionNotFound { .. } => "session_not_found",
            OpsError::KeyNotFound { .. } => "key_not_found",
            OpsError::KeyRevoked { .. } => "key_revoked",
            OpsError::InvalidSessionId { .. } => "invalid_session_id",
            OpsError::InvalidPath { .. } => "invalid_path",
            OpsError::BadRequest(_) => "bad_request",
            OpsError::TimeoutTooLong { .. } => "bad_request",
            OpsError::ProcessNotFound { .. } => "process_not_found",
            OpsError::Cancelled(_) => "cancelled",
            OpsError::Timeout(_) => "timeout",
            OpsError::Forbidden(_) => "forbidden",
            OpsError::FileTooLarge { .. } => "file_too_large",
            OpsError::Session(e) => e.code(),
            OpsError::Budget(e) => e.code(),
            OpsError::Agent { .. } | OpsError::UnexpectedAnswer(_) => "agent_error",
            OpsError::Internal(_) => "internal",
        }
    }
}
