//! Snapshot manifest: what a snapshot was made from, so the daemon can tell
//! a stale snapshot (new kernel, new rootfs, VMM upgrade, other VM shape) and
//! rebuild it instead of failing at restore. Backend-neutral.
//!
//! Inputs are identified two ways: a SHA-256 of the content (truth, computed
//! once when the snapshot is made; ~1 s for a 300 MiB rootfs) and a cheap
//! fingerprint (device, inode, size, mtime). [`Manifest::is_stale`] trusts a
//! matching fingerprint and only re-hashes a file whose fingerprint changed,
//! so the common check costs two `stat`s.

use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{Result, VmError};

pub const MANIFEST_FILE: &str = "manifest.json";
/// 2: snapshots are taken of a quiesced guest with the exec path warmed
/// (older ones restore correctly but slowly: rebuilt).
const FORMAT: u32 = 2;

/// Identity of one input file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileId {
    pub path: PathBuf,
    pub sha256: String,
    pub size: u64,
    pub dev: u64,
    pub inode: u64,
    pub mtime_ns: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub backend: String,
    pub vmm_version: String,
    pub kernel: FileId,
    pub rootfs: FileId,
    pub vcpus: u32,
    pub mem_mib: u32,
    /// Seconds since the Unix epoch.
    pub created_unix: u64,
    /// Files of the snapshot, relative to its directory.
    pub files: Vec<String>,
    /// What the guest saw at boot besides kernel and rootfs ([`devices`]):
    /// a restore with other devices or command line would not match it.
    #[serde(default)]
    pub devices: String,
}

/// What a restore would run with now.
#[derive(Debug, Clone)]
pub struct Inputs<'a> {
    pub backend: &'a str,
    pub vmm_version: &'a str,
    pub kernel: &'a Path,
    pub rootfs: &'a Path,
    pub vcpus: u32,
    pub mem_mib: u32,
    /// [`devices`] of the VM.
    pub devices: String,
}

impl<'a> Inputs<'a> {
    /// What a VM of `cfg`, run by `backend` at `vmm_version`, puts into a
    /// snapshot and needs from one.
    pub fn of(backend: &'a str, vmm_version: &'a str, cfg: &'a super::VmConfig) -> Inputs<'a> {
        Inputs {
            backend,
            vmm_version,
            kernel: &cfg.kernel,
            rootfs: &cfg.rootfs,
            vcpus: cfg.vcpus,
            mem_mib: cfg.mem_mib,
            devices: devices(cfg),
        }
    }
}

/// `Ok` if the snapshot in `dir` was made for `inputs`; otherwise
/// [`VmError::StaleSnapshot`] with the reason (the daemon rebuilds it).
pub fn check_fresh(dir: &Path, inputs: &Inputs<'_>) -> Result<()> {
    match Manifest::read(dir)?.is_stale(dir, inputs) {
        None => Ok(()),
        Some(reason) => Err(VmError::StaleSnapshot {
            dir: dir.to_path_buf(),
            reason,
        }),
    }
}

/// A short tag for the fixed machine a backend runs (CPU model, kernel
/// command line before `cmdline_extra`): backends append it to their
/// `vmm_version`, so a daemon whose VMs differ there does not restore
/// snapshots an older one made.
pub fn machine_tag(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0u8]);
    }
    let tag: String = h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("machine={tag}")
}

/// The guest-visible device shape of `cfg` that a snapshot fixes: its
/// network device (MAC) and the extra kernel command line (the guest's
/// address, gateway and resolver were set from it at boot).
pub fn devices(cfg: &super::VmConfig) -> String {
    devices_of(
        cfg.net.as_ref().map(|n| n.guest_mac.as_str()),
        &cfg.cmdline_extra,
    )
}

pub fn devices_of(mac: Option<&str>, cmdline_extra: &str) -> String {
    format!(
        "net={} cmdline={}",
        mac.unwrap_or("none"),
        cmdline_extra.trim()
    )
}

