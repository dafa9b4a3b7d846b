//! Template and snapshot registry: which templates exist
//! (`images/templates/*.json`), which kernel and rootfs were built for them
//! (the image cache, e.g. `/var/cache/agent-sandbox`), and a snapshot per
//! (template, backend) under `<state>/snapshots/<backend>/<template>/`,
//! rebuilt when its manifest no longer matches (kernel, rootfs, VMM
//! version, vCPUs, memory).

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};

use super::snapshot::{self, Manifest};
use super::{connect_agent, Backend, NetAttachment, Result, VmConfig, VmError};
use crate::proto::ExecRequest;

/// How the id of a snapshot build's VM starts (`snap-<template>-<pid>`):
/// with the sessions' `asbx-`, what the start-up sweep may remove.
pub const BUILD_ID_PREFIX: &str = "snap-";

/// Where every image has its agent: the kernel command line's `init=`.
pub const AGENT_PATH: &str = "/sbin/sandbox-agent";

/// `<cache>/templates`: the templates built from images (`vm::build`).
pub fn custom_templates_dir(cache: &Path) -> PathBuf {
    cache.join("templates")
}

/// One template file, with `extends` applied.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Template {
    pub name: String,
    /// Human-readable name for listings; the name when unset.
    #[serde(default)]
    pub display_name: Option<String>,
    /// Version of the template's contents, for listings.
    #[serde(default)]
    pub version: Option<String>,
    #[serde(default)]
    pub description: String,
    /// Commands a user can count on, for listings. Like the scalars, a
    /// child's list replaces its parent's.
    #[serde(default)]
    pub tools: Option<Vec<String>>,
    #[serde(default)]
    pub extends: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Shell commands run in the booted guest before its snapshot.
    #[serde(default)]
    pub warm: Vec<String>,
    #[serde(default)]
    pub memory_mib: Option<u32>,
    #[serde(default)]
    pub vcpus: Option<u32>,
    #[serde(default)]
    pub disk_mib: Option<u32>,
    /// Working directory of commands (an image's `WorkingDir`); the agent
    /// takes it from the image's template file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// uid/gid of commands (an image's `User`), likewise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    /// A template built from an image (`template build`): its root
    /// filesystem, instead of the cache's newest `<name>-<hash>.erofs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rootfs: Option<PathBuf>,
    /// Where a template built from an image came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<TemplateSource>,
}

/// The image a template was built from (`vm::build`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TemplateSource {
    /// `oci-archive:/path`, `docker://ref`, `dockerfile:/path`.
    pub from: String,
    /// The image's manifest digest.
    pub digest: String,
    /// Unix seconds.
    pub built_at: u64,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The Dockerfile it was built from (first 64 KiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dockerfile: Option<String>,
}

#[derive(Debug, Clone)]
pub struct RegistryConfig {
    /// `images/templates`.
    pub templates_dir: PathBuf,
    /// Image cache: `kernel/vmlinux-<hash>` and `rootfs/<template>-<hash>.erofs`,
    /// each with a `.json` manifest.
    pub cache_dir: PathBuf,
    /// Daemon state; snapshots live in `<state>/snapshots/<backend>/<template>/`.
    pub state_dir: PathBuf,
    /// Where the VM that makes a snapshot gets its run dir.
    pub run_dir: PathBuf,
    /// Unprivileged uid/gid the snapshot-making VMM runs as.
    pub uid: u32,
    pub gid: u32,
    /// VM shape when a template names none.
    pub default_vcpus: u32,
    pub default_mem_mib: u32,
    /// Kernel command line additions of snapshot VMs (e.g. `sandbox.ip=`):
    /// restored sessions inherit them.
    pub cmdline_extra: String,
    /// Network device of snapshot VMs. A restored VM has exactly the
    /// devices of the VM that was saved, so sessions with networking need
    /// snapshots made with it.
    pub net: Option<NetAttachment>,
    /// Use this kernel instead of the newest in the cache (e.g. the path
    /// `images/build.sh` printed).
    pub pinned_kernel: Option<PathBuf>,
    /// Per-template rootfs to use instead of the newest in the cache.
    pub pinned_rootfs: BTreeMap<String, PathBuf>,
    /// Templates built from images (`<cache>/templates`, `vm::build`).
    pub custom_templates_dir: PathBuf,
    /// Budget for one `warm` command.
    pub warm_timeout: Duration,
    /// Boot to agent hello.
    pub agent_timeout: Duration,
}

