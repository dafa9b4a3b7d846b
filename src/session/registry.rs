//! The session registry and the manager that owns sessions' lifecycles.

use super::checkpoints::{Entry, Store};
use super::limits::{Charge, Host, Limits};
use super::pool::Pool;
use super::worker::Origin;
use super::SessionError;
use super::{default_of, template_name, worker, Cmd, OnIdle, PausedInfo, Session, State};
use crate::config::guest_ca::GuestCas;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::net::inject::{Ca, Injection, SecretSpec};
use crate::net::EgressPolicy;
use crate::sandbox::{new_sandbox_id, SandboxFactory, SandboxSpec, TemplateInfo};
use crate::sync::lock;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a caller may choose when creating a session (validated by the API).
#[derive(Debug, Clone, Default)]
pub struct SessionOptions {
    pub template: Option<String>,
    pub vcpus: Option<u32>,
    pub mem_mib: Option<u32>,
    pub disk_mib: Option<u32>,
    pub ttl: Option<Duration>,
    pub idle_timeout: Option<Duration>,
    pub env: BTreeMap<String, String>,
    pub egress: Option<EgressPolicy>,
    pub on_idle: Option<super::OnIdle>,
    pub paused_ttl: Option<Duration>,
    /// Secrets the egress proxy injects (validated by `ops`).
    pub secrets: Vec<SecretSpec>,
    /// A fork's source secrets: the copy keeps their placeholders (its
    /// processes hold them) under a CA of its own. Wins over `secrets`.
    pub secrets_from: Option<Arc<Injection>>,
}

/// Sessions are keyed by (owner key id, session id): each key has its own
/// namespace, so one key can neither see nor guess another's sessions.
type Key = (String, String);

pub struct Manager {
    pub cfg: Arc<Config>,
    pub factory: Arc<dyn SandboxFactory>,
    pub metrics: Arc<Metrics>,
    pub pool: Arc<Pool>,
    /// Session shape bounds and per-key quotas.
    pub limits: Limits,
    /// Memory all replies built from guest data hold (REST and MCP alike).
    pub replies: Arc<crate::budget::ReplyBudget>,
    /// Saved session states (checkpoints, paused sessions, forks).
    pub checkpoints: Arc<Store>,
    /// `guest_ca_bundle`'s CAs, installed into every session's guest at
    /// each start (`cas::install_guest_cas`).
    pub guest_cas: Option<Arc<GuestCas>>,
    sessions: Mutex<HashMap<Key, Arc<Session>>>,
    closing: AtomicBool,
    /// Set to drain (issue #28): no new sessions; the ones here run on.
    draining: AtomicBool,
    /// The audit log, once the host that runs this manager started it
    /// (`Ops::start`); unset: records go nowhere.
    audit: std::sync::OnceLock<crate::audit::Log>,
}

/// What a new session is made of, however it is created.
struct NewSession {
    id: String,
    owner: String,
    spec: SandboxSpec,
    charge: Charge,
    lifetime: Duration,
    idle_timeout: Duration,
    on_idle: OnIdle,
    paused_ttl: Duration,
    created_unix_ms: u64,
    paused: Option<PausedInfo>,
    inject: Option<Arc<Injection>>,
}

/// The secrets a new session `id` gets: a fork's source's under a CA of
/// its own, or `opts.secrets` with a new CA; none without either.
fn injection_for(id: &str, opts: &SessionOptions) -> Result<Option<Arc<Injection>>, SessionError> {
    if opts.secrets_from.is_none() && opts.secrets.is_empty() {
        return Ok(None);
    }
    let failed = |why: String| SessionError::Failed {
        id: id.to_string(),
        why,
    };
    let ca = Arc::new(Ca::new(id).map_err(failed)?);
    let inj = match &opts.secrets_from {
        Some(src) => src.rebind(ca),
        None => Injection::new(ca, &opts.secrets, None).map_err(failed)?,
    };
    Ok(Some(Arc::new(inj)))
}

/// Sessions that run a VM (or are starting one): what capacity and the
/// keys' quotas count. A paused session holds only disk.
fn running(s: &Session) -> bool {
    s.state() != State::Paused
}