fn bad(path: &Path, problem: String, fix: &str) -> VmError {
    VmError::BadFile {
        path: path.to_path_buf(),
        problem,
        fix: fix.to_string(),
    }
}

struct Fingerprint {
    size: u64,
    dev: u64,
    inode: u64,
    mtime_ns: i64,
}

fn fingerprint(path: &Path) -> io::Result<Fingerprint> {
    let m = fs::metadata(path)?;
    Ok(Fingerprint {
        size: m.len(),
        dev: m.dev(),
        inode: m.ino(),
        mtime_ns: m.mtime().saturating_mul(1_000_000_000) + m.mtime_nsec(),
    })
}

pub fn sha256_file(path: &Path) -> io::Result<String> {
    let mut f = fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>())
}

/// [`sha256_file`], remembered while the file's fingerprint stands: a
/// checkpoint seals the same kernel and rootfs (hundreds of MiB) every
/// time, which took most of a checkpoint's time (issue #21).
fn sha256_cached(path: &Path, fp: &Fingerprint) -> io::Result<String> {
    type Key = (PathBuf, u64, u64, u64, i64);
    static SEEN: std::sync::Mutex<Vec<(Key, String)>> = std::sync::Mutex::new(Vec::new());
    let key: Key = (path.to_path_buf(), fp.size, fp.dev, fp.inode, fp.mtime_ns);
    if let Some((_, h)) = crate::sync::lock(&SEEN).iter().find(|(k, _)| *k == key) {
        return Ok(h.clone());
    }
    let h = sha256_file(path)?;
    let mut seen = crate::sync::lock(&SEEN);
    // Kernels and rootfs images: a handful; old ones drop off.
    if seen.len() >= 32 {
        seen.remove(0);
    }
    seen.push((key, h.clone()));
    Ok(h)
}

impl FileId {
    pub fn of(path: &Path) -> Result<Self> {
        let fix = "check the path, or rebuild the image";
        let fp = fingerprint(path).map_err(|e| bad(path, format!("cannot stat: {e}"), fix))?;
        let sha256 =
            sha256_cached(path, &fp).map_err(|e| bad(path, format!("cannot read: {e}"), fix))?;
        Ok(FileId {
            path: path.to_path_buf(),
            sha256,
            size: fp.size,
            dev: fp.dev,
            inode: fp.inode,
            mtime_ns: fp.mtime_ns,
        })
    }

    /// `None` if `current` has the same content, else why not.
    fn differs(&self, what: &str, current: &Path) -> Option<String> {
        let fp = match fingerprint(current) {
            Ok(fp) => fp,
            Err(e) => return Some(format!("{what} {}: {e}", current.display())),
        };
        if fp.size == self.size
            && fp.dev == self.dev
            && fp.inode == self.inode
            && fp.mtime_ns == self.mtime_ns
        {
            return None;
        }
        if fp.size != self.size {
            return Some(format!(
                "{what} {} changed size ({} -> {} bytes)",
                current.display(),
                self.size,
                fp.size
            ));
        }
        match sha256_file(current) {
            Ok(h) if h == self.sha256 => None,
            Ok(_) => Some(format!("{what} {} changed content", current.display())),
            Err(e) => Some(format!("{what} {}: {e}", current.display())),
        }
    }
}

impl Manifest {
    /// Describe a snapshot made now from `inputs` (hashes kernel and rootfs).
    pub fn create(inputs: &Inputs<'_>, files: Vec<String>) -> Result<Self> {
        Ok(Manifest {
            format: FORMAT,
            backend: inputs.backend.to_string(),
            vmm_version: inputs.vmm_version.to_string(),
            kernel: FileId::of(inputs.kernel)?,
            rootfs: FileId::of(inputs.rootfs)?,
            vcpus: inputs.vcpus,
            mem_mib: inputs.mem_mib,
            created_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            files,
            devices: inputs.devices.clone(),
        })
    }

