//! QEMU backend: `-M microvm` under KVM where KVM really works, TCG
//! elsewhere. Same kernel and rootfs as Firecracker; the agent is reached
//! over a virtio-serial port exposed as a Unix socket in the run dir; QMP
//! (another Unix socket there) drives pause, save and resume.
//!
//! A booted guest's RAM is a memfd the daemon makes and hands to QEMU
//! (`memory-backend-file,share=on` on `/proc/self/fd/N`): never a file on
//! persistent disk, freed with the VM, and readable by the daemon, so a
//! snapshot is the device state (`x-ignore-shared` leaves RAM out of the
//! migration stream; tens of KiB, written in milliseconds) plus a sparse
//! copy of that memfd into the snapshot dir ([`GuestRam`]). A restore
//! maps the snapshot's RAM privately (`share=off`): the guest reads the
//! snapshot's pages, its writes go to copy-on-write pages of its own, and
//! nothing is copied per restore. QEMU 7.2 opens a RAM file read-write even
//! for a private mapping, and the pristine snapshot must not be writable by
//! any VMM, so QEMU gets it as a sealed memfd ([`SnapshotMemory`]): loaded
//! once per snapshot, shared by every VM restored from it, and immutable
//! (`F_SEAL_WRITE`, `F_SEAL_SEAL`).
//!
//! Migration uses `fd:` URIs because `-sandbox spawn=deny` forbids `exec:`.

use crate::sync::lock;
use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::cgroup;
use super::jailer::{validate_id, Pidfd};
use super::launch::{self, Launch, Launcher, VmmProcess};
use super::qmp::Qmp;
use super::snapshot::{self, Manifest};
use super::{Backend, PreparedRestore, Result, Vm, VmConfig, VmError};
use crate::harden::spawner::{Bind, Jail, ProcLimits};

const NAME: &str = "qemu";

/// Snapshot file names inside a snapshot directory.
pub const SNAP_STATE_FILE: &str = "state";
pub const SNAP_MEM_FILE: &str = "memory";

/// Files in a VM's run dir.
pub const QMP_SOCK: &str = "qmp.sock";
pub const AGENT_SOCK: &str = "agent.sock";
pub const CONSOLE_LOG: &str = "console.log";
/// Where a jailed QEMU's root is mounted (in its own mount namespace; on
/// the host an empty directory).
pub const JAIL_ROOT: &str = "jail";

/// The agent prints this on the console once it listens.
pub const READY_MARKER: &[u8] = b"SANDBOX-AGENT READY";

/// Kernel command line before `cmdline_extra`.
// reboot=t: microvm has no i8042, so the keyboard-controller reboot
// Firecracker uses (reboot=k) would hang; a triple fault makes QEMU
// (-no-reboot) exit at once.
// pci=off: microvm has no PCI bus; probing for one costs a TCG boot ~50 ms.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=t panic=1 root=/dev/vda ro \
     rootfstype=erofs init=/sbin/sandbox-agent pci=off quiet";

/// Added under TCG only (under KVM the kernel has kvmclock and a TSC, and
/// neither cost exists):
/// - `noapictimer`: the kernel spends ~230 ms of a TCG boot (far more
///   under host load: it waits on jiffies) calibrating and then verifying
///   the local APIC timer, and the verification fails under TCG, leaving
///   the PIT as the tick. This goes straight to that end state.
/// - `lpj=`: with no TSC it can calibrate, the kernel times a delay loop
///   (~80 ms); a preset loops-per-jiffy (a value that loop measured here at
///   HZ=250; it varies 4x with host load anyway) skips it. It only scales
///   udelay(), which virtio devices do not rely on.
pub const TCG_CMDLINE: &str = "noapictimer lpj=163072";

/// Guest RAM as QEMU opens it: the memfd at [`MEM_FD`] (a booted VM's
/// own [`GuestRam`], or a restore's [`SnapshotMemory`]).
const MEM_PATH: &str = "/proc/self/fd/5";

/// Bytes of console output kept in memory for error messages.
const CONSOLE_TAIL: usize = 8 * 1024;

/// `console.log` grows to this, then becomes `console.log.1` (replacing
/// the one before) and a new `console.log` starts: a guest flooding its
/// serial port costs the host at most twice this on disk.
pub const CONSOLE_LOG_MAX: u64 = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// KVM if a probe boot under KVM works, else TCG.
    Auto,
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Auto => "auto",
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

impl std::str::FromStr for Accel {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Accel::Auto),
            "kvm" => Ok(Accel::Kvm),
            "tcg" => Ok(Accel::Tcg),
            _ => Err(format!("accel {s:?}: expected auto, kvm or tcg")),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Timeouts {
    /// VMM start to QMP answering; one ordinary QMP command.
    pub qmp: Duration,
    /// VMM start to the agent's READY line (TCG on a loaded host is slow).
    pub boot: Duration,
    /// Saving or loading the device state.
    pub migrate: Duration,
    /// Kill to exit.
    pub teardown: Duration,
    /// KVM probe boot: kernel start to its panic message.
    pub kvm_probe: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            qmp: Duration::from_secs(10),
            boot: Duration::from_secs(60),
            migrate: Duration::from_secs(60),
            teardown: Duration::from_secs(5),
            kvm_probe: Duration::from_secs(5),
        }
    }
}

#[derive(Debug, Clone)]
pub struct QemuConfig {
    /// `qemu-system-x86_64`, looked up in PATH when not absolute.
    pub binary: PathBuf,
    pub accel: Accel,
    pub timeouts: Timeouts,
    /// Where the `auto` probe result is remembered across restarts.
    pub accel_cache: Option<PathBuf>,
    /// How QEMU is started: the daemon's spawner, or directly (tools, tests).
    pub launcher: Arc<dyn Launcher>,
    /// cgroup directories (one per hierarchy, see `cgroup::Prepared`)
    /// under which each VM gets `<id>/` with its limits (empty: no per-VM
    /// cgroup).
    pub cgroup_parents: Vec<PathBuf>,
    /// The VMM's memory beyond guest RAM in its memory limit (`None`:
    /// [`cgroup::MEMORY_OVERHEAD_MIB`], plus [`cgroup::TCG_TB_MIB`] under
    /// TCG).
    pub mem_overhead_mib: Option<u64>,
    /// `io.max` lines of each VM's cgroup (see `cgroup::io_max_lines`).
    pub io_max: Vec<String>,
    /// A fixed `cpu.max` for every VM in place of one CPU per vCPU.
    pub cpu_max: Option<cgroup::CpuMax>,
    /// QEMU's RLIMIT_NOFILE (`None`: [`DEFAULT_NOFILE`]).
    pub nofile: Option<u64>,
}

impl std::fmt::Debug for dyn Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.kind())
    }
}

impl Default for QemuConfig {
    fn default() -> Self {
        QemuConfig {
            binary: PathBuf::from("qemu-system-x86_64"),
            accel: Accel::Auto,
            timeouts: Timeouts::default(),
            accel_cache: None,
            launcher: launch::direct(),
            cgroup_parents: Vec::new(),
            mem_overhead_mib: None,
            io_max: Vec::new(),
            cpu_max: None,
            nofile: None,
        }
    }
}

pub struct QemuBackend {
    cfg: QemuConfig,
    /// Sealed in-memory copies of snapshot RAM files, by path.
    snap_mem: Mutex<std::collections::HashMap<PathBuf, Arc<SnapshotMemory>>>,
    /// Resolved accelerator (never `Auto`), once known.
    accel: Mutex<Option<Accel>>,
    version: Mutex<Option<String>>,
    /// A kernel to probe KVM with when `vmm_version` is asked first.
    probe_kernel: Mutex<Option<PathBuf>>,
    /// What every jailed QEMU sees besides its VM's own files, once known.
    jail_base: Mutex<Option<Arc<Vec<Bind>>>>,
    /// Whether running unjailed was logged.
    unjailed_said: std::sync::Once,
}

fn io_err(what: String, source: io::Error) -> VmError {
    VmError::Io {
        backend: NAME,
        what,
        source,
    }
}

/// The probe result remembered in `QemuConfig::accel_cache`.
#[derive(Debug, Serialize, Deserialize)]
struct AccelCache {
    qemu_version: String,
    kernel: PathBuf,
    kvm_works: bool,
}

impl QemuBackend {
    /// What a VMM of `mem_mib` guest RAM may use beyond it (its memory
    /// limit's slack). Under TCG also the capped translation cache and
    /// once more the guest's RAM: measured, a fork bomb in a 512 MiB TCG
    /// guest reached 615 MiB anon (softmmu TLBs, code buffer, copied
    /// pages) beside 455 MiB of its RAM's shmem.
    fn mem_overhead(&self, accel: Accel, mem_mib: u32) -> u64 {
        self.cfg.mem_overhead_mib.unwrap_or(match accel {
            Accel::Kvm => cgroup::MEMORY_OVERHEAD_MIB,
            _ => cgroup::MEMORY_OVERHEAD_MIB + cgroup::TCG_TB_MIB + u64::from(mem_mib),
        })
    }

    pub fn new(cfg: QemuConfig) -> Self {
        let accel = match cfg.accel {
            Accel::Auto => None,
            a => Some(a),
        };
        QemuBackend {
            cfg,
            snap_mem: Mutex::new(std::collections::HashMap::new()),
            accel: Mutex::new(accel),
            version: Mutex::new(None),
            probe_kernel: Mutex::new(None),
            jail_base: Mutex::new(None),
            unjailed_said: std::sync::Once::new(),
        }
    }

    pub fn config(&self) -> &QemuConfig {
        &self.cfg
    }

    /// Kernel used for the KVM probe if `vmm_version` runs before any boot.
    pub fn set_probe_kernel(&self, kernel: &Path) {
        *lock(&self.probe_kernel) = Some(kernel.to_path_buf());
    }

