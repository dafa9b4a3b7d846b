//! The production factory: a VM backend + templates + per-session network.
//! Written against `crate::vm::{Backend, Vm}`; the template registry and the
//! networking layer plug in through the two small traits of
//! [`super::seams`].

use super::seams::{NetLease, NetProvider, ResolvedTemplate, TemplateSource};
use super::standby::{Key, Provision, Ready, Standby};
use super::{Result, Sandbox, SandboxError, SandboxFactory, SandboxSpec, TemplateInfo};
use crate::agent::{AgentClient, Started};
use crate::net::EgressPolicy;
use crate::vm::ids::{IdLease, VmIds};
use crate::vm::{Backend, Vm, VmConfig};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct VmSandboxFactory {
    pub backend: Arc<dyn Backend>,
    pub templates: Arc<dyn TemplateSource>,
    pub net: Option<Arc<dyn NetProvider>>,
    /// Parent of every VM's runtime directory.
    pub run_root: PathBuf,
    /// Where per-VM cgroups live, one per hierarchy (swept at start).
    pub cgroup_parents: Vec<PathBuf>,
    /// The uid/gid each VMM runs as: its own, leased for the session.
    pub ids: VmIds,
    pub agent_timeout: Duration,
    /// VMMs started ahead of restores (`standby_vmms`; module `standby`).
    pub standby: Arc<Standby>,
    /// Template builds (`serve` as root: the builder process).
    pub builds: Option<Arc<super::builds::Builds>>,
}

/// What making a VM needs, cloneable onto a standby thread.
#[derive(Clone)]
struct Maker {
    backend: Arc<dyn Backend>,
    net: Option<Arc<dyn NetProvider>>,
    ids: VmIds,
    run_root: PathBuf,
}

impl Maker {
    /// A uid/gid and a network for VM `id`.
    fn provision(&self, id: &str, egress: &EgressPolicy) -> Result<Provision> {
        let lease = self
            .ids
            .acquire()
            .map_err(|msg| SandboxError::UidsExhausted {
                id: id.to_string(),
                msg,
            })?;
        let owner = (lease.uid, lease.gid);
        let t_net = Instant::now();
        let net = match &self.net {
            Some(n) => Some(n.setup(id, egress, owner)?),
            None => None,
        };
        Ok(Provision {
            id: id.to_string(),
            lease,
            net_took: net.as_ref().map(|_| t_net.elapsed()),
            net,
        })
    }

    fn config(&self, p: &Provision, tpl: &ResolvedTemplate) -> VmConfig {
        VmConfig {
            id: p.id.clone(),
            kernel: tpl.kernel.clone(),
            rootfs: tpl.rootfs.clone(),
            vcpus: tpl.vcpus,
            mem_mib: tpl.mem_mib,
            cmdline_extra: tpl.cmdline_extra.clone(),
            net: p.net.as_ref().map(|n| n.attachment()),
            uid: p.lease.uid,
            gid: p.lease.gid,
            run_dir: self.run_root.join(&p.id),
        }
    }

    /// A VMM for VM `id` ready to load the snapshot in `dir`.
    fn prepare(&self, id: &str, key: Key, tpl: &ResolvedTemplate, dir: &Path) -> Result<Ready> {
        let prov = self.provision(id, key.egress())?;
        let cfg = self.config(&prov, tpl);
        match self.backend.prepare_restore(&cfg, dir) {
            Ok(prepared) => Ok(Ready {
                key,
                prov,
                prepared,
                since: Instant::now(),
            }),
            Err(e) => {
                // A failed start removes its VMM (the backends' contract).
                prov.release(true);
                Err(SandboxError::Failed {
                    id: id.to_string(),
                    what: "start vm",
                    msg: e.to_string(),
                })
            }
        }
    }
}

impl VmSandboxFactory {
    fn maker(&self) -> Maker {
        Maker {
            backend: self.backend.clone(),
            net: self.net.clone(),
            ids: self.ids.clone(),
            run_root: self.run_root.clone(),
        }
    }