impl RegistryConfig {
    pub fn new(templates_dir: PathBuf, cache_dir: PathBuf, state_dir: PathBuf) -> Self {
        let run_dir = state_dir.join("run");
        let custom_templates_dir = custom_templates_dir(&cache_dir);
        RegistryConfig {
            custom_templates_dir,
            templates_dir,
            cache_dir,
            state_dir,
            run_dir,
            uid: 65534,
            gid: 65534,
            default_vcpus: 1,
            default_mem_mib: 512,
            cmdline_extra: String::new(),
            net: None,
            pinned_kernel: None,
            pinned_rootfs: BTreeMap::new(),
            warm_timeout: Duration::from_secs(600),
            agent_timeout: Duration::from_secs(60),
        }
    }
}

/// Freshness of one template's snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", content = "reason", rename_all = "lowercase")]
pub enum SnapshotState {
    Fresh,
    Stale(String),
    Missing,
}

/// What is built for one template.
#[derive(Debug, Clone, Serialize)]
pub struct TemplateStatus {
    pub name: String,
    pub display_name: String,
    pub version: String,
    pub description: String,
    pub tools: Vec<String>,
    pub kernel: Option<PathBuf>,
    pub rootfs: Option<PathBuf>,
    pub snapshot_dir: PathBuf,
    pub snapshot: SnapshotState,
    pub vcpus: u32,
    pub mem_mib: u32,
    /// Built from an image (`template build`): where from.
    pub source: Option<TemplateSource>,
}

/// A snapshot ready to restore, and what to restore it with.
#[derive(Debug, Clone)]
pub struct SnapshotInfo {
    pub template: String,
    pub dir: PathBuf,
    pub kernel: PathBuf,
    pub rootfs: PathBuf,
    pub vcpus: u32,
    pub mem_mib: u32,
    pub cmdline_extra: String,
    /// Made by this call (it was missing or stale).
    pub rebuilt: bool,
    /// Environment for processes the agent starts (from the template).
    pub env: BTreeMap<String, String>,
}

impl SnapshotInfo {
    /// The `VmConfig` a restore of this snapshot needs.
    pub fn vm_config(&self, id: &str, run_dir: PathBuf, uid: u32, gid: u32) -> VmConfig {
        VmConfig {
            id: id.to_string(),
            kernel: self.kernel.clone(),
            rootfs: self.rootfs.clone(),
            vcpus: self.vcpus,
            mem_mib: self.mem_mib,
            cmdline_extra: self.cmdline_extra.clone(),
            net: None,
            uid,
            gid,
            run_dir,
        }
    }
}

pub struct Registry {
    cfg: RegistryConfig,
    backend: Arc<dyn Backend>,
    /// Held while a snapshot VM runs: every build of this registry uses the
    /// one network of `cfg.net` (a TAP only one VMM can attach to), so the
    /// builds of two templates take turns (the file lock is per template).
    building: std::sync::Mutex<()>,
}

fn bad(path: &Path, problem: String, fix: &str) -> VmError {
    VmError::BadFile {
        path: path.to_path_buf(),
        problem,
        fix: fix.to_string(),
    }
}

const IMAGE_FIX: &str = "agent-sandbox image build";

/// The template of a session that names none (config `default_template`
/// "default"): the developer image; `base` is the small one.
pub const DEFAULT_TEMPLATE: &str = "dev";