    /// The accelerator VMs get: the configured one, or for `auto` the result
    /// of a probe boot of `kernel` under KVM (done once, then cached).
    pub fn resolve_accel(&self, kernel: Option<&Path>) -> Result<Accel> {
        let mut slot = lock(&self.accel);
        if let Some(a) = *slot {
            return Ok(a);
        }
        if !kvm_device_usable() {
            *slot = Some(Accel::Tcg);
            return Ok(Accel::Tcg);
        }
        let kernel = match kernel {
            Some(k) => k.to_path_buf(),
            None => lock(&self.probe_kernel).clone().ok_or_else(|| {
                VmError::Other(
                    "qemu: accel=auto needs a kernel to probe KVM with; boot once or call \
                     set_probe_kernel"
                        .into(),
                )
            })?,
        };
        let version = self.qemu_version()?;
        if let Some(c) = self.read_accel_cache(&version, &kernel) {
            let a = if c { Accel::Kvm } else { Accel::Tcg };
            *slot = Some(a);
            return Ok(a);
        }
        let works = match self.probe_kvm(&kernel) {
            Ok(()) => true,
            Err(why) => {
                log::info!("qemu: KVM is not usable, using TCG: {why}");
                false
            }
        };
        self.write_accel_cache(&version, &kernel, works);
        let a = if works { Accel::Kvm } else { Accel::Tcg };
        *slot = Some(a);
        Ok(a)
    }

    fn read_accel_cache(&self, version: &str, kernel: &Path) -> Option<bool> {
        let path = self.cfg.accel_cache.as_ref()?;
        let c: AccelCache = serde_json::from_slice(&fs::read(path).ok()?).ok()?;
        (c.qemu_version == version && c.kernel == kernel).then_some(c.kvm_works)
    }

    fn write_accel_cache(&self, version: &str, kernel: &Path, works: bool) {
        let Some(path) = &self.cfg.accel_cache else {
            return;
        };
        let c = AccelCache {
            qemu_version: version.into(),
            kernel: kernel.into(),
            kvm_works: works,
        };
        if let Ok(bytes) = serde_json::to_vec(&c) {
            if let Some(d) = path.parent() {
                let _ = fs::create_dir_all(d);
            }
            if let Err(e) = fs::write(path, bytes) {
                log::warn!("qemu: cannot write accel cache {}: {e}", path.display());
            }
        }
    }

    /// [`probe_kvm`] through the configured launcher. Through the spawner
    /// the probe runs as the VMs' uid, which is the right question anyway
    /// (can a VM use /dev/kvm?).
    fn probe_kvm(&self, kernel: &Path) -> std::result::Result<(), String> {
        let timeout = self.cfg.timeouts.kvm_probe;
        if self.cfg.launcher.kind() == "direct" {
            return probe_kvm(&self.binary(), kernel, timeout);
        }
        let mut argv: Vec<OsString> = vec![self.binary().into_os_string()];
        argv.extend(PROBE_ARGS.iter().map(OsString::from));
        argv.push(kernel.as_os_str().to_owned());
        match self.cfg.launcher.run(&argv, Instant::now() + timeout) {
            Ok(out) => probe_verdict(&out.stdout, &out.stderr, out.code.map(|c| c.to_string())),
            Err(e) => Err(format!("a KVM guest did not reach its root mount: {e}")),
        }
    }

    fn binary(&self) -> PathBuf {
        find_in_path(&self.cfg.binary).unwrap_or_else(|| self.cfg.binary.clone())
    }

    /// First line of `qemu-system-x86_64 --version`.
    pub fn qemu_version(&self) -> Result<String> {
        let mut cached = lock(&self.version);
        if let Some(v) = cached.as_ref() {
            return Ok(v.clone());
        }
        let bin = self.binary();
        let out = self.cfg.launcher.run(
            &[bin.clone().into_os_string(), "--version".into()],
            Instant::now() + self.cfg.timeouts.qmp,
        )?;
        let text = String::from_utf8_lossy(&out.stdout);
        let v = text
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .filter(|_| out.code == Some(0))
            .ok_or_else(|| VmError::Api {
                backend: NAME,
                msg: format!(
                    "{} --version gave no version (exit code {:?}): {}",
                    bin.display(),
                    out.code,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            })?
            .to_string();
        *cached = Some(v.clone());
        Ok(v)
    }

    /// The host paths every jailed QEMU needs: its binary, its dynamic
    /// loader and the libraries it links (the loader's own trace, as `ldd`
    /// prints it), its modules (TCG is one in Debian's build), its
    /// firmware directories (`-L help`), the loader cache and
    /// the harmless devices. Found once, by running the binary.
    fn jail_base(&self) -> Result<Arc<Vec<Bind>>> {
        let mut slot = lock(&self.jail_base);
        if let Some(b) = slot.as_ref() {
            return Ok(b.clone());
        }
        let bin = self.binary();
        let deadline = Instant::now() + self.cfg.timeouts.qmp;
        let trace = self.cfg.launcher.run_env(
            &[bin.clone().into_os_string()],
            &[("LD_TRACE_LOADED_OBJECTS".into(), "1".into())],
            deadline,
        )?;
        let trace_text = String::from_utf8_lossy(&trace.stdout);
        if trace.code != Some(0) {
            return Err(VmError::Other(format!(
                "qemu jail: the library trace of {} failed (exit code {:?}): {}",
                bin.display(),
                trace.code,
                String::from_utf8_lossy(&trace.stderr).trim()
            )));
        }
        let mut paths = vec![bin.clone()];
        paths.extend(
            parse_ld_trace(&trace_text)
                .map_err(|e| VmError::Other(format!("qemu jail: {} links {e}", bin.display())))?,
        );
        let help = self.cfg.launcher.run(
            &[bin.clone().into_os_string(), "-L".into(), "help".into()],
            deadline,
        )?;
        let firmware = String::from_utf8_lossy(&help.stdout).into_owned();
        paths.extend(
            firmware
                .lines()
                .filter_map(|l| fs::canonicalize(l.trim()).ok())
                .filter(|p| p.is_dir()),
        );
        let canon = fs::canonicalize(&bin).unwrap_or_else(|_| bin.clone());
        if let Some(prefix) = canon.parent().and_then(Path::parent) {
            let triplet = format!("{}-linux-gnu", std::env::consts::ARCH);
            for d in [
                prefix.join("lib").join(triplet).join("qemu"),
                prefix.join("lib/qemu"),
                prefix.join("lib64/qemu"),
            ] {
                // Only the modules (the same dir names may hold helper
                // programs, some setuid root, that QEMU must not see).
                let Ok(rd) = fs::read_dir(&d) else { continue };
                paths.extend(
                    rd.flatten()
                        .map(|e| e.path())
                        .filter(|p| p.extension().is_some_and(|x| x == "so") && p.is_file()),
                );
            }
        }
        paths.push(PathBuf::from("/etc/ld.so.cache"));
        paths.extend(JAIL_DEVICES.iter().map(PathBuf::from));
        let binds: Vec<Bind> = paths
            .into_iter()
            .filter(|p| p.exists())
            .map(|p| Bind {
                path: p.display().to_string(),
                writable: false,
            })
            .collect();
        let binds = Arc::new(binds);
        log::info!(
            "qemu: VMMs run jailed (own mount, pid, network and IPC namespaces); their root holds {} host paths besides each VM's files",
            binds.len()
        );
        *slot = Some(binds.clone());
        Ok(binds)
    }

    /// The jail of one QEMU: [`Self::jail_base`] plus the VM's kernel (a
    /// boot only), root file system and run dir (the one writable path),
    /// and /dev/kvm under KVM. `None` when the launcher cannot jail.
    fn jail_for(&self, cfg: &VmConfig, accel: Accel, incoming: bool) -> Result<Option<Jail>> {
        if !self.cfg.launcher.can_jail() {
            self.unjailed_said.call_once(|| {
                log::info!(
                    "qemu: VMMs run in the host's mount, pid and network namespaces: the {} launcher cannot jail them (only the spawner of a daemon running as root can)",
                    self.cfg.launcher.kind()
                )
            });
            return Ok(None);
        }
        let mut binds: Vec<Bind> = self.jail_base()?.as_ref().clone();
        let ro = |p: &Path| Bind {
            path: p.display().to_string(),
            writable: false,
        };
        if !incoming {
            binds.push(ro(&cfg.kernel));
        }
        binds.push(ro(&cfg.rootfs));
        if accel == Accel::Kvm {
            binds.push(ro(Path::new("/dev/kvm")));
        }
        binds.push(Bind {
            path: cfg.run_dir.display().to_string(),
            writable: true,
        });
        let root = cfg.run_dir.join(JAIL_ROOT);
        fs::DirBuilder::new()
            .mode(0o755)
            .create(&root)
            .map_err(|e| io_err(format!("create jail mount point {}", root.display()), e))?;
        Ok(Some(Jail {
            root: root.display().to_string(),
            binds: without_overlaps(binds),
            proc: true,
        }))
    }

    /// The sealed memfd holding the snapshot RAM file `path` (`len` bytes),
    /// made on first use and reused while the file is unchanged (a rebuilt
    /// snapshot is a new file: its first restore loads it again).
    fn snapshot_memory(&self, path: &Path, len: u64) -> Result<Arc<SnapshotMemory>> {
        let bad = |problem: String| VmError::BadFile {
            path: path.to_path_buf(),
            problem,
            fix: "rebuild the snapshot: agent-sandbox snapshot create --template <T>".into(),
        };
        let m = fs::metadata(path).map_err(|e| bad(format!("cannot stat snapshot memory: {e}")))?;
        if m.len() != len {
            return Err(bad(format!(
                "snapshot memory is {} bytes, the VM has {len}",
                m.len()
            )));
        }
        let id = (m.dev(), m.ino(), m.len(), m.mtime(), m.mtime_nsec());
        // Held while loading: concurrent first restores load it once.
        let mut cache = lock(&self.snap_mem);
        if let Some(s) = cache.get(path) {
            if s.id == id {
                return Ok(s.clone());
            }
        }
        let t = Instant::now();
        let s = Arc::new(SnapshotMemory::load(path, len, id)?);
        log::info!(
            "qemu: loaded snapshot memory {} ({} MiB of data) in {} ms",
            path.display(),
            s.data_bytes >> 20,
            t.elapsed().as_millis()
        );
        cache.insert(path.to_path_buf(), s.clone());
        Ok(s)
    }

    /// Everything a run dir needs, or an error naming what is wrong.
    fn prepare_run_dir(cfg: &VmConfig) -> Result<()> {
        let dir = &cfg.run_dir;
        match fs::read_dir(dir) {
            Ok(mut it) => {
                if it.next().is_some() {
                    return Err(VmError::BadFile {
                        path: dir.clone(),
                        problem: "run dir is not empty (left over from an earlier VM?)".into(),
                        fix: "remove it or use a fresh run dir".into(),
                    });
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir)
                    .map_err(|e| io_err(format!("create run dir {}", dir.display()), e))?;
            }
            Err(e) => return Err(io_err(format!("read run dir {}", dir.display()), e)),
        }
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| io_err(format!("chmod {}", dir.display()), e))?;
        chown(dir, cfg.uid, cfg.gid)
    }