    /// Start the VM: from a standby VMM of this shape if one is ready,
    /// else restore or boot now. Returns the VM with what it holds, and
    /// how long the standby it came from had waited.
    fn start_vm(
        &self,
        spec: &SandboxSpec,
        tpl: &ResolvedTemplate,
    ) -> Result<(Provision, Box<dyn Vm>, Option<Duration>)> {
        let fail = |id: &str, e: crate::vm::VmError| SandboxError::Failed {
            id: id.to_string(),
            what: "start vm",
            msg: e.to_string(),
        };
        let maker = self.maker();
        let Some(dir) = &tpl.snapshot_dir else {
            let prov = maker.provision(&spec.id, &spec.egress)?;
            let cfg = maker.config(&prov, tpl);
            return match self.backend.boot(&cfg) {
                Ok(vm) => Ok((prov, vm, None)),
                Err(e) => {
                    prov.release(true);
                    Err(fail(&spec.id, e))
                }
            };
        };
        let key = Key::new(&spec.template, tpl, dir, &spec.egress);
        if let Some(r) = self.standby.take(&key) {
            let waited = r.since.elapsed();
            let Ready { prov, prepared, .. } = r;
            match prepared.finish() {
                Ok(vm) => return Ok((prov, vm, Some(waited))),
                // It may die between `take` and the load like any VMM; a
                // standby is a shortcut, never a reason for a session to
                // fail: restore afresh below.
                Err(e) => {
                    log::warn!(
                        "standby VMM {} for sandbox {}: {e}; restoring afresh",
                        prov.id,
                        spec.id
                    );
                    prov.release(true);
                }
            }
        }
        let ready = match maker.prepare(&spec.id, key.clone(), tpl, dir) {
            Ok(r) => r,
            // Standbys hold uids too: a session comes first.
            Err(SandboxError::UidsExhausted { .. }) if self.standby.ready() > 0 => {
                log::warn!(
                    "sandbox {}: VM uids used up; removing standby VMMs",
                    spec.id
                );
                self.standby.clear();
                maker.prepare(&spec.id, key.clone(), tpl, dir)?
            }
            Err(e) => return Err(e),
        };
        let Ready { prov, prepared, .. } = ready;
        let id = prov.id.clone();
        match prepared.finish() {
            Ok(vm) => Ok((prov, vm, None)),
            Err(e) => {
                prov.release(true);
                Err(fail(&id, e))
            }
        }
    }

    /// Have a standby VMM made for the next session of `spec`'s shape.
    fn refill_standby(&self, spec: &SandboxSpec, tpl: &ResolvedTemplate) {
        refill_standby(&self.standby, self.maker(), spec, tpl);
    }
}

fn refill_standby(
    standby: &Arc<Standby>,
    maker: Maker,
    spec: &SandboxSpec,
    tpl: &ResolvedTemplate,
) {
    let Some(dir) = tpl.snapshot_dir.clone() else {
        return;
    };
    let key = Key::new(&spec.template, tpl, &dir, &spec.egress);
    let tpl = tpl.clone();
    standby.refill(key.clone(), move || {
        // Never the last free uid: a session may need it.
        if maker.ids.unused().is_some_and(|n| n < 2) {
            return Err(SandboxError::Other("VM uids nearly used up".into()));
        }
        maker.prepare(&super::new_sandbox_id(), key, &tpl, &dir)
    });
}

