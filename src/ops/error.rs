//! The one error type of the operations layer. Each variant says what went
//! wrong in the client's terms; the front ends map it at the edge (REST:
//! status + `code`, `api::errors`; MCP: a tool error or JSON-RPC error).
//! Errors of the layers below keep their own types and are carried here.

use crate::agent::ClientError;
use crate::budget::BudgetError;
use crate::proto::ErrorCode;
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
    /// No snapshot of that id among the caller's.
    #[error("no snapshot {id:?}")]
    SnapshotNotFound { id: String },
    /// The session runs a command (or is pausing, resuming, forking): the
    /// state change it was asked for would cut it off.
    #[error("session {id:?} is busy: {why}")]
    SessionBusy { id: String, why: String },
    /// What the daemon's backend cannot do (local-process: checkpoints).
    #[error("{0}")]
    NotSupported(String),
    /// A snapshot this host cannot restore (other VMM version, CPU model,
    /// kernel, rootfs): listed as such, never dropped.
    #[error("snapshot {id:?} cannot be restored on this host: {why}")]
    SnapshotUnrestorable { id: String, why: String },
    /// Writing a checkpoint failed (the message names the path); the
    /// session runs on and nothing of the checkpoint is left. `no_space`:
    /// the disk was full.
    #[error("checkpoint of session {id:?} failed: {why}")]
    CheckpointFailed {
        id: String,
        why: String,
        no_space: bool,
    },
    /// No template build of that id (finished ones are kept a while).
    #[error("no template build {id:?}")]
    BuildNotFound { id: String },
    /// No template of that name built from an image.
    #[error("no template {name:?}")]
    TemplateNotFound { name: String },
    /// The template is used by sessions, being built, or built-in.
    #[error("template {name:?}: {why}")]
    TemplateBusy { name: String, why: String },
    /// Our fault: a thread that did not start, a reply that did not
    /// serialize.
    #[error("{0}")]
    Internal(String),
}

/// How the agent failed, in this layer's terms: the front ends give it a
/// status or error kind without knowing the agent client's types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentFailure {
    /// The guest refused the request with its own error code.
    Refused(ErrorCode),
    /// No answer in time.
    Timeout,
    /// The connection to the agent is gone.
    Closed,
    /// The guest answered with more than the host accepts.
    OverBudget,
    /// A protocol or I/O failure of the connection.
    Other,
}

impl AgentFailure {
    fn of(e: &ClientError) -> AgentFailure {
        match e {
            ClientError::Agent(b) => AgentFailure::Refused(b.code),
            ClientError::Timeout(_) => AgentFailure::Timeout,
            ClientError::Closed(_) => AgentFailure::Closed,
            ClientError::OverBudget(_) => AgentFailure::OverBudget,
            ClientError::Protocol(_) | ClientError::Io(_) => AgentFailure::Other,
        }
    }
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

    /// How the agent failed, when the error is an agent failure (of an
    /// operation, or of starting a request on a session).
    pub fn agent_failure(&self) -> Option<AgentFailure> {
        match self {
            OpsError::Agent { source, .. } | OpsError::Session(SessionError::Agent(source)) => {
                Some(AgentFailure::of(source))
            }
            _ => None,
        }
    }

    /// Seconds after which a retry may succeed, for the errors that say
    /// so (REST `Retry-After`): the daemon shutting down or full, the
    /// reply budget used up.
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            OpsError::Session(SessionError::ShuttingDown) => Some(1),
            OpsError::Session(SessionError::AtCapacity { .. }) => Some(5),
            OpsError::Session(SessionError::Draining) => Some(1),
            OpsError::Budget(BudgetError::Exhausted { .. }) => Some(1),
            _ => None,
        }
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
            OpsError::SnapshotNotFound { .. } => "snapshot_not_found",
            OpsError::SessionBusy { .. } => "session_busy",
            OpsError::NotSupported(_) => "not_supported",
            OpsError::SnapshotUnrestorable { .. } => "snapshot_unrestorable",
            OpsError::CheckpointFailed { .. } => "checkpoint_failed",
            OpsError::BuildNotFound { .. } => "build_not_found",
            OpsError::TemplateNotFound { .. } => "template_not_found",
            OpsError::TemplateBusy { .. } => "template_busy",
            OpsError::Internal(_) => "internal",
        }
    }
}