    /// [`Backend::restore`], keeping the concrete type (benchmarks and
    /// diagnostics use its QMP).
    pub fn restore_vm(&self, cfg: &VmConfig, snapshot_dir: &Path) -> Result<QemuVm> {
        self.prepare_restore_vm(cfg, snapshot_dir)?.finish_vm()
    }

    /// [`Backend::prepare_restore`], keeping the concrete type: QEMU
    /// started with `-incoming defer`, the snapshot's state and RAM handed
    /// over as fds, QMP connected.
    pub fn prepare_restore_vm(&self, cfg: &VmConfig, snapshot_dir: &Path) -> Result<QemuPrepared> {
        let version = self.vmm_version_for(&cfg.kernel)?;
        snapshot::check_fresh(snapshot_dir, &snapshot::Inputs::of(NAME, &version, cfg))?;
        let state = snapshot_dir.join(SNAP_STATE_FILE);
        let mem = snapshot_dir.join(SNAP_MEM_FILE);
        let vm = self.launch(cfg, Some((&state, &mem)))?;
        Ok(QemuPrepared {
            vm,
            state_path: state,
        })
    }

    fn launch(&self, cfg: &VmConfig, incoming: Option<(&Path, &Path)>) -> Result<QemuVm> {
        validate_id(&cfg.id)?;
        check_input(&cfg.kernel, "kernel", cfg)?;
        check_input(&cfg.rootfs, "rootfs", cfg)?;
        if cfg.vcpus == 0 || cfg.mem_mib < 64 {
            return Err(VmError::Other(format!(
                "VM {}: {} vCPUs / {} MiB is not a VM",
                cfg.id, cfg.vcpus, cfg.mem_mib
            )));
        }
        let accel = self.resolve_accel(Some(&cfg.kernel))?;
        let version = self.vmm_version_for(&cfg.kernel)?;
        // Open the TAP before creating anything, so a failure leaves nothing.
        let tap = match &cfg.net {
            Some(n) => {
                validate_mac(&n.guest_mac)?;
                Some(open_tap(&n.netns, &n.tap)?)
            }
            None => None,
        };
        Self::prepare_run_dir(cfg)?;
        let mut vm = QemuVm {
            id: cfg.id.clone(),
            cfg: cfg.clone(),
            child: None,
            pidfd: None,
            cgroups: Vec::new(),
            console: Arc::new(Console::default()),
            qmp: None,
            timeouts: self.cfg.timeouts.clone(),
            vmm_version: version,
            destroyed: false,
            ram: None,
            saved: false,
            restored: incoming.is_some(),
            accel,
        };
        // From here on, dropping `vm` on error removes everything.
        let (state, snap_mem, ram) = match incoming {
            Some((state, snap_mem)) => {
                let f = fs::File::open(state).map_err(|e| VmError::BadFile {
                    path: state.to_path_buf(),
                    problem: format!("cannot open snapshot state: {e}"),
                    fix: "rebuild the snapshot: agent-sandbox snapshot create --template <T>"
                        .into(),
                })?;
                let m = self.snapshot_memory(snap_mem, cfg.mem_mib as u64 * 1024 * 1024)?;
                (Some(f), Some(m), None)
            }
            None => (None, None, Some(GuestRam::new(cfg.mem_mib)?)),
        };
        let spec = ArgvSpec {
            accel,
            tap_fd: tap.as_ref().map(|_| TAP_FD),
            incoming: state.is_some(),
        };
        let argv = build_argv(cfg, &spec);
        let mut pass: Vec<(BorrowedFd<'_>, RawFd)> = Vec::new();
        if let Some(t) = &tap {
            pass.push((t.as_fd(), TAP_FD));
        }
        if let Some(s) = &state {
            pass.push((s.as_fd(), STATE_FD));
        }
        if let Some(m) = &snap_mem {
            pass.push((m.fd.as_fd(), MEM_FD));
        }
        if let Some(r) = &ram {
            pass.push((r.fd.as_fd(), MEM_FD));
        }
        if !self.cfg.cgroup_parents.is_empty() {
            let limits = cgroup::Limits {
                io_max: self.cfg.io_max.clone(),
                ..cgroup::Limits::for_vm(
                    cfg.vcpus,
                    cfg.mem_mib,
                    self.mem_overhead(accel, cfg.mem_mib),
                )
                .with_cpu_max(self.cfg.cpu_max)
            };
            vm.cgroups = cgroup::create(&self.cfg.cgroup_parents, &cfg.id, &limits)?;
        }
        let jail = self.jail_for(cfg, accel, state.is_some())?;
        vm.spawn(
            self.cfg.launcher.as_ref(),
            &self.binary(),
            &argv,
            &pass,
            jail,
            qemu_limits(cfg.mem_mib, self.cfg.nofile),
        )?;
        drop(pass);
        drop(tap);
        vm.ram = ram;
        let deadline = Instant::now() + self.cfg.timeouts.qmp;
        let qmp = {
            let pidfd = vm.pidfd.as_ref();
            Qmp::connect(&cfg.run_dir.join(QMP_SOCK), deadline, &|| {
                pidfd.is_some_and(Pidfd::is_alive)
            })
        };
        match qmp {
            Ok(q) => vm.qmp = Some(q),
            Err(e) => return Err(vm.explain(e, "starting")),
        }
        if state.is_some() {
            // RAM stays out of the stream (it is the mapped snapshot file).
            // Set now, so the state load (`QemuPrepared::finish_vm`) is only
            // migrate-incoming and `cont`.
            let t = self.cfg.timeouts.qmp;
            let caps =
                json!({ "capabilities": [{ "capability": "x-ignore-shared", "state": true }] });
            let set = vm
                .qmp()
                .and_then(|q| q.execute("migrate-set-capabilities", Some(caps), t));
            if let Err(e) = set {
                return Err(vm.explain(e, "setting up the snapshot load"));
            }
        }
        Ok(vm)
    }
}

/// A QEMU waiting in `-incoming defer` for [`QemuPrepared::finish_vm`]
/// ([`Backend::prepare_restore`]). It already holds the snapshot's state
/// file (fd [`STATE_FD`]) and RAM (fd [`MEM_FD`]).
pub struct QemuPrepared {
    vm: QemuVm,
    state_path: PathBuf,
}

impl QemuPrepared {
    /// Load the state and run the guest: migrate-incoming from the fd QEMU
    /// was started with, then `cont`.
    pub fn finish_vm(mut self) -> Result<QemuVm> {
        if let Err(e) = self.vm.load_state(STATE_FD) {
            let why = self.vm.explain(e, "loading the snapshot");
            return Err(VmError::BadFile {
                path: self.state_path,
                problem: format!("snapshot state does not load: {why}"),
                fix: "rebuild the snapshot: agent-sandbox snapshot create --template <T>".into(),
            });
        }
        Ok(self.vm)
    }
}

impl PreparedRestore for QemuPrepared {
    fn id(&self) -> &str {
        &self.vm.id
    }

    fn pid(&self) -> Option<i32> {
        Vm::pid(&self.vm)
    }

    fn alive(&self) -> bool {
        self.vm.alive()
    }

    fn finish(self: Box<Self>) -> Result<Box<dyn Vm>> {
        Ok(Box::new(self.finish_vm()?))
    }

    fn destroy(&mut self) -> Result<()> {
        Vm::destroy(&mut self.vm)
    }
}

impl Backend for QemuBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    /// QEMU's version, the accelerator and the machine: a snapshot made
    /// under TCG (`-cpu max`) does not restore under KVM (`-cpu host`) and
    /// vice versa, and one booted with another fixed command line holds
    /// a guest set up differently.
    fn vmm_version(&self) -> Result<String> {
        let v = self.qemu_version()?;
        let a = self.resolve_accel(None)?;
        Ok(version_string(&v, a))
    }

    fn vmm_version_for(&self, kernel: &Path) -> Result<String> {
        let v = self.qemu_version()?;
        let a = self.resolve_accel(Some(kernel))?;
        Ok(version_string(&v, a))
    }

    fn boot(&self, cfg: &VmConfig) -> Result<Box<dyn Vm>> {
        let mut vm = self.launch(cfg, None)?;
        let deadline = Instant::now() + self.cfg.timeouts.boot;
        if let Err(e) = vm.wait_ready(deadline) {
            return Err(vm.explain(e, "booting"));
        }
        Ok(Box::new(vm))
    }

    fn restore(&self, cfg: &VmConfig, snapshot_dir: &Path) -> Result<Box<dyn Vm>> {
        Ok(Box::new(self.restore_vm(cfg, snapshot_dir)?))
    }

    fn prepare_restore(
        &self,
        cfg: &VmConfig,
        snapshot_dir: &Path,
    ) -> Result<Box<dyn PreparedRestore>> {
        Ok(Box::new(self.prepare_restore_vm(cfg, snapshot_dir)?))
    }
}

fn version_string(qemu: &str, accel: Accel) -> String {
    format!(
        "{qemu}; accel={}; {}",
        accel.as_str(),
        snapshot::machine_tag(&[cpu_model(accel), &fixed_cmdline(accel), NET_DEVICE])
    )
}

fn cpu_model(accel: Accel) -> &'static str {
    match accel {
        Accel::Kvm => "host",
        _ => "max",
    }
}

struct ArgvSpec {
    accel: Accel,
    tap_fd: Option<RawFd>,
    incoming: bool,
}