impl SandboxFactory for VmSandboxFactory {
    fn backend(&self) -> &'static str {
        self.backend.name()
    }

    fn templates(&self) -> Vec<TemplateInfo> {
        self.templates.list()
    }

    fn builds(&self) -> Option<Arc<super::builds::Builds>> {
        self.builds.clone()
    }

    fn is_builtin_template(&self, name: &str) -> bool {
        self.templates.is_builtin(name)
    }

    fn delete_template(&self, name: &str) -> Result<bool> {
        if self.builds.as_ref().is_some_and(|b| b.building(name)) {
            return Err(SandboxError::Other(format!(
                "template {name} is being built"
            )));
        }
        self.templates.delete(name)
    }

    fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>> {
        let tpl = self
            .templates
            .resolve(&spec.template, spec.vcpus, spec.mem_mib)?;
        let (prov, vm, standby) = self.start_vm(spec, &tpl)?;
        let sb = self.connect(prov, vm, tpl.snapshot_dir.is_some(), standby)?;
        // Made once this session is up, not while it starts (the two
        // would compete for the CPU); a snapshot whose guest does not
        // answer is not worth one.
        self.refill_standby(spec, &tpl);
        Ok(sb)
    }

    fn restore(&self, spec: &SandboxSpec, dir: &Path) -> Result<Box<dyn Sandbox>> {
        let tpl = self
            .templates
            .resolve(&spec.template, spec.vcpus, spec.mem_mib)?;
        let maker = self.maker();
        let prov = maker.provision(&spec.id, &spec.egress)?;
        let cfg = maker.config(&prov, &tpl);
        match self.backend.restore(&cfg, dir) {
            Ok(vm) => self.connect(prov, vm, true, None),
            Err(e) => {
                prov.release(true);
                Err(restore_error(&spec.id, e))
            }
        }
    }

    fn check_restorable(&self, spec: &SandboxSpec, dir: &Path) -> Result<()> {
        let tpl = self
            .templates
            .resolve(&spec.template, spec.vcpus, spec.mem_mib)?;
        // What a restore's VM would be, but for what each gets its own
        // (id, uid, namespace), which a snapshot does not fix.
        let cfg = VmConfig {
            id: spec.id.clone(),
            kernel: tpl.kernel.clone(),
            rootfs: tpl.rootfs.clone(),
            vcpus: tpl.vcpus,
            mem_mib: tpl.mem_mib,
            cmdline_extra: tpl.cmdline_extra.clone(),
            net: self
                .net
                .as_ref()
                .and_then(|n| n.guest_mac())
                .map(|guest_mac| crate::vm::NetAttachment {
                    netns: PathBuf::new(),
                    tap: String::new(),
                    guest_mac,
                }),
            uid: 0,
            gid: 0,
            run_dir: PathBuf::new(),
        };
        self.backend
            .check_snapshot(&cfg, dir)
            .map_err(|e| restore_error(&spec.id, e))
    }

    fn forget_checkpoint(&self, dir: &Path) {
        self.backend.forget_snapshot(dir);
    }

    /// Resolves `spec`'s template (which may build its snapshot) and has a
    /// standby VMM made for it, on a thread the standby set waits for at
    /// shutdown.
    fn prime(&self, spec: &SandboxSpec) {
        if !self.standby.enabled() {
            return;
        }
        let (templates, maker, standby) =
            (self.templates.clone(), self.maker(), self.standby.clone());
        let spec = spec.clone();
        self.standby.spawn("vmm-standby-prime", move || {
            match templates.resolve(&spec.template, spec.vcpus, spec.mem_mib) {
                Ok(tpl) => refill_standby(&standby, maker, &spec, &tpl),
                Err(e) => log::warn!("standby VMM for template {}: {e}", spec.template),
            }
        });
    }

    fn sweep_orphans(&self) -> Result<usize> {
        let ours = [super::ID_PREFIX, crate::vm::templates::BUILD_ID_PREFIX];
        let vmms = sweep_vmm_processes(&self.run_root) + self.backend.sweep_orphans(&ours);
        let dirs = sweep_run_dirs(&self.run_root);
        let cgroups = crate::vm::cgroup::sweep(&self.cgroup_parents, super::ID_PREFIX);
        let net = match &self.net {
            Some(n) => n.sweep_orphans()?,
            None => 0,
        };
        Ok(vmms + dirs + cgroups + net)
    }

    fn close(&self) -> Result<()> {
        self.standby.close();
        self.templates.close();
        if let Some(b) = &self.builds {
            b.close();
        }
        match &self.net {
            Some(n) => n.close(),
            None => Ok(()),
        }
    }
}

/// A restore's failure: a checkpoint this host cannot restore is
/// [`SandboxError::Unrestorable`], anything else a failed start.
fn restore_error(id: &str, e: crate::vm::VmError) -> SandboxError {
    match e {
        crate::vm::VmError::StaleSnapshot { reason, .. } => SandboxError::Unrestorable(reason),
        e => SandboxError::Failed {
            id: id.to_string(),
            what: "restore checkpoint",
            msg: e.to_string(),
        },
    }
}

