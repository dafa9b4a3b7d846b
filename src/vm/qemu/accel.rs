//! Which accelerator VMs get: KVM where a probe boot under it works, TCG
//! elsewhere; the probe result is remembered per QEMU version and kernel.

use std::ffi::OsString;
use std::fs;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{lock, QemuBackend};
use crate::vm::launch;
use crate::vm::Result;
use crate::vm::VmError;

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

/// The probe result remembered in `QemuConfig::accel_cache`.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct AccelCache {
    qemu_version: String,
    kernel: PathBuf,
    kvm_works: bool,
}

impl QemuBackend {
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

pub(super) fn kvm_device_answers() -> bool {
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
pub(super) const PROBE_ARGS: &[&str] = &[
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

pub(super) fn probe_verdict(
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