/// QEMU's file-size and open-file limits (as the jailer gives Firecracker):
/// QEMU writes no RAM file (its RAM is a memfd the daemon sized) and the
/// device state of a snapshot is small (RAM stays out of it); the bound
/// is the guest's RAM size plus slack. `nofile`: the operator's open-file
/// limit, else [`DEFAULT_NOFILE`].
pub fn qemu_limits(mem_mib: u32, nofile: Option<u64>) -> ProcLimits {
    ProcLimits {
        fsize: Some((u64::from(mem_mib) << 20) + (64 << 20)),
        nofile: Some(nofile.unwrap_or(DEFAULT_NOFILE)),
    }
}

/// A VMM's open files: its disks, TAP, sockets, eventfds per queue.
pub const DEFAULT_NOFILE: u64 = 1024;

/// QEMU option values are comma-separated: a literal comma is doubled.
fn opt_path(p: &Path) -> String {
    p.display().to_string().replace(',', ",,")
}

/// The guest NIC. No guest announce: after a restore QEMU would ask the
/// guest to send gratuitous ARPs (and notify every netlink listener) for a
/// link whose peer is a fresh TAP that has no stale entry to correct; QEMU
/// announces from the host side instead. Part of the machine tag: a
/// snapshot's device features must match the restoring command line.
const NET_DEVICE: &str = "virtio-net-device,guest_announce=off";

/// The kernel command line before `cmdline_extra`.
fn fixed_cmdline(accel: Accel) -> String {
    let mut c = DEFAULT_CMDLINE.to_string();
    if accel != Accel::Kvm {
        c.push(' ');
        c.push_str(TCG_CMDLINE);
    }
    c
}

pub fn cmdline(cfg: &VmConfig, accel: Accel) -> String {
    let mut c = fixed_cmdline(accel);
    let extra = cfg.cmdline_extra.trim();
    if !extra.is_empty() {
        c.push(' ');
        c.push_str(extra);
    }
    c
}

fn build_argv(cfg: &VmConfig, spec: &ArgvSpec) -> Vec<OsString> {
    let run = &cfg.run_dir;
    let mut a: Vec<String> = vec![
        "-name".into(),
        format!("agent-sandbox-{}", cfg.id),
        // Devices on the kernel command line need acpi=off (see MEASURED.md).
        "-M".into(),
        "microvm,acpi=off,memory-backend=mem".into(),
        "-nodefaults".into(),
        "-no-user-config".into(),
        "-nographic".into(),
        "-no-reboot".into(),
    ];
    match spec.accel {
        Accel::Kvm => a.extend(["-accel".into(), "kvm".into()]),
        _ => a.extend([
            "-accel".into(),
            format!("tcg,tb-size={}", cgroup::TCG_TB_MIB),
        ]),
    }
    a.extend(["-cpu".into(), cpu_model(spec.accel).into()]);
    a.extend([
        "-smp".into(),
        cfg.vcpus.to_string(),
        "-m".into(),
        format!("{}M", cfg.mem_mib),
        "-object".into(),
        format!(
            "memory-backend-file,id=mem,size={}M,mem-path={},share={}",
            cfg.mem_mib,
            MEM_PATH,
            // A restore maps the snapshot RAM privately (module docs).
            if spec.incoming { "off" } else { "on" }
        ),
        "-chardev".into(),
        "stdio,id=con,signal=off".into(),
        "-serial".into(),
        "chardev:con".into(),
        "-drive".into(),
        format!(
            "id=root,file={},format=raw,if=none,readonly=on",
            opt_path(&cfg.rootfs)
        ),
        "-device".into(),
        "virtio-blk-device,drive=root".into(),
        "-device".into(),
        "virtio-serial-device".into(),
        "-chardev".into(),
        format!(
            "socket,id=agent,path={},server=on,wait=off",
            opt_path(&run.join(AGENT_SOCK))
        ),
        "-device".into(),
        "virtserialport,chardev=agent,name=agent".into(),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", opt_path(&run.join(QMP_SOCK))),
        "-sandbox".into(),
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny".into(),
    ]);
    // A restore needs no kernel: the running one is in the snapshot RAM.
    // Without it QEMU skips reading and staging the ~20 MiB vmlinux
    // (~10 ms of a TCG restore here).
    if !spec.incoming {
        a.extend([
            "-kernel".into(),
            cfg.kernel.display().to_string(),
            "-append".into(),
            cmdline(cfg, spec.accel),
        ]);
    }
    if let (Some(fd), Some(net)) = (spec.tap_fd, &cfg.net) {
        a.extend([
            "-netdev".into(),
            // QEMU takes the virtio-net header from the fd's IFF_VNET_HDR
            // (it refuses `vnet_hdr=` together with `fd=`).
            format!("tap,id=n0,fd={fd}"),
            "-device".into(),
            format!("{NET_DEVICE},netdev=n0,mac={}", net.guest_mac),
        ]);
    }
    if spec.incoming {
        // The state fd is handed over by number in `migrate-incoming`, after
        // x-ignore-shared is switched on (QEMU 7.2 has no property for it).
        a.extend(["-incoming".into(), "defer".into()]);
    }
    a.into_iter().map(OsString::from).collect()
}

fn validate_mac(mac: &str) -> Result<()> {
    let parts: Vec<&str> = mac.split(':').collect();
    let ok = parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.bytes().all(|b| b.is_ascii_hexdigit()));
    if ok {
        Ok(())
    } else {
        Err(VmError::Other(format!(
            "guest MAC {mac:?} is not six colon-separated hex bytes"
        )))
    }
}

fn chown(path: &Path, uid: u32, gid: u32) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(()); // unprivileged: the VMM runs as us and owns what we make
    }
    std::os::unix::fs::chown(path, Some(uid), Some(gid))
        .map_err(|e| io_err(format!("chown {uid}:{gid} {}", path.display()), e))
}

/// A file the VMM opens itself must exist and be readable by its uid/gid.
fn check_input(path: &Path, what: &str, cfg: &VmConfig) -> Result<()> {
    let fix = "agent-sandbox image build";
    let m = fs::metadata(path).map_err(|e| VmError::BadFile {
        path: path.to_path_buf(),
        problem: format!("{what}: {e}"),
        fix: fix.into(),
    })?;
    if !m.is_file() {
        return Err(VmError::BadFile {
            path: path.to_path_buf(),
            problem: format!("{what} is not a regular file"),
            fix: fix.into(),
        });
    }
    if m.len() == 0 {
        return Err(VmError::BadFile {
            path: path.to_path_buf(),
            problem: format!("{what} is empty"),
            fix: fix.into(),
        });
    }
    let mode = m.mode();
    let readable = mode & 0o004 != 0
        || (m.uid() == cfg.uid && mode & 0o400 != 0)
        || (m.gid() == cfg.gid && mode & 0o040 != 0);
    // SAFETY: geteuid has no preconditions.
    let as_root = unsafe { libc::geteuid() } == 0;
    if as_root && !readable {
        return Err(VmError::BadFile {
            path: path.to_path_buf(),
            problem: format!(
                "{what} is not readable by the VMM's uid {} / gid {}",
                cfg.uid, cfg.gid
            ),
            fix: format!("chmod o+r {}", path.display()),
        });
    }
    Ok(())
}

/// Devices every jailed QEMU gets (glib and QEMU read random bytes).
const JAIL_DEVICES: &[&str] = &["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"];

/// The paths in the dynamic loader's trace (`LD_TRACE_LOADED_OBJECTS=1`):
/// `name => /path (addr)` and the loader's own `/path (addr)`; the vDSO
/// has no path. A library not found is an error.
fn parse_ld_trace(text: &str) -> std::result::Result<Vec<PathBuf>, String> {
    let mut out = Vec::new();
    for l in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let target = match l.split_once("=>") {
            Some((name, rest)) => {
                let rest = rest.trim();
                if rest.starts_with("not found") {
                    return Err(format!("{} which is not found", name.trim()));
                }
                rest
            }
            None => l,
        };
        if let Some(p) = target
            .split_whitespace()
            .next()
            .filter(|p| p.starts_with('/'))
        {
            out.push(PathBuf::from(p));
        }
    }
    if out.is_empty() {
        return Err(format!("no library (loader trace: {text:?})"));
    }
    Ok(out)
}

/// `binds` without duplicates and without paths inside another bind
/// (visible through it already; the spawner refuses nested binds).
fn without_overlaps(mut binds: Vec<Bind>) -> Vec<Bind> {
    binds.sort_by(|a, b| a.path.cmp(&b.path));
    let mut out: Vec<Bind> = Vec::with_capacity(binds.len());
    for b in binds {
        if !out.iter().any(|o| Path::new(&b.path).starts_with(&o.path)) {
            out.push(b);
        }
    }
    out
}

