//! Per-VM cgroup directories for VMMs the daemon starts itself (QEMU;
//! the jailer makes Firecracker's): `<parent>/<id>` in every hierarchy
//! the daemon uses, with the VM's limits, created before the VMM starts
//! (the spawner places it in each before exec), removed at teardown and
//! by the orphan sweep.
//!
//! Two kinds of hierarchy, often both on one host (a hybrid setup):
//! - cgroup v2: `cpu.max`, `memory.max`, `pids.max`, `io.max`; the parent
//!   must delegate the controllers (`+cpu +memory +pids` in its and its
//!   ancestors' `cgroup.subtree_control`), which [`prepare_parents`] turns
//!   on. The VM always gets a v2 dir when v2 is mounted: membership and
//!   `cgroup.kill` at teardown, even where the limits live in v1.
//! - cgroup v1, one mount per controller (or a few together): the same
//!   limits as `memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes`
//!   where swap accounting is on), `cpu.cfs_period_us`/`cpu.cfs_quota_us`,
//!   `pids.max`, `blkio.throttle.*_device`.
//!
//! Which files a VM's dir gets follows from the dir itself (a v2 dir has
//! `cgroup.controllers`), so a VM's cgroups are just a list of paths.
//! A controller neither kind offers is reported by [`prepare_parents`];
//! `serve` refuses to start VMMs without it unless told
//! (`allow_unlimited_vmms`).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{Result, VmError};

const NAME: &str = "cgroup";

/// Controllers the per-VM limits need (`io` only with an `io.max` rule),
/// by their v2 names.
pub const CONTROLLERS: &[&str] = &["cpu", "memory", "pids", "io"];

/// The v1 name of a controller of [`CONTROLLERS`].
fn v1_name(c: &str) -> &str {
    if c == "io" {
        "blkio"
    } else {
        c
    }
}

/// QEMU's own memory beyond guest RAM (device emulation, page tables):
/// measured ~100-125 MiB RSS for a 256 MiB guest. The default of
/// `vm_memory_overhead_mib` under KVM.
pub const MEMORY_OVERHEAD_MIB: u64 = 256;

/// QEMU's TCG translation cache, capped with `-accel tcg,tb-size=` (its
/// default is 1 GiB): under TCG the default overhead adds it. (A fork bomb
/// in a 512 MiB guest took a TCG QEMU past guest RAM + 256 MiB.)
pub const TCG_TB_MIB: u64 = 256;

/// Threads and processes one VMM may have (QEMU: vCPU threads, I/O worker
/// pool of up to 64, RCU, main loop).
pub const PIDS_MAX: u64 = 256;

/// An operator's fixed `cpu.max` for every VM, whatever its vCPUs (the
/// seed's `VM_CPU_QUOTA_US` / `VM_CPU_PERIOD_US`); by default the quota is
/// one CPU per vCPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuMax {
    pub quota_us: u64,
    pub period_us: u64,
}

impl CpuMax {
    /// The kernel's bounds: period 1 ms..1 s, quota at least 1 ms.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if !(1_000..=1_000_000).contains(&self.period_us) {
            return Err(format!(
                "period_us {}: between 1000 and 1000000",
                self.period_us
            ));
        }
        if !(1_000..=u64::from(u32::MAX)).contains(&self.quota_us) {
            return Err(format!("quota_us {}: at least 1000", self.quota_us));
        }
        Ok(())
    }
}

/// The limits of one VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// `cpu.max`: quota and period in microseconds (one CPU per vCPU).
    pub cpu_quota_us: u64,
    pub cpu_period_us: u64,
    /// `memory.max` in bytes: guest RAM + the VMM's overhead.
    pub memory_max: u64,
    pub pids_max: u64,
    /// `io.max` lines, one per block device (`MAJ:MIN rbps=... wbps=...`),
    /// see [`io_max_lines`].
    pub io_max: Vec<String>,
}

impl Limits {
    /// `overhead_mib`: the VMM's memory beyond guest RAM
    /// ([`MEMORY_OVERHEAD_MIB`] unless configured).
    pub fn for_vm(vcpus: u32, mem_mib: u32, overhead_mib: u64) -> Limits {
        Limits {
            cpu_quota_us: u64::from(vcpus.max(1)) * 100_000,
            cpu_period_us: 100_000,
            memory_max: (u64::from(mem_mib) + overhead_mib) << 20,
            pids_max: PIDS_MAX,
            io_max: Vec::new(),
        }
    }

    /// With an operator's fixed `cpu.max` in place of the per-vCPU one.
    pub fn with_cpu_max(mut self, c: Option<CpuMax>) -> Limits {
        if let Some(c) = c {
            self.cpu_quota_us = c.quota_us;
            self.cpu_period_us = c.period_us;
        }
        self
    }

