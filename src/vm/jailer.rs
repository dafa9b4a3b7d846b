//! Firecracker's jailer: argv construction, chroot preparation, process
//! handles and teardown.
//!
//! Building the argv and running it are separate on purpose: seccomp filters
//! are inherited across `exec`, so in the daemon the jailer is started by a
//! small unfiltered spawner process, not by a filtered worker thread. The
//! [`Spawner`](super::launch::Spawner) trait is that seam;
//! [`DirectSpawner`](super::launch::DirectSpawner) runs it in-process
//! (both in [`super::launch`], shared with QEMU).
//!
//! Layout made by the jailer (`exec_name` is the file name of the Firecracker
//! binary, normally `firecracker`):
//!
//! ```text
//! <chroot_base>/<exec_name>/<id>/            jail dir (removed on teardown)
//! <chroot_base>/<exec_name>/<id>/root/       chroot; `/` for the VMM
//! <chroot_base>/<exec_name>/<id>/root/<exec_name>.pid   written with --new-pid-ns
//! <cgroup_root>/<parent_cgroup>/<id>/        cgroup v2 dir (removed on teardown)
//! <v1 root>/<parent_cgroup>/<id>/            with --cgroup-version 1: one per
//!                                            controller hierarchy used
//! ```

use std::ffi::{OsStr, OsString};
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::launch::{validate_id, Pidfd};
use super::{Result, VmError};

const BACKEND: &str = super::BackendKind::Firecracker.as_str();

/// Paths as the jailed VMM sees them (relative to its chroot).
pub mod in_jail {
    pub const API_SOCK: &str = "/api.sock";
    pub const VSOCK: &str = "/v.sock";
    pub const KERNEL: &str = "/vmlinux";
    pub const ROOTFS: &str = "/rootfs";
    pub const LOG: &str = "/firecracker.log";
    /// A booted guest's serial console (`PUT /serial`).
    pub const SERIAL: &str = "/serial.log";
    /// Snapshot being restored (hard links to the template's files).
    pub const SNAP_STATE: &str = "/snapshot.state";
    pub const SNAP_MEM: &str = "/snapshot.mem";
    /// Snapshot being created. Distinct from the restore names so a restored
    /// VM never writes through a hard link into the template it came from.
    pub const NEW_SNAP_STATE: &str = "/new-snapshot.state";
    pub const NEW_SNAP_MEM: &str = "/new-snapshot.mem";
}

/// Every flag the jailer v1.16 documents (docs/jailer.md, "Jailer Usage").
/// The argv builder only emits flags from this list; tests hold it to that.
pub const DOCUMENTED_JAILER_FLAGS: &[&str] = &[
    "--id",
    "--exec-file",
    "--uid",
    "--gid",
    "--parent-cgroup",
    "--cgroup-version",
    "--cgroup",
    "--chroot-base-dir",
    "--netns",
    "--resource-limit",
    "--daemonize",
    "--new-pid-ns",
];

/// Host-wide jailer settings.
#[derive(Debug, Clone)]
pub struct JailerConfig {
    pub jailer_bin: PathBuf,
    pub firecracker_bin: PathBuf,
    /// `--chroot-base-dir`; the jailer's own default is `/srv/jailer`.
    pub chroot_base: PathBuf,
    /// Where cgroup v2 is mounted (see [`cgroup2_mount`]); used to find the
    /// dir the jailer made, `<cgroup_root>/<parent_cgroup>/<id>`.
    pub cgroup_root: PathBuf,
    /// `--parent-cgroup`: every VM's cgroup is `<parent>/<id>`.
    pub parent_cgroup: String,
    /// `--cgroup-version`: 2, or 1 where the host binds cpu, memory and
    /// pids to cgroup v1 hierarchies (see `cgroup::jailer_plan`).
    pub cgroup_version: u8,
    /// With version 1: the mounts of the hierarchies the limits use (the
    /// jailer makes `<mount>/<parent>/<id>` in each).
    pub cgroup_v1_roots: Vec<PathBuf>,
    /// CPU quota beyond `vcpus` whole CPUs, in percent of one CPU, for the
    /// VMM's own API and device threads.
    pub cpu_overhead_pct: u32,
    /// memory.max = guest memory + this.
    pub mem_overhead_mib: u32,
    pub pids_max: u32,
    /// `--resource-limit no-file`.
    pub no_file: u64,
    /// A fixed `cpu.max` for every VM in place of one CPU per vCPU plus
    /// `cpu_overhead_pct`.
    pub cpu_max: Option<super::cgroup::CpuMax>,
    /// `--cgroup io.max=<line>` each (see `cgroup::io_max_lines`).
    pub io_max: Vec<String>,
    /// Added to the guest memory size for `--resource-limit fsize`: the
    /// largest file the VMM writes is the snapshot memory file.
    pub fsize_slack_bytes: u64,
}

