//! Shared helpers of the end-to-end VM tests: build (or find cached) guest
//! images, a QEMU backend, a template registry whose snapshots persist
//! under `target/vm-tests/` between runs (staleness is checked each time).
//!
//! Images come from the `images/` build scripts: set
//! `AGENT_SANDBOX_IMAGES_DIR` to another checkout's `images/` if this tree
//! has none. Without images (not root, no build tools), tests skip with a
//! message instead of failing.
#![allow(dead_code)]

use agent_sandbox::agent::{AgentClient, ExecOutput};
use agent_sandbox::proto::ExecRequest;
use agent_sandbox::vm::launch::Launcher;
use agent_sandbox::vm::qemu::{QemuBackend, QemuConfig};
use agent_sandbox::vm::templates::{Registry, RegistryConfig};
use agent_sandbox::vm::VmConfig;
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

pub const TEMPLATES: &[&str] = &["base", "python"];
/// Unprivileged uid/gid the VMMs run as (nobody / nogroup).
pub const VM_UID: u32 = 65534;
pub const VM_GID: u32 = 65534;

pub struct VmEnv {
    pub images_dir: PathBuf,
    pub cache_dir: PathBuf,
    pub kernel: PathBuf,
    pub rootfs: BTreeMap<String, PathBuf>,
    /// `target/vm-tests`: state (snapshots) and run dirs.
    pub work: PathBuf,
    pub backend: Arc<QemuBackend>,
    pub registry: Registry,
}

fn target_dir() -> PathBuf {
    if let Ok(d) = std::env::var("CARGO_TARGET_DIR") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().expect("test exe path");
    // target/<profile>/deps/<test>
    exe.parent()
        .and_then(Path::parent)
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf()
}

fn images_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("AGENT_SANDBOX_IMAGES_DIR") {
        return Some(PathBuf::from(d));
    }
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("images");
    d.join("build.sh").is_file().then_some(d)
}

/// A static guest agent (the rootfs's init).
fn static_agent() -> Result<PathBuf, String> {
    let target = target_dir();
    let triple = "x86_64-unknown-linux-gnu";
    let bin = target.join(triple).join("release").join("sandbox-agent");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let st = Command::new(cargo)
        .args([
            "build",
            "-q",
            "--release",
            "-p",
            "sandbox-agent",
            "--bin",
            "sandbox-agent",
            "--target",
            triple,
        ])
        .env(
            "RUSTFLAGS",
            agent_sandbox::admin::agent_rustflags(Path::new(env!("CARGO_MANIFEST_DIR"))),
        )
        .env("CARGO_TARGET_DIR", &target)
        .status()
        .map_err(|e| format!("run cargo: {e}"))?;
    if !st.success() || !bin.is_file() {
        return Err(format!("building the static agent failed ({st})"));
    }
    Ok(bin)
}

fn build_images(images: &Path) -> Result<(PathBuf, BTreeMap<String, PathBuf>), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("image builds and VMs with an unprivileged VMM user need root".into());
    }
    let agent = static_agent()?;
    // A pinned kernel skips the (slow, first-time) kernel build.
    if let Some(k) = std::env::var_os("AGENT_SANDBOX_TEST_KERNEL") {
        let mut rootfs = BTreeMap::new();
        for t in TEMPLATES {
            let out = Command::new("bash")
                .arg(images.join("build-rootfs.sh"))
                .arg(t)
                .arg(&agent)
                .stderr(std::process::Stdio::inherit())
                .output()
                .map_err(|e| format!("run images/build-rootfs.sh: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "images/build-rootfs.sh {t} failed ({})",
                    out.status
                ));
            }
            let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
            rootfs.insert(t.to_string(), PathBuf::from(path));
        }
        return Ok((PathBuf::from(k), rootfs));
    }
    let mut cmd = Command::new("bash");
    cmd.arg(images.join("build.sh")).arg("--agent").arg(&agent);
    for t in TEMPLATES {
        cmd.args(["--template", t]);
    }
    eprintln!("vm tests: building/checking guest images (cached after the first run)...");
    let out = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("run images/build.sh: {e}"))?;
    if !out.status.success() {
        return Err(format!("images/build.sh failed ({})", out.status));
    }
    let mut kernel = None;
    let mut rootfs = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some(k) = line.strip_prefix("kernel=") {
            kernel = Some(PathBuf::from(k));
        } else if let Some(rest) = line.strip_prefix("rootfs.") {
            if let Some((t, p)) = rest.split_once('=') {
                rootfs.insert(t.to_string(), PathBuf::from(p));
            }
        }
    }
    let kernel = kernel.ok_or("images/build.sh printed no kernel= line")?;
    Ok((kernel, rootfs))
}

