//! Host administration commands: `doctor`, `image build`, `snapshot create`.

use crate::config::Config;
use crate::sandbox::wiring;
use crate::vm::doctor;
use crate::vm::templates::Registry;
use std::path::{Path, PathBuf};
use std::process::Command;

/// `agent-sandbox doctor`: what this host has and lacks, each with its fix.
/// Fails (exit 1) if something the chosen backend needs is missing.
pub fn doctor(cfg: &Config, backend: &str, json: bool) -> Result<(), String> {
    let be = wiring::backend(backend, cfg).map_err(|e| e.to_string())?;
    let reg = Registry::new(wiring::registry_config(cfg), be);
    let opts = doctor::Options {
        kvm_probe_kernel: reg.kernel().ok(),
        ..Default::default()
    };
    let report = doctor::run(&opts, Some(&reg));
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?
        );
    } else {
        print!("{report}");
    }
    if report.ok() {
        Ok(())
    } else {
        Err("some checks failed (see the fixes above)".into())
    }
}

/// The directory holding `build.sh` and `templates/`.
fn images_dir() -> PathBuf {
    let t = wiring::templates_dir();
    let t = t.canonicalize().unwrap_or(t);
    t.parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("images"))
}

/// RUSTFLAGS of the guest agent build for the checkout at `root`. Static:
/// the agent is PID 1 of a root filesystem with its own libc. The checkout
/// path is remapped so that the binary, and with it the image cache key,
/// does not change from one clone to the next. Every build of the agent for
/// an image (this command, the VM tests) must use exactly these, or each
/// rebuilds the other's root filesystems.
pub fn agent_rustflags(root: &Path) -> String {
    format!(
        "-C target-feature=+crt-static --remap-path-prefix={}=/agent-sandbox",
        root.display()
    )
}

/// Builds the static guest agent from this source checkout, if there is one.
fn build_agent(images: &Path) -> Result<PathBuf, String> {
    let root = images
        .parent()
        .ok_or("images directory has no parent")?
        .to_path_buf();
    if !root.join("guest/Cargo.toml").exists() {
        return Err(format!(
            "no guest agent source next to {} and no --agent given",
            images.display()
        ));
    }
    let target = "x86_64-unknown-linux-gnu";
    eprintln!("==> building the static guest agent");
    let st = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(&root)
        .args([
            "build",
            "--release",
            "-p",
            "sandbox-agent",
            "--target",
            target,
        ])
        .env("RUSTFLAGS", agent_rustflags(&root))
        .status()
        .map_err(|e| format!("cargo: {e}"))?;
    if !st.success() {
        return Err("building the guest agent failed".into());
    }
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    Ok(target_dir.join(target).join("release/sandbox-agent"))
}

/// `agent-sandbox image build [--template T]... [--agent PATH]`: builds the
/// guest kernel and root filesystems that are missing (cached by input
/// hash; a second run only checks) in the image cache `cache`.
pub fn image_build(
    templates: &[String],
    agent: Option<PathBuf>,
    cache: &Path,
) -> Result<(), String> {
    let images = images_dir();
    let script = images.join("build.sh");
    if !script.exists() {
        return Err(format!("{} not found", script.display()));
    }
    // Host packages (QEMU, mmdebstrap, kernel source, ...): the script only
    // installs what is missing.
    let deps = images.join("install-deps.sh");
    // SAFETY: geteuid has no preconditions.
    if deps.exists() && unsafe { libc::geteuid() } == 0 {
        let st = Command::new("bash")
            .arg(&deps)
            .status()
            .map_err(|e| format!("{}: {e}", deps.display()))?;
        if !st.success() {
            return Err(format!("{} failed ({st})", deps.display()));
        }
    }
    let agent = match agent {
        Some(a) => a,
        None => build_agent(&images)?,
    };
    let mut cmd = Command::new("bash");
    cmd.arg(&script).arg("--agent").arg(&agent);
    // The scripts take the cache from the environment.
    cmd.env("AGENT_SANDBOX_CACHE", cache);
    for t in templates {
        cmd.args(["--template", t]);
    }
    // Progress goes to the terminal; the machine-readable result lines
    // (`kernel=...`, `rootfs.T=...`) are read from stdout.
    let out = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("{}: {e}", script.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    if !out.status.success() {
        return Err(format!("{} failed ({})", script.display(), out.status));
    }
    record_current(cache, &text)
}

/// Remembers which artifacts the last build produced (`<cache>/current.json`),
/// so the daemon restores images with the agent that was just built rather
/// than whatever is newest in a shared cache.
fn record_current(cache: &Path, build_output: &str) -> Result<(), String> {
    let path = cache.join("current.json");
    let mut cur: serde_json::Value = std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_else(|| serde_json::json!({"rootfs": {}}));
    for line in build_output.lines() {
        if let Some(k) = line.strip_prefix("kernel=") {
            cur["kernel"] = k.trim().into();
        } else if let Some((t, p)) = line.strip_prefix("rootfs.").and_then(|r| r.split_once('=')) {
            cur["rootfs"][t] = p.trim().into();
        }
    }
    let body = serde_json::to_vec_pretty(&cur).map_err(|e| e.to_string())?;
    std::fs::write(&path, body).map_err(|e| format!("{}: {e}", path.display()))
}

/// `agent-sandbox snapshot create [--template T]... [--force]`.
pub fn snapshot_create(
    cfg: &Config,
    backend: &str,
    templates: &[String],
    force: bool,
) -> Result<(), String> {
    let be = wiring::backend(backend, cfg).map_err(|e| e.to_string())?;
    let mut rc = wiring::registry_config(cfg);
    let _snap_net = wiring::snapshot_net(cfg, &mut rc).map_err(|e| e.to_string())?;
    let reg = Registry::new(rc, be);
    let names = if templates.is_empty() {
        reg.list()
            .map_err(|e| e.to_string())?
            .into_iter()
            .filter(|t| t.rootfs.is_some())
            .map(|t| t.name)
            .collect()
    } else {
        templates.to_vec()
    };
    if names.is_empty() {
        return Err("no template has a built image (run `agent-sandbox image build`)".into());
    }
    for t in names {
        let t0 = std::time::Instant::now();
        let info = if force {
            reg.create_snapshot(&t)
        } else {
            reg.ensure_snapshot(&t)
        }
        .map_err(|e| format!("{t}: {e}"))?;
        println!(
            "{t}: {} {} ({:.1} s)",
            if info.rebuilt { "made" } else { "fresh" },
            info.dir.display(),
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