impl Default for JailerConfig {
    fn default() -> Self {
        JailerConfig {
            jailer_bin: "/usr/local/bin/jailer".into(),
            firecracker_bin: "/usr/local/bin/firecracker".into(),
            chroot_base: "/srv/jailer".into(),
            cgroup_root: "/sys/fs/cgroup".into(),
            parent_cgroup: "agent-sandbox".into(),
            cgroup_version: 2,
            cgroup_v1_roots: Vec::new(),
            cpu_overhead_pct: 25,
            mem_overhead_mib: 64,
            pids_max: 64,
            no_file: super::launch::DEFAULT_NOFILE,
            cpu_max: None,
            io_max: Vec::new(),
            fsize_slack_bytes: 64 << 20,
        }
    }
}

/// Where cgroup v2 is mounted, found the way the jailer finds it: the first
/// `cgroup2` entry of `/proc/mounts`. `None` without cgroup v2.
pub fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = fs::read_to_string("/proc/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let mut f = l.split(' ');
        let (_dev, dir, fstype) = (f.next()?, f.next()?, f.next()?);
        // /proc/mounts escapes spaces as \040; cgroup mounts do not have any.
        (fstype == "cgroup2").then(|| PathBuf::from(dir))
    })
}

/// Per-VM launch parameters.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub id: String,
    pub uid: u32,
    pub gid: u32,
    pub netns: Option<PathBuf>,
    pub vcpus: u32,
    pub mem_mib: u32,
}

/// Where everything of one VM lives, as seen from the host.
#[derive(Debug, Clone)]
pub struct JailPaths {
    pub id: String,
    pub exec_name: String,
    pub jail_dir: PathBuf,
    pub root: PathBuf,
    /// The VM's cgroup in each hierarchy: the v2 one, or with
    /// `--cgroup-version 1` one per v1 root.
    pub cgroup_dirs: Vec<PathBuf>,
}

impl JailPaths {
    pub fn new(cfg: &JailerConfig, id: &str) -> Result<Self> {
        validate_id(id)?;
        let exec_name = exec_name(cfg)?;
        let jail_dir = cfg.chroot_base.join(&exec_name).join(id);
        Ok(JailPaths {
            id: id.to_string(),
            root: jail_dir.join("root"),
            jail_dir,
            cgroup_dirs: if cfg.cgroup_version == 1 {
                cfg.cgroup_v1_roots
                    .iter()
                    .map(|r| r.join(&cfg.parent_cgroup).join(id))
                    .collect()
            } else {
                vec![cfg.cgroup_root.join(&cfg.parent_cgroup).join(id)]
            },
            exec_name,
        })
    }

    /// Host path of a path inside the chroot.
    pub fn host(&self, in_jail: &str) -> PathBuf {
        self.root.join(in_jail.trim_start_matches('/'))
    }

    pub fn api_sock(&self) -> PathBuf {
        self.host(in_jail::API_SOCK)
    }

    pub fn vsock(&self) -> PathBuf {
        self.host(in_jail::VSOCK)
    }

    /// Written by the jailer with `--new-pid-ns`: `<chroot>/<exec_name>.pid`.
    pub fn pid_file(&self) -> PathBuf {
        self.root.join(format!("{}.pid", self.exec_name))
    }
}

fn exec_name(cfg: &JailerConfig) -> Result<String> {
    let name = cfg
        .firecracker_bin
        .file_name()
        .and_then(OsStr::to_str)
        .ok_or_else(|| {
            VmError::Other(format!(
                "firecracker binary path {} has no usable file name",
                cfg.firecracker_bin.display()
            ))
        })?;
    // Older jailers insist on this; keep to it so any 1.x jailer accepts us.
    if !name.contains("firecracker") {
        return Err(VmError::Other(format!(
            "firecracker binary {} must have \"firecracker\" in its file name (jailer rule)",
            cfg.firecracker_bin.display()
        )));
    }
    Ok(name.to_string())
}

