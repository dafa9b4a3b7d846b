//! Builds the production factory: a VM backend, the template/snapshot
//! registry over the image cache, and (later) per-session networking.

use super::vm::{ResolvedTemplate, TemplateSource, VmSandboxFactory};
use super::{Result, SandboxError, SandboxFactory, TemplateInfo};
use crate::config::Config;
use crate::vm::firecracker::FirecrackerBackend;
use crate::vm::jailer::{DirectSpawner, JailerConfig};
use crate::vm::qemu::{QemuBackend, QemuConfig};
use crate::vm::templates::{Registry, RegistryConfig};
use crate::vm::Backend;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Uid/gid VMMs run as (nobody), unless configured otherwise.
const VM_UID: u32 = 65534;
const VM_GID: u32 = 65534;

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
fn cfg_cache_dir(cfg: &Config) -> PathBuf {
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

pub fn registry_config(cfg: &Config) -> RegistryConfig {
    let cache = cfg_cache_dir(cfg);
    let templates = cfg
        .artifacts
        .templates_dir
        .clone()
        .unwrap_or_else(templates_dir);
    let mut rc = RegistryConfig::new(templates, cache.clone(), snapshot_state(cfg));
    // The artifacts `agent-sandbox image build` made last, if it recorded
    // them; otherwise the registry takes the newest in the cache.
    if let Some(cur) = std::fs::read(cache.join("current.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
    {
        if let Some(k) = cur["kernel"].as_str() {
            rc.pinned_kernel = Some(PathBuf::from(k));
        }
        if let Some(m) = cur["rootfs"].as_object() {
            for (t, p) in m {
                if let Some(p) = p.as_str() {
                    rc.pinned_rootfs.insert(t.clone(), PathBuf::from(p));
                }
            }
        }
    }
    // The config names artifacts explicitly (the Nix build does): they win.
    if let Some(k) = &cfg.artifacts.kernel {
        rc.pinned_kernel = Some(k.clone());
    }
    for (t, p) in &cfg.artifacts.images {
        rc.pinned_rootfs.insert(t.clone(), p.clone());
    }
    rc.uid = VM_UID;
    rc.gid = VM_GID;
    rc.default_vcpus = cfg.default_vcpus;
    rc.default_mem_mib = cfg.default_mem_mib;
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
    jc.chroot_base = cfg.state_dir.join("jail");
    if let Some(root) = crate::vm::jailer::cgroup2_mount() {
        jc.cgroup_root = root;
    }
    jc
}

pub fn backend(name: &str, cfg: &Config) -> Result<Arc<dyn Backend>> {
    match name {
        "qemu" => Ok(Arc::new(QemuBackend::new(qemu_config(cfg)))),
        "firecracker" => Ok(Arc::new(FirecrackerBackend::new(
            jailer_config(cfg),
            Arc::new(DirectSpawner),
        ))),
        other => Err(SandboxError::Other(format!("unknown VM backend {other:?}"))),
    }
}

/// The registry as the factory's template source: sessions restore the
/// template's snapshot (made on first use, remade when stale); a session
/// asking for more vCPUs or memory than the snapshot has cold-boots.
struct Templates {
    reg: Registry,
}

impl TemplateSource for Templates {
    fn list(&self) -> Vec<TemplateInfo> {
        let default = "base";
        match self.reg.list() {
            Ok(l) => l
                .into_iter()
                .filter(|t| t.rootfs.is_some() && t.kernel.is_some())
                .map(|t| TemplateInfo {
                    is_default: t.name == default,
                    name: t.name,
                    description: t.description,
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

    fn resolve(&self, name: &str, vcpus: u32, mem_mib: u32) -> Result<ResolvedTemplate> {
        let name = if name == "default" { "base" } else { name };
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

pub fn factory(name: &str, cfg: &Config) -> Result<Arc<dyn SandboxFactory>> {
    let run_root = prepare_run_root(cfg)?;
    let be = backend(name, cfg)?;
    let reg = Registry::new(registry_config(cfg), be.clone());
    Ok(Arc::new(VmSandboxFactory {
        backend: be,
        templates: Arc::new(Templates { reg }),
        net: None,
        run_root,
        uid: VM_UID,
        gid: VM_GID,
        agent_timeout: Duration::from_secs(60),
    }))
}