/// One error of each kind (every variant, every agent failure, every
/// session error), for the front ends' tests of their mappings.
#[cfg(test)]
pub fn samples() -> Vec<OpsError> {
    use crate::proto::ErrorBody;
    use std::time::Duration;
    fn refused(code: ErrorCode) -> ClientError {
        ClientError::Agent(ErrorBody {
            code,
            message: "no such file".into(),
            id: None,
        })
    }
    let mut out = vec![
        OpsError::SessionNotFound { id: "s1".into() },
        OpsError::KeyNotFound { id: "k1".into() },
        OpsError::KeyRevoked { id: "k1".into() },
        OpsError::InvalidSessionId { id: "a b".into() },
        OpsError::InvalidPath {
            path: "path".into(),
            why: "must be absolute",
        },
        OpsError::BadRequest("limits.vcpus must be 1..=64".into()),
        OpsError::TimeoutTooLong { ms: 9, max: 5 },
        OpsError::ProcessNotFound {
            proc: 3,
            session: "s1".into(),
        },
        OpsError::Cancelled("the run was cancelled".into()),
        OpsError::Timeout("no answer".into()),
        OpsError::Forbidden("owner= needs an admin key".into()),
        OpsError::FileTooLarge {
            path: "/x".into(),
            max: 10,
        },
        OpsError::unexpected("Pong"),
        OpsError::Internal("thread".into()),
        OpsError::SnapshotNotFound {
            id: "snap-1".into(),
        },
        OpsError::SessionBusy {
            id: "s1".into(),
            why: "a command is running".into(),
        },
        OpsError::NotSupported("no checkpoints".into()),
        OpsError::SnapshotUnrestorable {
            id: "snap-1".into(),
            why: "other QEMU".into(),
        },
        OpsError::CheckpointFailed {
            id: "s1".into(),
            why: "write /x: no space".into(),
            no_space: true,
        },
        OpsError::CheckpointFailed {
            id: "s1".into(),
            why: "qmp".into(),
            no_space: false,
        },
        OpsError::BuildNotFound { id: "b1".into() },
        OpsError::TemplateNotFound { name: "t".into() },
        OpsError::TemplateBusy {
            name: "t".into(),
            why: "2 sessions use it".into(),
        },
        crate::budget::too_large(10, 5, "list less").into(),
        OpsError::Budget(BudgetError::Exhausted {
            used: 1,
            limit: 2,
            need: 3,
        }),
    ];
    let id = || "s1".to_string();
    let wait = Duration::from_secs(2);
    out.extend(
        [
            SessionError::ShuttingDown,
            SessionError::Exists { id: id() },
            SessionError::InvalidShape("vcpus 0 outside 1..=64".into()),
            SessionError::UnknownTemplate { name: "t".into() },
            SessionError::QuotaExceeded("key k1 may run 1 session".into()),
            SessionError::AtCapacity { max: 3 },
            SessionError::Thread {
                id: id(),
                why: "EAGAIN".into(),
            },
            SessionError::Failed {
                id: id(),
                why: "boot".into(),
            },
            SessionError::Closed { id: id() },
            SessionError::StartTimeout { id: id(), wait },
            SessionError::EgressTimeout { id: id() },
            SessionError::EgressNotApplied("nft".into()),
            SessionError::Agent(refused(ErrorCode::Invalid)),
            SessionError::Agent(ClientError::Closed("gone".into())),
        ]
        .map(OpsError::from),
    );
    let failures = || {
        [
            ClientError::Timeout(Duration::from_millis(1500)),
            ClientError::Closed("gone".into()),
            ClientError::OverBudget("too many".into()),
            ClientError::Protocol("bad frame".into()),
            ClientError::Io(std::io::Error::other("reset")),
        ]
    };
    let codes = [
        ErrorCode::NotFound,
        ErrorCode::AlreadyExists,
        ErrorCode::PermissionDenied,
        ErrorCode::NotADirectory,
        ErrorCode::IsADirectory,
        ErrorCode::DirectoryNotEmpty,
        ErrorCode::Invalid,
        ErrorCode::SpawnFailed,
        ErrorCode::NoSpace,
        ErrorCode::Cancelled,
        ErrorCode::Unavailable,
        ErrorCode::Io,
        ErrorCode::Protocol,
    ];
    out.extend(codes.map(|c| OpsError::agent("read /x")(refused(c))));
    out.extend(failures().map(|f| OpsError::agent("exec")(f)));
    out.extend(failures().map(|f| SessionError::Agent(f).into()));
    out
}
