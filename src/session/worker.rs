//! One thread per session: creates (or takes from the pool) the sandbox,
//! starts agent requests for the API, destroys the sandbox at the end.

use super::checkpoints::{self, Entry, Kind, Meta, PausedRecord, Store};
use super::pool::Pool;
use super::SessionError;
use super::{now_unix_ms, CheckpointAsk, Cmd, PausedInfo, Session, State};
use crate::config::guest_ca::GuestCas;
use crate::metrics::Metrics;
use crate::sandbox::{Sandbox, SandboxError, SandboxFactory, SandboxSpec};
use crate::sync::lock;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often an idle session checks that its sandbox is still there. A VMM
/// that dies (killed, crashed, OOM on the host) closes the agent
/// connection; in-flight calls fail at once, this catches idle sessions.
const LIVENESS_CHECK: Duration = Duration::from_secs(1);

/// What a session's worker uses of the registry (`Manager::home` fills
/// it): where sandboxes come from, the metrics, and how to drop a session
/// that failed. Passed in so the worker does not depend on the registry
/// that spawns it.
pub(crate) struct Home {
    pub pool: Arc<Pool>,
    pub factory: Arc<dyn SandboxFactory>,
    pub metrics: Arc<Metrics>,
    pub forget: Forget,
    /// Where checkpoints go.
    pub store: Arc<Store>,
    /// `guest_ca_bundle`'s CAs: in the guest before the session is ready.
    pub guest_cas: Option<Arc<GuestCas>>,
    /// The registry's admission of a paused session about to resume
    /// (capacity and the key's quota, as for a new session); it marks
    /// the session starting under the registry's lock.
    pub admit: Admit,
    /// The audit log the sandbox's layers (its egress proxy) record to.
    pub audit: crate::audit::Log,
}

/// The registry's `forget`: drops a session that failed to start.
pub(crate) type Forget = Box<dyn Fn(&Arc<Session>) + Send>;
/// See [`Home::admit`].
pub(crate) type Admit = Box<dyn Fn(&Arc<Session>) -> Result<(), SessionError> + Send>;

/// Where a session's first sandbox comes from.
pub(crate) enum Origin {
    /// Its template (the warm pool, a standby VMM or a restore).
    Template,
    /// A checkpoint (`fromSnapshot`, a fork's copy): held until it is up.
    Checkpoint(Arc<Entry>),
    /// Nowhere yet: a paused session found after a restart; its own
    /// checkpoint is restored by its resume.
    Paused(Arc<Entry>),
}

impl Home {
    fn forget(&self, s: &Arc<Session>) {
        (self.forget)(s)
    }
}

/// The sandbox went away under the session: mark it failed, drop it from
/// the registry (later requests get 404, or a fresh session on the seed
/// routes) and let the caller's loop destroy what is left of it.
fn died(mgr: &Home, session: &Arc<Session>) {
    log::error!(
        "session {}/{}: sandbox died (agent connection lost); destroying it",
        session.owner,
        session.id
    );
    mgr.metrics.error("sandbox_died");
    *lock(&session.state) = State::Failed("sandbox died (agent connection lost)".into());
    mgr.forget(session);
}

/// Session threads do little work of their own; a small stack keeps the
/// per-session memory low.
const STACK: usize = 256 * 1024;

/// Spawns the session's worker.
pub(crate) fn spawn(
    mgr: Home,
    session: Arc<Session>,
    rx: Receiver<Cmd>,
    origin: Origin,
) -> std::io::Result<JoinHandle<()>> {
    // Started by an HTTP worker, but must not be limited to what HTTP
    // workers may do: the broker starts it with the Session allowlist.
    crate::harden::thread::spawn(
        crate::harden::ThreadKind::Session,
        std::thread::Builder::new()
            .name(format!("session-{}", session.id))
            .stack_size(STACK),
        move || {
            Worker {
                home: mgr,
                session,
                sandbox: None,
                paused: None,
            }
            .run(rx, origin)
        },
    )
}

struct Worker {
    home: Home,
    session: Arc<Session>,
    sandbox: Option<Box<dyn Sandbox>>,
    /// A paused session's own checkpoint.
    paused: Option<Arc<Entry>>,
}

/// A sandbox error of a checkpoint in the session's terms.
fn checkpoint_error(id: &str, e: SandboxError) -> SessionError {
    match e {
        SandboxError::Unsupported(m) => SessionError::Unsupported(m),
        e => {
            let why = e.to_string();
            let no_space = why.contains("No space left") || why.contains("os error 28");
            SessionError::CheckpointFailed {
                id: id.to_string(),
                why,
                no_space,
            }
        }
    }
}