impl VmSandboxFactory {
    /// Connects to a started VM's agent (`restored`: the hello fixes the
    /// clock and entropy) and makes it a sandbox; on failure removes it.
    fn connect(
        &self,
        prov: Provision,
        mut vm: Box<dyn Vm>,
        restored: bool,
        standby: Option<Duration>,
    ) -> Result<Box<dyn Sandbox>> {
        let fail = |what: &'static str, msg: String| SandboxError::Failed {
            id: prov.id.clone(),
            what,
            msg,
        };
        // After a restore the hello carries the clock/entropy fixup.
        let start = Started::of(restored, &*vm);
        let connected = vm
            .connect_agent(Instant::now() + self.agent_timeout)
            .map_err(|e| fail("agent socket", e.to_string()))
            .and_then(|s| {
                AgentClient::connect_with(s, self.agent_timeout, start)
                    .map_err(|e| fail("agent hello", e.to_string()))
            });
        match connected {
            Ok(agent) => {
                if let Some(note) = vm.close_note() {
                    agent.set_close_note(note);
                }
                Ok(Box::new(VmSandbox {
                    agent_timeout: self.agent_timeout,
                    id: prov.id,
                    vm,
                    net: prov.net,
                    agent,
                    destroyed: false,
                    net_took: prov.net_took,
                    standby,
                    ids: Some(prov.lease),
                }))
            }
            Err(e) => {
                let gone = vm.destroy().is_ok();
                prov.release(gone);
                Err(e)
            }
        }
    }
}

/// Kills VMM processes a crashed daemon left running: they are found by
/// their run directory (`<run_root>/asbx-...`) on their command line.
/// One daemon owns a state dir, so anything there is ours and orphaned.
fn sweep_vmm_processes(run_root: &std::path::Path) -> usize {
    let needle = format!("{}/{}", run_root.display(), super::ID_PREFIX);
    let me = std::process::id() as i32;
    let mut killed = 0;
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return 0;
    };
    for e in rd.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if pid == me {
            continue;
        }
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmd).contains(&needle) {
            log::warn!("sweep: killing orphaned VMM pid {pid}");
            // SAFETY: kill with a pid read from /proc; ESRCH is harmless.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            killed += 1;
        }
    }
    if killed > 0 {
        // Give the kernel a moment to tear them down before their dirs go.
        std::thread::sleep(Duration::from_millis(200));
    }
    killed
}

fn sweep_run_dirs(run_root: &std::path::Path) -> usize {
    let Ok(rd) = std::fs::read_dir(run_root) else {
        return 0;
    };
    let mut n = 0;
    for e in rd.flatten() {
        if e.file_name()
            .to_string_lossy()
            .starts_with(super::ID_PREFIX)
            && std::fs::remove_dir_all(e.path()).is_ok()
        {
            n += 1;
        }
    }
    n
}

pub struct VmSandbox {
    id: String,
    /// For the agent's reconnect after a checkpoint that resets it.
    agent_timeout: Duration,
    vm: Box<dyn Vm>,
    net: Option<Box<dyn NetLease>>,
    agent: AgentClient,
    destroyed: bool,
    net_took: Option<Duration>,
    /// How long the standby VMM it was restored into had waited.
    standby: Option<Duration>,
    /// The VMM's uid/gid: free for another VM once this one is gone.
    ids: Option<IdLease>,
}

impl Sandbox for VmSandbox {
    fn id(&self) -> &str {
        &self.id
    }

    fn agent(&self) -> &AgentClient {
        &self.agent
    }

    fn destroy(&mut self) -> Result<()> {
        if self.destroyed {
            return Ok(());
        }
        self.destroyed = true;
        self.agent.close();
        let vm = self.vm.destroy().map_err(|e| SandboxError::Failed {
            id: self.id.clone(),
            what: "destroy vm",
            msg: e.to_string(),
        });
        match (self.ids.take(), vm.is_ok()) {
            (Some(l), true) => drop(l),
            // Its VMM may still run: the uid must not go to another VM.
            (Some(l), false) => l.leak(),
            (None, _) => {}
        }
        let net = match self.net.as_mut() {
            Some(n) => n.teardown(),
            None => Ok(()),
        };
        vm.and(net)
    }

    fn pids(&self) -> Vec<i32> {
        self.vm.pid().into_iter().collect()
    }

