//! Builds the production factory: a VM backend, the template/snapshot
//! registry over the image cache, and per-session networking.

use super::seams::{NetLease, NetProvider, ResolvedTemplate, TemplateSource};
use super::vm::VmSandboxFactory;
use super::{Result, SandboxError, SandboxFactory, TemplateInfo};
use crate::config::Config;
use crate::harden::spawner::SpawnerClient;
use crate::net::{EgressPolicy, Isolated, Net, NetConfig, SessionNet};
use crate::sync::lock;
use crate::vm::firecracker::FirecrackerBackend;
use crate::vm::ids::VmIds;
use crate::vm::jailer::JailerConfig;
use crate::vm::launch::DirectSpawner;
use crate::vm::launch::{self, Launcher};
use crate::vm::qemu::{QemuBackend, QemuConfig};
use crate::vm::templates::{Registry, RegistryConfig, DEFAULT_TEMPLATE};
use crate::vm::Backend;
use crate::vm::BackendKind;
use crate::vm::NetAttachment;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// The ids of snapshot-making VMs and the default TAP owner: the first of
/// the configured range as root; an unprivileged daemon's VMs run as
/// itself (its spawner can start nothing else).
pub fn builder_ids(cfg: &Config) -> (u32, u32) {
    // SAFETY: geteuid/getegid have no preconditions.
    let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
    if euid == 0 {
        cfg.vm_ids.builder()
    } else {
        (euid, egid)
    }
}

/// The pool sessions lease their VMM's uid/gid from (see `vm::ids`).
pub fn vm_ids(cfg: &Config) -> Result<VmIds> {
    // SAFETY: geteuid/getegid have no preconditions.
    let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
    if euid != 0 {
        return Ok(VmIds::shared(euid, egid));
    }
    VmIds::host(cfg.vm_ids).map_err(SandboxError::Other)
}

/// What the hardened daemon hands the backends: its spawner (the only way
/// it can start processes) and the cgroup parents per-VM cgroups go under.
/// The default (no spawner, no cgroups) is for tools and tests.
#[derive(Clone, Default)]
pub struct Host {
    pub spawner: Option<SpawnerClient>,
    /// One per hierarchy (`cgroup::Prepared::parents`); empty: none.
    pub cgroup_parents: Vec<PathBuf>,
    /// The images the daemon locked at start ([`pinned_images`]): its
    /// registry restores from exactly these, not from a second read of
    /// `current.json` that a build finishing in between could change.
    pub images: Option<PinnedImages>,
    /// The template builder process (`serve` as root), taken by the factory.
    pub builder: Arc<std::sync::Mutex<Option<super::builds::BuilderHandle>>>,
}

/// The kernel and root filesystems a registry should use.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PinnedImages {
    pub kernel: Option<PathBuf>,
    pub rootfs: std::collections::BTreeMap<String, PathBuf>,
}

impl PinnedImages {
    pub fn paths(&self) -> impl Iterator<Item = &std::path::Path> {
        self.kernel
            .iter()
            .chain(self.rootfs.values())
            .map(PathBuf::as_path)
    }
}