/// The guest trusts the session's interception CA, then the proxy gets
/// the secrets (in that order: a request it intercepts must verify).
fn arm_injection(
    id: &str,
    sb: &mut dyn Sandbox,
    inj: Option<&Arc<crate::net::inject::Injection>>,
) -> Result<(), String> {
    if let Some(i) = inj {
        super::cas::install_guest_cas(sb.agent(), super::cas::PROXY_LABEL, i.ca().pem())
            .map_err(|e| format!("session {id}: the egress proxy's CA into the guest: {e}"))?;
    }
    sb.set_injection(inj.cloned())
        .map_err(|e| format!("session {id}: {e}"))
}

fn restore_error(id: &str, e: SandboxError) -> SessionError {
    match e {
        SandboxError::Unsupported(m) => SessionError::Unsupported(m),
        SandboxError::Unrestorable(why) => SessionError::Unrestorable {
            id: id.to_string(),
            why,
        },
        e => SessionError::Failed {
            id: id.to_string(),
            why: e.to_string(),
        },
    }
}

impl Worker {
    fn id(&self) -> &str {
        &self.session.id
    }

    /// The spec a restore of this session runs with: its current egress
    /// policy, a new sandbox id.
    fn restore_spec(&self) -> SandboxSpec {
        SandboxSpec {
            id: crate::sandbox::new_sandbox_id(),
            egress: lock(&self.session.egress).clone(),
            ..self.session.spec.clone()
        }
    }

    fn run(mut self, rx: Receiver<Cmd>, origin: Origin) {
        let t0 = Instant::now();
        let spec = self.session.spec.clone();
        let made = match origin {
            Origin::Paused(e) => {
                self.paused = Some(e);
                *lock(&self.session.state) = State::Paused;
                log::info!(
                    "session {}/{}: paused (found after a restart)",
                    self.session.owner,
                    self.session.id
                );
                return self.serve(rx);
            }
            Origin::Template => match self.home.pool.take(&spec) {
                Some(sb) => Ok(sb),
                None => self.home.factory.create(&spec).inspect(|_| {
                    self.home.metrics.sandbox_created(
                        self.home.factory.backend(),
                        &spec.template,
                        t0.elapsed(),
                    )
                }),
            },
            // Held until the copy is up, so a delete meanwhile does not
            // pull its files away.
            Origin::Checkpoint(e) => self.home.factory.restore(&spec, e.dir()),
        };
        let made = made.and_then(|sb| self.prepare(sb));
        let sandbox = match made {
            Ok(sb) => sb,
            Err(e) => {
                let msg = e.to_string();
                log::error!("session {}/{}: {msg}", self.session.owner, self.session.id);
                self.home.metrics.error("sandbox_create");
                *lock(&self.session.state) = State::Failed(msg.clone());
                self.home.forget(&self.session);
                // Answer everything queued so far; later senders find the
                // channel closed and report the failure from the state.
                let failed = || SessionError::Failed {
                    id: self.session.id.clone(),
                    why: msg.clone(),
                };
                for cmd in rx.try_iter() {
                    refuse(cmd, failed());
                }
                return;
            }
        };
        self.started(sandbox, t0);
        self.serve(rx);
    }

    /// What a sandbox needs before the session's first request, however it
    /// came up (fresh, pool, standby, template or checkpoint restore,
    /// resume): the daemon's extra CAs in its trust store. Run on this
    /// thread before `started`, so no call can reach the guest first. A
    /// sandbox that cannot take them is destroyed: a session without the
    /// trust its operator asked for would fail later and less clearly.
    fn prepare(&self, sb: Box<dyn Sandbox>) -> Result<Box<dyn Sandbox>, SandboxError> {
        let mut sb = self.prepare_cas(sb)?;
        if self.home.audit.is_enabled() {
            sb.set_audit(Some(crate::audit::Tag {
                log: self.home.audit.clone(),
                owner: self.session.owner.clone(),
                session: self.session.id.clone(),
            }));
        }
        let inj = lock(&self.session.inject).clone();
        if let Err(msg) = arm_injection(&self.session.id, sb.as_mut(), inj.as_ref()) {
            self.home.metrics.error("secret_injection");
            if let Err(d) = sb.destroy() {
                log::warn!(
                    "session {}/{}: destroy after failed secret injection: {d}",
                    self.session.owner,
                    self.session.id
                );
            }
            return Err(SandboxError::Failed {
                id: sb.id().to_string(),
                what: "arm the egress proxy with the session's secrets",
                msg,
            });
        }
        Ok(sb)
    }

