//! The seam between sessions and everything below them. A [`Sandbox`] is
//! one isolated machine with a connected guest agent; a [`SandboxFactory`]
//! makes them. Sessions, the pool and the API know only these traits.
//!
//! Factories:
//! - [`vm::VmSandboxFactory`]: a VM backend + templates + networking. The
//!   production factory, completed when the QEMU/template and networking
//!   branches land (see [`production_factory`]).
//! - [`local::LocalProcessFactory`]: the real guest agent run as an ordinary
//!   host process. No isolation at all: for development and the daemon's own
//!   tests only, selected explicitly with `--backend local-process`.

/// The developer image every language of `/v1/run` runs in (what a
/// session naming no template gets unless `default_template` says
/// otherwise), for the front ends, which do not reach into `vm`.
pub use crate::vm::templates::DEFAULT_TEMPLATE as DEVELOPER_TEMPLATE;

pub mod builds;
pub mod local;
pub mod seams;
pub mod standby;
pub mod vm;
pub mod wiring;

use crate::agent::AgentClient;
use crate::config::Config;
use crate::net::EgressPolicy;
use crate::vm::BackendKind;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("unknown template {0:?}")]
    UnknownTemplate(String),
    #[error("sandbox {id}: {what}: {msg}")]
    Failed {
        id: String,
        what: &'static str,
        msg: String,
    },
    /// No VM uid could be leased for sandbox `id` (the range is used up,
    /// by sessions and standby VMMs of this daemon or by other daemons).
    #[error("sandbox {id}: vm uid: {msg}")]
    UidsExhausted { id: String, msg: String },
    /// What this backend cannot do (local-process: checkpoints).
    #[error("{0}")]
    Unsupported(String),
    /// A checkpoint this host cannot restore (other VMM version, kernel,
    /// rootfs or shape): the reason names what differs.
    #[error("{0}")]
    Unrestorable(String),
    #[error("{0}")]
    Other(String),
}

pub type Result<T> = std::result::Result<T, SandboxError>;

/// What to make.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    /// Internal id, `[a-z0-9-]`, unique per daemon run; names VMs, jails,
    /// namespaces and runtime dirs. Carries [`ID_PREFIX`] so the orphan
    /// sweep recognises leftovers.
    pub id: String,
    pub template: String,
    pub vcpus: u32,
    pub mem_mib: u32,
    pub disk_mib: u32,
    /// Environment every command in the sandbox starts with.
    pub env: BTreeMap<String, String>,
    pub egress: EgressPolicy,
}

/// Prefix of every resource name we create (processes, dirs, netns, ...).
pub const ID_PREFIX: &str = "asbx-";

/// One template as listed (`GET /exec/templates`, `/v1/templates`, MCP
/// `list_templates`): serialized in the seed's shape (`displayName`,
/// `version`, `tools`, `resources`) plus our own fields.
#[derive(Debug, Clone, Default)]
pub struct TemplateInfo {
    pub name: String,
    pub display_name: String,
    pub version: String,
    pub description: String,
    pub tools: Vec<String>,
    pub vcpus: u32,
    pub mem_mib: u32,
    pub is_default: bool,
    /// Shipped with the daemon (not built from an image).
    pub builtin: bool,
    /// Built from an image: where from.
    pub source: Option<crate::vm::templates::TemplateSource>,
}

impl Serialize for TemplateInfo {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Resources {
            mem_size_mib: u32,
            vcpu_count: u32,
        }
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Wire<'a> {
            name: &'a str,
            display_name: &'a str,
            version: &'a str,
            description: &'a str,
            tools: &'a [String],
            resources: Resources,
            vcpus: u32,
            memory_mib: u32,
            default: bool,
            builtin: bool,
            #[serde(skip_serializing_if = "Option::is_none")]
            source: Option<&'a crate::vm::templates::TemplateSource>,
        }
        Wire {
            name: &self.name,
            display_name: &self.display_name,
            version: &self.version,
            description: &self.description,
            tools: &self.tools,
            resources: Resources {
                mem_size_mib: self.mem_mib,
                vcpu_count: self.vcpus,
            },
            vcpus: self.vcpus,
            memory_mib: self.mem_mib,
            default: self.is_default,
            builtin: self.builtin,
            source: self.source.as_ref(),
        }
        .serialize(s)
    }
}

