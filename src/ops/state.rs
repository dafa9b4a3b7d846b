//! Stateful sessions (issue #21): checkpoints of a running session, fork,
//! pause and resume, sessions started from a checkpoint. The state lives
//! in the session layer's checkpoint store (`session::checkpoints`); this
//! module checks what a caller may do and shows it.

use super::sessions::{new_id, options};
use super::{validate, Ops, OpsError, OpsResult, Principal, SessionSpec};
use crate::sandbox::SandboxSpec;
use crate::session::checkpoints::{Entry, Kind};
use crate::session::{Session, SessionError, SessionOptions, State};
use serde::Serialize;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The most sessions one fork, or one create from a snapshot, starts
/// (defined with the other request limits in `validate`).
pub use super::validate::MAX_FORK;

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

/// A state change of the session layer in this layer's terms.
fn lift(e: SessionError) -> OpsError {
    match e {
        SessionError::Busy { id, why } => OpsError::SessionBusy { id, why },
        SessionError::Unsupported(m) => OpsError::NotSupported(m),
        SessionError::Unrestorable { id, why } => OpsError::SnapshotUnrestorable { id, why },
        SessionError::CheckpointFailed { id, why, no_space } => {
            OpsError::CheckpointFailed { id, why, no_space }
        }
        e => OpsError::Session(e),
    }
}

fn busy(s: &Session, what: &str) -> OpsResult<()> {
    // Checked first, for its own message: secret files must never be in a
    // snapshot, so this is a refusal, not a wait.
    if !crate::sync::lock(&s.secret_files).is_empty() {
        return Err(OpsError::SessionBusy {
            id: s.id.clone(),
            why: format!(
                "a command with secret files (/run/secrets) is running (or its files \
                 could not be removed) and a snapshot must not capture them; {what} once \
                 it ends"
            ),
        });
    }
    if s.busy() {
        return Err(OpsError::SessionBusy {
            id: s.id.clone(),
            why: format!(
                "a command is running; {what} once it ends (background processes are kept)"
            ),
        });
    }
    Ok(())
}

/// The spec a restore from `e` is checked with: the checkpoint's template
/// and shape.
fn spec_of(e: &Entry) -> SandboxSpec {
    e.meta().sandbox_spec(e.meta().id.clone())
}

impl Ops {
    /// How long a checkpoint, pause or resume may take before the caller
    /// is told the session is busy (it still finishes).
    fn state_wait(&self) -> Duration {
        self.cfg.create_timeout.max(Duration::from_secs(120))
    }

    fn view(&self, e: &Entry) -> SnapshotView {
        let m = e.meta();
        let problem = match self.mgr.factory.check_restorable(&spec_of(e), e.dir()) {
            Ok(()) => None,
            Err(err) => Some(err.to_string()),
        };
        SnapshotView {
            id: m.id.clone(),
            name: m.name.clone(),
            session_id: m.session_id.clone(),
            template: m.template.clone(),
            vcpus: m.vcpus,
            memory_mib: m.mem_mib,
            disk_mib: m.disk_mib,
            size_bytes: m.bytes,
            paused_ms: m.paused_ms,
            created_at: m.created_unix_ms,
            restorable: problem.is_none(),
            problem,
        }
    }

    fn snapshot_entry(&self, owner: &str, sid: &str) -> OpsResult<Arc<Entry>> {
        validate::snapshot_id(sid, "snapshot")?;
        self.mgr
            .checkpoints
            .get(owner, sid)
            .ok_or_else(|| OpsError::SnapshotNotFound { id: sid.into() })
    }

    /// Saves the running session's whole state as a new snapshot of its
    /// owner's; the session runs on (its guest stopped only while the
    /// state is written: `pausedMs`).
    pub fn checkpoint(&self, s: &Arc<Session>, name: Option<String>) -> OpsResult<SnapshotView> {
        if let Some(n) = &name {
            validate::snapshot_name(n)?;
        }
        busy(s, "checkpoint it")?;
        let store = &self.mgr.checkpoints;
        let held = store.list(Some(&s.owner));
        if held.len() >= self.cfg.max_snapshots_per_key {
            return Err(OpsError::Session(SessionError::QuotaExceeded(format!(
                "key {} holds {} snapshots, its quota max_snapshots_per_key is {}; delete one first",
                s.owner,
                held.len(),
                self.cfg.max_snapshots_per_key
            ))));
        }
        self.disk_quota(&s.owner)?;
        let e = s
            .checkpoint(Kind::Checkpoint, name, self.state_wait())
            .map_err(lift)?;
        Ok(self.view(&e))
    }

