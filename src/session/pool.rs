//! Warm pool: sandboxes created ahead of demand, per template, so a new
//! session with the template's default shape starts without waiting for a
//! boot/restore.

use crate::config::Config;
use crate::metrics::Metrics;
use crate::sandbox::{new_sandbox_id, Sandbox, SandboxFactory, SandboxSpec};
use crate::sync::lock;
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

    /// Starts the refill thread (no-op with a pool size of 0), and has the
    /// factory get ready for the first session of the default template
    /// (a VM factory starts a standby VMM for it).
    pub fn start(self: &Arc<Self>) -> std::io::Result<()> {
        let default = super::template_name(&*self.factory, self.cfg.default_template.clone());
        self.factory.prime(&self.pooled_spec(&default));
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

    /// Starts one filler per template (and per template that appears
    /// later), so a template whose sandboxes hang until the boot timeout
    /// holds up nobody else; waits for them at shutdown.
    fn fill_loop(self: Arc<Self>) {
        let mut fillers: HashMap<String, JoinHandle<()>> = HashMap::new();
        while !self.stopping.load(Ordering::Acquire) {
            for t in self.factory.templates() {
                if fillers.contains_key(&t.name) {
                    continue;
                }
                let me = self.clone();
                let name = t.name.clone();
                match crate::harden::thread::spawn(
                    crate::harden::ThreadKind::Session,
                    std::thread::Builder::new().name(format!("pool-{name}")),
                    move || me.fill_template(&name),
                ) {
                    Ok(h) => {
                        fillers.insert(t.name, h);
                    }
                    Err(e) => log::error!("pool: filler for template {}: {e}", t.name),
                }
            }
            let g = lock(&self.ready);
            if self.stopping.load(Ordering::Acquire) {
                break;
            }
            let _ = self.wake.wait_timeout(g, Duration::from_secs(2));
        }
        for (_, h) in fillers {
            let _ = h.join();
        }
    }

    /// Keeps `template`'s warm sandboxes at the pool size. After a failed
    /// creation it waits [`retry_delay`] (doubling per consecutive failure)
    /// before trying again.
    fn fill_template(&self, template: &str) {
        let mut failures = 0u32;
        let mut retry_at: Option<Instant> = None;
        while !self.stopping.load(Ordering::Acquire) {
            let due = retry_at.is_none_or(|at| Instant::now() >= at);
            if due && self.size(template) < self.cfg.pool_size {
                let spec = self.pooled_spec(template);
                let t0 = Instant::now();
                match self.factory.create(&spec) {
                    Ok(sb) => {
                        (failures, retry_at) = (0, None);
                        self.metrics.sandbox_created(
                            self.factory.backend(),
                            template,
                            t0.elapsed(),
                        );
                        let mut ready = lock(&self.ready);
                        if self.stopping.load(Ordering::Acquire) {
                            drop(ready);
                            let mut sb = sb;
                            let _ = sb.destroy();
                            return;
                        }
                        let list = ready.entry(template.to_string()).or_default();
                        list.push(sb);
                        self.metrics.set_pool(template, list.len());
                    }
                    Err(e) => {
                        failures += 1;
                        let wait = retry_delay(failures);
                        log::error!(
                            "pool: template {template}: {e} (failure {failures}; next try in {} s)",
                            wait.as_secs()
                        );
                        retry_at = Some(Instant::now() + wait);
                        self.metrics.error("pool_create");
                    }
                }
                continue;
            }
            // Full or backing off: wait for a take, shutdown or the retry.
            let g = lock(&self.ready);
            if self.stopping.load(Ordering::Acquire) {
                return;
            }
            let tick = retry_at
                .map(|at| at.saturating_duration_since(Instant::now()))
                .unwrap_or(Duration::from_secs(2))
                .clamp(Duration::from_millis(10), Duration::from_secs(2));
            let _ = self.wake.wait_timeout(g, tick);
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