impl Manager {
    pub fn new(
        cfg: Arc<Config>,
        factory: Arc<dyn SandboxFactory>,
        metrics: Arc<Metrics>,
    ) -> Arc<Manager> {
        let pool = Pool::new(cfg.clone(), factory.clone(), metrics.clone());
        let limits = Limits::new(&cfg, Host::probe());
        log::info!(
            "session shapes: at most {} vCPUs ({}), {} MiB memory ({}), {} MiB disk; per key: {} \
             sessions, {} vCPUs, {} MiB",
            limits.vcpus.max,
            limits.vcpus.why,
            limits.mem_mib.max,
            limits.mem_mib.why,
            limits.disk_mib.max,
            limits.quota.sessions,
            limits.quota.vcpus,
            limits.quota.mem_mib
        );
        if let Err(e) =
            limits.check_shape(cfg.default_vcpus, cfg.default_mem_mib, cfg.default_disk_mib)
        {
            log::warn!("the default session shape does not fit this host: {e}");
        }
        let replies = crate::budget::ReplyBudget::new(cfg.max_reply_memory as u64);
        let forget_in = factory.clone();
        let forget: super::checkpoints::Forget = Arc::new(move |d| forget_in.forget_checkpoint(d));
        let root = cfg.state_dir.join("checkpoints");
        let checkpoints = Store::open(root.clone(), forget).unwrap_or_else(|e| {
            // Sessions still run; every checkpoint fails naming the path.
            log::error!("checkpoints: {e}");
            Store::unusable(root)
        });
        // `Config::validate` and `Ops::start` fail the daemon's start on a
        // bad bundle; a Manager made without them (tests, fuzzing) and a
        // file broken since then run without, and say so.
        let guest_cas = match cfg.guest_cas() {
            Ok(c) => c.map(Arc::new),
            Err(e) => {
                log::error!("{e}: guests get no extra CAs");
                None
            }
        };
        if let Some(c) = &guest_cas {
            log::info!(
                "guest_ca_bundle {}: {} certificate(s) for every guest",
                c.path.display(),
                c.certs.len()
            );
        }
        let mgr = Arc::new(Manager {
            cfg,
            factory,
            metrics,
            pool,
            limits,
            replies,
            checkpoints: Arc::new(checkpoints),
            guest_cas,
            sessions: Mutex::new(HashMap::new()),
            closing: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            audit: std::sync::OnceLock::new(),
        });
        mgr.load_paused();
        mgr
    }

    /// The paused sessions a previous run left: listed again, resumed on
    /// demand.
    fn load_paused(self: &Arc<Self>) {
        let found = self.checkpoints.take_paused();
        let mut map = lock(&self.sessions);
        for e in found {
            let m = e.meta().clone();
            let Some(p) = m.paused.clone() else {
                continue;
            };
            let charge = self.charge_of(&m.template, m.vcpus, m.mem_mib);
            let spec = m.sandbox_spec(new_sandbox_id());
            let ttl = Duration::from_millis(p.paused_ttl_ms);
            let n = NewSession {
                id: m.session_id.clone(),
                owner: m.owner.clone(),
                spec,
                charge,
                lifetime: Duration::from_millis(p.lifetime_left_ms),
                idle_timeout: Duration::from_millis(p.idle_timeout_ms),
                on_idle: p.on_idle,
                paused_ttl: ttl,
                created_unix_ms: p.created_unix_ms,
                paused: Some(PausedInfo {
                    bytes: m.bytes,
                    since_unix_ms: p.paused_at_unix_ms,
                    expires_unix_ms: p.paused_at_unix_ms + p.paused_ttl_ms,
                }),
                // Secret values are never written to disk: a session
                // paused by an earlier run comes back without them.
                inject: None,
            };
            let (id, owner) = (n.id.clone(), n.owner.clone());
            if map.contains_key(&(owner.clone(), id.clone())) {
                log::warn!("checkpoints: paused session {owner}/{id} twice; keeping the first");
                continue;
            }
            match self.insert(&mut map, n, Origin::Paused(e)) {
                Ok(_) => log::info!("session {owner}/{id}: paused, listed again"),
                Err(err) => log::error!("session {owner}/{id}: {err}"),
            }
        }
    }