/// The artifacts `agent-sandbox image build` recorded last in
/// `current.json` (none: the registry takes the newest in the cache), with
/// those the config names explicitly (the Nix build does) winning.
pub fn pinned_images(cfg: &Config) -> PinnedImages {
    let mut pins = PinnedImages::default();
    if let Some(cur) = std::fs::read(cfg_cache_dir(cfg).join("current.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
    {
        if let Some(k) = cur["kernel"].as_str() {
            pins.kernel = Some(PathBuf::from(k));
        }
        if let Some(m) = cur["rootfs"].as_object() {
            for (t, p) in m {
                if let Some(p) = p.as_str() {
                    pins.rootfs.insert(t.clone(), PathBuf::from(p));
                }
            }
        }
    }
    if let Some(k) = &cfg.artifacts.kernel {
        pins.kernel = Some(k.clone());
    }
    for (t, p) in &cfg.artifacts.images {
        pins.rootfs.insert(t.clone(), p.clone());
    }
    pins
}

impl Host {
    fn launcher(&self) -> Arc<dyn Launcher> {
        match &self.spawner {
            Some(s) => Arc::new(s.clone()),
            None => launch::direct(),
        }
    }
}

/// Where templates are looked up: `AGENT_SANDBOX_TEMPLATES`, then a source
/// checkout's `images/templates`, then an installed share directory.
pub fn templates_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("AGENT_SANDBOX_TEMPLATES") {
        return PathBuf::from(d);
    }
    let mut cands = vec![PathBuf::from("images/templates")];
    if let Ok(exe) = std::env::current_exe() {
        if let Some(bin) = exe.parent() {
            cands.push(bin.join("../share/agent-sandbox/templates"));
            // target/<profile>/agent-sandbox in a source checkout
            cands.push(bin.join("../../images/templates"));
        }
    }
    cands.push(PathBuf::from("/usr/share/agent-sandbox/templates"));
    cands
        .into_iter()
        .find(|p| p.is_dir())
        .unwrap_or_else(|| PathBuf::from("images/templates"))
}

/// The image cache `images/build.sh` writes (`AGENT_SANDBOX_CACHE`).
pub fn cache_dir() -> PathBuf {
    std::env::var_os("AGENT_SANDBOX_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/agent-sandbox"))
}

/// The image cache of this config: `cache_dir`, else [`cache_dir`].
pub fn cfg_cache_dir(cfg: &Config) -> PathBuf {
    cfg.artifacts.cache_dir.clone().unwrap_or_else(cache_dir)
}

/// Where snapshots live: beside the images they are made from, in the
/// host-wide cache (`<cache>/snapshots/<backend>/<template>`), shared by
/// every daemon on the host (the registry locks and checks freshness).
/// `snapshot_dir` (`AGENT_SANDBOX_SNAPSHOT_STATE`) puts them elsewhere.
fn snapshot_state(cfg: &Config) -> PathBuf {
    cfg.artifacts
        .snapshot_dir
        .clone()
        .or_else(|| std::env::var_os("AGENT_SANDBOX_SNAPSHOT_STATE").map(PathBuf::from))
        .unwrap_or_else(|| cfg_cache_dir(cfg))
}

/// `io.max` lines for `vm_io_max` on the disks VMMs use: the state dir
/// (run dirs with memory files, jails), the image cache and snapshots.
fn io_max(cfg: &Config) -> Vec<String> {
    let Some(rule) = &cfg.vm_io_max else {
        return Vec::new();
    };
    let (cache, snaps) = (cfg_cache_dir(cfg), snapshot_state(cfg));
    let lines = crate::vm::cgroup::io_max_lines(rule, &[&cfg.state_dir, &cache, &snaps]);
    if lines.is_empty() {
        log::warn!("vm_io_max: no block device under the state or image directories; not applied");
    }
    lines
}

/// The interface of the main table's default route (lowest metric), from
/// `/proc/net/route` of the daemon's namespace.
pub fn default_uplink() -> Option<String> {
    default_route_if(&std::fs::read_to_string("/proc/net/route").ok()?)
}

/// [`default_uplink`] of the namespace at `netns` (the one that plays the
/// host, `network.host_netns`), or of the daemon's own with `None`.
pub fn default_uplink_in(netns: Option<&std::path::Path>) -> Option<String> {
    let Some(p) = netns else {
        return default_uplink();
    };
    let ns = crate::net::netns::open(p).ok()?;
    crate::net::netns::run_in(Some(&ns), "the host namespace", || {
        // This thread's namespace, not the process's.
        Ok(std::fs::read_to_string("/proc/thread-self/net/route").ok())
    })
    .ok()
    .flatten()
    .and_then(|t| default_route_if(&t))
}

fn default_route_if(t: &str) -> Option<String> {
    t.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // Iface Destination Gateway Flags RefCnt Use Metric Mask ...
            (f.len() > 7 && f[1] == "00000000" && f[7] == "00000000")
                .then(|| (f[6].parse::<u32>().unwrap_or(u32::MAX), f[0].to_string()))
        })
        .min()
        .map(|(_, i)| i)
}