    /// Describes the snapshot just written into `dir` (its `files`) and
    /// writes the manifest there, last: what every backend's
    /// `Vm::snapshot` ends with.
    pub fn seal(dir: &Path, inputs: &Inputs<'_>, files: &[&str]) -> Result<()> {
        Self::create(inputs, files.iter().map(|f| f.to_string()).collect())?.write(dir)
    }

    /// Write `<dir>/manifest.json` atomically (temp file + rename), last, so
    /// a manifest exists only for a complete snapshot.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join(MANIFEST_FILE);
        let tmp = dir.join(format!(".{MANIFEST_FILE}.tmp"));
        let io_err = |what: String, source: io::Error| VmError::Io {
            backend: "snapshot",
            what,
            source,
        };
        let json = serde_json::to_vec_pretty(self)
            .map_err(|e| VmError::Other(format!("serialize snapshot manifest: {e}")))?;
        fs::write(&tmp, json).map_err(|e| {
            // A torn temp file (disk full) must not stay behind either.
            let _ = fs::remove_file(&tmp);
            io_err(format!("write {}", tmp.display()), e)
        })?;
        fs::rename(&tmp, &path).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            io_err(format!("rename {} to {}", tmp.display(), path.display()), e)
        })
    }

    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST_FILE);
        let fix = "rebuild it: agent-sandbox snapshot create --template <T>";
        let data = fs::read(&path).map_err(|e| bad(&path, format!("cannot read: {e}"), fix))?;
        let m: Manifest = serde_json::from_slice(&data)
            .map_err(|e| bad(&path, format!("not a valid snapshot manifest: {e}"), fix))?;
        if m.format != FORMAT {
            return Err(bad(
                &path,
                format!("manifest format {} (this build reads {FORMAT})", m.format),
                fix,
            ));
        }
        for f in &m.files {
            if f.is_empty() || f.contains('/') || f == "." || f == ".." {
                return Err(bad(&path, format!("bad file name {f:?} in manifest"), fix));
            }
        }
        Ok(m)
    }

    /// Why a snapshot in `dir` made per this manifest cannot serve `current`,
    /// or `None` if it can.
    pub fn is_stale(&self, dir: &Path, current: &Inputs<'_>) -> Option<String> {
        if self.backend != current.backend {
            return Some(format!(
                "made by backend {}, not {}",
                self.backend, current.backend
            ));
        }
        if self.vmm_version != current.vmm_version {
            return Some(format!(
                "made by VMM {}, this host runs {}",
                self.vmm_version, current.vmm_version
            ));
        }
        if self.vcpus != current.vcpus || self.mem_mib != current.mem_mib {
            return Some(format!(
                "made for {} vCPUs / {} MiB, wanted {} vCPUs / {} MiB",
                self.vcpus, self.mem_mib, current.vcpus, current.mem_mib
            ));
        }
        if self.devices != current.devices {
            return Some(format!(
                "made with devices [{}], wanted [{}]",
                self.devices, current.devices
            ));
        }
        for f in &self.files {
            if !dir.join(f).is_file() {
                return Some(format!(
                    "snapshot file {} is missing",
                    dir.join(f).display()
                ));
            }
        }
        if let Some(r) = self.kernel.differs("kernel", current.kernel) {
            return Some(r);
        }
        self.rootfs.differs("rootfs", current.rootfs)
    }
}

#[cfg(test)]
mod tests {
    use super::machine_tag;

    #[test]
    fn machine_tag_is_stable_and_keeps_part_boundaries() {
        let t = machine_tag(&["max", "console=ttyS0"]);
        assert_eq!(t, machine_tag(&["max", "console=ttyS0"]));
        assert_eq!(t.len(), "machine=".len() + 16);
        assert_ne!(t, machine_tag(&["host", "console=ttyS0"]));
        assert_ne!(machine_tag(&["a", "bc"]), machine_tag(&["ab", "c"]));
    }
}