    /// cgroup v2 files, in the order they are written.
    fn files(&self) -> Vec<(&'static str, String)> {
        let mut f = vec![
            (
                "cpu.max",
                format!("{} {}", self.cpu_quota_us, self.cpu_period_us),
            ),
            ("memory.max", self.memory_max.to_string()),
            ("pids.max", self.pids_max.to_string()),
        ];
        // io.max takes one device per write.
        f.extend(self.io_max.iter().map(|l| ("io.max", l.clone())));
        f
    }

    /// The same limits as cgroup v1 files, with the controller each needs,
    /// in the order they must be written (the period before the quota, the
    /// memory limit before memory+swap, which may not be below it).
    /// `memory.memsw.limit_in_bytes` exists only with swap accounting.
    pub fn v1_files(&self) -> Vec<(&'static str, &'static str, String)> {
        let mut f = vec![
            ("cpu", "cpu.cfs_period_us", self.cpu_period_us.to_string()),
            ("cpu", "cpu.cfs_quota_us", self.cpu_quota_us.to_string()),
            (
                "memory",
                "memory.limit_in_bytes",
                self.memory_max.to_string(),
            ),
            (
                "memory",
                "memory.memsw.limit_in_bytes",
                self.memory_max.to_string(),
            ),
            ("pids", "pids.max", self.pids_max.to_string()),
        ];
        for line in &self.io_max {
            let mut it = line.split_whitespace();
            let Some(dev) = it.next() else { continue };
            for kv in it {
                let Some((k, v)) = kv.split_once('=') else {
                    continue;
                };
                let file = match k {
                    "rbps" => "blkio.throttle.read_bps_device",
                    "wbps" => "blkio.throttle.write_bps_device",
                    "riops" => "blkio.throttle.read_iops_device",
                    "wiops" => "blkio.throttle.write_iops_device",
                    _ => continue,
                };
                // v1 has no "max": no rule is no limit.
                if v != "max" {
                    f.push(("blkio", file, format!("{dev} {v}")));
                }
            }
        }
        f
    }
}

/// Checks an `io.max` rule without its device: `rbps=`, `wbps=`, `riops=`,
/// `wiops=` with a number or `max`, each at most once.
pub fn validate_io_rule(rule: &str) -> std::result::Result<(), String> {
    let mut seen = Vec::new();
    for tok in rule.split_whitespace() {
        let (k, v) = tok
            .split_once('=')
            .ok_or_else(|| format!("io.max rule {rule:?}: {tok:?} is not KEY=VALUE"))?;
        if !["rbps", "wbps", "riops", "wiops"].contains(&k) || seen.contains(&k) {
            return Err(format!(
                "io.max rule {rule:?}: {k:?} is not one of rbps, wbps, riops, wiops (once each)"
            ));
        }
        if v != "max" && v.parse::<u64>().map_or(true, |n| n == 0) {
            return Err(format!(
                "io.max rule {rule:?}: {k}={v} must be a positive number or max"
            ));
        }
        seen.push(k);
    }
    if seen.is_empty() {
        return Err("io.max rule is empty".into());
    }
    Ok(())
}

/// The whole disk (`MAJ:MIN`) holding `path`'s filesystem: io.max takes
/// disks, not partitions. `None` for filesystems without one (tmpfs,
/// overlay, network file systems).
pub fn disk_of(path: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let dev = fs::metadata(path).ok()?.dev();
    let (maj, min) = (libc::major(dev), libc::minor(dev));
    if maj == 0 {
        return None;
    }
    let sys = PathBuf::from(format!("/sys/dev/block/{maj}:{min}"));
    if !sys.join("partition").exists() {
        return sys.exists().then(|| format!("{maj}:{min}"));
    }
    // .../block/vda/vda1 -> .../block/vda/dev
    let parent = fs::canonicalize(&sys).ok()?.parent()?.join("dev");
    Some(fs::read_to_string(parent).ok()?.trim().to_string())
}

/// `io.max` lines for `rule` on the disks under `paths` (deduplicated):
/// where a VMM's disk traffic goes (its memory file, its images).
pub fn io_max_lines(rule: &str, paths: &[&Path]) -> Vec<String> {
    let mut disks: Vec<String> = paths.iter().filter_map(|p| disk_of(p)).collect();
    disks.sort();
    disks.dedup();
    disks.into_iter().map(|d| format!("{d} {rule}")).collect()
}

fn io_err(what: String, source: io::Error) -> VmError {
    VmError::Io {
        backend: NAME,
        what,
        source,
    }
}