/// `bin` itself when it has a directory part, else its first PATH match.
pub fn find_in_path(bin: &Path) -> Option<PathBuf> {
    if bin.components().count() > 1 {
        return Some(bin.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(bin))
        .find(|p| p.is_file())
}

/// `/dev/kvm` opens and answers KVM_GET_API_VERSION. Necessary, not
/// sufficient: nested setups exist where it does and guests still hang.
///
/// Answered once per process (at daemon start, on the main thread): API
/// threads that list templates end up here, and their seccomp filter does
/// not allow KVM ioctls.
pub fn kvm_device_usable() -> bool {
    static USABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *USABLE.get_or_init(kvm_device_answers)
}

fn kvm_device_answers() -> bool {
    let Ok(f) = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    else {
        return false;
    };
    use crate::harden::seccomp::KVM_GET_API_VERSION;
    // SAFETY: ioctl without arguments on an fd we own.
    let v = unsafe { libc::ioctl(f.as_raw_fd(), KVM_GET_API_VERSION, 0) };
    v == 12
}

/// Boot `kernel` under KVM without a root disk: a kernel that gets as far
/// as panicking over the missing root has run its whole early boot (CPU,
/// timers, interrupts) under this KVM. Anything else within `timeout` means
/// KVM does not work here.
// Every QEMU dies with whoever started it (`launch::die_with_parent`): on
// the direct path the thread that owns it for its whole life (a session's
// worker, the warm pool, a snapshot build, the KVM probe); through the
// spawner the spawner, which dies with the daemon. So a killed daemon
// cannot leave VMs behind, including the probe and snapshot-build VMs the
// start-up sweep does not know about.
const PROBE_ARGS: &[&str] = &[
    "-M",
    "microvm,acpi=off",
    "-accel",
    "kvm",
    "-cpu",
    "host",
    "-m",
    "128M",
    "-nodefaults",
    "-no-user-config",
    "-nographic",
    "-no-reboot",
    "-serial",
    "stdio",
    "-append",
    "console=ttyS0 panic=-1 loglevel=4",
    "-kernel",
];

fn probe_verdict(
    console: &[u8],
    stderr: &[u8],
    status: Option<String>,
) -> std::result::Result<(), String> {
    let text = String::from_utf8_lossy(console);
    if text.contains("Kernel panic") || text.contains("VFS: Unable to mount root") {
        return Ok(());
    }
    Err(match status {
        None => "a KVM guest did not reach its root mount in time".to_string(),
        Some(st) => format!(
            "qemu -accel kvm exited ({st}): {}",
            String::from_utf8_lossy(stderr).trim()
        ),
    })
}

pub fn probe_kvm(qemu: &Path, kernel: &Path, timeout: Duration) -> std::result::Result<(), String> {
    let mut cmd = Command::new(qemu);
    cmd.args(PROBE_ARGS)
        .arg(kernel)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the closure runs in the forked child before exec and only
    // makes async-signal-safe syscalls (prctl, getppid); it allocates nothing.
    unsafe { cmd.pre_exec(move || launch::die_with_parent(parent)) };
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", qemu.display()))?;
    let pid = child.id() as i32;
    let mut out = child.stdout.take();
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(o) = out.as_mut() {
            let _ = o.take(1 << 20).read_to_end(&mut buf);
        }
        buf
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                // SAFETY: signalling the process group of our own child.
                unsafe { libc::kill(-pid, libc::SIGKILL) };
                let _ = child.wait();
                break None;
            }
        }
    };
    let console = reader.join().unwrap_or_default();
    let text = String::from_utf8_lossy(&console);
    if text.contains("Kernel panic") || text.contains("VFS: Unable to mount root") {
        return Ok(());
    }
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    Err(match status {
        None => format!(
            "a KVM guest did not reach its root mount within {} ms",
            timeout.as_millis()
        ),
        Some(st) => format!("qemu -accel kvm exited ({st}): {}", err.trim()),
    })
}

/// Open `tap` inside the network namespace `netns` (a thread enters the
/// namespace, so the rest of the process never does) and return the fd to
/// hand to QEMU, so QEMU needs neither /dev/net/tun nor the namespace.
pub fn open_tap(netns: &Path, tap: &str) -> Result<OwnedFd> {
    if tap.is_empty() || tap.len() >= libc::IFNAMSIZ || tap.contains('/') || tap.contains('\0') {
        return Err(VmError::Other(format!("bad TAP name {tap:?}")));
    }
    let ns = fs::File::open(netns).map_err(|e| VmError::BadFile {
        path: netns.to_path_buf(),
        problem: format!("cannot open network namespace: {e}"),
        fix: "create the session's network namespace first".into(),
    })?;
    let name = tap.to_string();
    let handle = std::thread::Builder::new()
        .name("tap-open".into())
        .spawn(move || -> io::Result<OwnedFd> {
            // SAFETY: setns on a namespace fd affects only this thread,
            // which ends right after.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            let tun = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open("/dev/net/tun")?;
            // struct ifreq: 16 bytes name, then a short of flags (padded).
            let mut ifr = [0u8; 40];
            ifr[..name.len()].copy_from_slice(name.as_bytes());
            let flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as u16;
            ifr[16..18].copy_from_slice(&flags.to_ne_bytes());
            // SAFETY: TUNSETIFF reads and writes a struct ifreq we own.
            if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, ifr.as_mut_ptr()) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(OwnedFd::from(tun))
        })
        .map_err(|e| io_err("spawn TAP opener thread".into(), e))?;
    handle
        .join()
        .map_err(|_| VmError::Other("TAP opener thread panicked".into()))?
        .map_err(|e| {
            io_err(
                format!("open TAP {tap} in network namespace {}", netns.display()),
                e,
            )
        })
}

/// A booted VM's RAM: a memfd of the daemon's, sized to the guest's RAM
/// and sealed against resizing, that QEMU maps shared. Its pages live in
/// memory (charged to the VM's cgroup as QEMU touches them), never on a
/// persistent disk, and go when the last holder closes it.
pub struct GuestRam {
    fd: OwnedFd,
}