/// The host's resolvers (`nameserver` lines of /etc/resolv.conf), port 53.
/// The per-session forwarders ask them from the host namespace, so a local
/// stub resolver (127.0.0.53) works too.
pub fn host_resolvers() -> Vec<std::net::SocketAddr> {
    let t = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    t.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|a| a.trim().parse::<std::net::IpAddr>().ok())
        .map(|ip| std::net::SocketAddr::new(ip, 53))
        .take(3)
        .collect()
}

/// The network settings every VM is booted with, networking on or off: a
/// snapshot fixes the guest's NIC and address, so all sessions share them.
pub fn net_config(cfg: &Config) -> NetConfig {
    let mut n = cfg.network.clone().unwrap_or_else(|| NetConfig {
        prefix: cfg.net_prefix.clone().unwrap_or_else(|| "asbx".into()),
        ..NetConfig::default()
    });
    let (uid, gid) = builder_ids(cfg);
    n.tap_uid = Some(uid);
    n.tap_gid = Some(gid);
    n
}

/// The guest's MAC, derived from its address (locally administered).
fn guest_mac(n: &NetConfig) -> String {
    let o = n.guest_addr().octets();
    format!("06:00:{:02x}:{:02x}:{:02x}:{:02x}", o[0], o[1], o[2], o[3])
}

/// Kernel command line that configures the guest's eth0: its address, the
/// TAP as gateway and resolver (a forwarder answers there, see `net`).
fn guest_cmdline(n: &NetConfig) -> String {
    format!(
        "sandbox.ip={}/{} sandbox.gw={} sandbox.dns={}",
        n.guest_addr(),
        n.guest_cidr.prefix_len,
        n.tap_addr(),
        n.tap_addr()
    )
}

fn attachment(netns: PathBuf, n: &NetConfig) -> NetAttachment {
    NetAttachment {
        netns,
        tap: n.tap_name.clone(),
        guest_mac: guest_mac(n),
    }
}

/// The NIC snapshot-making VMs get: a TAP in a namespace of its own with no
/// other link, so nothing a warm command does reaches any network. Keep the
/// returned guard while the registry may build snapshots.
pub fn snapshot_net(cfg: &Config, rc: &mut RegistryConfig) -> Result<Isolated> {
    let n = net_config(cfg);
    let iso = Isolated::create_for_snapshots(&n)
        .map_err(|e| SandboxError::Other(format!("snapshot network namespace: {e}")))?;
    rc.net = Some(attachment(iso.path(), &n));
    Ok(iso)
}

pub fn registry_config(cfg: &Config) -> RegistryConfig {
    registry_config_with(cfg, pinned_images(cfg))
}

fn registry_config_with(cfg: &Config, pins: PinnedImages) -> RegistryConfig {
    let cache = cfg_cache_dir(cfg);
    let templates = cfg
        .artifacts
        .templates_dir
        .clone()
        .unwrap_or_else(templates_dir);
    let mut rc = RegistryConfig::new(templates, cache, snapshot_state(cfg));
    rc.pinned_kernel = pins.kernel;
    rc.pinned_rootfs = pins.rootfs;
    (rc.uid, rc.gid) = builder_ids(cfg);
    rc.default_vcpus = cfg.default_vcpus;
    rc.default_mem_mib = cfg.default_mem_mib;
    let n = net_config(cfg);
    rc.cmdline_extra = guest_cmdline(&n);
    // The attachment itself comes from `snapshot_net`; the MAC is fixed here
    // so that freshness checks see the shape sessions will restore with.
    rc.net = Some(attachment(PathBuf::new(), &n));
    rc
}

/// The QEMU backend's settings for `cfg`.
pub fn qemu_config(cfg: &Config) -> QemuConfig {
    let mut qc = QemuConfig {
        // The KVM probe costs seconds: remember its answer beside the
        // snapshots (which are only valid for that answer anyway).
        accel_cache: Some(snapshot_state(cfg).join("qemu-accel")),
        ..Default::default()
    };
    if let Some(q) = &cfg.artifacts.qemu {
        qc.binary = q.clone();
    }
    qc.io_max = io_max(cfg);
    qc.mem_overhead_mib = cfg.vm_memory_overhead_mib;
    qc.cpu_max = cfg.vm_cpu_max;
    qc.nofile = cfg.vm_nofile_limit;
    qc
}

