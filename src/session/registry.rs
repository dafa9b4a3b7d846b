//! The session registry and the manager that owns sessions' lifecycles.

use super::limits::{Charge, Host, Limits};
use super::pool::Pool;
use super::SessionError;
use super::{default_of, template_name, worker, Cmd, Session, State};
use crate::config::Config;
use crate::metrics::Metrics;
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
    sessions: Mutex<HashMap<Key, Arc<Session>>>,
    closing: AtomicBool,
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
        Arc::new(Manager {
            cfg,
            factory,
            metrics,
            pool,
            limits,
            replies,
            sessions: Mutex::new(HashMap::new()),
            closing: AtomicBool::new(false),
        })
    }

    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
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
            .filter(|s| owner.map_or(true, |o| s.owner == o))
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
        // A session that fits its template's snapshot runs at the
        // snapshot's shape: count the larger of the two (an upper bound on
        // what its VM gets either way).
        let charge = Charge {
            vcpus: vcpus.max(tpl.vcpus),
            mem_mib: mem_mib.max(tpl.mem_mib),
        };
        // Checked and inserted under one lock: concurrent creates of one
        // key see each other.
        let held: Vec<Charge> = map
            .values()
            .filter(|s| s.owner == owner)
            .map(|s| s.charge)
            .collect();
        if let Err(e) = self.limits.check_quota(owner, &held, charge) {
            self.metrics.error("quota_exceeded");
            return Err(e);
        }
        if map.len() >= self.cfg.max_sessions {
            self.metrics.error("at_capacity");
            return Err(SessionError::AtCapacity {
                max: self.cfg.max_sessions,
            });
        }
        let now = Instant::now();
        let lifetime = opts
            .ttl
            .unwrap_or(self.cfg.max_lifetime)
            .min(self.cfg.max_lifetime);
        let spec = SandboxSpec {
            id: new_sandbox_id(),
            template,
            vcpus,
            mem_mib,
            disk_mib,
            env: opts.env,
            egress: opts
                .egress
                .unwrap_or_else(|| self.cfg.default_egress.clone()),
        };
        let (tx, rx) = crossbeam_channel::unbounded();
        let egress = Mutex::new(spec.egress.clone());
        let session = Arc::new(Session {
            id: id.to_string(),
            owner: owner.to_string(),
            spec,
            charge,
            created: now,
            created_unix_ms: super::now_unix_ms(),
            expires: now + lifetime,
            idle_timeout: opts.idle_timeout.unwrap_or(self.cfg.idle_timeout),
            on_idle: opts.on_idle.unwrap_or_default(),
            paused_ttl: opts.paused_ttl.unwrap_or(Duration::from_secs(24 * 3600)),
            paused: Mutex::new(None),
            last_used: Mutex::new(now),
            active: AtomicUsize::new(0),
            state: Mutex::new(State::Starting),
            tx,
            thread: Mutex::new(None),
            pids: Mutex::new(Vec::new()),
            egress,
        });
        let handle =
            worker::spawn(self.home(), session.clone(), rx).map_err(|e| SessionError::Thread {
                id: id.to_string(),
                why: e.to_string(),
            })?;
        *lock(&session.thread) = Some(handle);
        map.insert(key, session.clone());
        self.metrics.sessions_created.inc();
        self.metrics.sessions_active.inc();
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
        worker::Home {
            pool: self.pool.clone(),
            factory: self.factory.clone(),
            metrics: self.metrics.clone(),
            forget: Box::new(move |s| me.forget(s)),
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
        log::info!("session {}/{}: closing ({why})", s.owner, s.id);
        let was_failed = matches!(s.state(), State::Failed(_));
        *lock(&s.state) = State::Closing;
        if !was_failed {
            self.metrics.sessions_active.dec();
        }
        self.metrics
            .session_duration
            .observe(s.created.elapsed().as_secs_f64());
        let _ = s.tx.send(Cmd::Stop);
        if wait {
            let h = lock(&s.thread).take();
            if let Some(h) = h {
                let _ = h.join();
            }
        }
    }

    /// Sessions due for reaping: expired, or idle past their timeout.
    pub fn reap(&self) -> usize {
        let due: Vec<(Arc<Session>, &'static str)> = lock(&self.sessions)
            .values()
            .filter_map(|s| {
                if Instant::now() >= s.expires {
                    Some((s.clone(), "max lifetime reached"))
                } else if !s.busy() && s.idle_for() >= s.idle_timeout {
                    Some((s.clone(), "idle timeout"))
                } else {
                    None
                }
            })
            .collect();
        let n = due.len();
        for (s, why) in due {
            if self.remove(&s.owner, &s.id, why, false) {
                self.metrics.error(if why == "idle timeout" {
                    "reaped_idle"
                } else {
                    "reaped_lifetime"
                });
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
                self.stop(s, "shutdown", false);
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