/// The full jailer argv (argv[0] is the jailer binary).
pub fn build_argv(cfg: &JailerConfig, spec: &LaunchSpec) -> Result<Vec<OsString>> {
    validate_id(&spec.id)?;
    exec_name(cfg)?;
    for (what, p) in [
        ("jailer binary", &cfg.jailer_bin),
        ("firecracker binary", &cfg.firecracker_bin),
        ("chroot base", &cfg.chroot_base),
    ] {
        if !p.is_absolute() {
            return Err(VmError::Other(format!(
                "{what} path {} must be absolute",
                p.display()
            )));
        }
    }
    let parent = Path::new(&cfg.parent_cgroup);
    if cfg.parent_cgroup.is_empty()
        || parent.is_absolute()
        || parent
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(VmError::Other(format!(
            "parent cgroup {:?} must be a relative path without '.' or '..'",
            cfg.parent_cgroup
        )));
    }
    if spec.vcpus == 0 || spec.mem_mib == 0 {
        return Err(VmError::Other(format!(
            "VM {}: vcpus and mem_mib must be non-zero",
            spec.id
        )));
    }

    let (quota, period) = match cfg.cpu_max {
        Some(c) => (c.quota_us, c.period_us),
        None => {
            let period: u64 = 100_000;
            let q = period * u64::from(spec.vcpus) + period * u64::from(cfg.cpu_overhead_pct) / 100;
            (q, period)
        }
    };
    let mem_max = (u64::from(spec.mem_mib) + u64::from(cfg.mem_overhead_mib)) << 20;
    let fsize = (u64::from(spec.mem_mib) << 20) + cfg.fsize_slack_bytes;

    let mut a: Vec<OsString> = Vec::with_capacity(40);
    let mut push = |s: &dyn AsRef<OsStr>| a.push(s.as_ref().to_os_string());
    push(&cfg.jailer_bin);
    push(&"--id");
    push(&spec.id);
    push(&"--exec-file");
    push(&cfg.firecracker_bin);
    push(&"--uid");
    push(&spec.uid.to_string());
    push(&"--gid");
    push(&spec.gid.to_string());
    push(&"--chroot-base-dir");
    push(&cfg.chroot_base);
    if let Some(ns) = &spec.netns {
        if !ns.is_absolute() {
            return Err(VmError::Other(format!(
                "VM {}: netns path {} must be absolute",
                spec.id,
                ns.display()
            )));
        }
        push(&"--netns");
        push(ns);
    }
    push(&"--cgroup-version");
    push(&cfg.cgroup_version.to_string());
    push(&"--parent-cgroup");
    push(&cfg.parent_cgroup);
    let limits = super::cgroup::Limits {
        cpu_quota_us: quota,
        cpu_period_us: period,
        memory_max: mem_max,
        pids_max: u64::from(cfg.pids_max),
        io_max: cfg.io_max.clone(),
    };
    match cfg.cgroup_version {
        2 => {
            push(&"--cgroup");
            push(&format!("cpu.max={quota} {period}"));
            push(&"--cgroup");
            push(&format!("memory.max={mem_max}"));
            push(&"--cgroup");
            push(&format!("pids.max={}", cfg.pids_max));
            for line in &cfg.io_max {
                push(&"--cgroup");
                push(&format!("io.max={line}"));
            }
        }
        1 => {
            // memsw exists only with swap accounting: passed where the
            // memory hierarchy has it (as QEMU's cgroup gets it), after the
            // memory limit (the jailer writes a controller's files in order,
            // and memsw may not be below the limit).
            let memsw = cfg
                .cgroup_v1_roots
                .iter()
                .any(|r| r.join("memory.memsw.limit_in_bytes").exists());
            for (_, file, value) in limits.v1_files() {
                if file != "memory.memsw.limit_in_bytes" || memsw {
                    push(&"--cgroup");
                    push(&format!("{file}={value}"));
                }
            }
        }
        v => {
            return Err(VmError::Other(format!(
                "cgroup version {v}: the jailer takes 1 or 2"
            )))
        }
    }
    push(&"--resource-limit");
    push(&format!("fsize={fsize}"));
    push(&"--resource-limit");
    push(&format!("no-file={}", cfg.no_file));
    // --new-pid-ns makes the jailer exit once the VMM runs (it writes the
    // VMM's pid to <chroot>/<exec_name>.pid), so the spawner can wait for it.
    push(&"--new-pid-ns");
    push(&"--daemonize");
    push(&"--");
    push(&"--api-sock");
    push(&in_jail::API_SOCK);
    Ok(a)
}

