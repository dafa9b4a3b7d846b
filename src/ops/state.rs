//! Stateful sessions (issue #21): checkpoints of a running session, fork,
//! pause and resume, sessions started from a checkpoint. The state lives
//! in the session layer's checkpoint store (`session::checkpoints`); this
//! module checks what a caller may do and shows it.

use super::{Ops, OpsError, OpsResult, Principal, SessionSpec};
use crate::session::Session;
use serde::Serialize;
use std::sync::Arc;

/// The most sessions one fork, or one create from a snapshot (`count`),
/// starts.
pub const MAX_FORK: u32 = 100;

/// A checkpoint as the API shows it (`/v1/snapshots`, MCP
/// `list_snapshots`). Times are ms since the epoch.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotView {
    /// `snap-` and 12 hex digits.
    pub id: String,
    pub name: Option<String>,
    /// The session it was taken of.
    pub session_id: String,
    pub template: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub disk_mib: u32,
    /// Bytes its files take on disk (sparse: what is allocated).
    pub size_bytes: u64,
    /// How long the source's guest was stopped to write it.
    pub paused_ms: u64,
    pub created_at: u64,
    /// Whether this host can start sessions from it; if not, `problem`
    /// says why (other VMM version, kernel, rootfs).
    pub restorable: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
}

impl SnapshotView {
    pub fn json(&self) -> serde_json::Value {
        // Strings and numbers: cannot fail.
        serde_json::to_value(self).unwrap_or_default()
    }
}

/// What a fork answers: the copies (started, not yet waited for: see
/// [`Ops::ready`]) and how long the source was paused.
pub struct Fork {
    pub source: Arc<Session>,
    pub paused_ms: u64,
    /// The checkpoint's size on disk.
    pub snapshot_bytes: u64,
    pub sessions: Vec<Arc<Session>>,
}

fn unsupported<T>() -> OpsResult<T> {
    Err(OpsError::NotSupported(
        "stateful sessions are not built yet".into(),
    ))
}

impl Ops {
    /// Saves the running session's whole state as a new snapshot of the
    /// caller's; the session runs on.
    pub fn checkpoint(&self, s: &Arc<Session>, name: Option<String>) -> OpsResult<SnapshotView> {
        let _ = (s, name);
        unsupported()
    }

    /// The caller's snapshots (an admin key with `every_owner`: all).
    pub fn snapshots(&self, p: &Principal, every_owner: bool) -> Vec<SnapshotView> {
        let _ = (p, every_owner);
        Vec::new()
    }

    /// The caller's snapshot `sid`.
    pub fn snapshot(&self, p: &Principal, sid: &str) -> OpsResult<SnapshotView> {
        let _ = p;
        Err(OpsError::SnapshotNotFound { id: sid.into() })
    }

    /// Removes the caller's snapshot `sid` (sessions started from it run
    /// on).
    pub fn delete_snapshot(&self, p: &Principal, sid: &str) -> OpsResult<()> {
        let _ = p;
        Err(OpsError::SnapshotNotFound { id: sid.into() })
    }

    /// `spec.count` sessions (default 1) from checkpoint
    /// `spec.from_snapshot`, started in the background ([`Ops::ready`]
    /// waits for each); without `from_snapshot`, [`Ops::create`].
    pub fn create_many(&self, p: &Principal, spec: SessionSpec) -> OpsResult<Vec<Arc<Session>>> {
        let _ = (p, spec);
        unsupported()
    }

    /// Checkpoint + `count` sessions started from it; the source runs on.
    pub fn fork(&self, s: &Arc<Session>, count: u32) -> OpsResult<Fork> {
        let _ = (s, count);
        unsupported()
    }

    /// Saves the session's state and stops its VMM; it stays listed as
    /// `paused`.
    pub fn pause(&self, s: &Arc<Session>) -> OpsResult<()> {
        let _ = s;
        unsupported()
    }

    /// Restores a paused session where it was (a running one: nothing to
    /// do).
    pub fn resume(&self, s: &Arc<Session>) -> OpsResult<()> {
        let _ = s;
        unsupported()
    }
}

impl Ops {
    /// Waits for each of `sessions` (started together, so the wait is the
    /// slowest one's), for the front ends' answer to a fork or a create of
    /// several. One that fails to start is removed ([`Ops::ready`]) and its
    /// error is kept in its place; if every one failed, the first error is
    /// the answer.
    pub fn ready_each(&self, sessions: &[Arc<Session>]) -> OpsResult<Vec<OpsResult<()>>> {
        let each: Vec<OpsResult<()>> = sessions.iter().map(|s| self.ready(s)).collect();
        if each.iter().any(Result::is_ok) {
            return Ok(each);
        }
        match each.into_iter().next() {
            Some(Err(e)) => Err(e),
            _ => Ok(Vec::new()),
        }
    }
}