/// A mounted cgroup hierarchy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    pub mount: PathBuf,
    /// `None` for cgroup v2; for a v1 mount, which of [`CONTROLLERS`] it
    /// holds (by their v2 names).
    pub v1: Option<Vec<&'static str>>,
}

/// The hierarchies in `/proc/mounts` text: the first cgroup2 mount (as the
/// jailer finds it), then every v1 mount holding one of [`CONTROLLERS`].
pub fn parse_mounts(text: &str) -> Vec<Hierarchy> {
    let mut v2 = None;
    let mut v1 = Vec::new();
    for l in text.lines() {
        let mut f = l.split(' ');
        let (Some(_dev), Some(dir), Some(fstype), Some(opts)) =
            (f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        // /proc/mounts escapes spaces as \040; cgroup mounts do not have any.
        match fstype {
            "cgroup2" if v2.is_none() => v2 = Some(PathBuf::from(dir)),
            "cgroup" => {
                let opts: Vec<&str> = opts.split(',').collect();
                let ours: Vec<&'static str> = CONTROLLERS
                    .iter()
                    .copied()
                    .filter(|c| opts.contains(&v1_name(c)))
                    .collect();
                if !ours.is_empty() {
                    v1.push(Hierarchy {
                        mount: PathBuf::from(dir),
                        v1: Some(ours),
                    });
                }
            }
            _ => {}
        }
    }
    let mut all: Vec<Hierarchy> = v2
        .map(|mount| Hierarchy { mount, v1: None })
        .into_iter()
        .collect();
    all.extend(v1);
    all
}

/// This host's hierarchies (see [`parse_mounts`]).
pub fn hierarchies() -> Vec<Hierarchy> {
    parse_mounts(&fs::read_to_string("/proc/mounts").unwrap_or_default())
}

/// The controllers a v2 mount offers at its root.
pub fn v2_controllers(mount: &Path) -> Vec<String> {
    controllers(mount)
}

/// `agent-sandbox/d-<hash of the state dir>`: the daemon's parent, below
/// each hierarchy's mount. One daemon owns a state dir, so its orphan
/// sweep may remove everything under this parent without touching another
/// daemon's VMs on the same host.
pub fn daemon_rel(state_dir: &Path) -> PathBuf {
    use sha2::{Digest, Sha256};
    let canon = fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
    let h = Sha256::digest(canon.as_os_str().as_encoded_bytes());
    let tag: String = h[..6].iter().map(|b| format!("{b:02x}")).collect();
    Path::new("agent-sandbox").join(format!("d-{tag}"))
}

/// The daemon's parent in every hierarchy of this host (existing or not),
/// with the `standalone` placement.
pub fn daemon_parents(state_dir: &Path) -> Vec<PathBuf> {
    let rel = daemon_rel(state_dir);
    hierarchies().iter().map(|h| h.mount.join(&rel)).collect()
}

/// Where `serve` puts the per-VM cgroups (config `cgroup_placement`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// `own` when systemd delegated the daemon's cgroup to it (a unit with
    /// `Delegate=yes`), else `standalone`.
    #[default]
    Auto,
    /// Below the daemon's own cgroup in every hierarchy: the daemon moves
    /// into `<own>/daemon`, VMs go to `<own>/vms/<id>`. Stopping the unit
    /// (killing its cgroup) stops every VMM, and the unit's device policy
    /// confines them.
    Own,
    /// `agent-sandbox/d-<hash of the state dir>` below each hierarchy's
    /// mount (a daemon started by hand, from a login shell).
    Standalone,
}

impl std::str::FromStr for Placement {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Placement::Auto),
            "own" => Ok(Placement::Own),
            "standalone" => Ok(Placement::Standalone),
            _ => Err(format!("{s:?}: one of auto, own, standalone")),
        }
    }
}

/// The leaf the daemon moves itself into below its own cgroup (`own`): on
/// cgroup v2 a cgroup whose children get controllers holds no process.
pub const DAEMON_LEAF: &str = "daemon";
/// The parent of the VMs' cgroups below the daemon's own (`own`).
pub const VMS_DIR: &str = "vms";