/// The jailer's settings for `cfg`: binaries from the config, else the
/// environment, else the jailer's defaults; the jail lives under the state
/// dir so snapshot files can be hard-linked into it.
pub fn jailer_config(cfg: &Config) -> JailerConfig {
    let mut jc = JailerConfig::default();
    let env = |k: &str| std::env::var_os(k).map(PathBuf::from);
    if let Some(p) = cfg
        .artifacts
        .jailer
        .clone()
        .or_else(|| env("AGENT_SANDBOX_JAILER"))
    {
        jc.jailer_bin = p;
    }
    if let Some(p) = cfg
        .artifacts
        .firecracker
        .clone()
        .or_else(|| env("AGENT_SANDBOX_FIRECRACKER"))
    {
        jc.firecracker_bin = p;
    }
    jc.chroot_base = cfg
        .jail_dir
        .clone()
        .unwrap_or_else(|| cfg.state_dir.join("jail"));
    jc.cpu_max = cfg.vm_cpu_max;
    if let Some(n) = cfg.vm_nofile_limit {
        jc.no_file = n;
    }
    jc.io_max = io_max(cfg);
    if let Some(root) = crate::vm::jailer::cgroup2_mount() {
        jc.cgroup_root = root;
    }
    if let Some(m) = cfg.vm_memory_overhead_mib {
        jc.mem_overhead_mib = u32::try_from(m).unwrap_or(u32::MAX);
    }
    // cgroup v1 where this host binds the controllers there.
    let (version, roots) =
        crate::vm::cgroup::jailer_plan(&crate::vm::cgroup::hierarchies(), &wanted_controllers(cfg));
    if version == 1 {
        jc.cgroup_version = 1;
        jc.cgroup_v1_roots = roots;
    }
    jc
}

/// The jailer's `--parent-cgroup` for the daemon's VM parents (one per
/// hierarchy): their path below their mount, so Firecracker's VMs sit where
/// QEMU's do (below the daemon's own cgroup with `cgroup_placement own`).
/// `None` without parents (the jailer's default parent); an error when the
/// paths differ between hierarchies: the jailer takes one path for all, and
/// its VMs would land outside the daemon's cgroup.
pub fn jailer_parent(
    parents: &[PathBuf],
    hs: &[crate::vm::cgroup::Hierarchy],
) -> std::result::Result<Option<String>, String> {
    let rels: Vec<&std::path::Path> = parents
        .iter()
        .filter_map(|p| {
            hs.iter()
                .filter_map(|h| p.strip_prefix(&h.mount).ok())
                .min_by_key(|r| r.components().count())
        })
        .collect();
    let Some(first) = rels.first().copied() else {
        return Ok(None);
    };
    if rels.len() != parents.len() || rels.iter().any(|r| *r != first) {
        return Err(format!(
            "the VMs' cgroup parents {parents:?} are not at one path in every hierarchy, and \
             Firecracker's jailer takes one --parent-cgroup for all: start the daemon in \
             cgroups of one path (a systemd unit does that) or use cgroup_placement standalone"
        ));
    }
    Ok(first.to_str().map(str::to_string))
}

/// The controllers VMs' limits need under `cfg` (`io` with `vm_io_max`).
pub fn wanted_controllers(cfg: &Config) -> Vec<&'static str> {
    crate::vm::cgroup::CONTROLLERS
        .iter()
        .copied()
        .filter(|c| *c != "io" || cfg.vm_io_max.is_some())
        .collect()
}

/// The VM backend `name` (`qemu`, `firecracker`), as the admin commands
/// and tools name it.
pub fn backend(name: &str, cfg: &Config) -> Result<Arc<dyn Backend>> {
    let kind = name
        .parse()
        .map_err(|_| SandboxError::Other(format!("unknown VM backend {name:?}")))?;
    backend_on(kind, cfg, &Host::default())
}