/// The version listed for a template file that states none.
const UNVERSIONED: &str = "0";

pub fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 32
        && n.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        && n.as_bytes()[0] != b'-'
        && n.as_bytes()[0] != b'_'
}

/// The kind of an artifact file name `<kind>-<hex hash><suffix>` (`base`
/// for `base-09bf6fc5de523068.erofs`, `vmlinux` for a kernel), if it is one.
pub(crate) fn artifact_name<'a>(name: &'a str, suffix: &str) -> Option<&'a str> {
    let (kind, hash) = name.strip_suffix(suffix)?.rsplit_once('-')?;
    (!kind.is_empty() && !hash.is_empty() && hash.bytes().all(|b| b.is_ascii_hexdigit()))
        .then_some(kind)
}

/// Newest `<dir>/<prefix><hash><suffix>` that has its `.json` manifest
/// (written last by the image build, so a half-built artifact has none).
pub(crate) fn newest_artifact(dir: &Path, prefix: &str, suffix: &str) -> Option<PathBuf> {
    let rd = fs::read_dir(dir).ok()?;
    let mut best: Option<(SystemTime, PathBuf)> = None;
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(rest) = name.strip_prefix(prefix) else {
            continue;
        };
        let Some(hash) = rest.strip_suffix(suffix) else {
            continue;
        };
        if hash.is_empty() || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
            continue;
        }
        let path = e.path();
        let manifest = PathBuf::from(format!("{}.json", path.display()));
        let Ok(m) = fs::metadata(&manifest) else {
            continue;
        };
        let t = m.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        if best.as_ref().is_none_or(|(bt, _)| t > *bt) {
            best = Some((t, path));
        }
    }
    best.map(|(_, p)| p)
}

impl Registry {
    pub fn new(cfg: RegistryConfig, backend: Arc<dyn Backend>) -> Self {
        Registry {
            cfg,
            backend,
            building: std::sync::Mutex::new(()),
        }
    }