    /// `guest_ca_bundle` into the guest (see [`Self::prepare`]).
    fn prepare_cas(&self, mut sb: Box<dyn Sandbox>) -> Result<Box<dyn Sandbox>, SandboxError> {
        let Some(cas) = &self.home.guest_cas else {
            return Ok(sb);
        };
        let t0 = Instant::now();
        match super::cas::install_guest_cas(sb.agent(), super::cas::CONFIG_LABEL, &cas.pem()) {
            Ok(done) => {
                log::debug!(
                    "session {}/{}: {} extra CA(s) in the guest in {:?}{}",
                    self.session.owner,
                    self.session.id,
                    done.certs,
                    t0.elapsed(),
                    if done.bundle_changed {
                        ""
                    } else {
                        " (already there)"
                    }
                );
                Ok(sb)
            }
            Err(e) => {
                self.home.metrics.error("guest_ca_install");
                if let Err(d) = sb.destroy() {
                    log::warn!(
                        "session {}/{}: destroy after a failed CA install: {d}",
                        self.session.owner,
                        self.session.id
                    );
                }
                Err(SandboxError::Failed {
                    id: sb.id().to_string(),
                    what: "install guest_ca_bundle into the guest",
                    msg: e,
                })
            }
        }
    }

    /// A sandbox is up: the session is ready.
    fn started(&mut self, sandbox: Box<dyn Sandbox>, t0: Instant) {
        let spec = &self.session.spec;
        *lock(&self.session.pids) = sandbox.pids();
        for (phase, took) in sandbox.timings() {
            let template = vec![("template", spec.template.clone())];
            match phase {
                crate::sandbox::Phase::Network => self
                    .home
                    .metrics
                    .net_setup
                    .get_or_create(&template)
                    .observe(took.as_secs_f64()),
                crate::sandbox::Phase::StandbyVmm => {
                    self.home
                        .metrics
                        .standby_used
                        .get_or_create(&template)
                        .inc();
                }
            }
        }
        {
            let mut st = lock(&self.session.state);
            if matches!(*st, State::Starting | State::Paused) {
                *st = State::Ready;
            }
        }
        log::info!(
            "session {}/{}: ready as {} in {:?}",
            self.session.owner,
            self.session.id,
            sandbox.id(),
            t0.elapsed()
        );
        self.sandbox = Some(sandbox);
    }