    /// `owner`'s snapshots and paused sessions may take more disk.
    fn disk_quota(&self, owner: &str) -> OpsResult<()> {
        let paused: u64 = self
            .mgr
            .list(Some(owner))
            .iter()
            .filter_map(|s| s.paused())
            .map(|p| p.bytes)
            .sum();
        let used = self.mgr.checkpoints.bytes_of(owner) + paused;
        let max = self.cfg.max_snapshot_bytes_per_key;
        if used >= max {
            return Err(OpsError::Session(SessionError::QuotaExceeded(format!(
                "key {owner}'s snapshots and paused sessions take {} MiB, its quota \
                 max_snapshot_bytes_per_key is {} MiB; delete a snapshot or a paused session",
                used >> 20,
                max >> 20
            ))));
        }
        Ok(())
    }

    /// The caller's snapshots (an admin key with `every_owner`: all).
    pub fn snapshots(&self, p: &Principal, every_owner: bool) -> Vec<SnapshotView> {
        let owner = (!(every_owner && p.is_admin())).then_some(p.id.as_str());
        self.mgr
            .checkpoints
            .list(owner)
            .iter()
            .map(|e| self.view(e))
            .collect()
    }

    /// The caller's snapshot `sid`.
    pub fn snapshot(&self, p: &Principal, sid: &str) -> OpsResult<SnapshotView> {
        let e = self.snapshot_entry(&p.id, sid)?;
        Ok(self.view(&e))
    }

    /// Removes the caller's snapshot `sid` (sessions started from it run
    /// on; its files go once those being started from it are up).
    pub fn delete_snapshot(&self, p: &Principal, sid: &str) -> OpsResult<()> {
        self.snapshot_entry(&p.id, sid)?;
        if self.mgr.checkpoints.remove(&p.id, sid) {
            Ok(())
        } else {
            Err(OpsError::SnapshotNotFound { id: sid.into() })
        }
    }

    /// `spec.count` sessions (default 1) from checkpoint
    /// `spec.from_snapshot`, started in the background ([`Ops::ready`]
    /// waits for each); without `from_snapshot`, [`Ops::create`].
    pub fn create_many(
        &self,
        p: &Principal,
        mut spec: SessionSpec,
    ) -> OpsResult<Vec<Arc<Session>>> {
        let Some(sid) = spec.from_snapshot.clone() else {
            if spec.count.is_some() {
                return Err(OpsError::BadRequest(
                    "count needs fromSnapshot (sessions from one checkpoint)".into(),
                ));
            }
            return Ok(vec![self.create(p, spec)?]);
        };
        let count = validate::count(spec.count.unwrap_or(1).into(), "count")?;
        if count > 1 && spec.id.is_some() {
            return Err(OpsError::BadRequest(
                "id names one session: leave it out with count > 1".into(),
            ));
        }
        validate::snapshot_id(&sid, "fromSnapshot")?;
        let e = self.snapshot_entry(&p.id, &sid)?;
        let m = e.meta();
        let differs = [
            (
                "template",
                spec.template
                    .as_ref()
                    .is_some_and(|t| *t != m.template && t != "default"),
            ),
            ("vcpus", spec.vcpus.is_some_and(|v| v != m.vcpus)),
            ("memoryMib", spec.memory_mib.is_some_and(|v| v != m.mem_mib)),
            ("diskMib", spec.disk_mib.is_some_and(|v| v != m.disk_mib)),
        ];
        if let Some((field, _)) = differs.iter().find(|(_, d)| *d) {
            return Err(OpsError::BadRequest(format!(
                "{field} differs from snapshot {sid}'s (template {}, {} vCPUs, {} MiB, {} MiB \
                 disk): a session from a snapshot has its shape; leave {field} out",
                m.template, m.vcpus, m.mem_mib, m.disk_mib
            )));
        }
        if let Some(eg) = &spec.egress {
            validate::egress(eg, &self.cfg)?;
        }
        if let Err(err) = self.mgr.factory.check_restorable(&spec_of(&e), e.dir()) {
            return Err(OpsError::SnapshotUnrestorable {
                id: sid,
                why: err.to_string(),
            });
        }
        let ids = match spec.id.take() {
            Some(id) => {
                validate::session_id(&id)?;
                vec![id]
            }
            None => (0..count).map(|_| new_id()).collect::<OpsResult<_>>()?,
        };
        self.can_inject(&spec.secrets)?;
        // Template and shape are the checkpoint's (checked above).
        let opts = options(spec)?;
        self.mgr
            .create_from(&p.id, &ids, &e, opts)
            .map_err(OpsError::from)
    }