/// One isolated machine with a connected agent. Owned by exactly one
/// session thread (or the warm pool until a session takes it).
pub trait Sandbox: Send {
    fn id(&self) -> &str;
    fn agent(&self) -> &AgentClient;
    /// Ends the machine and frees everything it held. Idempotent.
    fn destroy(&mut self) -> Result<()>;
    /// Host pids that belong to this sandbox (VMM or agent), for tests and
    /// diagnostics.
    fn pids(&self) -> Vec<i32> {
        Vec::new()
    }
    /// Changes the egress policy of the running sandbox (networking layer).
    fn set_egress(&mut self, policy: &EgressPolicy) -> Result<()> {
        let _ = policy;
        Err(SandboxError::Other(format!(
            "sandbox {}: changing the egress policy is not supported by this backend",
            self.id()
        )))
    }
    /// What the session's egress inspection proxy did (networking layer).
    fn proxy_stats(&self) -> Option<crate::net::ProxyStats> {
        None
    }
    /// Dials the guest's TCP ports from the host side (preview URLs);
    /// `None`: this backend or network has no way to.
    fn guest_connector(&mut self) -> Option<crate::net::GuestConnector> {
        None
    }
    /// Secrets the session's egress proxy puts into requests to their
    /// hosts (`None`: none); see `net::inject`.
    fn set_injection(&mut self, inj: Option<Arc<crate::net::inject::Injection>>) -> Result<()> {
        if inj.is_none() {
            return Ok(());
        }
        Err(SandboxError::Unsupported(format!(
            "sandbox {}: injected secrets need a VM backend with per-session networking",
            self.id()
        )))
    }
    /// The session whose audit log the sandbox's own layers (its egress
    /// proxy) record to; `None`: none. Backends without them ignore it.
    fn set_audit(&mut self, tag: Option<crate::audit::Tag>) {
        let _ = tag;
    }
    /// How long the phases of creation took, e.g. `(Phase::Network, 3 ms)`;
    /// exported as metrics by the session layer.
    fn timings(&self) -> Vec<(Phase, std::time::Duration)> {
        Vec::new()
    }
    /// Save the running sandbox's whole state into `dir` (the VM's
    /// [`crate::vm::Vm::checkpoint`]); it runs on afterwards.
    fn checkpoint(&mut self, dir: &std::path::Path) -> Result<CheckpointStats> {
        let _ = dir;
        Err(SandboxError::Unsupported(format!(
            "sandbox {}: this backend cannot checkpoint a session",
            self.id()
        )))
    }
}

pub use crate::vm::CheckpointStats;

/// A phase of a sandbox's creation that [`Sandbox::timings`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Its network (namespace, veth, TAP, rules) was set up.
    Network,
    /// It restored into a VMM started ahead (`standby_vmms`); the time is
    /// how long that VMM had waited.
    StandbyVmm,
}

