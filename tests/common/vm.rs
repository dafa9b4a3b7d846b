//! Shared helpers of the end-to-end VM tests: build (or find cached) guest
//! images, a QEMU backend, a template registry whose snapshots persist
//! between runs (staleness is checked each time) in a per-checkout work
//! dir under [`WORK_ROOT`].
//!
//! Images come from the `images/` build scripts: set
//! `AGENT_SANDBOX_IMAGES_DIR` to another checkout's `images/` if this tree
//! has none. Not root, no QEMU or no build scripts: the tests skip (see
//! `tests/common/skip.rs`: a failure under CI). A build that fails (the
//! static agent, `images/build.sh`) fails every VM test.
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
use std::time::Duration;

/// Every template in `images/templates/`: each is built and booted by a
/// test (`tests/vm_qemu.rs`), so none can rot unnoticed.
pub const TEMPLATES: &[&str] = &["base", "python", "node", "go", "rust", "dev"];
/// Unprivileged uid/gid the VMMs run as (nobody / nogroup).
pub const VM_UID: u32 = 65534;
pub const VM_GID: u32 = 65534;

pub struct VmEnv {
    pub images_dir: PathBuf,
    pub cache_dir: PathBuf,
    pub kernel: PathBuf,
    pub rootfs: BTreeMap<String, PathBuf>,
    /// This checkout's dir under [`WORK_ROOT`]: state (snapshots), run dirs.
    pub work: PathBuf,
    pub backend: Arc<QemuBackend>,
    pub registry: Registry,
}

/// The image build scripts: `$AGENT_SANDBOX_IMAGES_DIR`, else this
/// checkout's `images/`; `Err` (a skip) names what is missing.
fn images_dir() -> Result<PathBuf, String> {
    let (d, from) = match std::env::var_os("AGENT_SANDBOX_IMAGES_DIR") {
        Some(d) => (PathBuf::from(d), "AGENT_SANDBOX_IMAGES_DIR="),
        None => (Path::new(env!("CARGO_MANIFEST_DIR")).join("images"), ""),
    };
    if d.join("build.sh").is_file() {
        Ok(d)
    } else {
        Err(format!(
            "no images/build.sh in {from}{} (set AGENT_SANDBOX_IMAGES_DIR to a checkout's images/)",
            d.display()
        ))
    }
}

/// A static guest agent (the rootfs's init).
fn static_agent() -> Result<PathBuf, String> {
    let target = crate::skip::target_dir();
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

/// Where the VM tests of all checkouts keep their state: outside any
/// checkout, because the VMM runs as nobody and must reach its run dir,
/// and a checkout may sit under a mode-700 directory (a clone in /root).
pub const WORK_ROOT: &str = "/var/tmp/agent-sandbox-tests";

/// Why the VM tests cannot run: a skip (this host lacks something; a
/// failure under CI) or a failure (something that should work broke).
enum NoEnv {
    Skip(String),
    Fail(String),
}

/// This checkout's work dir, `WORK_ROOT/<sha256 of the checkout path>`
/// (mode 0711 down from `WORK_ROOT`, so nobody can reach a run dir but not
/// list them), recording its checkout. Dirs of checkouts that are gone
/// are removed.
fn work_dir() -> Result<PathBuf, String> {
    use sha2::{Digest, Sha256};
    let checkout = env!("CARGO_MANIFEST_DIR");
    let hash = Sha256::digest(checkout.as_bytes());
    let name: String = hash[..8].iter().map(|b| format!("{b:02x}")).collect();
    let root = Path::new(WORK_ROOT);
    let work = root.join(name);
    std::fs::create_dir_all(work.join("run"))
        .map_err(|e| format!("create {}: {e}", work.display()))?;
    for d in [root.to_path_buf(), work.clone(), work.join("run")] {
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o711))
            .map_err(|e| format!("chmod 0711 {}: {e}", d.display()))?;
    }
    std::fs::write(work.join("checkout"), checkout)
        .map_err(|e| format!("write {}/checkout: {e}", work.display()))?;
    for e in std::fs::read_dir(root).into_iter().flatten().flatten() {
        let owner = std::fs::read_to_string(e.path().join("checkout"));
        if owner.is_ok_and(|c| !Path::new(&c).exists()) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    // Every parent must be searchable by others for the VMM to get in.
    let mut dir = work.clone();
    while let Some(p) = dir.parent() {
        let mode = std::fs::metadata(p)
            .map(|m| m.permissions().mode())
            .map_err(|e| format!("stat {}: {e}", p.display()))?;
        if mode & 0o001 == 0 {
            return Err(format!(
                "{} is not searchable by others: the unprivileged VMM cannot reach its run dir",
                p.display()
            ));
        }
        dir = p.to_path_buf();
    }
    Ok(work)
}

fn try_env() -> Result<VmEnv, NoEnv> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(NoEnv::Skip(
            "image builds and VMs with an unprivileged VMM user need root".into(),
        ));
    }
    if !which("qemu-system-x86_64") {
        return Err(NoEnv::Skip(
            "qemu-system-x86_64 is not installed (images/install-deps.sh)".into(),
        ));
    }
    let images = images_dir().map_err(NoEnv::Skip)?;
    let (kernel, rootfs) = build_images(&images).map_err(NoEnv::Fail)?;
    let cache_dir = kernel
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| NoEnv::Fail(format!("kernel {} has no cache dir", kernel.display())))?
        .to_path_buf();
    let work = work_dir().map_err(NoEnv::Fail)?;
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
}

/// The shared environment, built once per test binary. `None` when the
/// host lacks it: the calling test is recorded as skipped (a failure
/// under CI unless allowlisted) and must return. A broken build panics.
pub fn env() -> Option<&'static VmEnv> {
    static ENV: OnceLock<Result<VmEnv, NoEnv>> = OnceLock::new();
    match ENV.get_or_init(try_env) {
        Ok(e) => Some(e),
        Err(NoEnv::Skip(why)) => {
            crate::skip::skipped(&format!("VM tests need guest images and QEMU: {why}"));
            None
        }
        Err(NoEnv::Fail(why)) => panic!("VM test environment: {why}"),
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
    sh_within(c, cmd, Duration::from_secs(120))
}

/// [`sh`] with a timeout of its own (a compile under TCG takes minutes).
pub fn sh_within(c: &AgentClient, cmd: &str, timeout: Duration) -> ExecOutput {
    c.exec(
        ExecRequest {
            shell: Some(cmd.to_string()),
            timeout_ms: Some(timeout.as_millis() as u64),
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