    fn set_egress(&mut self, policy: &EgressPolicy) -> Result<()> {
        match self.net.as_mut() {
            Some(n) => n.set_egress(policy),
            None => Err(SandboxError::Other(format!(
                "sandbox {} has no network to apply an egress policy to",
                self.id
            ))),
        }
    }

    fn proxy_stats(&self) -> Option<crate::net::ProxyStats> {
        self.net.as_ref().and_then(|n| n.proxy_stats())
    }

    fn guest_connector(&mut self) -> Option<crate::net::GuestConnector> {
        self.net.as_mut().and_then(|n| n.guest_connector())
    }

    fn set_audit(&mut self, tag: Option<crate::audit::Tag>) {
        if let Some(n) = self.net.as_ref() {
            n.set_audit(tag);
        }
    }

    fn set_injection(
        &mut self,
        inj: Option<std::sync::Arc<crate::net::inject::Injection>>,
    ) -> Result<()> {
        match self.net.as_mut() {
            Some(n) => n.set_injection(inj),
            None if inj.is_none() => Ok(()),
            None => Err(SandboxError::Unsupported(format!(
                "sandbox {} has no network for injected secrets",
                self.id
            ))),
        }
    }

    fn checkpoint(&mut self, dir: &Path) -> Result<super::CheckpointStats> {
        let r = self.vm.checkpoint(dir).map_err(|e| SandboxError::Failed {
            id: self.id.clone(),
            what: "checkpoint",
            msg: e.to_string(),
        });
        if self.vm.checkpoint_resets_agent() {
            // Firecracker's snapshot resets the vsock connection (whatever
            // the result): a new one, greeted as the same machine (its own
            // clock and entropy stand).
            self.agent.close();
            let t = self.agent_timeout;
            let agent = crate::vm::connect_agent(&mut *self.vm, false, t).map_err(|e| {
                SandboxError::Failed {
                    id: self.id.clone(),
                    what: "agent reconnect after checkpoint",
                    msg: e.to_string(),
                }
            })?;
            if let Some(note) = self.vm.close_note() {
                agent.set_close_note(note);
            }
            self.agent = agent;
        }
        r
    }

    fn timings(&self) -> Vec<(super::Phase, Duration)> {
        let net = self.net_took.map(|d| (super::Phase::Network, d));
        let standby = self.standby.map(|d| (super::Phase::StandbyVmm, d));
        net.into_iter().chain(standby).collect()
    }
}

impl Drop for VmSandbox {
    fn drop(&mut self) {
        let _ = self.destroy();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::ids::IdRange;

    /// Never asked for a VM: provisioning fails before.
    struct NoVms;

    impl Backend for NoVms {
        fn name(&self) -> &'static str {
            "none"
        }
        fn vmm_version(&self) -> crate::vm::Result<String> {
            Ok("none".into())
        }
        fn boot(&self, _: &VmConfig) -> crate::vm::Result<Box<dyn Vm>> {
            Err(crate::vm::VmError::Other("no VMs here".into()))
        }
        fn prepare_restore(
            &self,
            _: &VmConfig,
            _: &Path,
        ) -> crate::vm::Result<Box<dyn crate::vm::PreparedRestore>> {
            Err(crate::vm::VmError::Other("no VMs here".into()))
        }
    }

    #[test]
    fn a_used_up_uid_range_is_uids_exhausted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let range = IdRange {
            first: 320_000,
            count: 3,
        };
        let ids = VmIds::new(range, &dir.path().join("vm-ids.lock")).expect("ids");
        let held: Vec<IdLease> = std::iter::from_fn(|| ids.acquire().ok()).collect();
        assert_eq!(held.len(), range.sessions() as usize);
        let maker = Maker {
            backend: Arc::new(NoVms),
            net: None,
            ids,
            run_root: dir.path().to_path_buf(),
        };
        match maker.provision("s1", &EgressPolicy::default()) {
            Err(e @ SandboxError::UidsExhausted { .. }) => {
                // The message the API has always shown.
                let text = e.to_string();
                assert!(
                    text.starts_with("sandbox s1: vm uid: no free VM uid"),
                    "{text}"
                );
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("a VM uid was leased from a used-up range"),
        }
        drop(held);
        assert!(maker.provision("s2", &EgressPolicy::default()).is_ok());
    }
}