pub trait SandboxFactory: Send + Sync {
    /// Backend name for metrics labels (`firecracker`, `qemu`, `local-process`).
    fn backend(&self) -> &'static str;
    /// Boot or restore a sandbox and connect to its agent. May take seconds;
    /// called on a session or pool thread, never on an API thread.
    fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>>;
    fn templates(&self) -> Vec<TemplateInfo>;
    /// Removes what an earlier, crashed run left behind (processes, jails,
    /// netns, links, firewall rules, cgroups), found by [`ID_PREFIX`].
    /// Called once at start, before the API opens. Returns how many
    /// resources were removed.
    fn sweep_orphans(&self) -> Result<usize> {
        Ok(0)
    }
    /// Get ready for sessions like `spec` without making one: a VM factory
    /// starts a standby VMM for its shape ahead of the first such session.
    /// Returns at once (the work runs on a thread of the factory's).
    fn prime(&self, spec: &SandboxSpec) {
        let _ = spec;
    }
    /// At shutdown, after every sandbox is destroyed: release what is
    /// shared by all of them (the network's host table and routes, the
    /// snapshot namespace).
    fn close(&self) -> Result<()> {
        Ok(())
    }
    /// The template builds this host runs (`POST /v1/templates`), if any.
    fn builds(&self) -> Option<Arc<builds::Builds>> {
        None
    }
    /// Whether `name` is one of the daemon's own templates, built or not:
    /// a name builds from images may not take.
    fn is_builtin_template(&self, name: &str) -> bool {
        self.templates().iter().any(|t| t.name == name && t.builtin)
    }
    /// Removes template `name` if it was built from an image (its image,
    /// template file and snapshots): `Ok(false)` when there is no such
    /// template, `Unsupported` for a built-in one.
    fn delete_template(&self, name: &str) -> Result<bool> {
        let _ = name;
        Err(SandboxError::Unsupported(
            "this backend has no templates built from images".into(),
        ))
    }
    /// A sandbox of `spec` (its template and shape) started from the
    /// checkpoint in `dir` instead of the template's snapshot: its own
    /// network namespace (with `spec.egress`), VMM uid and cgroup, the
    /// guest's clock and entropy fixed up as after every restore.
    fn restore(&self, spec: &SandboxSpec, dir: &std::path::Path) -> Result<Box<dyn Sandbox>> {
        let _ = dir;
        Err(SandboxError::Unsupported(format!(
            "sandbox {}: this backend cannot restore a checkpoint",
            spec.id
        )))
    }
    /// Whether the checkpoint in `dir` restores as `spec` on this host
    /// ([`SandboxError::Unrestorable`] says why not).
    fn check_restorable(&self, spec: &SandboxSpec, dir: &std::path::Path) -> Result<()> {
        let _ = dir;
        Err(SandboxError::Unsupported(format!(
            "sandbox {}: this backend cannot restore a checkpoint",
            spec.id
        )))
    }
    /// The checkpoint in `dir` is about to be removed.
    fn forget_checkpoint(&self, dir: &std::path::Path) {
        let _ = dir;
    }
}

/// The factory `serve` (and an in-process `mcp`) runs with.
/// `agent_bin` is only used by `local-process`.
pub fn build_factory(
    backend: BackendKind,
    agent_bin: Option<std::path::PathBuf>,
    cfg: &Config,
) -> Result<Arc<dyn SandboxFactory>> {
    build_factory_on(backend, agent_bin, cfg, &wiring::Host::default())
}

/// [`build_factory`] for the hardened daemon: processes start through
/// `host.spawner`, VMs get cgroups under `host.cgroup_parents`.
pub fn build_factory_on(
    backend: BackendKind,
    agent_bin: Option<std::path::PathBuf>,
    cfg: &Config,
    host: &wiring::Host,
) -> Result<Arc<dyn SandboxFactory>> {
    match backend {
        BackendKind::LocalProcess => {
            log::warn!(
                "backend local-process: commands run on this host WITHOUT isolation \
                 (development and testing only)"
            );
            let bin = agent_bin.unwrap_or_else(local::LocalProcessFactory::default_agent_bin);
            let f = local::LocalProcessFactory::new(bin, cfg.state_dir.join("run"))?;
            Ok(Arc::new(match &host.spawner {
                Some(s) => f.with_spawner(s.clone()),
                None => f,
            }))
        }
        vmm @ (BackendKind::Qemu | BackendKind::Firecracker) => wiring::factory_on(vmm, cfg, host),
    }
}

/// INTEGRATION POINT for the VM backends: build the production factory for
/// `--backend qemu|firecracker`. When the QEMU/template and networking
/// branches land, construct a [`vm::VmSandboxFactory`] here from the chosen
/// `crate::vm::Backend`, a [`seams::TemplateSource`] over the template registry
/// and (optionally) a [`seams::NetProvider`] over `crate::net`.
pub fn production_factory(backend: BackendKind, cfg: &Config) -> Result<Arc<dyn SandboxFactory>> {
    wiring::factory(backend, cfg)
}

/// A unique internal id for a new sandbox.
pub fn new_sandbox_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(1);
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    // Not a secret: pid and sequence make it unique in this run, the
    // random part across runs (a clock if the kernel gives no random).
    let r = crate::agent::random_u64().unwrap_or_else(|_| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    }) & 0xffff_ffff;
    format!("{ID_PREFIX}{}-{n}-{r:08x}", std::process::id())
}