fn which(bin: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
        .unwrap_or(false)
}

/// How [`env`]'s backend starts QEMU (default: directly); set before the
/// first [`env`] (benchmarks: through a spawner, jailed or not).
pub static LAUNCHER: OnceLock<Arc<dyn Launcher>> = OnceLock::new();

/// The shared environment, or `None` (with the reason printed) to skip.
pub fn env() -> Option<&'static VmEnv> {
    static ENV: OnceLock<Result<VmEnv, String>> = OnceLock::new();
    let r = ENV.get_or_init(|| {
        if !which("qemu-system-x86_64") {
            return Err(
                "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)".into(),
            );
        }
        let images = images_dir()
            .ok_or("no images/ directory (set AGENT_SANDBOX_IMAGES_DIR to a checkout's images/)")?;
        let (kernel, rootfs) = build_images(&images)?;
        let cache_dir = kernel
            .parent()
            .and_then(Path::parent)
            .ok_or("kernel path has no cache dir")?
            .to_path_buf();
        let work = target_dir().join("vm-tests");
        std::fs::create_dir_all(work.join("run")).map_err(|e| e.to_string())?;
        // The VMM runs as nobody and must reach its run dir.
        for d in [work.clone(), work.join("run")] {
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o711))
                .map_err(|e| e.to_string())?;
        }
        let mut dir = work.clone();
        while let Some(p) = dir.parent() {
            let mode = std::fs::metadata(p)
                .map(|m| m.permissions().mode())
                .unwrap_or(0);
            if mode & 0o001 == 0 {
                return Err(format!(
                    "{} is not searchable by others: the unprivileged VMM cannot reach its run dir",
                    p.display()
                ));
            }
            dir = p.to_path_buf();
        }
        let backend = Arc::new(QemuBackend::new(QemuConfig {
            accel_cache: Some(work.join("accel.json")),
            launcher: LAUNCHER
                .get()
                .cloned()
                .unwrap_or_else(agent_sandbox::vm::launch::direct),
            ..QemuConfig::default()
        }));
        let mut rc = RegistryConfig::new(
            images.join("templates"),
            cache_dir.clone(),
            work.join("state"),
        );
        rc.run_dir = work.join("run");
        rc.uid = VM_UID;
        rc.gid = VM_GID;
        rc.pinned_kernel = Some(kernel.clone());
        rc.pinned_rootfs = rootfs.clone();
        let registry = Registry::new(rc, backend.clone());
        Ok(VmEnv {
            images_dir: images,
            cache_dir,
            kernel,
            rootfs,
            work,
            backend,
            registry,
        })
    });
    match r {
        Ok(e) => Some(e),
        Err(why) => {
            eprintln!("SKIPPED: VM tests need guest images and QEMU: {why}");
            None
        }
    }
}

/// VMs under TCG on two shared cores: run one test's VMs at a time.
pub fn serial() -> MutexGuard<'static, ()> {
    static M: Mutex<()> = Mutex::new(());
    M.lock().unwrap_or_else(|p| p.into_inner())
}

impl VmEnv {
    pub fn run_dir(&self, id: &str) -> PathBuf {
        self.work.join("run").join(id)
    }

    pub fn rootfs(&self, template: &str) -> PathBuf {
        self.rootfs
            .get(template)
            .cloned()
            .unwrap_or_else(|| panic!("no rootfs for template {template}"))
    }

    /// A cold-boot config for `template`'s image.
    pub fn cold_config(&self, id: &str, template: &str, mem_mib: u32) -> VmConfig {
        let run_dir = self.run_dir(id);
        let _ = std::fs::remove_dir_all(&run_dir);
        VmConfig {
            id: id.to_string(),
            kernel: self.kernel.clone(),
            rootfs: self.rootfs(template),
            vcpus: 1,
            mem_mib,
            cmdline_extra: String::new(),
            net: None,
            uid: VM_UID,
            gid: VM_GID,
            run_dir,
        }
    }
}

pub fn sh(c: &AgentClient, cmd: &str) -> ExecOutput {
    c.exec(
        ExecRequest {
            shell: Some(cmd.to_string()),
            timeout_ms: Some(120_000),
            ..Default::default()
        },
        1 << 20,
    )
    .unwrap_or_else(|e| panic!("exec {cmd:?}: {e}"))
}

pub fn stdout(o: &ExecOutput) -> String {
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

pub fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(pid, 0) == 0 }
}