/// The cgroup this process is in within `h`, relative to its mount, from
/// `/proc/self/cgroup`'s text (`0::/path` for v2, `N:ctl,ctl:/path` for
/// v1). A daemon already in its `daemon` leaf (a restart inside the same
/// unit) is given the unit's cgroup.
pub fn own_rel(h: &Hierarchy, proc_cgroup: &str) -> Option<PathBuf> {
    for l in proc_cgroup.lines() {
        let mut f = l.splitn(3, ':');
        let (Some(id), Some(ctls), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let hit = match &h.v1 {
            None => id == "0" && ctls.is_empty(),
            Some(ours) => ours
                .first()
                .is_some_and(|c| ctls.split(',').any(|x| x == v1_name(c))),
        };
        if hit {
            let rel = PathBuf::from(path.trim().trim_start_matches('/'));
            return Some(if rel.file_name().is_some_and(|n| n == DAEMON_LEAF) {
                rel.parent().map(Path::to_path_buf).unwrap_or_default()
            } else {
                rel
            });
        }
    }
    None
}

/// Whether systemd delegated the cgroup `dir` (a unit with
/// `Delegate=yes`: systemd 251+ sets the xattr `trusted.delegate`, or
/// `user.delegate` for user managers, to `1`).
pub fn delegated(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(p) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    [c"trusted.delegate", c"user.delegate"].iter().any(|name| {
        let mut v = [0u8; 8];
        // SAFETY: NUL-terminated strings and a buffer of the length given.
        let n =
            unsafe { libc::getxattr(p.as_ptr(), name.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
        n > 0 && v[..n as usize].starts_with(b"1")
    })
}

/// The relative parent of the VMs' cgroups in each of `hs`, as placed by
/// `placement` for a daemon whose `/proc/self/cgroup` reads `proc_cgroup`;
/// `true` with them when that is below the daemon's own cgroup.
pub fn plan(
    hs: &[Hierarchy],
    state_dir: &Path,
    placement: Placement,
    proc_cgroup: &str,
) -> std::result::Result<(bool, Vec<(Hierarchy, PathBuf)>), String> {
    let own = match placement {
        Placement::Standalone => false,
        Placement::Own => true,
        Placement::Auto => hs
            .iter()
            .find(|h| h.v1.is_none())
            .and_then(|h| Some((h, own_rel(h, proc_cgroup)?)))
            // (A root cgroup is nobody's to delegate.)
            .is_some_and(|(h, r)| !r.as_os_str().is_empty() && delegated(&h.mount.join(r))),
    };
    if !own {
        let rel = daemon_rel(state_dir);
        return Ok((false, hs.iter().map(|h| (h.clone(), rel.clone())).collect()));
    }
    let mut out = Vec::new();
    for h in hs {
        let r = own_rel(h, proc_cgroup).ok_or_else(|| {
            format!(
                "cgroup_placement own: this process is in no cgroup of {}",
                h.mount.display()
            )
        })?;
        if r.as_os_str().is_empty() {
            return Err(format!(
                "cgroup_placement own: the daemon is in the root cgroup of {}; start it in a \
                 cgroup of its own (a systemd unit with Delegate=yes) or use \
                 cgroup_placement standalone",
                h.mount.display()
            ));
        }
        out.push((h.clone(), r.join(VMS_DIR)));
    }
    Ok((true, out))
}

/// Moves this process (all its threads) into the `daemon` leaf beside
/// `vms` in each hierarchy of an `own` plan, before the VMs' parents get
/// controllers. Called while the daemon is still one process: children
/// forked later (the spawner, VMMs) start there.
pub fn enter_daemon_leaf(rels: &[(Hierarchy, PathBuf)]) -> Result<()> {
    for (h, rel) in rels {
        let unit = h.mount.join(rel.parent().unwrap_or(Path::new("")));
        let leaf = unit.join(DAEMON_LEAF);
        fs::create_dir_all(&leaf).map_err(|e| io_err(format!("create {}", leaf.display()), e))?;
        let procs = leaf.join("cgroup.procs");
        fs::write(&procs, "0")
            .map_err(|e| io_err(format!("move the daemon into {}", procs.display()), e))?;
    }
    Ok(())
}

fn controllers(dir: &Path) -> Vec<String> {
    fs::read_to_string(dir.join("cgroup.controllers"))
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// What [`prepare_parents`] set up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prepared {
    /// The parent dir in each hierarchy used, v2 first: each VM gets
    /// `<parent>/<id>` in every one.
    pub parents: Vec<PathBuf>,
    /// Each wanted controller that limits VMs, and the parent it does so in.
    pub enforced: Vec<(&'static str, PathBuf)>,
    /// Wanted controllers no hierarchy offers: those limits are not applied.
    pub missing: Vec<&'static str>,
}

/// Create `<mount>/<rel>` in the hierarchies of `rels` that are of use for
/// the controllers `want` (a subset of [`CONTROLLERS`]): the v2 one always
/// (membership, `cgroup.kill`), delegating what it offers from the mount
/// down; each v1 one holding a wanted controller v2 does not offer.
pub fn prepare_parents(rels: &[(Hierarchy, PathBuf)], want: &[&'static str]) -> Result<Prepared> {
    let mut out = Prepared::default();
    for (h, rel) in rels {
        let parent = h.mount.join(rel);
        match &h.v1 {
            None => {
                let offered = prepare_v2_parent(&parent)?;
                for c in want.iter().copied().filter(|c| offered.contains(c)) {
                    out.enforced.push((c, parent.clone()));
                }
                out.parents.push(parent);
            }
            Some(ctls) => {
                let new: Vec<&'static str> = ctls
                    .iter()
                    .copied()
                    .filter(|c| want.contains(c) && !out.enforced.iter().any(|(e, _)| e == c))
                    .collect();
                if new.is_empty() {
                    continue;
                }
                fs::create_dir_all(&parent)
                    .map_err(|e| io_err(format!("create {}", parent.display()), e))?;
                out.enforced
                    .extend(new.into_iter().map(|c| (c, parent.clone())));
                out.parents.push(parent);
            }
        }
    }
    out.missing = want
        .iter()
        .copied()
        .filter(|c| !out.enforced.iter().any(|(e, _)| e == c))
        .collect();
    Ok(out)
}

/// Create the v2 `parent` and have it (and its ancestors up to the mount)
/// delegate whichever of [`CONTROLLERS`] the hierarchy offers. Returns the
/// ones its children have.
fn prepare_v2_parent(parent: &Path) -> Result<Vec<&'static str>> {
    fs::create_dir_all(parent).map_err(|e| io_err(format!("create {}", parent.display()), e))?;
    // Ancestors first: a controller reaches a child only through every
    // level between it and the root.
    let mut chain: Vec<&Path> = parent.ancestors().skip(1).collect();
    chain.retain(|d| d.join("cgroup.subtree_control").exists());
    chain.reverse();
    chain.push(parent);
    for dir in chain {
        let have = controllers(dir);
        for c in CONTROLLERS.iter().filter(|c| have.iter().any(|h| h == *c)) {
            let f = dir.join("cgroup.subtree_control");
            if let Err(e) = fs::write(&f, format!("+{c}")) {
                log::debug!("cgroup: enable {c} in {}: {e}", f.display());
            }
        }
    }
    let subtree = fs::read_to_string(parent.join("cgroup.subtree_control")).unwrap_or_default();
    Ok(CONTROLLERS
        .iter()
        .copied()
        .filter(|c| subtree.split_whitespace().any(|s| s == *c))
        .collect())
}

/// Create `<parent>/<id>` under each of `parents` and write `limits` into
/// it: a v2 dir (it has `cgroup.controllers`) gets the v2 files, a v1 dir
/// the v1 files of its controllers. Files a dir does not have are skipped
/// (the controller lives in another hierarchy); any other failure removes
/// every dir made. Returns the dirs, in the order of `parents`.
pub fn create(parents: &[PathBuf], id: &str, limits: &Limits) -> Result<Vec<PathBuf>> {
    super::launch::validate_id(id)?;
    let mut made = Vec::new();
    let undo = |made: &[PathBuf]| {
        for d in made.iter().rev() {
            let _ = fs::remove_dir(d);
        }
    };
    for parent in parents {
        let dir = parent.join(id);
        if let Err(e) = fs::create_dir(&dir) {
            undo(&made);
            return Err(io_err(format!("create cgroup {}", dir.display()), e));
        }
        made.push(dir.clone());
        let files: Vec<(&str, String)> = if dir.join("cgroup.controllers").exists() {
            limits.files()
        } else {
            limits
                .v1_files()
                .into_iter()
                .map(|(_, f, v)| (f, v))
                .collect()
        };
        for (file, value) in files {
            let p = dir.join(file);
            if !p.exists() {
                continue;
            }
            if let Err(e) = fs::write(&p, &value) {
                undo(&made);
                return Err(io_err(format!("write {value:?} to {}", p.display()), e));
            }
        }
    }
    Ok(made)
}

/// Kill whatever is still in `dir` (v2: `cgroup.kill`; a v1 dir's
/// processes are the same VMM, killed through its v2 dir or by its
/// owner) and remove it; waits (until `deadline`) for the kernel to let
/// go of exiting processes. Missing is fine.
pub fn remove(dir: &Path, deadline: Instant) -> Result<()> {
    let kill = dir.join("cgroup.kill");
    if kill.exists() {
        let _ = fs::write(&kill, "1");
    }
    let mut pause = Duration::from_millis(1);
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(20));
            }
            Err(e) => return Err(io_err(format!("remove cgroup {}", dir.display()), e)),
        }
    }
}

