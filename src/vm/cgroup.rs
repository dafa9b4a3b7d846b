//! Per-VM cgroup v2 directories for VMMs the daemon starts itself (QEMU;
//! the jailer makes Firecracker's): `<parent>/<id>` with `cpu.max`,
//! `memory.max` and `pids.max`, created before the VMM starts (the spawner
//! starts it inside), removed at teardown and by the orphan sweep.
//!
//! The parent must delegate the controllers (`+cpu +memory +pids` in its
//! and its ancestors' `cgroup.subtree_control`); [`prepare_parent`] turns on
//! what the hierarchy offers and reports what it lacks. On hosts where
//! those controllers are bound to a cgroup v1 hierarchy (a hybrid setup)
//! the VM still gets its own v2 cgroup (membership, `cgroup.kill` at
//! teardown) but the limits cannot be applied; that is logged at start.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{Result, VmError};

const NAME: &str = "cgroup";

/// Controllers the per-VM limits need (`io` only with an `io.max` rule).
pub const CONTROLLERS: &[&str] = &["cpu", "memory", "pids", "io"];

/// QEMU's own memory beyond guest RAM (device emulation, TCG translation
/// cache, page tables): measured ~100-125 MiB RSS for a 256 MiB TCG guest.
pub const MEMORY_OVERHEAD_MIB: u64 = 256;

/// Threads and processes one VMM may have (QEMU: vCPU threads, I/O worker
/// pool of up to 64, RCU, main loop).
pub const PIDS_MAX: u64 = 256;

/// The limits of one VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// `cpu.max`: quota and period in microseconds (one CPU per vCPU).
    pub cpu_quota_us: u64,
    pub cpu_period_us: u64,
    /// `memory.max` in bytes: guest RAM + [`MEMORY_OVERHEAD_MIB`].
    pub memory_max: u64,
    pub pids_max: u64,
    /// `io.max` lines, one per block device (`MAJ:MIN rbps=... wbps=...`),
    /// see [`io_max_lines`].
    pub io_max: Vec<String>,
}

impl Limits {
    pub fn for_vm(vcpus: u32, mem_mib: u32) -> Limits {
        Limits {
            cpu_quota_us: u64::from(vcpus.max(1)) * 100_000,
            cpu_period_us: 100_000,
            memory_max: (u64::from(mem_mib) + MEMORY_OVERHEAD_MIB) << 20,
            pids_max: PIDS_MAX,
            io_max: Vec::new(),
        }
    }

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

/// `<cgroup2 mount>/agent-sandbox`, when cgroup v2 is mounted.
pub fn default_parent() -> Option<PathBuf> {
    super::jailer::cgroup2_mount().map(|m| m.join("agent-sandbox"))
}

/// The parent for the daemon owning `state_dir`:
/// `<cgroup2 mount>/agent-sandbox/d-<hash of the state dir>`. One daemon
/// owns a state dir, so its orphan sweep may remove everything under this
/// parent without touching another daemon's VMs on the same host.
pub fn daemon_parent(state_dir: &Path) -> Option<PathBuf> {
    use sha2::{Digest, Sha256};
    let canon = fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
    let h = Sha256::digest(canon.as_os_str().as_encoded_bytes());
    let tag: String = h[..6].iter().map(|b| format!("{b:02x}")).collect();
    default_parent().map(|p| p.join(format!("d-{tag}")))
}

fn controllers(dir: &Path) -> Vec<String> {
    fs::read_to_string(dir.join("cgroup.controllers"))
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// Create `parent` and have it (and its ancestors up to the mount) delegate
/// whichever of [`CONTROLLERS`] the hierarchy offers. Returns the ones its
/// children will not have.
pub fn prepare_parent(parent: &Path) -> Result<Vec<&'static str>> {
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
        .filter(|c| !subtree.split_whitespace().any(|s| s == *c))
        .collect())
}

/// Create `<parent>/<id>` and write `limits` into it. Limit files the
/// hierarchy does not offer are skipped (see the module docs); any other
/// failure removes the directory again.
pub fn create(parent: &Path, id: &str, limits: &Limits) -> Result<PathBuf> {
    super::jailer::validate_id(id)?;
    let dir = parent.join(id);
    fs::create_dir(&dir).map_err(|e| io_err(format!("create cgroup {}", dir.display()), e))?;
    for (file, value) in limits.files() {
        let p = dir.join(file);
        if !p.exists() {
            continue;
        }
        if let Err(e) = fs::write(&p, &value) {
            let _ = fs::remove_dir(&dir);
            return Err(io_err(format!("write {value:?} to {}", p.display()), e));
        }
    }
    Ok(dir)
}

/// Kill whatever is still in `dir` and remove it; waits (until `deadline`)
/// for the kernel to let go of exiting processes. Missing is fine.
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

/// Remove every `<parent>/<prefix>*` cgroup (an earlier run's VMs).
pub fn sweep(parent: &Path, prefix: &str) -> usize {
    let Ok(rd) = fs::read_dir(parent) else {
        return 0;
    };
    let mut n = 0;
    for e in rd.flatten() {
        let name = e.file_name();
        if !name.to_string_lossy().starts_with(prefix) {
            continue;
        }
        match remove(&e.path(), Instant::now() + Duration::from_secs(2)) {
            Ok(()) => n += 1,
            Err(e) => log::warn!("orphan sweep: {e}"),
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_follow_the_vm_size() {
        let l = Limits::for_vm(2, 512);
        assert_eq!(l.cpu_quota_us, 200_000);
        assert_eq!(l.memory_max, (512 + MEMORY_OVERHEAD_MIB) << 20);
        let f = l.files();
        assert_eq!(f[0], ("cpu.max", "200000 100000".to_string()));
        assert_eq!(f.len(), 3, "no io.max without a rule");
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
        let mut l = Limits::for_vm(1, 256);
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
    fn create_skips_missing_files_sweep_takes_only_ours() {
        // A plain directory stands in for a cgroupfs parent whose hierarchy
        // offers none of the limit files: the VM's dir is still made.
        let t = tempfile::tempdir().expect("tempdir");
        let parent = t.path();
        let made = create(parent, "asbx-1", &Limits::for_vm(1, 256));
        assert_eq!(made.ok(), Some(parent.join("asbx-1")));
        assert!(!parent.join("asbx-1/memory.max").exists());
        assert!(create(parent, "asbx-1", &Limits::for_vm(1, 256)).is_err());
        assert!(create(parent, "../x", &Limits::for_vm(1, 256)).is_err());
        fs::create_dir(parent.join("other")).expect("mkdir");
        assert_eq!(sweep(parent, "asbx-"), 1);
        assert!(!parent.join("asbx-1").exists());
        assert!(parent.join("other").exists());
        assert!(remove(&parent.join("gone"), Instant::now()).is_ok());
    }
}