/// A VM backend that starts its processes the way `host` says.
pub fn backend_on(kind: BackendKind, cfg: &Config, host: &Host) -> Result<Arc<dyn Backend>> {
    match kind {
        BackendKind::Qemu => {
            // Settled now, on the start-up thread (see kvm_device_usable).
            let _ = crate::vm::qemu::kvm_device_usable();
            let qc = QemuConfig {
                launcher: host.launcher(),
                cgroup_parents: host.cgroup_parents.clone(),
                ..qemu_config(cfg)
            };
            Ok(Arc::new(QemuBackend::new(qc)))
        }
        BackendKind::Firecracker => {
            let spawner: Arc<dyn crate::vm::launch::Spawner> = match &host.spawner {
                Some(s) => Arc::new(s.clone()),
                None => Arc::new(DirectSpawner),
            };
            let mut jc = jailer_config(cfg);
            if let Some(p) = jailer_parent(&host.cgroup_parents, &crate::vm::cgroup::hierarchies())
                .map_err(SandboxError::Other)?
            {
                jc.parent_cgroup = p;
            }
            Ok(Arc::new(FirecrackerBackend::new(jc, spawner)))
        }
        // Not a VMM: the agent runs as a host process (`sandbox::local`).
        BackendKind::LocalProcess => Err(SandboxError::Other(format!(
            "unknown VM backend {:?}",
            kind.as_str()
        ))),
    }
}

/// The registry as the factory's template source: sessions restore the
/// template's snapshot (made on first use, remade when stale); a session
/// asking for more vCPUs or memory than the snapshot has cold-boots.
struct Templates {
    reg: Registry,
    /// The namespace snapshot builds attach to, until shutdown.
    snap_net: std::sync::Mutex<Option<Isolated>>,
}

impl TemplateSource for Templates {
    fn ensure_snapshot(&self, name: &str) -> Result<()> {
        self.reg
            .ensure_snapshot(name)
            .map(drop)
            .map_err(|e| SandboxError::Other(format!("template {name}: {e}")))
    }

    fn is_builtin(&self, name: &str) -> bool {
        crate::vm::templates::valid_name(name)
            && self
                .reg
                .config()
                .templates_dir
                .join(format!("{name}.json"))
                .is_file()
    }

    fn delete(&self, name: &str) -> Result<bool> {
        let t = match self.reg.template(name) {
            Ok(t) => t,
            Err(_) => return Ok(false),
        };
        if t.source.is_none() {
            return Err(SandboxError::Unsupported(format!(
                "{name} is a built-in template: it cannot be deleted"
            )));
        }
        let removed = crate::vm::build::remove(&self.reg.config().cache_dir, name)
            .map_err(SandboxError::Other)?;
        let snap = self.reg.snapshot_dir(name);
        if let Err(e) = std::fs::remove_dir_all(&snap) {
            if e.kind() != std::io::ErrorKind::NotFound {
                log::warn!("template {name}: remove {}: {e}", snap.display());
            }
        }
        Ok(removed)
    }

    fn list(&self) -> Vec<TemplateInfo> {
        match self.reg.list() {
            Ok(l) => l
                .into_iter()
                .filter(|t| t.rootfs.is_some() && t.kernel.is_some())
                .map(|t| TemplateInfo {
                    is_default: t.name == DEFAULT_TEMPLATE,
                    builtin: t.source.is_none(),
                    // Listings name the source, not its whole Dockerfile.
                    source: t.source.map(|s| crate::vm::templates::TemplateSource {
                        dockerfile: None,
                        ..s
                    }),
                    name: t.name,
                    display_name: t.display_name,
                    version: t.version,
                    description: t.description,
                    tools: t.tools,
                    vcpus: t.vcpus,
                    mem_mib: t.mem_mib,
                })
                .collect(),
            Err(e) => {
                log::warn!("templates: {e}");
                Vec::new()
            }
        }
    }

    fn close(&self) {
        lock(&self.snap_net).take();
    }