impl GuestRam {
    pub fn new(mem_mib: u32) -> Result<GuestRam> {
        // SAFETY: memfd_create with a NUL-terminated name; the fd is ours.
        let fd = unsafe {
            libc::memfd_create(
                c"agent-sandbox-ram".as_ptr(),
                libc::MFD_ALLOW_SEALING | libc::MFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io_err(
                "memfd_create for guest RAM".into(),
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: a new fd nobody else owns.
        let mem = unsafe { fs::File::from_raw_fd(fd) };
        mem.set_len(u64::from(mem_mib) << 20)
            .map_err(|e| io_err(format!("size the guest RAM memfd to {mem_mib} MiB"), e))?;
        // A compromised QEMU can reopen it through /proc/self/fd: it must
        // not grow it past the guest's size (or shrink it under the daemon).
        let seals = libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on our own fd.
        if unsafe { libc::fcntl(mem.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
            return Err(io_err(
                "seal the guest RAM memfd".into(),
                io::Error::last_os_error(),
            ));
        }
        Ok(GuestRam { fd: mem.into() })
    }

    /// Copies the RAM's data into a new 0600 file `dst` of the same size,
    /// keeping holes (most of a fresh guest's RAM was never touched).
    fn save(self, dst: &Path, mem_mib: u32) -> Result<()> {
        let len = u64::from(mem_mib) << 20;
        let d = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dst)
            .map_err(|e| io_err(format!("create {}", dst.display()), e))?;
        d.set_len(len)
            .map_err(|e| io_err(format!("size {}", dst.display()), e))?;
        let src = fs::File::from(self.fd);
        copy_extents(&src, &d, len, Path::new("guest RAM memfd"), dst).map(|_| ())
    }
}

/// A snapshot's RAM in a sealed memfd: QEMU maps it privately (reads share
/// its pages, writes are copy-on-write in the VM's own memory). The seals
/// make it immutable for every holder, including a compromised VMM that
/// reopens it read-write through `/proc/self/fd`: no write, no resize, no
/// shared writable mapping, no seal removed.
pub struct SnapshotMemory {
    fd: OwnedFd,
    /// (dev, inode, size, mtime s, mtime ns) of the file it was loaded from.
    id: (u64, u64, u64, i64, i64),
    data_bytes: u64,
}

impl SnapshotMemory {
    /// `path` must be `len` bytes long (checked by the caller).
    fn load(path: &Path, len: u64, id: (u64, u64, u64, i64, i64)) -> Result<SnapshotMemory> {
        let bad = |problem: String| VmError::BadFile {
            path: path.to_path_buf(),
            problem,
            fix: "rebuild the snapshot: agent-sandbox snapshot create --template <T>".into(),
        };
        let src =
            fs::File::open(path).map_err(|e| bad(format!("cannot open snapshot memory: {e}")))?;
        // SAFETY: memfd_create with a NUL-terminated name; the fd is ours.
        let fd = unsafe {
            libc::memfd_create(
                c"agent-sandbox-snapshot-ram".as_ptr(),
                libc::MFD_ALLOW_SEALING | libc::MFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io_err(
                format!("memfd_create for {}", path.display()),
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: a new fd nobody else owns.
        let mem = unsafe { fs::File::from_raw_fd(fd) };
        mem.set_len(len)
            .map_err(|e| io_err(format!("size the memfd for {}", path.display()), e))?;
        let data_bytes = copy_extents(&src, &mem, len, path, Path::new("memfd"))?;
        let seals =
            libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on our own fd.
        if unsafe { libc::fcntl(mem.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
            return Err(io_err(
                format!("seal the memfd for {}", path.display()),
                io::Error::last_os_error(),
            ));
        }
        Ok(SnapshotMemory {
            fd: mem.into(),
            id,
            data_bytes,
        })
    }
}

/// Copies the data extents of `s` to the same offsets of `d`; returns the
/// bytes copied.
fn copy_extents(s: &fs::File, d: &fs::File, len: u64, src: &Path, dst: &Path) -> Result<u64> {
    let bad = |problem: String| VmError::BadFile {
        path: src.to_path_buf(),
        problem,
        fix: "rebuild the snapshot: agent-sandbox snapshot create --template <T>".into(),
    };
    let (sfd, dfd) = (s.as_raw_fd(), d.as_raw_fd());
    let mut off: i64 = 0;
    let mut copied: u64 = 0;
    while (off as u64) < len {
        // SAFETY: lseek on our own fd.
        let data = unsafe { libc::lseek(sfd, off, libc::SEEK_DATA) };
        if data < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // only a hole is left
            }
            return Err(io_err(format!("SEEK_DATA in {}", src.display()), e));
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(sfd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io_err(
                format!("SEEK_HOLE in {}", src.display()),
                io::Error::last_os_error(),
            ));
        }
        let mut so = data;
        let mut doff = data;
        while so < hole {
            // SAFETY: copy_file_range between two fds we own with offsets
            // we own.
            let n = unsafe {
                libc::copy_file_range(sfd, &mut so, dfd, &mut doff, (hole - so) as usize, 0)
            };
            let n = if n < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EXDEV) {
                // copy_file_range does not cross file systems (into a
                // memfd, for one): sendfile writes at the file position.
                // SAFETY: lseek/sendfile on our own fds and offsets.
                unsafe {
                    if libc::lseek(dfd, doff, libc::SEEK_SET) < 0 {
                        -1
                    } else {
                        let n = libc::sendfile(dfd, sfd, &mut so, (hole - so) as usize);
                        if n > 0 {
                            doff += n as i64;
                        }
                        n
                    }
                }
            } else {
                n
            };
            if n < 0 {
                return Err(io_err(
                    format!("copy {} to {}", src.display(), dst.display()),
                    io::Error::last_os_error(),
                ));
            }
            if n == 0 {
                return Err(bad("snapshot memory shrank while being copied".into()));
            }
            copied += n as u64;
        }
        off = hole;
    }
    Ok(copied)
}

/// Console output of one VM: appended to `console.log` in the run dir, the
/// tail kept in memory for error messages, and the READY line noticed.
#[derive(Default)]
struct Console {
    state: Mutex<ConsoleState>,
    cv: Condvar,
}

#[derive(Default)]
struct ConsoleState {
    tail: VecDeque<u8>,
    ready: bool,
    /// The VMM closed its stdout/stderr: it has exited.
    eof: bool,
}

/// The console's file in the run dir, bounded by rotation
/// ([`CONSOLE_LOG_MAX`]).
struct ConsoleLog {
    path: PathBuf,
    file: fs::File,
    size: u64,
}

impl ConsoleLog {
    fn open(path: PathBuf) -> io::Result<ConsoleLog> {
        let file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&path)?;
        let size = file.metadata()?.len();
        Ok(ConsoleLog { path, file, size })
    }

    /// Appends, rotating first when `chunk` would take the file past the
    /// cap. An error stops the logging (the in-memory tail goes on).
    fn write(&mut self, chunk: &[u8]) -> io::Result<()> {
        if self.size > 0 && self.size + chunk.len() as u64 > CONSOLE_LOG_MAX {
            let mut old = self.path.clone().into_os_string();
            old.push(".1");
            fs::rename(&self.path, &old)?;
            *self = ConsoleLog::open(self.path.clone())?;
        }
        self.file.write_all(chunk)?;
        self.size += chunk.len() as u64;
        Ok(())
    }
}

impl Console {
    fn run(self: Arc<Self>, mut from: fs::File, mut log: Option<ConsoleLog>) {
        let mut buf = [0u8; 4096];
        let mut window: Vec<u8> = Vec::new();
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            };
            let chunk = &buf[..n];
            if let Some(l) = log.as_mut() {
                if let Err(e) = l.write(chunk) {
                    log::warn!("{}: {e}; console no longer logged", l.path.display());
                    log = None;
                }
            }
            let mut st = lock(&self.state);
            st.tail.extend(chunk);
            let over = st.tail.len().saturating_sub(CONSOLE_TAIL);
            st.tail.drain(..over);
            if !st.ready {
                // Look across read boundaries without rescanning everything.
                window.extend_from_slice(chunk);
                if window
                    .windows(READY_MARKER.len())
                    .any(|w| w == READY_MARKER)
                {
                    st.ready = true;
                    self.cv.notify_all();
                }
                let keep = window.len().saturating_sub(READY_MARKER.len());
                window.drain(..keep);
            }
        }
        lock(&self.state).eof = true;
        self.cv.notify_all();
    }

    fn tail(&self) -> String {
        let st = lock(&self.state);
        let bytes: Vec<u8> = st.tail.iter().copied().collect();
        drop(st);
        let text = String::from_utf8_lossy(&bytes);
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        let last = &lines[lines.len().saturating_sub(12)..];
        // A panic's reason is above its stack dump: keep it in view.
        let mut out: Vec<&str> = lines
            .iter()
            .filter(|l| l.contains("Kernel panic") && !last.contains(l))
            .take(2)
            .copied()
            .collect();
        out.extend_from_slice(last);
        // Guest output, bound for error messages and the daemon's log.
        out.iter()
            .map(|l| crate::agent::guestlog::untrusted(l).to_string())
            .collect::<Vec<_>>()
            .join(" | ")
    }

    /// Wait until the VMM's output has been read to its end.
    fn wait_eof(&self, deadline: Instant) {
        let mut st = lock(&self.state);
        while !st.eof {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            st = match self.cv.wait_timeout(st, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }

    /// Wait for READY; `Ok(false)` if the VMM exited first.
    fn wait_ready(&self, deadline: Instant) -> std::result::Result<bool, ()> {
        let mut st = lock(&self.state);
        loop {
            if st.ready {
                return Ok(true);
            }
            if st.eof {
                return Ok(false);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(());
            }
            st = match self.cv.wait_timeout(st, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

/// Where QEMU finds the fds it is handed: the TAP (`-netdev tap,fd=`), the
/// snapshot state (`migrate-incoming fd:`) and the snapshot RAM.
const TAP_FD: RawFd = 3;
const STATE_FD: RawFd = 4;
/// The snapshot RAM memfd of a restore ([`SNAP_MEM_PATH`]).
const MEM_FD: RawFd = 5;

pub struct QemuVm {
    id: String,
    cfg: VmConfig,
    child: Option<Box<dyn VmmProcess>>,
    pidfd: Option<Pidfd>,
    /// Its cgroups (`<cgroup parent>/<id>` in each hierarchy), removed at
    /// teardown.
    cgroups: Vec<PathBuf>,
    console: Arc<Console>,
    qmp: Option<Qmp>,
    timeouts: Timeouts,
    vmm_version: String,
    destroyed: bool,
    /// A booted VM's RAM (a restored one maps its snapshot's), kept to
    /// copy into a snapshot; dropped at teardown, which frees it.
    ram: Option<GuestRam>,
    /// Saved into a snapshot: it must never run again.
    saved: bool,
    /// Restored from a snapshot: its RAM is a private mapping, not a file.
    restored: bool,
    /// KVM or TCG (resolved, never `Auto`).
    accel: Accel,
}

impl QemuVm {
    fn spawn(
        &mut self,
        launcher: &dyn Launcher,
        bin: &Path,
        argv: &[OsString],
        pass: &[(BorrowedFd<'_>, RawFd)],
        jail: Option<Jail>,
        limits: ProcLimits,
    ) -> Result<()> {
        let (rd, wr) = pipe().map_err(|e| io_err("create console pipe".into(), e))?;
        let log_path = self.cfg.run_dir.join(CONSOLE_LOG);
        let log = ConsoleLog::open(log_path.clone())
            .map_err(|e| io_err(format!("create {}", log_path.display()), e))?;
        let mut full = vec![bin.as_os_str().to_owned()];
        full.extend(argv.iter().cloned());
        let l = Launch {
            argv: full,
            cwd: self.cfg.run_dir.clone(),
            uid: self.cfg.uid,
            gid: self.cfg.gid,
            cgroups: self.cgroups.clone(),
            limits,
            jail,
        };
        let mut fds: Vec<(BorrowedFd<'_>, RawFd)> = vec![(wr.as_fd(), 1), (wr.as_fd(), 2)];
        fds.extend_from_slice(pass);
        let child = launcher.start(&l, &fds)?;
        let pidfd = child.pidfd();
        self.pidfd = Some(Pidfd::from_owned(
            pidfd.pid(),
            pidfd
                .as_fd()
                .try_clone_to_owned()
                .map_err(|e| io_err(format!("dup pidfd of QEMU pid {}", pidfd.pid()), e))?,
        ));
        self.child = Some(child);
        drop(fds);
        drop(wr); // only QEMU holds the console's write end now
        let console = self.console.clone();
        std::thread::Builder::new()
            .name(format!("console-{}", self.id))
            .spawn(move || console.run(rd, Some(log)))
            .map_err(|e| io_err("spawn console reader".into(), e))?;
        Ok(())
    }

    fn alive(&self) -> bool {
        self.pidfd.as_ref().is_some_and(Pidfd::is_alive)
    }

    /// Turn a failure into one that says whether the VMM died, with the
    /// console tail, and tear everything down.
    fn explain(&mut self, e: VmError, when: &str) -> VmError {
        // Let the console reader catch the last words of a dying VMM.
        if let Some(p) = &self.pidfd {
            p.wait_exit(Instant::now() + Duration::from_millis(100));
        }
        let died = !self.alive();
        if died {
            self.console
                .wait_eof(Instant::now() + Duration::from_millis(500));
        }
        let status = if died {
            self.child.as_mut().and_then(|c| c.exit_status())
        } else {
            None
        };
        let tail = self.console.tail();
        let _ = self.destroy();
        let what = if died {
            // QEMU's own complaints ("invalid kernel header") omit the file.
            format!(
                "VM {}: QEMU exited while {when} ({}; kernel {}, rootfs {})",
                self.id,
                status.unwrap_or_else(|| "status unknown".into()),
                self.cfg.kernel.display(),
                self.cfg.rootfs.display()
            )
        } else {
            format!("VM {}: {e} while {when}", self.id)
        };
        VmError::Api {
            backend: NAME,
            msg: if tail.is_empty() {
                format!("{what}; no console output")
            } else {
                format!("{what}; console: {tail}")
            },
        }
    }

    fn wait_ready(&mut self, deadline: Instant) -> Result<()> {
        let start = Instant::now();
        match self.console.wait_ready(deadline) {
            Ok(true) => Ok(()),
            Ok(false) => Err(VmError::Api {
                backend: NAME,
                msg: "QEMU exited before the agent was ready".into(),
            }),
            Err(()) => Err(VmError::Timeout {
                backend: NAME,
                what: "the agent's READY line on the console".into(),
                ms: start.elapsed().as_millis() as u64,
            }),
        }
    }

    fn qmp(&mut self) -> Result<&mut Qmp> {
        self.qmp.as_mut().ok_or_else(|| VmError::Api {
            backend: NAME,
            msg: "no QMP connection".into(),
        })
    }

    /// Migrate the state in from `fd` and run (x-ignore-shared was set at
    /// launch).
    fn load_state(&mut self, fd: RawFd) -> Result<()> {
        let t = self.timeouts.qmp;
        let deadline = Instant::now() + self.timeouts.migrate;
        let q = self.qmp()?;
        q.execute(
            "migrate-incoming",
            Some(json!({ "uri": format!("fd:{fd}") })),
            t,
        )?;
        q.wait_migration(deadline)?;
        // The source was paused when saved, so the VM stays paused until told.
        q.execute("cont", None, t)?;
        Ok(())
    }

    /// Path of the agent socket (for tools and tests).
    pub fn agent_socket(&self) -> PathBuf {
        self.cfg.run_dir.join(AGENT_SOCK)
    }

    /// The last lines of the console.
    pub fn console_tail(&self) -> String {
        self.console.tail()
    }

    /// How many blocks TCG has translated in this QEMU (HMP `info jit`),
    /// or `None` under KVM. The work of a restored guest under TCG is
    /// mostly translation, so this counts it independently of host speed.
    pub fn translated_blocks(&mut self) -> Option<u64> {
        let out = self
            .qmp_execute(
                "human-monitor-command",
                Some(json!({ "command-line": "info jit" })),
            )
            .ok()?;
        parse_tb_count(out.as_str()?)
    }

    /// Run a QMP command (diagnostics, tests).
    pub fn qmp_execute(&mut self, cmd: &str, args: Option<Value>) -> Result<Value> {
        if self.saved && cmd == "cont" {
            return Err(VmError::Other(format!(
                "VM {}: its RAM now belongs to a snapshot; it cannot run again",
                self.id
            )));
        }
        let t = self.timeouts.qmp;
        self.qmp()?.execute(cmd, args, t)
    }
}

/// `TB count            24018` in `info jit`.
fn parse_tb_count(info_jit: &str) -> Option<u64> {
    info_jit
        .lines()
        .find_map(|l| l.trim().strip_prefix("TB count"))
        .and_then(|n| n.trim().parse().ok())
}

fn pipe() -> io::Result<(fs::File, fs::File)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two fds on success.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds are new and ours.
    Ok(unsafe { (fs::File::from_raw_fd(fds[0]), fs::File::from_raw_fd(fds[1])) })
}

impl Vm for QemuVm {
    fn close_note(&self) -> Option<crate::agent::CloseNote> {
        let (cgs, limit) = (
            self.cgroups.clone(),
            cgroup::memory_limit_of(&self.cgroups)?,
        );
        Some(Box::new(move || {
            (cgroup::oom_kills(&cgs) > 0).then(|| {
                format!(
                    "the VMM was killed by the host's OOM killer at its cgroup memory limit \
                     of {} MiB (guest RAM + vm_memory_overhead_mib)",
                    limit >> 20
                )
            })
        }))
    }

    fn id(&self) -> &str {
        &self.id
    }

    fn translates_guest_code(&self) -> bool {
        self.accel == Accel::Tcg
    }

    fn pid(&self) -> Option<i32> {
        self.pidfd.as_ref().filter(|p| p.is_alive()).map(Pidfd::pid)
    }

    fn connect_agent(&mut self, deadline: Instant) -> Result<UnixStream> {
        let started = Instant::now();
        let path = self.agent_socket();
        loop {
            match UnixStream::connect(&path) {
                // No reset round trip: virtio-serial cannot signal a new
                // connection to a guest that still holds an old one (a
                // restored guest does), so the protocol's hello itself
                // restarts the agent's connection, and the client skips
                // stale output by the hello's nonce.
                Ok(s) => return Ok(s),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                    ) =>
                {
                    if !self.alive() {
                        return Err(VmError::Api {
                            backend: NAME,
                            msg: format!(
                                "VM {}: QEMU is gone; console: {}",
                                self.id,
                                self.console.tail()
                            ),
                        });
                    }
                    if Instant::now() >= deadline {
                        return Err(VmError::Timeout {
                            backend: NAME,
                            what: format!("agent socket {}", path.display()),
                            ms: started.elapsed().as_millis() as u64,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(io_err(format!("connect {}", path.display()), e)),
            }
        }
    }

    fn snapshot(&mut self, dir: &Path) -> Result<()> {
        if self.saved {
            return Err(VmError::Other(format!(
                "VM {}: already saved into a snapshot; boot or restore a new VM",
                self.id
            )));
        }
        if self.restored {
            // Its RAM is copy-on-write over another snapshot's, in no file.
            return Err(VmError::Other(format!(
                "VM {}: was restored from a snapshot; snapshots are made from booted VMs",
                self.id
            )));
        }
        fs::create_dir_all(dir)
            .map_err(|e| io_err(format!("create snapshot dir {}", dir.display()), e))?;
        // A stale manifest must not describe the files about to be replaced.
        let _ = fs::remove_file(dir.join(snapshot::MANIFEST_FILE));
        let state_tmp = dir.join(format!(".{SNAP_STATE_FILE}.tmp"));
        let mem_tmp = dir.join(format!(".{SNAP_MEM_FILE}.tmp"));
        let _ = fs::remove_file(&mem_tmp);
        let state = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&state_tmp)
            .map_err(|e| io_err(format!("create {}", state_tmp.display()), e))?;
        let t = self.timeouts.qmp;
        let deadline = Instant::now() + self.timeouts.migrate;
        let r = (|| {
            let q = self.qmp()?;
            q.execute("stop", None, t)?;
            q.execute(
                "migrate-set-capabilities",
                Some(
                    json!({ "capabilities": [{ "capability": "x-ignore-shared", "state": true }] }),
                ),
                t,
            )?;
            q.getfd("snapshot", &state, t)?;
            q.execute("migrate", Some(json!({ "uri": "fd:snapshot" })), t)?;
            q.wait_migration(deadline)
        })();
        drop(state);
        if let Err(e) = r {
            let _ = fs::remove_file(&state_tmp);
            return Err(if self.alive() {
                e
            } else {
                self.explain(e, "saving a snapshot")
            });
        }
        // The paused VM's RAM is complete in its memfd: copy its data into
        // the snapshot (a file of the daemon's, 0600: no VMM can alter what
        // later sessions start from). The VM is never resumed after a
        // snapshot (`saved` forbids it): the daemon lets go of its RAM now.
        self.saved = true;
        let res = match self.ram.take() {
            Some(ram) => ram.save(&mem_tmp, self.cfg.mem_mib),
            None => Err(VmError::Other(format!(
                "VM {}: has no RAM of its own to save",
                self.id
            ))),
        }
        .and_then(|_| {
            fs::rename(&state_tmp, dir.join(SNAP_STATE_FILE))
                .map_err(|e| io_err(format!("rename {}", state_tmp.display()), e))
        })
        .and_then(|_| {
            fs::rename(&mem_tmp, dir.join(SNAP_MEM_FILE))
                .map_err(|e| io_err(format!("rename {}", mem_tmp.display()), e))
        });
        if let Err(e) = res {
            let _ = fs::remove_file(&state_tmp);
            let _ = fs::remove_file(&mem_tmp);
            return Err(e);
        }
        let manifest = Manifest::create(
            &snapshot::Inputs::of(NAME, &self.vmm_version, &self.cfg),
            vec![SNAP_STATE_FILE.into(), SNAP_MEM_FILE.into()],
        )?;
        manifest.write(dir)
    }

    fn destroy(&mut self) -> Result<()> {
        if self.destroyed {
            return Ok(());
        }
        self.qmp = None;
        let mut first_err = None;
        if let (Some(p), Some(child)) = (&self.pidfd, self.child.as_mut()) {
            // Its own process group (setsid): take anything it started.
            if let Err(e) = child.kill_group() {
                first_err.get_or_insert(io_err(format!("kill QEMU pid {}", p.pid()), e));
            }
            if !p.wait_exit(Instant::now() + self.timeouts.teardown) {
                first_err.get_or_insert(VmError::Timeout {
                    backend: NAME,
                    what: format!("QEMU pid {} to exit after SIGKILL", p.pid()),
                    ms: self.timeouts.teardown.as_millis() as u64,
                });
            } else {
                let _ = child.exit_status(); // reaps a direct child
            }
        }
        // The last reference to its RAM once QEMU is gone: frees it.
        self.ram = None;
        if !self.cgroups.is_empty() {
            match cgroup::remove_all(&self.cgroups, Instant::now() + self.timeouts.teardown) {
                Ok(()) => self.cgroups.clear(),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match fs::remove_dir_all(&self.cfg.run_dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                first_err.get_or_insert(io_err(
                    format!("remove run dir {}", self.cfg.run_dir.display()),
                    e,
                ));
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        self.child = None;
        self.pidfd = None;
        self.destroyed = true;
        Ok(())
    }
}

impl Drop for QemuVm {
    fn drop(&mut self) {
        if let Err(e) = self.destroy() {
            log::warn!("qemu VM {}: teardown on drop: {e}", self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_log_rotates_within_its_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CONSOLE_LOG);
        let mut log = ConsoleLog::open(path.clone()).unwrap();
        let chunk = [b'x'; 4096];
        // Five times the cap: the flood a guest can make.
        for _ in 0..(5 * CONSOLE_LOG_MAX as usize / chunk.len()) {
            log.write(&chunk).unwrap();
        }
        let cur = fs::metadata(&path).unwrap().len();
        let old = fs::metadata(dir.path().join("console.log.1"))
            .unwrap()
            .len();
        assert!(
            cur <= CONSOLE_LOG_MAX && old <= CONSOLE_LOG_MAX,
            "{cur} {old}"
        );
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn console_tail_is_escaped() {
        let c = Console::default();
        lock(&c.state)
            .tail
            .extend(b"boot ok\nsession a/b: destroyed\x1b[31m\n".iter());
        let t = c.tail();
        assert!(!t.contains('\x1b'), "{t:?}");
        assert!(t.contains("\\u{1b}[31m"), "{t:?}");
    }

    #[test]
    fn tb_count_is_read_from_info_jit() {
        let out = "Translation buffer state:\r\ngen code size       8459827/1073736704\r\n\
                   TB count            24018\r\nTB avg target size  352 max=2336 bytes\r\n";
        assert_eq!(parse_tb_count(out), Some(24018));
        assert_eq!(parse_tb_count("TCG is not enabled"), None);
    }
    use crate::vm::NetAttachment;

    fn cfg() -> VmConfig {
        VmConfig {
            id: "t1".into(),
            kernel: "/k/vmlinux".into(),
            rootfs: "/r/base,evil.erofs".into(),
            vcpus: 2,
            mem_mib: 256,
            cmdline_extra: "sandbox.ip=10.0.0.2/30".into(),
            net: Some(NetAttachment {
                netns: "/run/netns/x".into(),
                tap: "tap0".into(),
                guest_mac: "02:00:00:00:00:01".into(),
            }),
            uid: 1000,
            gid: 1000,
            run_dir: "/run/asbx/t1".into(),
        }
    }

    fn argv(spec: &ArgvSpec) -> Vec<String> {
        build_argv(&cfg(), spec)
            .into_iter()
            .map(|s| s.into_string().unwrap_or_default())
            .collect()
    }

    fn after<'a>(a: &'a [String], flag: &str) -> Vec<&'a str> {
        a.windows(2)
            .filter(|w| w[0] == flag)
            .map(|w| w[1].as_str())
            .collect()
    }

    #[test]
    fn argv_has_the_isolation_and_device_flags() {
        let a = argv(&ArgvSpec {
            accel: Accel::Tcg,
            tap_fd: Some(7),
            incoming: true,
        });
        assert_eq!(after(&a, "-M"), ["microvm,acpi=off,memory-backend=mem"]);
        assert_eq!(
            after(&a, "-sandbox"),
            ["on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]
        );
        for f in ["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"] {
            assert!(a.iter().any(|x| x == f), "{f} missing");
        }
        assert_eq!(
            after(&a, "-accel"),
            [format!("tcg,tb-size={}", cgroup::TCG_TB_MIB)]
        );
        assert_eq!(after(&a, "-cpu"), ["max"]);
        assert_eq!(after(&a, "-smp"), ["2"]);
        // A comma in a path must not start a new QEMU option.
        assert!(after(&a, "-drive")[0].contains("file=/r/base,,evil.erofs,"));
        assert!(after(&a, "-drive")[0].contains("readonly=on"));
        // A restore runs the kernel in the snapshot RAM.
        assert!(after(&a, "-kernel").is_empty());
        assert!(after(&a, "-append").is_empty());
        assert_eq!(after(&a, "-netdev"), ["tap,id=n0,fd=7"]);
        assert!(after(&a, "-device")
            .contains(&"virtio-net-device,guest_announce=off,netdev=n0,mac=02:00:00:00:00:01"));
        assert!(after(&a, "-device").contains(&"virtserialport,chardev=agent,name=agent"));
        assert_eq!(after(&a, "-incoming"), ["defer"]);
        // A restore maps the snapshot RAM privately, from the memfd.
        assert!(after(&a, "-object")[0].contains("share=off"));
        assert!(after(&a, "-object")[0].contains("mem-path=/proc/self/fd/5,"));

        let a = argv(&ArgvSpec {
            accel: Accel::Tcg,
            tap_fd: Some(7),
            incoming: false,
        });
        assert_eq!(after(&a, "-kernel"), ["/k/vmlinux"]);
        let append = after(&a, "-append")[0];
        assert!(append.starts_with(DEFAULT_CMDLINE), "{append}");
        assert!(append.contains(TCG_CMDLINE), "{append}");
        assert!(append.ends_with("sandbox.ip=10.0.0.2/30"), "{append}");
        // A booted VM's RAM is its memfd, shared with the daemon.
        assert!(after(&a, "-object")[0].contains("share=on"));
        assert!(after(&a, "-object")[0].contains("mem-path=/proc/self/fd/5,"));

        let a = argv(&ArgvSpec {
            accel: Accel::Kvm,
            tap_fd: None,
            incoming: false,
        });
        assert_eq!(after(&a, "-accel"), ["kvm"]);
        assert_eq!(after(&a, "-cpu"), ["host"]);
        assert!(!after(&a, "-append")[0].contains("lpj="));
        assert!(after(&a, "-netdev").is_empty());
        assert!(after(&a, "-incoming").is_empty());
        assert!(after(&a, "-object")[0].contains("share=on"));
    }

    #[test]
    fn version_names_accel_and_machine() {
        let tcg = version_string("QEMU emulator version 7.2.22", Accel::Tcg);
        let kvm = version_string("QEMU emulator version 7.2.22", Accel::Kvm);
        assert!(tcg.starts_with("QEMU emulator version 7.2.22; accel=tcg; machine="));
        assert!(kvm.starts_with("QEMU emulator version 7.2.22; accel=kvm; machine="));
        // Another CPU model or fixed command line is another machine.
        let tag = |s: &str| s.rsplit_once("machine=").map(|(_, t)| t.to_string());
        assert_ne!(tag(&tcg), tag(&kvm));
        assert_eq!(
            tag(&tcg),
            tag(&snapshot::machine_tag(&[
                "max",
                &fixed_cmdline(Accel::Tcg),
                NET_DEVICE
            ]))
        );
    }

    #[test]
    fn macs_and_tap_names_are_checked() {
        assert!(validate_mac("02:00:00:00:00:01").is_ok());
        for bad in [
            "02:00:00:00:00",
            "02:00:00:00:00:01,x=y",
            "zz:00:00:00:00:01",
            "",
        ] {
            assert!(validate_mac(bad).is_err(), "{bad}");
        }
        for bad in ["", "a/b", "0123456789abcdef"] {
            assert!(open_tap(Path::new("/nonexistent"), bad).is_err());
        }
        match open_tap(Path::new("/nonexistent/netns"), "tap0") {
            Err(VmError::BadFile { path, .. }) => assert_eq!(path, Path::new("/nonexistent/netns")),
            other => panic!("{:?}", other.err()),
        }
    }

    #[test]
    fn snapshot_memory_is_a_sealed_copy_reloaded_when_the_file_changes() {
        use std::os::unix::fs::FileExt;
        let d = tempfile::tempdir().expect("tempdir");
        let src = d.path().join("memory");
        let f = fs::File::create(&src).expect("create");
        f.set_len(16 << 20).expect("size");
        f.write_all_at(b"guest", 3 << 20).expect("write");
        drop(f);
        let b = QemuBackend::new(QemuConfig::default());
        let m = b.snapshot_memory(&src, 16 << 20).expect("load");
        assert_eq!(m.data_bytes % 4096, 0);
        assert!(
            m.data_bytes < 1 << 20,
            "holes were copied: {}",
            m.data_bytes
        );
        let mem = fs::File::from(m.fd.try_clone().expect("dup"));
        assert_eq!(mem.metadata().expect("stat").len(), 16 << 20);
        let mut buf = [0u8; 5];
        mem.read_exact_at(&mut buf, 3 << 20).expect("read");
        assert_eq!(&buf, b"guest");
        // Sealed: a VMM holding it (or reopening it read-write through
        // /proc/self/fd) cannot change what later restores start from.
        let rw = fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/self/fd/{}", mem.as_raw_fd()))
            .expect("reopen read-write");
        assert!(rw.write_all_at(b"evil!", 3 << 20).is_err());
        assert!(rw.set_len(1 << 20).is_err());
        // SAFETY: F_GET_SEALS on our own fd.
        let seals = unsafe { libc::fcntl(mem.as_raw_fd(), libc::F_GET_SEALS) };
        assert_ne!(seals & libc::F_SEAL_SEAL, 0);
        // Unchanged file: the same copy; a rebuilt one: a new copy.
        assert!(Arc::ptr_eq(
            &m,
            &b.snapshot_memory(&src, 16 << 20).expect("again")
        ));
        std::thread::sleep(Duration::from_millis(10));
        fs::OpenOptions::new()
            .write(true)
            .open(&src)
            .expect("open")
            .write_all_at(b"other", 3 << 20)
            .expect("write");
        let m2 = b.snapshot_memory(&src, 16 << 20).expect("reload");
        assert!(!Arc::ptr_eq(&m, &m2));
        match b.snapshot_memory(&src, 32 << 20) {
            Err(VmError::BadFile { path, .. }) => assert_eq!(path, src),
            other => panic!("{:?}", other.err()),
        }
    }

    #[test]
    fn loader_trace_gives_library_paths_and_refuses_missing_ones() {
        let trace = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                     \tlibz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x00007f11)\n\
                     \t/lib64/ld-linux-x86-64.so.2 (0x00007f12)\n";
        assert_eq!(
            parse_ld_trace(trace).unwrap(),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libz.so.1"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2")
            ]
        );
        let e = parse_ld_trace("\tlibgone.so.3 => not found\n").unwrap_err();
        assert!(e.contains("libgone.so.3"), "{e}");
        assert!(parse_ld_trace("\tstatically linked\n").is_err());
    }

    #[test]
    fn jail_binds_lose_duplicates_and_nested_paths() {
        let b = |p: &str, w: bool| Bind {
            path: p.into(),
            writable: w,
        };
        let got = without_overlaps(vec![
            b("/usr/share/qemu/keymaps", false),
            b("/usr/share/qemu", false),
            b("/usr/share/qemu-extra", false),
            b("/run/vm", true),
            b("/run/vm", true),
        ]);
        assert_eq!(
            got,
            [
                b("/run/vm", true),
                b("/usr/share/qemu", false),
                b("/usr/share/qemu-extra", false)
            ]
        );
    }

    #[test]
    fn guest_ram_is_a_sealed_memfd_saved_sparsely() {
        use std::os::unix::fs::FileExt;
        let ram = GuestRam::new(64).expect("memfd");
        let path = format!("/proc/self/fd/{}", ram.fd.as_raw_fd());
        let link = fs::read_link(&path).expect("readlink");
        assert!(
            link.to_string_lossy()
                .starts_with("/memfd:agent-sandbox-ram"),
            "{link:?}"
        );
        // What QEMU does: open it by path and write through it.
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("reopen");
        f.write_all_at(b"hello", 10 << 20).expect("write");
        f.write_all_at(b"world", (64 << 20) - 5).expect("write");
        // Sealed: neither grown nor shrunk, by anyone.
        assert!(f.set_len(128 << 20).is_err());
        assert!(f.set_len(1 << 20).is_err());
        drop(f);
        let d = tempfile::tempdir().expect("tempdir");
        let dst = d.path().join("memory");
        ram.save(&dst, 64).expect("save");
        let m = fs::metadata(&dst).expect("stat");
        assert_eq!(m.len(), 64 << 20);
        assert_eq!(m.mode() & 0o777, 0o600);
        assert!(m.blocks() * 512 < 8 << 20, "copy is not sparse");
        let data = fs::read(&dst).expect("read");
        assert_eq!(&data[10 << 20..(10 << 20) + 5], b"hello");
        assert_eq!(&data[(64 << 20) - 5..], b"world");
        assert!(data[..10 << 20].iter().all(|&b| b == 0));
    }
}
