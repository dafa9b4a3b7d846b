//! Warm pool: sandboxes created ahead of demand, per template, so a new
//! session with the template's default shape starts without waiting for a
//! boot/restore.

use super::lock;
use crate::api::metrics::Metrics;
use crate::config::Config;
use crate::sandbox::{new_sandbox_id, Sandbox, SandboxFactory, SandboxSpec};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// First retry of a template whose pooled sandbox failed to start; each
/// further failure doubles it, up to [`POOL_RETRY_MAX`].
pub const POOL_RETRY_MIN: Duration = Duration::from_secs(5);
pub const POOL_RETRY_MAX: Duration = Duration::from_secs(300);

fn retry_delay(failures: u32) -> Duration {
    POOL_RETRY_MIN
        .saturating_mul(1u32 << failures.saturating_sub(1).min(16))
        .min(POOL_RETRY_MAX)
}

pub struct Pool {
    cfg: Arc<Config>,
    factory: Arc<dyn SandboxFactory>,
    metrics: Arc<Metrics>,
    ready: Mutex<HashMap<String, Vec<Box<dyn Sandbox>>>>,
    wake: Condvar,
    stopping: AtomicBool,
    filler: Mutex<Option<JoinHandle<()>>>,
}

impl Pool {
    pub fn new(
        cfg: Arc<Config>,
        factory: Arc<dyn SandboxFactory>,
        metrics: Arc<Metrics>,
    ) -> Arc<Pool> {
        Arc::new(Pool {
            cfg,
            factory,
            metrics,
            ready: Mutex::new(HashMap::new()),
            wake: Condvar::new(),
            stopping: AtomicBool::new(false),
            filler: Mutex::new(None),
        })
    }

    /// Starts the refill thread (no-op with a pool size of 0).
    pub fn start(self: &Arc<Self>) -> std::io::Result<()> {
        if self.cfg.pool_size == 0 {
            return Ok(());
        }
        let me = self.clone();
        let h = crate::harden::thread::spawn(
            crate::harden::ThreadKind::Session,
            std::thread::Builder::new().name("pool-filler".into()),
            move || me.fill_loop(),
        )?;
        *lock(&self.filler) = Some(h);
        Ok(())
    }

    /// The spec a pooled sandbox of `template` is made with.
    fn pooled_spec(&self, template: &str) -> SandboxSpec {
        SandboxSpec {
            id: new_sandbox_id(),
            template: template.to_string(),
            vcpus: self.cfg.default_vcpus,
            mem_mib: self.cfg.default_mem_mib,
            disk_mib: self.cfg.default_disk_mib,
            env: Default::default(),
            egress: self.cfg.default_egress.clone(),
        }
    }

    /// A warm sandbox fitting `spec`, if one is ready. Session env is applied
    /// per command, so only the machine shape and egress policy must match.
    pub fn take(&self, spec: &SandboxSpec) -> Option<Box<dyn Sandbox>> {
        if self.cfg.pool_size == 0 {
            return None;
        }
        let p = self.pooled_spec(&spec.template);
        if (spec.vcpus, spec.mem_mib, spec.disk_mib) != (p.vcpus, p.mem_mib, p.disk_mib)
            || spec.egress != p.egress
        {
            return None;
        }
        let mut ready = lock(&self.ready);
        let list = ready.get_mut(&spec.template)?;
        let sb = list.pop();
        self.metrics.set_pool(&spec.template, list.len());
        drop(ready);
        self.wake.notify_all();
        sb
    }

    pub fn size(&self, template: &str) -> usize {
        lock(&self.ready).get(template).map_or(0, Vec::len)
    }

    fn fill_loop(self: Arc<Self>) {
        // Templates whose last creation failed: consecutive failures and
        // when to try again. A template that cannot start (a missing or
        // stale image can take the whole boot timeout to fail) must not
        // hold up refilling the others on every pass.
        let mut backoff: HashMap<String, (u32, Instant)> = HashMap::new();
        while !self.stopping.load(Ordering::Acquire) {
            let mut made_any = false;
            for t in self.factory.templates() {
                if self.size(&t.name) >= self.cfg.pool_size {
                    continue;
                }
                if backoff
                    .get(&t.name)
                    .is_some_and(|(_, at)| Instant::now() < *at)
                {
                    continue;
                }
                let spec = self.pooled_spec(&t.name);
                let t0 = Instant::now();
                match self.factory.create(&spec) {
                    Ok(sb) => {
                        backoff.remove(&t.name);
                        self.metrics
                            .sandbox_created(self.factory.backend(), &t.name, t0.elapsed());
                        let mut ready = lock(&self.ready);
                        if self.stopping.load(Ordering::Acquire) {
                            drop(ready);
                            let mut sb = sb;
                            let _ = sb.destroy();
                            return;
                        }
                        let list = ready.entry(t.name.clone()).or_default();
                        list.push(sb);
                        self.metrics.set_pool(&t.name, list.len());
                        made_any = true;
                    }
                    Err(e) => {
                        let failures = backoff.get(&t.name).map_or(0, |b| b.0) + 1;
                        let wait = retry_delay(failures);
                        log::error!(
                            "pool: template {}: {e} (failure {failures}; next try in {} s)",
                            t.name,
                            wait.as_secs()
                        );
                        backoff.insert(t.name.clone(), (failures, Instant::now() + wait));
                        self.metrics.error("pool_create");
                    }
                }
            }
            if !made_any {
                // Full (or failing): wait for a take or a retry tick.
                let g = lock(&self.ready);
                let _ = self.wake.wait_timeout(g, Duration::from_secs(2));
            }
        }
    }

    /// Stops refilling and destroys every warm sandbox.
    pub fn shutdown(&self) {
        self.stopping.store(true, Ordering::Release);
        self.wake.notify_all();
        if let Some(h) = lock(&self.filler).take() {
            let _ = h.join();
        }
        let all: Vec<Box<dyn Sandbox>> = lock(&self.ready).drain().flat_map(|(_, v)| v).collect();
        for mut sb in all {
            let _ = sb.destroy();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_back_off_from_5_s_to_5_min() {
        let secs: Vec<u64> = [1, 2, 3, 6, 7, 40]
            .map(|n| retry_delay(n).as_secs())
            .to_vec();
        assert_eq!(secs, [5, 10, 20, 160, 300, 300]);
    }
}