    fn serve(mut self, rx: Receiver<Cmd>) {
        let mut keep_paused = false;
        loop {
            let cmd = match rx.recv_timeout(LIVENESS_CHECK) {
                Ok(cmd) => cmd,
                Err(RecvTimeoutError::Timeout) => {
                    if self.sandbox.as_ref().is_some_and(|s| s.agent().is_closed()) {
                        died(&self.home, &self.session);
                        break;
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => break,
            };
            match cmd {
                Cmd::Call(req, reply) => {
                    if let Err(e) = self.resume() {
                        let _ = reply.send(Err(e));
                        continue;
                    }
                    let Some(sb) = self.sandbox.as_ref() else {
                        continue;
                    };
                    let r = sb.agent().call(&req).map_err(SessionError::Agent);
                    let _ = reply.send(r);
                    if sb.agent().is_closed() {
                        died(&self.home, &self.session);
                        break;
                    }
                }
                Cmd::SetEgress(policy, reply) => {
                    // A paused session gets it with its next restore.
                    let r = match self.sandbox.as_mut() {
                        Some(sb) => sb
                            .set_egress(&policy)
                            .map_err(|e| SessionError::EgressNotApplied(e.to_string())),
                        None => Ok(()),
                    };
                    let _ = reply.send(r);
                }
                Cmd::SetSecrets(inj, reply) => {
                    // A paused session gets them with its next restore.
                    let r = match self.sandbox.as_mut() {
                        Some(sb) => arm_injection(&self.session.id, sb.as_mut(), inj.as_ref()),
                        None => Ok(()),
                    };
                    let _ = reply.send(r.map_err(SessionError::EgressNotApplied));
                }
                Cmd::Connector(reply) => {
                    let c = self.sandbox.as_mut().and_then(|sb| sb.guest_connector());
                    let _ = reply.send(Ok(c));
                }
                Cmd::ProxyStats(reply) => {
                    let _ = reply.send(Ok(self.sandbox.as_ref().and_then(|sb| sb.proxy_stats())));
                }
                Cmd::Checkpoint(ask, reply) => {
                    let _ = reply.send(self.checkpoint(ask));
                }
                Cmd::Pause(reply) => {
                    let _ = reply.send(self.pause());
                }
                Cmd::IdlePause => {
                    if self.session.busy() {
                        continue; // used again meanwhile
                    }
                    if let Err(e) = self.pause() {
                        log::error!(
                            "session {}/{}: idle pause failed: {e}; destroying it",
                            self.session.owner,
                            self.session.id
                        );
                        self.home.metrics.error("idle_pause_failed");
                        *lock(&self.session.state) = State::Closing;
                        self.home.forget(&self.session);
                        break;
                    }
                }
                Cmd::Resume(reply) => {
                    let _ = reply.send(self.resume());
                }
                Cmd::Stop => break,
                Cmd::Shutdown => {
                    keep_paused = true;
                    break;
                }
            }
        }
        if let Some(sb) = self.sandbox.take() {
            self.destroy(sb);
        }
        if let Some(p) = self.paused.take() {
            if !keep_paused {
                p.discard();
            }
        }
        // Anything that raced with the stop gets a clear answer.
        for cmd in rx.try_iter() {
            refuse(
                cmd,
                SessionError::Closed {
                    id: self.session.id.clone(),
                },
            );
        }
        log::info!(
            "session {}/{}: {}",
            self.session.owner,
            self.session.id,
            if keep_paused {
                "stopped, paused state kept"
            } else {
                "destroyed"
            }
        );
    }

    fn destroy(&self, mut sb: Box<dyn Sandbox>) {
        let (bytes_in, bytes_out) = sb.agent().traffic();
        self.home.metrics.agent_traffic(bytes_in, bytes_out);
        if let Err(e) = sb.destroy() {
            log::error!(
                "session {}/{}: destroy: {e}",
                self.session.owner,
                self.session.id
            );
            self.home.metrics.error("sandbox_destroy");
        }
    }

    /// The session's record for `meta.json`.
    fn meta(&self, kind: Kind, name: Option<String>, paused_ms: u64) -> Meta {
        let s = &self.session;
        let paused = (kind == Kind::Pause).then(|| PausedRecord {
            created_unix_ms: s.created_unix_ms,
            idle_timeout_ms: s.idle_timeout.as_millis() as u64,
            on_idle: s.on_idle,
            paused_ttl_ms: s.paused_ttl.as_millis() as u64,
            lifetime_left_ms: s
                .expires()
                .saturating_duration_since(Instant::now())
                .as_millis() as u64,
            paused_at_unix_ms: now_unix_ms(),
        });
        Meta {
            id: String::new(),
            owner: s.owner.clone(),
            kind,
            name,
            session_id: s.id.clone(),
            template: s.spec.template.clone(),
            vcpus: s.spec.vcpus,
            mem_mib: s.spec.mem_mib,
            disk_mib: s.spec.disk_mib,
            env: s.spec.env.clone(),
            egress: lock(&s.egress).clone(),
            created_unix_ms: now_unix_ms(),
            paused_ms,
            bytes: 0,
            paused,
        }
    }

    /// Writes a checkpoint of the running sandbox, or of a paused
    /// session's own (its files linked, nothing restored).
    fn checkpoint(&mut self, ask: CheckpointAsk) -> Result<Arc<Entry>, SessionError> {
        let id = self.id().to_string();
        let store = self.home.store.clone();
        let fail = |why: String, no_space: bool| SessionError::CheckpointFailed {
            id: id.clone(),
            why,
            no_space,
        };
        if self.session.busy() && ask.kind == Kind::Pause {
            return Err(SessionError::Busy {
                id: id.clone(),
                why: "a command is running (wait for it or kill it, then pause)".into(),
            });
        }
        let pending = store
            .begin()
            .map_err(|e| fail(e.to_string(), is_enospc(&e)))?;
        let paused_ms = if let Some(sb) = self.sandbox.as_mut() {
            match sb.checkpoint(&pending.tmp) {
                Ok(st) => st.paused.as_millis() as u64,
                Err(e) => {
                    store.abort(pending);
                    return Err(checkpoint_error(&id, e));
                }
            }
        } else if let Some(p) = &self.paused {
            if let Err(e) = link_files(p.dir(), &pending.tmp) {
                store.abort(pending);
                return Err(fail(e.to_string(), is_enospc(&e)));
            }
            0
        } else {
            store.abort(pending);
            return Err(SessionError::Closed { id });
        };
        let meta = self.meta(ask.kind, ask.name, paused_ms);
        let entry = store
            .commit(pending, meta)
            .map_err(|e| fail(e.to_string(), is_enospc(&e)))?;
        self.home.metrics.error(if ask.kind == Kind::Pause {
            "session_paused"
        } else {
            "session_checkpointed"
        });
        log::info!(
            "session {}/{}: checkpoint {} ({:?}, {} MiB, guest paused {paused_ms} ms)",
            self.session.owner,
            self.session.id,
            entry.meta().id,
            ask.kind,
            entry.meta().bytes >> 20
        );
        Ok(entry)
    }

    fn pause(&mut self) -> Result<(), SessionError> {
        if self.sandbox.is_none() {
            return Ok(()); // already paused
        }
        let entry = self.checkpoint(CheckpointAsk {
            kind: Kind::Pause,
            name: None,
        })?;
        if let Some(sb) = self.sandbox.take() {
            self.destroy(sb);
        }
        let m = entry.meta();
        let since = m
            .paused
            .as_ref()
            .map_or_else(now_unix_ms, |p| p.paused_at_unix_ms);
        *lock(&self.session.paused) = Some(PausedInfo {
            bytes: m.bytes,
            since_unix_ms: since,
            expires_unix_ms: since + self.session.paused_ttl.as_millis() as u64,
        });
        lock(&self.session.pids).clear();
        *lock(&self.session.state) = State::Paused;
        self.paused = Some(entry);
        Ok(())
    }

    /// Restores a paused session; nothing to do for a running one.
    fn resume(&mut self) -> Result<(), SessionError> {
        let Some(entry) = self.paused.clone() else {
            return Ok(());
        };
        let t0 = Instant::now();
        (self.home.admit)(&self.session)?;
        let left = entry
            .meta()
            .paused
            .as_ref()
            .map(|p| Duration::from_millis(p.lifetime_left_ms));
        let restored = self
            .home
            .factory
            .restore(&self.restore_spec(), entry.dir())
            .and_then(|sb| self.prepare(sb));
        match restored {
            Ok(sb) => {
                if let Some(left) = left {
                    *lock(&self.session.expires) = Instant::now() + left;
                }
                *lock(&self.session.paused) = None;
                self.paused = None;
                entry.discard();
                drop(entry);
                self.started(sb, t0);
                self.session.touch();
                Ok(())
            }
            Err(e) => {
                // Still paused: its checkpoint is kept for another try.
                *lock(&self.session.state) = State::Paused;
                log::error!(
                    "session {}/{}: resume: {e}",
                    self.session.owner,
                    self.session.id
                );
                self.home.metrics.error("session_resume");
                Err(restore_error(self.id(), e))
            }
        }
    }
}

fn is_enospc(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::ENOSPC) || e.to_string().contains("No space left")
}

/// Hard links every file of checkpoint `from` into `to` (a checkpoint of
/// a paused session costs no copy).
fn link_files(from: &std::path::Path, to: &std::path::Path) -> std::io::Result<()> {
    for e in std::fs::read_dir(from)? {
        let e = e?;
        let name = e.file_name();
        if name == checkpoints::META_FILE || !e.file_type()?.is_file() {
            continue;
        }
        std::fs::hard_link(e.path(), to.join(&name)).map_err(|err| {
            std::io::Error::new(
                err.kind(),
                format!("link {} into {}: {err}", e.path().display(), to.display()),
            )
        })?;
    }
    Ok(())
}

/// Answers a command that will not run with `e`.
fn refuse(cmd: Cmd, e: SessionError) {
    fn send<T>(tx: Sender<Result<T, SessionError>>, e: SessionError) {
        let _ = tx.send(Err(e));
    }
    match cmd {
        Cmd::Call(_, tx) => send(tx, e),
        Cmd::SetEgress(_, tx) => send(tx, e),
        Cmd::SetSecrets(_, tx) => send(tx, e),
        Cmd::Connector(tx) => send(tx, e),
        Cmd::ProxyStats(tx) => send(tx, e),
        Cmd::Checkpoint(_, tx) => send(tx, e),
        Cmd::Pause(tx) | Cmd::Resume(tx) => send(tx, e),
        Cmd::Stop | Cmd::Shutdown | Cmd::IdlePause => {}
    }
}