    /// What a session of `template` at this shape counts against its key:
    /// one that fits its template's snapshot runs at the snapshot's shape,
    /// so the larger of the two (an upper bound on what its VM gets).
    fn charge_of(&self, template: &str, vcpus: u32, mem_mib: u32) -> Charge {
        let tpl = self
            .factory
            .templates()
            .into_iter()
            .find(|t| t.name == template);
        Charge {
            vcpus: vcpus.max(tpl.as_ref().map_or(0, |t| t.vcpus)),
            mem_mib: mem_mib.max(tpl.as_ref().map_or(0, |t| t.mem_mib)),
        }
    }

    /// Registers and starts a session (the registry's lock held).
    fn insert(
        self: &Arc<Self>,
        map: &mut HashMap<Key, Arc<Session>>,
        n: NewSession,
        origin: Origin,
    ) -> Result<Arc<Session>, SessionError> {
        let now = Instant::now();
        let (tx, rx) = crossbeam_channel::unbounded();
        let egress = Mutex::new(n.spec.egress.clone());
        let state = if n.paused.is_some() {
            State::Paused
        } else {
            State::Starting
        };
        let session = Arc::new(Session {
            id: n.id.clone(),
            owner: n.owner.clone(),
            spec: n.spec,
            charge: n.charge,
            created: now,
            created_unix_ms: n.created_unix_ms,
            expires: Mutex::new(now + n.lifetime),
            idle_timeout: n.idle_timeout,
            on_idle: n.on_idle,
            paused_ttl: n.paused_ttl,
            paused: Mutex::new(n.paused),
            last_used: Mutex::new(now),
            active: AtomicUsize::new(0),
            secret_files: Default::default(),
            secret_procs: Default::default(),
            audited_exits: Default::default(),
            state: Mutex::new(state),
            tx,
            thread: Mutex::new(None),
            pids: Mutex::new(Vec::new()),
            egress,
            inject: Mutex::new(n.inject),
            ports: Mutex::new(BTreeMap::new()),
            base_env: if self.guest_cas.is_some() {
                super::cas::guest_env()
            } else {
                BTreeMap::new()
            },
        });
        let from = match &origin {
            Origin::Template => Some("template"),
            Origin::Checkpoint(_) => Some("snapshot"),
            Origin::Paused(_) => None,
        };
        if let Some(from) = from {
            let sp = &session.spec;
            self.audit().record(
                &session.owner,
                &session.id,
                "session",
                serde_json::json!({
                    "event": "created", "from": from, "template": sp.template,
                    "vcpus": sp.vcpus, "memMib": sp.mem_mib, "diskMib": sp.disk_mib,
                    "envNames": sp.env.keys().collect::<Vec<_>>(),
                }),
            );
        }
        let handle = worker::spawn(self.home(), session.clone(), rx, origin).map_err(|e| {
            SessionError::Thread {
                id: n.id.clone(),
                why: e.to_string(),
            }
        })?;
        *lock(&session.thread) = Some(handle);
        map.insert((n.owner, n.id), session.clone());
        self.metrics.sessions_created.inc();
        self.metrics.sessions_active.inc();
        Ok(session)
    }

    /// Capacity and `owner`'s quota for `n` more running sessions of
    /// `charge` (`except`: a session being resumed, not counted twice).
    fn admit_locked(
        &self,
        map: &HashMap<Key, Arc<Session>>,
        owner: &str,
        charge: Charge,
        n: usize,
        except: Option<&Arc<Session>>,
    ) -> Result<(), SessionError> {
        if except.is_none() && self.is_draining() {
            self.metrics.error("draining");
            return Err(SessionError::Draining);
        }
        let counted = |s: &&Arc<Session>| running(s) && except.is_none_or(|e| !Arc::ptr_eq(s, e));
        let mut held: Vec<Charge> = map
            .values()
            .filter(counted)
            .filter(|s| s.owner == owner)
            .map(|s| s.charge)
            .collect();
        for _ in 0..n {
            if let Err(e) = self.limits.check_quota(owner, &held, charge) {
                self.metrics.error("quota_exceeded");
                return Err(e);
            }
            held.push(charge);
        }
        if map.values().filter(counted).count() + n > self.cfg.max_sessions {
            self.metrics.error("at_capacity");
            return Err(SessionError::AtCapacity {
                max: self.cfg.max_sessions,
            });
        }
        Ok(())
    }