    pub fn config(&self) -> &RegistryConfig {
        &self.cfg
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    fn read_raw(&self, name: &str) -> Result<Template> {
        if !valid_name(name) {
            return Err(VmError::Other(format!(
                "template name {name:?}: expected [a-z0-9][a-z0-9_-]{{0,31}}"
            )));
        }
        let mut path = self.cfg.templates_dir.join(format!("{name}.json"));
        if !path.exists() {
            let custom = self.cfg.custom_templates_dir.join(format!("{name}.json"));
            if custom.exists() {
                path = custom;
            }
        }
        let data = fs::read(&path).map_err(|e| {
            bad(
                &path,
                format!("cannot read template: {e}"),
                "check the template name (GET /exec/templates lists them)",
            )
        })?;
        let t: Template = serde_json::from_slice(&data).map_err(|e| {
            bad(
                &path,
                format!("not a valid template: {e}"),
                "fix it against images/templates/schema.json",
            )
        })?;
        if t.name != name {
            return Err(bad(
                &path,
                format!("names itself {:?}", t.name),
                "make `name` equal the file name",
            ));
        }
        Ok(t)
    }

    /// A template with its `extends` chain applied: env and scalars of the
    /// child override, `warm` commands are appended to the parent's.
    pub fn template(&self, name: &str) -> Result<Template> {
        let mut chain = vec![self.read_raw(name)?];
        while let Some(parent) = chain.last().and_then(|t| t.extends.clone()) {
            if chain.len() >= 8 || chain.iter().any(|t| t.name == parent) {
                return Err(VmError::Other(format!(
                    "template {name}: extends chain too deep or cyclic at {parent}"
                )));
            }
            chain.push(self.read_raw(&parent)?);
        }
        let mut it = chain.into_iter().rev();
        let mut t = it
            .next()
            .ok_or_else(|| VmError::Other("empty template chain".into()))?;
        for c in it {
            t.env.extend(c.env);
            t.warm.extend(c.warm);
            t.memory_mib = c.memory_mib.or(t.memory_mib);
            t.vcpus = c.vcpus.or(t.vcpus);
            t.disk_mib = c.disk_mib.or(t.disk_mib);
            t.display_name = c.display_name.or(t.display_name);
            t.version = c.version.or(t.version);
            t.tools = c.tools.or(t.tools);
            t.workdir = c.workdir.or(t.workdir);
            t.uid = c.uid.or(t.uid);
            t.gid = c.gid.or(t.gid);
            t.rootfs = c.rootfs;
            t.source = c.source;
            t.name = c.name;
            t.description = c.description;
            t.extends = c.extends;
        }
        Ok(t)
    }

    /// Names of all templates, sorted.
    pub fn template_names(&self) -> Result<Vec<String>> {
        let dir = &self.cfg.templates_dir;
        let rd = fs::read_dir(dir).map_err(|e| {
            bad(
                dir,
                format!("cannot list templates: {e}"),
                "point templates_dir at images/templates",
            )
        })?;
        let files = |rd: fs::ReadDir| -> Vec<String> {
            rd.flatten()
                .filter_map(|e| {
                    let n = e.file_name().to_str()?.strip_suffix(".json")?.to_string();
                    (valid_name(&n) && n != "schema").then_some(n)
                })
                .collect()
        };
        let mut names = files(rd);
        // Templates built from images; a built-in name always wins.
        if let Ok(rd) = fs::read_dir(&self.cfg.custom_templates_dir) {
            names.extend(files(rd));
        }
        names.sort();
        names.dedup();
        Ok(names)
    }

    /// The newest built kernel.
    pub fn kernel(&self) -> Result<PathBuf> {
        if let Some(k) = &self.cfg.pinned_kernel {
            return Ok(k.clone());
        }
        let dir = self.cfg.cache_dir.join("kernel");
        newest_artifact(&dir, "vmlinux-", "").ok_or_else(|| {
            bad(
                &dir,
                "no built kernel (vmlinux-<hash> with its .json manifest)".into(),
                IMAGE_FIX,
            )
        })
    }

    /// The newest built rootfs of `template`.
    pub fn rootfs(&self, template: &str) -> Result<PathBuf> {
        if let Some(r) = self.cfg.pinned_rootfs.get(template) {
            return Ok(r.clone());
        }
        // A template built from an image names its own (with a manifest,
        // which the build writes last).
        if let Ok(Template {
            rootfs: Some(r), ..
        }) = self.read_raw(template)
        {
            if !PathBuf::from(format!("{}.json", r.display())).exists() {
                return Err(bad(
                    &r,
                    format!("the image of template {template} is missing"),
                    &format!("agent-sandbox template build {template} --from ..."),
                ));
            }
            return Ok(r);
        }
        let dir = self.cfg.cache_dir.join("rootfs");
        newest_artifact(&dir, &format!("{template}-"), ".erofs")
            .or_else(|| newest_artifact(&dir, &format!("{template}-"), ".ext4"))
            .ok_or_else(|| {
                bad(
                    &dir,
                    format!("no built rootfs for template {template}"),
                    &format!("{IMAGE_FIX} --template {template}"),
                )
            })
    }

    pub fn snapshot_dir(&self, template: &str) -> PathBuf {
        self.cfg
            .state_dir
            .join("snapshots")
            .join(self.backend.name())
            .join(template)
    }

    fn shape(&self, t: &Template) -> (u32, u32) {
        (
            t.vcpus.unwrap_or(self.cfg.default_vcpus),
            t.memory_mib.unwrap_or(self.cfg.default_mem_mib),
        )
    }

    /// Why the snapshot of `template` cannot be restored now, if it cannot.
    pub fn snapshot_state(&self, template: &str) -> Result<SnapshotState> {
        let t = self.template(template)?;
        let kernel = self.kernel()?;
        let rootfs = self.rootfs(template)?;
        self.state_of(&t, &kernel, &rootfs)
    }

    fn state_of(&self, t: &Template, kernel: &Path, rootfs: &Path) -> Result<SnapshotState> {
        let dir = self.snapshot_dir(&t.name);
        if !dir.join(snapshot::MANIFEST_FILE).exists() {
            return Ok(SnapshotState::Missing);
        }
        let m = match Manifest::read(&dir) {
            Ok(m) => m,
            Err(e) => return Ok(SnapshotState::Stale(e.to_string())),
        };
        let version = self.backend.vmm_version_for(kernel)?;
        let (vcpus, mem_mib) = self.shape(t);
        let inputs = snapshot::Inputs {
            backend: self.backend.name(),
            vmm_version: &version,
            kernel,
            rootfs,
            vcpus,
            mem_mib,
            devices: snapshot::devices_of(
                self.cfg.net.as_ref().map(|n| n.guest_mac.as_str()),
                &self.cfg.cmdline_extra,
            ),
        };
        Ok(match m.is_stale(&dir, &inputs) {
            None => SnapshotState::Fresh,
            Some(r) => SnapshotState::Stale(r),
        })
    }

    /// Every template and what is built for it.
    pub fn list(&self) -> Result<Vec<TemplateStatus>> {
        let kernel = self.kernel().ok();
        let mut out = Vec::new();
        for name in self.template_names()? {
            let t = match self.template(&name) {
                Ok(t) => t,
                Err(e) => {
                    log::warn!("template {name}: {e}");
                    continue;
                }
            };
            let rootfs = self.rootfs(&name).ok();
            let snapshot = match (&kernel, &rootfs) {
                (Some(k), Some(r)) => self
                    .state_of(&t, k, r)
                    .unwrap_or_else(|e| SnapshotState::Stale(e.to_string())),
                _ => SnapshotState::Missing,
            };
            let (vcpus, mem_mib) = self.shape(&t);
            out.push(TemplateStatus {
                snapshot_dir: self.snapshot_dir(&name),
                display_name: t.display_name.unwrap_or_else(|| name.clone()),
                version: t.version.unwrap_or_else(|| UNVERSIONED.into()),
                name,
                description: t.description,
                tools: t.tools.unwrap_or_default(),
                kernel: kernel.clone(),
                rootfs,
                snapshot,
                vcpus,
                mem_mib,
                source: t.source,
            });
        }
        Ok(out)
    }

    /// A fresh snapshot of `template`, made now if missing or stale. Safe
    /// to call from several threads and processes at once (one builds, the
    /// others wait on a lock file).
    pub fn ensure_snapshot(&self, template: &str) -> Result<SnapshotInfo> {
        self.snapshot_inner(template, false)
    }

    /// Make the snapshot of `template` again, fresh or not.
    pub fn create_snapshot(&self, template: &str) -> Result<SnapshotInfo> {
        self.snapshot_inner(template, true)
    }

    fn snapshot_inner(&self, template: &str, force: bool) -> Result<SnapshotInfo> {
        let t = self.template(template)?;
        let kernel = self.kernel()?;
        let rootfs = self.rootfs(template)?;
        let (vcpus, mem_mib) = self.shape(&t);
        let info = SnapshotInfo {
            template: t.name.clone(),
            dir: self.snapshot_dir(&t.name),
            kernel: kernel.clone(),
            rootfs: rootfs.clone(),
            vcpus,
            mem_mib,
            cmdline_extra: self.cfg.cmdline_extra.clone(),
            rebuilt: false,
            env: t.env.clone(),
        };
        if !force && self.state_of(&t, &kernel, &rootfs)? == SnapshotState::Fresh {
            return Ok(info);
        }
        let parent = info
            .dir
            .parent()
            .ok_or_else(|| VmError::Other(format!("bad snapshot dir {}", info.dir.display())))?
            .to_path_buf();
        fs::create_dir_all(&parent)
            .map_err(|e| io_err(format!("create {}", parent.display()), e))?;
        let _lock = FileLock::acquire(&parent.join(format!(".{}.lock", t.name)))?;
        // Someone else may have built it while we waited.
        if !force {
            match self.state_of(&t, &kernel, &rootfs)? {
                SnapshotState::Fresh => return Ok(info),
                SnapshotState::Stale(r) => {
                    log::info!("snapshot of {} is stale ({r}); rebuilding", t.name)
                }
                SnapshotState::Missing => log::info!("making the snapshot of {}", t.name),
            }
        }
        {
            // Another template's build may hold the TAP (a poisoned lock
            // only means that build panicked; the TAP is free again).
            let _turn = self.building.lock().unwrap_or_else(|p| p.into_inner());
            self.build(&t, &info)?;
        }
        Ok(SnapshotInfo {
            rebuilt: true,
            ..info
        })
    }

    /// Boot, wait for the agent, run the warm commands, save. The new
    /// snapshot is made next to the old one and swapped in by rename.
    fn build(&self, t: &Template, info: &SnapshotInfo) -> Result<()> {
        let started = Instant::now();
        let tmp = info.dir.with_file_name(format!(".{}.new", t.name));
        let _ = fs::remove_dir_all(&tmp);
        let id = format!(
            "{BUILD_ID_PREFIX}{}-{}",
            t.name.replace('_', "-"),
            std::process::id()
        );
        let mut cfg = VmConfig {
            run_dir: self.cfg.run_dir.join(&id),
            ..info.vm_config(&id, PathBuf::new(), self.cfg.uid, self.cfg.gid)
        };
        cfg.net = self.cfg.net.clone();
        if let Some(parent) = cfg.run_dir.parent() {
            fs::create_dir_all(parent)
                .map_err(|e| io_err(format!("create {}", parent.display()), e))?;
        }
        // A run dir left by a crashed build of ours would block the boot.
        let _ = fs::remove_dir_all(&cfg.run_dir);
        let mut vm = self.backend.boot(&cfg)?;
        let res = (|| {
            let client = connect_agent(vm.as_mut(), false, self.cfg.agent_timeout)?;
            for cmd in &t.warm {
                let t0 = Instant::now();
                let out = client
                    .exec(
                        ExecRequest {
                            shell: Some(cmd.clone()),
                            env: t.env.clone(),
                            timeout_ms: Some(self.cfg.warm_timeout.as_millis() as u64),
                            ..Default::default()
                        },
                        64 * 1024,
                    )
                    .map_err(|e| {
                        VmError::Other(format!("template {}: warm command {cmd:?}: {e}", t.name))
                    })?;
                if out.status.code != Some(0) {
                    return Err(VmError::Other(format!(
                        "template {}: warm command {cmd:?} failed ({:?}): {}",
                        t.name,
                        out.status,
                        String::from_utf8_lossy(&out.stderr).trim()
                    )));
                }
                log::info!(
                    "template {}: warmed with {cmd:?} in {} ms",
                    t.name,
                    t0.elapsed().as_millis()
                );
            }
            // The exec path every session's first request takes (argv, PATH
            // lookup, the dynamic loader and libc, `true` itself): in the
            // page cache of the snapshot, so a restored guest does not read
            // and decompress them from the image under emulation.
            // An image of a user's may have no `true` (or no shell): the
            // agent itself is always there.
            let argv = match &t.source {
                None => vec!["true".into()],
                Some(_) => vec![AGENT_PATH.into(), "--version".into()],
            };
            let out = client
                .exec(
                    ExecRequest {
                        argv,
                        env: t.env.clone(),
                        timeout_ms: Some(self.cfg.warm_timeout.as_millis() as u64),
                        ..Default::default()
                    },
                    1024,
                )
                .map_err(|e| {
                    VmError::Other(format!("template {}: warm exec `true`: {e}", t.name))
                })?;
            if out.status.code != Some(0) {
                return Err(VmError::Other(format!(
                    "template {}: warm exec `true` failed ({:?})",
                    t.name, out.status
                )));
            }
            // Detach before saving, so the saved agent is between connections
            // as far as it can tell (and if it has not noticed yet, the
            // first hello after a restore starts a new connection anyway).
            client.close();
            // Work the guest still has queued (removing the warm commands'
            // cgroups, RCU callbacks, the detach) would otherwise run after
            // every restore, in front of the first request.
            let waited = wait_idle(vm.pid(), QUIESCE);
            log::info!(
                "template {}: guest idle after {} ms",
                t.name,
                waited.as_millis()
            );
            vm.snapshot(&tmp)
        })();
        let destroyed = vm.destroy();
        if let Err(e) = res {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
        destroyed?;
        let old = info.dir.with_file_name(format!(".{}.old", t.name));
        let _ = fs::remove_dir_all(&old);
        if info.dir.exists() {
            fs::rename(&info.dir, &old)
                .map_err(|e| io_err(format!("move aside {}", info.dir.display()), e))?;
        }
        fs::rename(&tmp, &info.dir)
            .map_err(|e| io_err(format!("install snapshot {}", info.dir.display()), e))?;
        let _ = fs::remove_dir_all(&old);
        log::info!(
            "snapshot of {} made in {} ms: {}",
            t.name,
            started.elapsed().as_millis(),
            info.dir.display()
        );
        Ok(())
    }
}

/// How [`wait_idle`] decides a guest has settled: its VMM used less than
/// `busy` of CPU time in `window`, at most `max` in all.
#[derive(Debug, Clone, Copy)]
pub struct Quiesce {
    pub window: Duration,
    pub busy: Duration,
    pub max: Duration,
}

/// A TCG guest that has finished its deferred work uses ~1% of a core
/// (timer ticks); one still tearing down cgroups uses all of it.
pub const QUIESCE: Quiesce = Quiesce {
    window: Duration::from_millis(100),
    busy: Duration::from_millis(10),
    max: Duration::from_secs(5),
};

/// Waits until the VMM `pid` is (nearly) idle, measured by the CPU time of
/// all its threads. Returns how long it waited. Without a pid or /proc it
/// waits one `max`/10, a fixed allowance.
pub fn wait_idle(pid: Option<i32>, q: Quiesce) -> Duration {
    let start = Instant::now();
    let Some(pid) = pid else {
        std::thread::sleep(q.max / 10);
        return start.elapsed();
    };
    let Some(mut last) = cpu_time(pid) else {
        std::thread::sleep(q.max / 10);
        return start.elapsed();
    };
    while start.elapsed() < q.max {
        std::thread::sleep(q.window);
        let Some(now) = cpu_time(pid) else { break };
        if now.saturating_sub(last) < q.busy {
            break;
        }
        last = now;
    }
    start.elapsed()
}

/// CPU time of every thread of `pid` (`/proc/<pid>/task/*/schedstat`).
fn cpu_time(pid: i32) -> Option<Duration> {
    let mut ns: u64 = 0;
    for e in fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
        // A thread may end between the listing and the read: skip it.
        if let Ok(s) = fs::read_to_string(e.path().join("schedstat")) {
            ns += s.split_whitespace().next()?.parse::<u64>().ok()?;
        }
    }
    Some(Duration::from_nanos(ns))
}

fn io_err(what: String, source: io::Error) -> VmError {
    VmError::Io {
        backend: "templates",
        what,
        source,
    }
}

/// An exclusive `flock` held until dropped.
struct FileLock {
    _file: fs::File,
}

impl FileLock {
    fn acquire(path: &Path) -> Result<FileLock> {
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|e| io_err(format!("open lock {}", path.display()), e))?;
        loop {
            // SAFETY: flock on an fd we own.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(FileLock { _file: file });
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(io_err(format!("lock {}", path.display()), e));
            }
        }
    }
}
