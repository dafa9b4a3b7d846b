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

pub fn registry_config(cfg: &Config) -> RegistryConfig {
    let mut rc = RegistryConfig::new(templates_dir(), cache_dir(), cfg.state_dir.clone());
    rc.uid = VM_UID;
    rc.gid = VM_GID;
    rc.default_vcpus = cfg.default_vcpus;
    rc.default_mem_mib = cfg.default_mem_mib;
    rc
}

pub fn backend(name: &str, cfg: &Config) -> Result<Arc<dyn Backend>> {
    match name {
        "qemu" => {
            let qc = QemuConfig {
                accel_cache: Some(cfg.state_dir.join("qemu-accel")),
                ..Default::default()
            };
            Ok(Arc::new(QemuBackend::new(qc)))
        }
        "firecracker" => {
            // Binaries from PATH-like env overrides; the jail lives under the
            // state dir so snapshot files can be hard-linked into it.
            let mut jc = JailerConfig::default();
            if let Some(p) = std::env::var_os("AGENT_SANDBOX_JAILER") {
                jc.jailer_bin = p.into();
            }
            if let Some(p) = std::env::var_os("AGENT_SANDBOX_FIRECRACKER") {
                jc.firecracker_bin = p.into();
            }
            jc.chroot_base = cfg.state_dir.join("jail");
            if let Some(root) = crate::vm::jailer::cgroup2_mount() {
                jc.cgroup_root = root;
            }
            Ok(Arc::new(FirecrackerBackend::new(
                jc,
                Arc::new(DirectSpawner),
            )))
        }
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

pub fn factory(name: &str, cfg: &Config) -> Result<Arc<dyn SandboxFactory>> {
    let be = backend(name, cfg)?;
    let reg = Registry::new(registry_config(cfg), be.clone());
    Ok(Arc::new(VmSandboxFactory {
        backend: be,
        templates: Arc::new(Templates { reg }),
        net: None,
        run_root: cfg.state_dir.join("run"),
        uid: VM_UID,
        gid: VM_GID,
        agent_timeout: Duration::from_secs(60),
    }))
}