    fn resolve(&self, name: &str, vcpus: u32, mem_mib: u32) -> Result<ResolvedTemplate> {
        let name = if name == "default" {
            DEFAULT_TEMPLATE
        } else {
            name
        };
        self.reg
            .template(name)
            .map_err(|_| SandboxError::UnknownTemplate(name.to_string()))?;
        let snap = self
            .reg
            .ensure_snapshot(name)
            .map_err(|e| SandboxError::Other(format!("template {name}: {e}")))?;
        if vcpus <= snap.vcpus && mem_mib <= snap.mem_mib {
            return Ok(ResolvedTemplate {
                kernel: snap.kernel,
                rootfs: snap.rootfs,
                snapshot_dir: Some(snap.dir),
                cmdline_extra: snap.cmdline_extra,
                vcpus: snap.vcpus,
                mem_mib: snap.mem_mib,
            });
        }
        Ok(ResolvedTemplate {
            kernel: snap.kernel,
            rootfs: snap.rootfs,
            snapshot_dir: None,
            cmdline_extra: snap.cmdline_extra,
            vcpus,
            mem_mib,
        })
    }
}

/// VMMs run as an unprivileged uid and must reach their run dir: make the
/// path to it traversable (not listable). Secrets in the state dir (the
/// key file) are 0600 files, unaffected.
fn prepare_run_root(cfg: &Config) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let run_root = cfg.state_dir.join("run");
    std::fs::create_dir_all(&run_root)
        .map_err(|e| SandboxError::Other(format!("create {}: {e}", run_root.display())))?;
    for d in [&cfg.state_dir, &run_root] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o711))
            .map_err(|e| SandboxError::Other(format!("chmod {}: {e}", d.display())))?;
    }
    Ok(run_root)
}

/// Per-session networks over `crate::net`: namespace, veth, TAP, NAT and
/// the egress policy, installed and verified before the VM starts.
struct SessionNets {
    net: Net,
}

struct SessionLease {
    net: SessionNet,
    mac: String,
}

impl NetProvider for SessionNets {
    fn close(&self) -> Result<()> {
        self.net
            .close()
            .map_err(|e| SandboxError::Other(format!("closing the network: {e}")))
    }

    fn setup(
        &self,
        id: &str,
        egress: &EgressPolicy,
        owner: (u32, u32),
    ) -> Result<Box<dyn NetLease>> {
        let policy = egress.compile().map_err(SandboxError::Other)?;
        let net = self
            .net
            .create_session_for(policy, owner)
            .map_err(|e| SandboxError::Failed {
                id: id.to_string(),
                what: "network",
                msg: e.to_string(),
            })?;
        log::debug!("sandbox {id}: network {net:?}");
        Ok(Box::new(SessionLease {
            net,
            mac: guest_mac(self.net.config()),
        }))
    }

    fn guest_mac(&self) -> Option<String> {
        Some(guest_mac(self.net.config()))
    }
}

impl NetLease for SessionLease {
    fn attachment(&self) -> NetAttachment {
        NetAttachment {
            netns: self.net.netns_path(),
            tap: self.net.tap_name().to_string(),
            guest_mac: self.mac.clone(),
        }
    }
    fn set_egress(&mut self, policy: &EgressPolicy) -> Result<()> {
        let p = policy.compile().map_err(SandboxError::Other)?;
        self.net
            .set_policy(p)
            .map_err(|e| SandboxError::Other(format!("session network {}: {e}", self.net.id())))
    }
    fn teardown(&mut self) -> Result<()> {
        self.net
            .teardown()
            .map_err(|e| SandboxError::Other(format!("session network {}: {e}", self.net.id())))
    }
    fn proxy_stats(&self) -> Option<crate::net::ProxyStats> {
        self.net.proxy_stats()
    }
    fn guest_connector(&mut self) -> Option<crate::net::GuestConnector> {
        match self.net.guest_connector() {
            Ok(c) => Some(c),
            Err(e) => {
                log::warn!("session network {}: guest connector: {e}", self.net.id());
                None
            }
        }
    }
    fn set_audit(&self, tag: Option<crate::audit::Tag>) {
        self.net.set_audit(tag);
    }