/// [`remove`] each of `dirs` in order (v2 first: its kill empties the v1
/// dirs of the same VMM); the first error, after trying all.
pub fn remove_all(dirs: &[PathBuf], deadline: Instant) -> Result<()> {
    let mut first = None;
    for d in dirs {
        if let Err(e) = remove(d, deadline) {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// Remove every `<parent>/<prefix>*` cgroup (an earlier run's VMs) under
/// each of `parents`, in order. Returns how many dirs went.
pub fn sweep(parents: &[PathBuf], prefix: &str) -> usize {
    let mut n = 0;
    for parent in parents {
        let Ok(rd) = fs::read_dir(parent) else {
            continue;
        };
        for e in rd.flatten() {
            let name = e.file_name();
            if !name.to_string_lossy().starts_with(prefix) || !e.path().is_dir() {
                continue;
            }
            match remove(&e.path(), Instant::now() + Duration::from_secs(2)) {
                Ok(()) => n += 1,
                Err(e) => log::warn!("orphan sweep: {e}"),
            }
        }
    }
    n
}

/// The memory limit (bytes) in the first of `dirs` that has one (v2
/// `memory.max`, v1 `memory.limit_in_bytes`).
pub fn memory_limit_of(dirs: &[PathBuf]) -> Option<u64> {
    dirs.iter().find_map(|d| {
        ["memory.max", "memory.limit_in_bytes"]
            .iter()
            .find_map(|f| fs::read_to_string(d.join(f)).ok()?.trim().parse().ok())
    })
}

/// How many processes the OOM killer killed in `dirs` for their memory
/// limit (`oom_kill` of v2 `memory.events`, v1 `memory.oom_control`).
pub fn oom_kills(dirs: &[PathBuf]) -> u64 {
    OomCounter::open(dirs).kills()
}

/// The OOM-kill counters of a VMM's cgroups, opened once: read later on a
/// thread whose seccomp filter allows no `openat` (the agent reader, when
/// it is the one to see the VMM's connection close), with `pread` only.
pub struct OomCounter {
    files: Vec<fs::File>,
}

impl OomCounter {
    pub fn open(dirs: &[PathBuf]) -> OomCounter {
        let files = dirs
            .iter()
            .flat_map(|d| ["memory.events", "memory.oom_control"].map(|f| d.join(f)))
            .filter_map(|p| fs::File::open(p).ok())
            .collect();
        OomCounter { files }
    }

    /// Kills counted now (each file read afresh from its start).
    pub fn kills(&self) -> u64 {
        use std::os::unix::fs::FileExt;
        let mut buf = [0u8; 4096];
        let mut n = 0;
        for f in &self.files {
            // Both files are a few short lines: one read holds them.
            let Ok(len) = f.read_at(&mut buf, 0) else {
                continue;
            };
            n += String::from_utf8_lossy(&buf[..len])
                .lines()
                .filter_map(|l| l.strip_prefix("oom_kill ")?.trim().parse::<u64>().ok())
                .sum::<u64>();
        }
        n
    }
}

/// How the jailer should make Firecracker's cgroups here: `--cgroup-version`
/// and the mounts its per-VM dirs appear under. v2 when the v2 mount offers
/// cpu, memory and pids; else v1 when v1 mounts hold them (the mounts of
/// those, and of blkio with `io`); else v2 (the jailer then fails loudly).
pub fn jailer_plan(hs: &[Hierarchy], want: &[&'static str]) -> (u8, Vec<PathBuf>) {
    let v2 = hs.iter().find(|h| h.v1.is_none());
    let core = ["cpu", "memory", "pids"];
    if let Some(h) = v2 {
        let have = controllers(&h.mount);
        if core.iter().all(|c| have.iter().any(|h| h == c)) {
            return (2, vec![h.mount.clone()]);
        }
    }
    let v1: Vec<&Hierarchy> = hs
        .iter()
        .filter(|h| {
            h.v1.as_ref()
                .is_some_and(|c| c.iter().any(|c| want.contains(c)))
        })
        .collect();
    let covered = |c: &str| {
        v1.iter()
            .any(|h| h.v1.as_ref().is_some_and(|v| v.contains(&c)))
    };
    if !v1.is_empty() && core.iter().all(|c| covered(c)) {
        return (1, v1.iter().map(|h| h.mount.clone()).collect());
    }
    (2, v2.map(|h| vec![h.mount.clone()]).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_follow_the_vm_size() {
        let l = Limits::for_vm(2, 512, MEMORY_OVERHEAD_MIB);
        assert_eq!(l.cpu_quota_us, 200_000);
        assert_eq!(l.memory_max, (512 + MEMORY_OVERHEAD_MIB) << 20);
        let f = l.files();
        assert_eq!(f[0], ("cpu.max", "200000 100000".to_string()));
        assert_eq!(f.len(), 3, "no io.max without a rule");
        assert_eq!(Limits::for_vm(1, 256, 16).memory_max, 272 << 20);
    }

    #[test]
    fn v1_files_carry_the_same_limits_in_a_writable_order() {
        let mut l = Limits::for_vm(2, 512, 64);
        l.io_max = vec!["8:0 rbps=1000 wbps=max wiops=50".into()];
        let f = l.v1_files();
        let mem = ((512 + 64) << 20).to_string();
        assert_eq!(
            f,
            vec![
                ("cpu", "cpu.cfs_period_us", "100000".to_string()),
                ("cpu", "cpu.cfs_quota_us", "200000".to_string()),
                ("memory", "memory.limit_in_bytes", mem.clone()),
                ("memory", "memory.memsw.limit_in_bytes", mem),
                ("pids", "pids.max", "256".to_string()),
                ("blkio", "blkio.throttle.read_bps_device", "8:0 1000".into()),
                ("blkio", "blkio.throttle.write_iops_device", "8:0 50".into()),
            ]
        );
    }

    #[test]
    fn mounts_of_a_hybrid_host() {
        let text = "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n\
                    cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0\n\
                    cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n\
                    cgroup /sys/fs/cgroup/blkio cgroup rw,relatime,blkio 0 0\n\
                    cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0\n\
                    cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0\n\
                    cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n";
        let hs = parse_mounts(text);
        let m = |h: &Hierarchy| (h.mount.to_string_lossy().into_owned(), h.v1.clone());
        assert_eq!(
            hs.iter().map(m).collect::<Vec<_>>(),
            vec![
                ("/sys/fs/cgroup/unified".into(), None),
                ("/sys/fs/cgroup/cpu".into(), Some(vec!["cpu"])),
                ("/sys/fs/cgroup/memory".into(), Some(vec!["memory"])),
                ("/sys/fs/cgroup/blkio".into(), Some(vec!["io"])),
                ("/sys/fs/cgroup/pids".into(), Some(vec!["pids"])),
            ]
        );
        // Controllers mounted together are one hierarchy.
        let hs = parse_mounts("cgroup /c cgroup rw,cpu,cpuacct,memory 0 0\n");
        assert_eq!(hs[0].v1, Some(vec!["cpu", "memory"]));
        // The v2 root here is a plain dir without cpu/memory/pids: v1.
        let (v, roots) = jailer_plan(&parse_mounts(text), &["cpu", "memory", "pids"]);
        assert_eq!(v, 1);
        assert_eq!(
            roots,
            ["cpu", "memory", "pids"]
                .map(|c| PathBuf::from(format!("/sys/fs/cgroup/{c}")))
                .to_vec()
        );
        let (v, roots) = jailer_plan(&parse_mounts(text), &["cpu", "memory", "pids", "io"]);
        assert_eq!((v, roots.len()), (1, 4));
    }

    #[test]
    fn prepare_uses_v1_for_what_v2_lacks() {
        let t = tempfile::tempdir().expect("tempdir");
        let hs = [
            Hierarchy {
                mount: t.path().join("v1mem"),
                v1: Some(vec!["memory"]),
            },
            Hierarchy {
                mount: t.path().join("v1blk"),
                v1: Some(vec!["io"]),
            },
        ];
        let rel = Path::new("agent-sandbox/d-1");
        let rels: Vec<_> = hs.iter().map(|h| (h.clone(), rel.to_path_buf())).collect();
        let p = prepare_parents(&rels, &["cpu", "memory", "pids"]).expect("prepare");
        assert_eq!(p.parents, vec![t.path().join("v1mem").join(rel)]);
        assert_eq!(p.missing, vec!["cpu", "pids"]);
        assert!(!t.path().join("v1blk").exists(), "blkio without an io rule");
    }

    #[test]
    fn own_placement_follows_proc_self_cgroup() {
        let v2 = Hierarchy {
            mount: "/sys/fs/cgroup".into(),
            v1: None,
        };
        let mem = Hierarchy {
            mount: "/sys/fs/cgroup/memory".into(),
            v1: Some(vec!["memory"]),
        };
        let cpu = Hierarchy {
            mount: "/sys/fs/cgroup/cpu,cpuacct".into(),
            v1: Some(vec!["cpu"]),
        };
        let text = "12:cpu,cpuacct:/system.slice/a.service\n4:memory:/system.slice/a.service/daemon\n0::/system.slice/a.service\n";
        let unit = PathBuf::from("system.slice/a.service");
        assert_eq!(own_rel(&v2, text), Some(unit.clone()));
        // Already in the leaf (a restart in the same unit): the unit.
        assert_eq!(own_rel(&mem, text), Some(unit.clone()));
        assert_eq!(own_rel(&cpu, text), Some(unit.clone()));
        let hs = [v2.clone(), mem.clone()];
        let (own, rels) = plan(&hs, Path::new("/x"), Placement::Own, text).expect("plan");
        assert!(own);
        assert_eq!(rels[0].1, unit.join(VMS_DIR));
        assert_eq!(rels[1].1, unit.join(VMS_DIR));
        // Standalone, and auto on a cgroup systemd did not delegate.
        for p in [Placement::Standalone, Placement::Auto] {
            let (own, rels) = plan(&hs, Path::new("/x"), p, text).expect("plan");
            assert!(!own);
            assert_eq!(rels[0].1, daemon_rel(Path::new("/x")));
        }
        // In the root cgroup: refused, with the way out.
        let e = plan(&hs, Path::new("/x"), Placement::Own, "0::/\n4:memory:/\n").unwrap_err();
        assert!(
            e.contains("root cgroup") && e.contains("Delegate=yes"),
            "{e}"
        );
        assert_eq!("own".parse::<Placement>(), Ok(Placement::Own));
        assert!("mine".parse::<Placement>().is_err());
    }

    #[test]
    fn io_rules_and_disks() {
        assert!(validate_io_rule("rbps=1048576 wbps=max riops=100").is_ok());
        for bad in ["", "rbps", "rbps=0", "rbps=x", "foo=1", "wbps=1 wbps=2"] {
            assert!(validate_io_rule(bad).is_err(), "{bad:?} accepted");
        }
        // The disk under / here (a partition's disk, or the disk itself).
        if let Some(d) = disk_of(Path::new("/")) {
            let dev = PathBuf::from(format!("/sys/dev/block/{d}"));
            assert!(dev.exists(), "{d}");
            assert!(!dev.join("partition").exists(), "{d} is a partition");
            let lines = io_max_lines("wbps=1000", &[Path::new("/"), Path::new("/")]);
            assert_eq!(lines, vec![format!("{d} wbps=1000")]);
        }
        assert_eq!(disk_of(Path::new("/proc")), None);
        let mut l = Limits::for_vm(1, 256, MEMORY_OVERHEAD_MIB);
        l.io_max = vec!["8:0 wbps=1".into(), "8:16 wbps=1".into()];
        let f = l.files();
        assert_eq!(
            &f[3..],
            &[
                ("io.max", "8:0 wbps=1".to_string()),
                ("io.max", "8:16 wbps=1".to_string())
            ]
        );
    }

    #[test]
    fn create_makes_a_dir_per_parent_sweep_takes_only_ours() {
        // Plain directories stand in for two cgroupfs parents whose
        // hierarchies offer none of the limit files: the dirs are made
        // (the real files: tests/security_daemon.rs).
        let t = tempfile::tempdir().expect("tempdir");
        let (mem, other) = (t.path().join("mem"), t.path().join("none"));
        fs::create_dir_all(&mem).expect("mkdir");
        fs::create_dir_all(&other).expect("mkdir");
        let parents = vec![mem.clone(), other.clone()];
        let l = Limits::for_vm(1, 256, 16);
        let made = create(&parents, "asbx-1", &l).expect("create");
        assert_eq!(made, vec![mem.join("asbx-1"), other.join("asbx-1")]);
        assert!(!other.join("asbx-1/memory.max").exists());
        // A second create fails and leaves the first's dirs alone.
        assert!(create(&parents, "asbx-1", &l).is_err());
        assert!(create(&parents, "../x", &l).is_err());
        fs::create_dir(mem.join("other")).expect("mkdir");
        assert_eq!(sweep(&parents, "asbx-"), 2);
        assert!(!mem.join("asbx-1").exists() && !other.join("asbx-1").exists());
        assert!(mem.join("other").exists());
        assert!(remove_all(&[mem.join("gone")], Instant::now()).is_ok());
    }

    #[test]
    fn create_undoes_on_failure() {
        let t = tempfile::tempdir().expect("tempdir");
        let a = t.path().join("a");
        fs::create_dir_all(&a).expect("mkdir");
        let missing_parent = t.path().join("nope");
        let r = create(
            &[a.clone(), missing_parent],
            "asbx-2",
            &Limits::for_vm(1, 1, 1),
        );
        assert!(r.is_err());
        assert!(!a.join("asbx-2").exists(), "first dir not removed");
    }
}