/// The jailer copies only the exec file into an empty chroot, so a
/// dynamically linked Firecracker cannot start there (the jailer's exec
/// fails with ENOENT for the missing loader, and with `--daemonize` nobody
/// sees it). `Err` names the interpreter; Firecracker's releases are static
/// (musl) builds. A file that is not a 64-bit ELF is left to exec to judge.
pub fn check_static_exec(path: &Path) -> Result<()> {
    let bad = |problem: String| VmError::BadFile {
        path: path.to_path_buf(),
        problem,
        fix: "use a statically linked firecracker (the releases are static musl builds; \
              a source build: --target x86_64-unknown-linux-musl, or RUSTFLAGS='-C \
              target-feature=+crt-static')"
            .into(),
    };
    match elf_interpreter(path) {
        Ok(Some(interp)) => Err(bad(format!(
            "is dynamically linked (interpreter {interp}); the jailer runs it in an \
             empty chroot, where that loader does not exist"
        ))),
        Ok(None) => Ok(()),
        Err(e) => Err(VmError::Io {
            backend: BACKEND,
            what: format!("read firecracker binary {}", path.display()),
            source: e,
        }),
    }
}

/// The `PT_INTERP` of a 64-bit little-endian ELF file, `None` for a static
/// one or a file that is not such an ELF.
pub fn elf_interpreter(path: &Path) -> io::Result<Option<String>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = fs::File::open(path)?;
    let mut h = [0u8; 64];
    if f.read_exact(&mut h).is_err() || &h[..4] != b"\x7fELF" || h[4] != 2 || h[5] != 1 {
        return Ok(None);
    }
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
    let u64_at = |b: &[u8], o: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[o..o + 8]);
        u64::from_le_bytes(a)
    };
    let (phoff, phentsize, phnum) = (u64_at(&h, 0x20), u16_at(&h, 0x36), u16_at(&h, 0x38));
    if phentsize < 56 || phnum > 512 {
        return Ok(None);
    }
    let mut ph = vec![0u8; usize::from(phentsize) * usize::from(phnum)];
    f.seek(SeekFrom::Start(phoff))?;
    f.read_exact(&mut ph)?;
    const PT_INTERP: u32 = 3;
    for e in ph.chunks_exact(usize::from(phentsize)) {
        if u32::from_le_bytes([e[0], e[1], e[2], e[3]]) != PT_INTERP {
            continue;
        }
        let (off, size) = (u64_at(e, 0x08), u64_at(e, 0x20).min(4096));
        let mut name = vec![0u8; usize::try_from(size).unwrap_or(0)];
        f.seek(SeekFrom::Start(off))?;
        f.read_exact(&mut name)?;
        let name = String::from_utf8_lossy(&name);
        return Ok(Some(name.trim_end_matches('\0').to_string()));
    }
    Ok(None)
}

/// Read the VMM pid the jailer wrote; `None` while the file is missing or
/// still empty (the jailer creates it, then writes it).
pub fn read_pid_file(paths: &JailPaths) -> io::Result<Option<i32>> {
    let s = match fs::read_to_string(paths.pid_file()) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    if s.trim().is_empty() {
        return Ok(None);
    }
    s.trim()
        .parse::<i32>()
        .ok()
        .filter(|p| *p > 0)
        .map(Some)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("pid file holds {:?}", s.trim()),
            )
        })
}