    fn set_injection(
        &mut self,
        inj: Option<std::sync::Arc<crate::net::inject::Injection>>,
    ) -> Result<()> {
        self.net
            .set_injection(inj)
            .map_err(|e| SandboxError::Other(format!("session network {}: {e}", self.net.id())))
    }
}

/// Networking off: every VM still gets its NIC (the snapshot has one), on a
/// TAP in a namespace of its own that leads nowhere.
struct NoNetwork {
    cfg: NetConfig,
}

struct IsolatedLease {
    iso: Option<Isolated>,
    at: NetAttachment,
}

impl NetProvider for NoNetwork {
    fn setup(
        &self,
        id: &str,
        _egress: &EgressPolicy,
        owner: (u32, u32),
    ) -> Result<Box<dyn NetLease>> {
        let iso = Isolated::create_for(&self.cfg, owner).map_err(|e| SandboxError::Failed {
            id: id.to_string(),
            what: "isolated network namespace",
            msg: e.to_string(),
        })?;
        let at = attachment(iso.path(), &self.cfg);
        Ok(Box::new(IsolatedLease { iso: Some(iso), at }))
    }

    fn guest_mac(&self) -> Option<String> {
        Some(guest_mac(&self.cfg))
    }
}

impl NetLease for IsolatedLease {
    fn attachment(&self) -> NetAttachment {
        self.at.clone()
    }
    fn set_egress(&mut self, _policy: &EgressPolicy) -> Result<()> {
        Err(SandboxError::Other(
            "this host runs without per-session networking (serve --network): \
             sessions have no egress to change"
                .into(),
        ))
    }
    fn teardown(&mut self) -> Result<()> {
        self.iso = None;
        Ok(())
    }
}

/// Remove what a crashed daemon with our prefix left of its networking:
/// with networking on, session and isolated namespaces, host links and our
/// nftables table; with it off, only the isolated namespaces (a daemon
/// without networking must not touch the host's tables and routes).
fn sweep_network(n: &NetConfig, on: bool) {
    if on {
        match Net::sweep(n) {
            Ok(r) if !r.is_empty() => log::warn!("network sweep removed {r:?}"),
            Ok(_) => {}
            Err(e) => log::warn!("network sweep: {e}"),
        }
        return;
    }
    match Isolated::sweep(&n.prefix) {
        Ok(l) if !l.is_empty() => log::warn!("sweep: removed namespaces {l:?}"),
        Ok(_) => {}
        Err(e) => log::warn!("sweep: {e}"),
    }
}

pub fn factory(kind: BackendKind, cfg: &Config) -> Result<Arc<dyn SandboxFactory>> {
    factory_on(kind, cfg, &Host::default())
}