    /// A paused session may run again: capacity and its key's quota
    /// allow it. Marks it starting under the lock.
    fn admit_resume(&self, s: &Arc<Session>) -> Result<(), SessionError> {
        if self.is_closing() {
            return Err(SessionError::ShuttingDown);
        }
        let map = lock(&self.sessions);
        self.admit_locked(&map, &s.owner, s.charge, 1, Some(s))?;
        *lock(&s.state) = State::Starting;
        Ok(())
    }

    /// `ids.len()` sessions of `owner` started from checkpoint `entry`: its
    /// template, shape, env (with `opts.env` over it) and egress policy
    /// (unless `opts` names one). All or none are created.
    pub fn create_from(
        self: &Arc<Self>,
        owner: &str,
        ids: &[String],
        entry: &Arc<Entry>,
        opts: SessionOptions,
    ) -> Result<Vec<Arc<Session>>, SessionError> {
        if self.is_closing() {
            return Err(SessionError::ShuttingDown);
        }
        let m = entry.meta();
        let charge = self.charge_of(&m.template, m.vcpus, m.mem_mib);
        let mut map = lock(&self.sessions);
        for id in ids {
            if map.contains_key(&(owner.to_string(), id.clone())) {
                return Err(SessionError::Exists { id: id.clone() });
            }
        }
        self.admit_locked(&map, owner, charge, ids.len(), None)?;
        let mut env = m.env.clone();
        env.extend(opts.env.clone());
        let mut out: Vec<Arc<Session>> = Vec::with_capacity(ids.len());
        for id in ids {
            let spec = SandboxSpec {
                env: env.clone(),
                egress: opts.egress.clone().unwrap_or_else(|| m.egress.clone()),
                ..m.sandbox_spec(new_sandbox_id())
            };
            let mut n = self.new_session(id, owner, spec, charge, &opts);
            n.inject = match injection_for(id, &opts) {
                Ok(i) => i,
                Err(e) => {
                    for s in &out {
                        map.remove(&(s.owner.clone(), s.id.clone()));
                        let _ = s.tx.send(Cmd::Stop);
                        self.metrics.sessions_active.dec();
                    }
                    return Err(e);
                }
            };
            match self.insert(&mut map, n, Origin::Checkpoint(entry.clone())) {
                Ok(s) => out.push(s),
                Err(e) => {
                    // All or none: the ones made so far go again.
                    for s in &out {
                        map.remove(&(s.owner.clone(), s.id.clone()));
                        let _ = s.tx.send(Cmd::Stop);
                        self.metrics.sessions_active.dec();
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// A new running session of `opts` (defaults from the config).
    fn new_session(
        &self,
        id: &str,
        owner: &str,
        spec: SandboxSpec,
        charge: Charge,
        opts: &SessionOptions,
    ) -> NewSession {
        NewSession {
            id: id.to_string(),
            owner: owner.to_string(),
            spec,
            charge,
            lifetime: opts
                .ttl
                .unwrap_or(self.cfg.max_lifetime)
                .min(self.cfg.max_lifetime),
            idle_timeout: opts.idle_timeout.unwrap_or(self.cfg.idle_timeout),
            on_idle: opts.on_idle.unwrap_or(self.default_on_idle()),
            paused_ttl: opts.paused_ttl.unwrap_or(self.cfg.paused_ttl),
            created_unix_ms: super::now_unix_ms(),
            paused: None,
            inject: None,
        }
    }

    fn default_on_idle(&self) -> OnIdle {
        if self.cfg.idle_pause {
            OnIdle::Pause
        } else {
            OnIdle::Destroy
        }
    }

    /// Drain (`true`) or serve again: a draining host refuses new
    /// sessions (and forks) with `draining`; its own run, pause and resume
    /// as before until they end.
    pub fn set_draining(&self, on: bool) {
        self.draining.store(on, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// The audit log every layer above records through (disabled until
    /// [`Manager::set_audit`]).
    pub fn audit(&self) -> &crate::audit::Log {
        static OFF: std::sync::OnceLock<crate::audit::Log> = std::sync::OnceLock::new();
        self.audit
            .get()
            .unwrap_or_else(|| OFF.get_or_init(crate::audit::Log::disabled))
    }

    /// Set once, by the host that starts the log.
    pub fn set_audit(&self, log: crate::audit::Log) {
        let _ = self.audit.set(log);
    }

    pub fn get(&self, owner: &str, id: &str) -> Option<Arc<Session>> {
        lock(&self.sessions)
            .get(&(owner.to_string(), id.to_string()))
            .cloned()
    }

    /// Sessions of `owner`, or all of them for `None`.
    pub fn list(&self, owner: Option<&str>) -> Vec<Arc<Session>> {
        let mut v: Vec<Arc<Session>> = lock(&self.sessions)
            .values()
            .filter(|s| owner.is_none_or(|o| s.owner == o))
            .cloned()
            .collect();
        v.sort_by(|a, b| (&a.owner, &a.id).cmp(&(&b.owner, &b.id)));
        v
    }

    /// The templates sessions can be made from, listed with `default` on
    /// the one a session naming none gets (config `default_template`).
    pub fn templates(&self) -> Vec<TemplateInfo> {
        let mut all = self.factory.templates();
        let default = default_of(&all, &self.cfg.default_template);
        for t in &mut all {
            t.is_default = t.name == default;
        }
        all
    }

    pub fn count(&self) -> usize {
        lock(&self.sessions).len()
    }

    /// Sessions that hold a sandbox (not paused): what `max_sessions`
    /// bounds, as admission counts them.
    pub fn running_count(&self) -> usize {
        lock(&self.sessions).values().filter(|s| running(s)).count()
    }

    /// The existing session, or a new one. `explicit` creation of an id
    /// that exists is a conflict; lazy creation (first exec) reuses it.
    pub fn get_or_create(
        self: &Arc<Self>,
        owner: &str,
        id: &str,
        opts: SessionOptions,
        explicit: bool,
    ) -> Result<(Arc<Session>, bool), SessionError> {
        if self.is_closing() {
            return Err(SessionError::ShuttingDown);
        }
        let template = opts
            .template
            .clone()
            .unwrap_or_else(|| self.cfg.default_template.clone());
        let template = template_name(&*self.factory, template);
        let key = (owner.to_string(), id.to_string());
        let mut map = lock(&self.sessions);
        if let Some(s) = map.get(&key) {
            if explicit {
                return Err(SessionError::Exists { id: id.to_string() });
            }
            return Ok((s.clone(), false));
        }
        let vcpus = opts.vcpus.unwrap_or(self.cfg.default_vcpus);
        let mem_mib = opts.mem_mib.unwrap_or(self.cfg.default_mem_mib);
        let disk_mib = opts.disk_mib.unwrap_or(self.cfg.default_disk_mib);
        self.limits.check_shape(vcpus, mem_mib, disk_mib)?;
        let Some(tpl) = self
            .factory
            .templates()
            .into_iter()
            .find(|t| t.name == template)
        else {
            return Err(SessionError::UnknownTemplate { name: template });
        };
        let charge = Charge {
            vcpus: vcpus.max(tpl.vcpus),
            mem_mib: mem_mib.max(tpl.mem_mib),
        };
        // Checked and inserted under one lock: concurrent creates of one
        // key see each other.
        self.admit_locked(&map, owner, charge, 1, None)?;
        let spec = SandboxSpec {
            id: new_sandbox_id(),
            template,
            vcpus,
            mem_mib,
            disk_mib,
            env: opts.env.clone(),
            egress: opts
                .egress
                .clone()
                .unwrap_or_else(|| self.cfg.default_egress.clone()),
        };
        let mut n = self.new_session(id, owner, spec, charge, &opts);
        n.inject = injection_for(id, &opts)?;
        let session = self.insert(&mut map, n, Origin::Template)?;
        Ok((session, true))
    }

    /// Removes a session from the registry and stops it. With `wait`, returns
    /// once its sandbox is destroyed.
    pub fn remove(&self, owner: &str, id: &str, why: &str, wait: bool) -> bool {
        let s = lock(&self.sessions).remove(&(owner.to_string(), id.to_string()));
        match s {
            Some(s) => {
                self.stop(&s, why, wait);
                true
            }
            None => false,
        }
    }

    /// What a session's worker uses of the registry.
    fn home(self: &Arc<Self>) -> worker::Home {
        let me = self.clone();
        let me2 = self.clone();
        worker::Home {
            pool: self.pool.clone(),
            factory: self.factory.clone(),
            metrics: self.metrics.clone(),
            forget: Box::new(move |s| me.forget(s)),
            store: self.checkpoints.clone(),
            guest_cas: self.guest_cas.clone(),
            admit: Box::new(move |s| me2.admit_resume(s)),
            audit: self.audit().clone(),
        }
    }

    /// Drops a session that failed to start, only if it is still the one
    /// registered under its key.
    pub(crate) fn forget(&self, s: &Arc<Session>) {
        let mut map = lock(&self.sessions);
        let key = (s.owner.clone(), s.id.clone());
        if map.get(&key).is_some_and(|cur| Arc::ptr_eq(cur, s)) {
            map.remove(&key);
            self.metrics.sessions_active.dec();
        }
    }

    fn stop(&self, s: &Arc<Session>, why: &str, wait: bool) {
        self.stop_with(s, why, wait, Cmd::Stop)
    }

    /// Ends the session's worker with `cmd` ([`Cmd::Stop`] or, when the
    /// daemon stops, [`Cmd::Shutdown`], which keeps a paused one's state).
    fn stop_with(&self, s: &Arc<Session>, why: &str, wait: bool, cmd: Cmd) {
        log::info!("session {}/{}: closing ({why})", s.owner, s.id);
        let event = if matches!(cmd, Cmd::Shutdown) {
            "stopped"
        } else {
            "destroyed"
        };
        self.audit().record(
            &s.owner,
            &s.id,
            "session",
            serde_json::json!({"event": event, "reason": why}),
        );
        let was_failed = matches!(s.state(), State::Failed(_));
        *lock(&s.state) = State::Closing;
        if !was_failed {
            self.metrics.sessions_active.dec();
        }
        self.metrics
            .session_duration
            .observe(s.created.elapsed().as_secs_f64());
        let _ = s.tx.send(cmd);
        if wait {
            let h = lock(&s.thread).take();
            if let Some(h) = h {
                let _ = h.join();
            }
        }
    }

    /// Sessions due for reaping: expired, idle past their timeout (paused
    /// instead when they ask for it), or paused past their `pausedTtl`.
    pub fn reap(&self) -> usize {
        enum Due {
            Remove(&'static str),
            Pause,
        }
        let now_ms = super::now_unix_ms();
        let due: Vec<(Arc<Session>, Due)> = lock(&self.sessions)
            .values()
            .filter_map(|s| {
                let d = match s.state() {
                    State::Paused => s
                        .paused()
                        .filter(|p| now_ms >= p.expires_unix_ms)
                        .map(|_| Due::Remove("paused ttl reached")),
                    _ if Instant::now() >= s.expires() => Some(Due::Remove("max lifetime reached")),
                    State::Ready
                        if !s.busy()
                            && s.idle_for() >= s.idle_timeout
                            && s.on_idle == OnIdle::Pause =>
                    {
                        Some(Due::Pause)
                    }
                    _ if !s.busy() && s.idle_for() >= s.idle_timeout => {
                        Some(Due::Remove("idle timeout"))
                    }
                    _ => None,
                };
                d.map(|d| (s.clone(), d))
            })
            .collect();
        let n = due.len();
        for (s, d) in due {
            match d {
                Due::Pause => {
                    // Not again while it pauses.
                    s.touch();
                    s.pause_when_idle();
                    self.metrics.error("paused_idle");
                }
                Due::Remove(why) => {
                    if self.remove(&s.owner, &s.id, why, false) {
                        self.metrics.error(match why {
                            "idle timeout" => "reaped_idle",
                            "paused ttl reached" => "reaped_paused",
                            _ => "reaped_lifetime",
                        });
                    }
                }
            }
        }
        n
    }

    /// Stops accepting sessions and destroys every one, waiting for each.
    pub fn shutdown(&self) {
        self.closing.store(true, Ordering::Release);
        let all: Vec<Arc<Session>> = lock(&self.sessions).drain().map(|(_, s)| s).collect();
        for s in &all {
            // Failed sessions were already taken off the books.
            if !matches!(s.state(), State::Failed(_)) {
                self.stop_with(s, "shutdown", false, Cmd::Shutdown);
            }
        }
        for s in &all {
            let h = lock(&s.thread).take();
            if let Some(h) = h {
                let _ = h.join();
            }
        }
        self.pool.shutdown();
        if let Err(e) = self.factory.close() {
            log::error!("shutdown: {e}");
        }
    }
}