/// Handle to the process the pid file names, without checking what it is.
/// For use right after launching, when the file is fresh: the jailer writes
/// it just after cloning the VMM, possibly before the VMM has exec'd, so its
/// name may still be the jailer's.
pub fn open_pid_file(paths: &JailPaths) -> io::Result<Option<Pidfd>> {
    let Some(pid) = read_pid_file(paths)? else {
        return Ok(None);
    };
    match Pidfd::open(pid) {
        Ok(p) => Ok(Some(p)),
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Open a handle to the VMM named by a possibly stale pid file, but only if
/// that process really is the VMM: its `comm` must be the exec file name.
/// Guards against killing an unrelated process that reused the pid.
pub fn open_vmm(paths: &JailPaths) -> io::Result<Option<Pidfd>> {
    let Some(pfd) = open_pid_file(paths)? else {
        return Ok(None);
    };
    // Check identity after opening the pidfd: if comm matches now, the pidfd
    // refers to that process for good.
    let comm = match fs::read(format!("/proc/{}/comm", pfd.pid())) {
        Ok(c) => c,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let comm = String::from_utf8_lossy(&comm).trim_end().to_string();
    let want: String = paths.exec_name.chars().take(15).collect();
    if comm == want {
        Ok(Some(pfd))
    } else {
        Ok(None)
    }
}

/// On cgroup v1 the jailer first copies each file it is given from the
/// parent cgroup (the first line of `<mount>/<parent_cgroup>/<file>`, or of
/// the mount's own file when that is empty) into the VM's cgroup, and fails
/// (`CgroupInheritFromParent`) when both are empty: a
/// `blkio.throttle.*_device` file is, until a rule is written to it. So
/// before the jailer runs, the parent cgroup gets, for each device and file
/// of `io_max` it has no rule for yet, a rule that never binds (the largest
/// value the kernel keeps as a rule: `u64::MAX - 1` bytes/s,
/// `u32::MAX - 1` IO/s); the VM's cgroup then gets its real limit. Nothing
/// to do on cgroup v2 or without `io_max`. Seen with jailer v1.17.0-dev.
pub fn prepare_v1_parents(cfg: &JailerConfig) -> Result<()> {
    if cfg.cgroup_version != 1 || cfg.io_max.is_empty() {
        return Ok(());
    }
    let Some(root) = cfg
        .cgroup_v1_roots
        .iter()
        .find(|r| r.join("blkio.throttle.read_bps_device").exists())
    else {
        // No blkio hierarchy: the jailer names the missing controller.
        return Ok(());
    };
    let io_err = |what: String, source: io::Error| VmError::Io {
        backend: BACKEND,
        what,
        source,
    };
    let parent = root.join(&cfg.parent_cgroup);
    fs::create_dir_all(&parent)
        .map_err(|e| io_err(format!("create cgroup {}", parent.display()), e))?;
    let limits = super::cgroup::Limits {
        io_max: cfg.io_max.clone(),
        ..super::cgroup::Limits::for_vm(1, 0, 0)
    };
    for (ctl, file, rule) in limits.v1_files() {
        let Some(dev) = rule.split_whitespace().next().filter(|_| ctl == "blkio") else {
            continue;
        };
        let path = parent.join(file);
        let have =
            fs::read_to_string(&path).map_err(|e| io_err(format!("read {}", path.display()), e))?;
        if have
            .lines()
            .any(|l| l.split_whitespace().next() == Some(dev))
        {
            continue;
        }
        let never = if file.contains("iops") {
            u64::from(u32::MAX - 1)
        } else {
            u64::MAX - 1
        };
        fs::write(&path, format!("{dev} {never}\n"))
            .map_err(|e| io_err(format!("write {} to {}", rule, path.display()), e))?;
    }
    Ok(())
}

/// A file to place in the chroot.
#[derive(Debug, Clone)]
pub struct JailFile {
    pub src: PathBuf,
    pub in_jail: &'static str,
}

/// Create `<root>` and hard-link (or, across filesystems, copy) the VM's
/// files into it. Also creates empty files the VMM writes to (`writable`),
/// owned by the VM user. The jailer chowns `<root>` itself.
pub fn prepare_chroot(
    paths: &JailPaths,
    uid: u32,
    gid: u32,
    files: &[JailFile],
    writable: &[&str],
) -> Result<()> {
    let io_err = |what: String, source: io::Error| VmError::Io {
        backend: BACKEND,
        what,
        source,
    };
    fs::create_dir_all(&paths.root)
        .map_err(|e| io_err(format!("create jail root {}", paths.root.display()), e))?;
    // SAFETY: geteuid has no preconditions.
    let root_user = unsafe { libc::geteuid() } == 0;
    for f in files {
        let meta = fs::metadata(&f.src).map_err(|e| VmError::BadFile {
            path: f.src.clone(),
            problem: format!("cannot stat: {e}"),
            fix: "check the path, or rebuild the image/snapshot".into(),
        })?;
        if !meta.is_file() {
            return Err(VmError::BadFile {
                path: f.src.clone(),
                problem: "not a regular file".into(),
                fix: "point the config at the image file".into(),
            });
        }
        let dst = paths.host(f.in_jail);
        let _ = fs::remove_file(&dst);
        match fs::hard_link(&f.src, &dst) {
            Ok(()) => {
                // A link shares the inode: the VM user must be able to read
                // it and must not be able to write it (a compromised VMM
                // would otherwise corrupt the image every VM shares).
                check_shared_file(&f.src, &meta, uid, gid)?;
            }
            Err(_) => {
                // Typically EXDEV. A private copy is the VM user's own.
                fs::copy(&f.src, &dst).map_err(|e| {
                    io_err(format!("copy {} to {}", f.src.display(), dst.display()), e)
                })?;
                fs::set_permissions(&dst, fs::Permissions::from_mode(0o400))
                    .map_err(|e| io_err(format!("chmod {}", dst.display()), e))?;
                if root_user {
                    chown(&dst, uid, gid)?;
                }
            }
        }
    }
    for w in writable {
        let dst = paths.host(w);
        fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&dst)
            .map_err(|e| io_err(format!("create {}", dst.display()), e))?;
        fs::set_permissions(&dst, fs::Permissions::from_mode(0o600))
            .map_err(|e| io_err(format!("chmod {}", dst.display()), e))?;
        if root_user {
            chown(&dst, uid, gid)?;
        }
    }
    Ok(())
}

fn check_shared_file(path: &Path, meta: &fs::Metadata, uid: u32, gid: u32) -> Result<()> {
    let mode = meta.mode();
    let readable = (meta.uid() == uid && mode & 0o400 != 0)
        || (meta.gid() == gid && mode & 0o040 != 0)
        || mode & 0o004 != 0;
    let writable = (meta.uid() == uid && mode & 0o200 != 0)
        || (meta.gid() == gid && mode & 0o020 != 0)
        || mode & 0o002 != 0;
    if !readable {
        return Err(VmError::BadFile {
            path: path.to_path_buf(),
            problem: format!("not readable by the VM user {uid}:{gid}"),
            fix: format!("chgrp {gid} {0} && chmod g+r {0}", path.display()),
        });
    }
    if writable {
        return Err(VmError::BadFile {
            path: path.to_path_buf(),
            problem: format!("writable by the VM user {uid}:{gid}, and shared by every VM"),
            fix: format!("chown root:{gid} {0} && chmod 0440 {0}", path.display()),
        });
    }
    Ok(())
}

pub fn chown(path: &Path, uid: u32, gid: u32) -> Result<()> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(|e| VmError::Io {
        backend: BACKEND,
        what: format!("chown {uid}:{gid} {}", path.display()),
        source: e,
    })
}

/// Kill the VMM, reap it, remove the jail dir and the VM's cgroup.
/// Idempotent: whatever is already gone is skipped. `vmm` is the handle
/// taken at launch; without it the pid file is consulted (and only a
/// process whose name is the exec file's is killed).
pub fn teardown(paths: &JailPaths, vmm: Option<&Pidfd>, deadline: Instant) -> Result<()> {
    let budget_ms = deadline
        .saturating_duration_since(Instant::now())
        .as_millis() as u64;
    let mut first_err: Option<VmError> = None;
    let opened;
    let vmm = match vmm {
        Some(p) => Some(p),
        None => {
            opened = open_vmm(paths).unwrap_or(None);
            opened.as_ref()
        }
    };
    if let Some(p) = vmm {
        if let Err(e) = p.kill() {
            first_err.get_or_insert(VmError::Io {
                backend: BACKEND,
                what: format!("kill VMM pid {} of {}", p.pid(), paths.id),
                source: e,
            });
        }
        if p.wait_exit(deadline) {
            p.reap();
        } else {
            first_err.get_or_insert(VmError::Timeout {
                backend: BACKEND,
                what: format!("VMM pid {} of {} to exit after SIGKILL", p.pid(), paths.id),
                ms: budget_ms,
            });
        }
    }
    match fs::remove_dir_all(&paths.jail_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            first_err.get_or_insert(VmError::Io {
                backend: BACKEND,
                what: format!("remove jail dir {}", paths.jail_dir.display()),
                source: e,
            });
        }
    }
    // A cgroup dir can be removed once its last process is gone; the kernel
    // may take a moment after the kill to notice.
    if let Err(e) = super::cgroup::remove_all(&paths.cgroup_dirs, deadline) {
        first_err.get_or_insert(e);
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Sockets paths must fit `sockaddr_un.sun_path` (108 bytes with the NUL).
pub fn check_socket_path(p: &Path) -> Result<()> {
    if p.as_os_str().as_bytes().len() >= 108 {
        return Err(VmError::Other(format!(
            "socket path {} is longer than 107 bytes; use a shorter chroot base or id",
            p.display()
        )));
    }
    Ok(())
}