pub fn factory_on(kind: BackendKind, cfg: &Config, host: &Host) -> Result<Arc<dyn SandboxFactory>> {
    let run_root = prepare_run_root(cfg)?;
    let be = backend_on(kind, cfg, host)?;
    let n = net_config(cfg);
    sweep_network(&n, cfg.network.is_some());
    let net: Arc<dyn NetProvider> = match &cfg.network {
        Some(_) => {
            let net =
                Net::new(n.clone()).map_err(|e| SandboxError::Other(format!("networking: {e}")))?;
            log::info!(
                "networking on: uplink {}, sessions in {}, guest {}",
                n.uplink_if,
                n.veth_range,
                n.guest_cidr
            );
            Arc::new(SessionNets { net })
        }
        None => {
            log::warn!("networking off (serve --network): sessions have no network access");
            Arc::new(NoNetwork { cfg: n })
        }
    };
    let mut rc = match &host.images {
        Some(pins) => registry_config_with(cfg, pins.clone()),
        None => registry_config(cfg),
    };
    let snap_net = snapshot_net(cfg, &mut rc)?;
    let cache = rc.cache_dir.clone();
    let reg = Registry::new(rc, be.clone());
    let templates = Arc::new(Templates {
        reg,
        snap_net: std::sync::Mutex::new(Some(snap_net)),
    });
    let builds = match lock(&host.builder).take() {
        Some(h) => {
            let t = templates.clone();
            let hook: super::builds::SnapshotHook =
                Arc::new(move |name: &str| t.ensure_snapshot(name).map_err(|e| e.to_string()));
            let run = cfg.state_dir.join("run");
            Some(
                super::builds::Builds::start(h, run, cache, hook)
                    .map_err(|e| SandboxError::Other(format!("template builds: {e}")))?,
            )
        }
        None => None,
    };
    Ok(Arc::new(VmSandboxFactory {
        builds,
        backend: be,
        templates,
        net: Some(net),
        run_root,
        cgroup_parents: host.cgroup_parents.clone(),
        ids: vm_ids(cfg)?,
        agent_timeout: Duration::from_secs(60),
        // Without the spawner a VMM is started by the calling thread and
        // dies with it (PR_SET_PDEATHSIG); a standby's thread ends once its
        // VMM is up, so standbys need the spawner (`serve`; an in-process
        // `mcp` has none).
        // A standby is at most one session's worth of VMM, uid and
        // network: never more of them than sessions.
        standby: super::standby::Standby::new(match host.spawner {
            Some(_) => cfg.standby_vmms.min(cfg.max_sessions),
            None => 0,
        }),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn the_jailer_parent_is_the_vm_parent_below_its_mount() {
        use crate::vm::cgroup::Hierarchy;
        let hs = [
            Hierarchy {
                mount: "/sys/fs/cgroup/unified".into(),
                v1: None,
            },
            Hierarchy {
                mount: "/sys/fs/cgroup/memory".into(),
                v1: Some(vec!["memory"]),
            },
        ];
        let same = [
            PathBuf::from("/sys/fs/cgroup/unified/system.slice/a.service/vms"),
            PathBuf::from("/sys/fs/cgroup/memory/system.slice/a.service/vms"),
        ];
        assert_eq!(
            jailer_parent(&same, &hs),
            Ok(Some("system.slice/a.service/vms".to_string()))
        );
        let differ = [
            PathBuf::from("/sys/fs/cgroup/unified/a/vms"),
            PathBuf::from("/sys/fs/cgroup/memory/b/vms"),
        ];
        let e = jailer_parent(&differ, &hs).unwrap_err();
        assert!(e.contains("one --parent-cgroup"), "{e}");
        assert_eq!(jailer_parent(&[], &hs), Ok(None));
    }

    #[test]
    fn images_come_from_current_json_and_the_config_wins() {
        let cache = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            cache.path().join("current.json"),
            r#"{"kernel": "/c/vmlinux-a", "rootfs": {"base": "/c/base-a.erofs", "python": "/c/py-a.erofs"}}"#,
        )
        .expect("write current.json");
        let mut cfg = Config::default();
        cfg.artifacts.cache_dir = Some(cache.path().to_path_buf());
        let pins = pinned_images(&cfg);
        assert_eq!(pins.kernel.as_deref(), Some(Path::new("/c/vmlinux-a")));
        assert_eq!(pins.rootfs.len(), 2);
        cfg.artifacts
            .images
            .insert("python".into(), "/nix/py.erofs".into());
        let pins = pinned_images(&cfg);
        assert_eq!(pins.rootfs["python"], Path::new("/nix/py.erofs"));
        assert_eq!(pins.rootfs["base"], Path::new("/c/base-a.erofs"));
        // The registry of a daemon uses what it locked, even after
        // current.json moved on.
        std::fs::write(
            cache.path().join("current.json"),
            r#"{"kernel": "/c/vmlinux-b"}"#,
        )
        .expect("rewrite current.json");
        let rc = registry_config_with(&cfg, pins.clone());
        assert_eq!(rc.pinned_kernel, pins.kernel);
        assert_eq!(rc.pinned_rootfs, pins.rootfs);
        assert_eq!(
            registry_config(&cfg).pinned_kernel.as_deref(),
            Some(Path::new("/c/vmlinux-b"))
        );
    }
}