    /// Checkpoint + `count` sessions started from it, each with its own
    /// namespace, VMM uid and cgroup and the source's egress policy,
    /// lifetime left, timeouts and env; the source runs on.
    pub fn fork(&self, s: &Arc<Session>, count: u32) -> OpsResult<Fork> {
        let count = validate::count(count.into(), "count")?;
        busy(s, "fork it")?;
        let e = s
            .checkpoint(Kind::Fork, None, self.state_wait())
            .map_err(lift)?;
        let ids = (0..count)
            .map(|_| new_id())
            .collect::<OpsResult<Vec<_>>>()?;
        let opts = SessionOptions {
            ttl: Some(
                s.expires()
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_secs(1)),
            ),
            idle_timeout: Some(s.idle_timeout),
            egress: Some(crate::sync::lock(&s.egress).clone()),
            on_idle: Some(s.on_idle),
            paused_ttl: Some(s.paused_ttl),
            // The copies' processes hold the source's placeholders; each
            // copy gets a CA of its own.
            secrets_from: s.injection(),
            ..Default::default()
        };
        let sessions = self.mgr.create_from(&s.owner, &ids, &e, opts)?;
        let a = self.audit();
        a.record(
            &s.owner,
            &s.id,
            "session",
            serde_json::json!({"event": "forked", "copies": ids}),
        );
        for c in &sessions {
            a.record(
                &c.owner,
                &c.id,
                "session",
                serde_json::json!({"event": "forked_from", "source": s.id}),
            );
        }
        Ok(Fork {
            source: s.clone(),
            paused_ms: e.meta().paused_ms,
            snapshot_bytes: e.meta().bytes,
            sessions,
        })
    }

    /// Saves the session's state and stops its VMM; it stays listed as
    /// `paused` until resumed, deleted or its `pausedTtl` passes.
    pub fn pause(&self, s: &Arc<Session>) -> OpsResult<()> {
        if s.state() == State::Paused {
            return Ok(());
        }
        busy(s, "pause it")?;
        let paused = self
            .mgr
            .list(Some(&s.owner))
            .iter()
            .filter(|x| x.state() == State::Paused)
            .count();
        if paused >= self.cfg.max_paused_per_key {
            return Err(OpsError::Session(SessionError::QuotaExceeded(format!(
                "key {} holds {paused} paused sessions, its quota max_paused_per_key is {}; \
                 resume or delete one first",
                s.owner, self.cfg.max_paused_per_key
            ))));
        }
        self.disk_quota(&s.owner)?;
        let r = s.pause(self.state_wait()).map_err(lift);
        self.audit_state(s, "paused", &r);
        r
    }

    fn audit_state(&self, s: &Session, event: &str, r: &OpsResult<()>) {
        let error = r.as_ref().err().map(|e| e.to_string());
        self.audit().record(
            &s.owner,
            &s.id,
            "session",
            serde_json::json!({"event": event, "ok": r.is_ok(), "error": error}),
        );
    }

    /// Restores a paused session where it was (a running one: nothing to
    /// do).
    pub fn resume(&self, s: &Arc<Session>) -> OpsResult<()> {
        let was_paused = s.state() == State::Paused;
        let r = s.resume(self.state_wait()).map_err(lift);
        if was_paused {
            self.audit_state(s, "resumed", &r);
        }
        r
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
