//! Host administration commands: `doctor`, `image build`, `image gc`,
//! `snapshot create`.

pub mod router;

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
    let mut opts = doctor::Options {
        kvm_probe_kernel: reg.kernel().ok(),
        ..Default::default()
    };
    // The binaries `serve` would run (config, else AGENT_SANDBOX_*), else
    // the names looked up on PATH.
    if let Some(p) = &cfg.artifacts.firecracker {
        opts.firecracker = p.clone();
    }
    if let Some(p) = &cfg.artifacts.jailer {
        opts.jailer = p.clone();
    }
    if let Some(p) = &cfg.artifacts.qemu {
        opts.qemu = p.clone();
    }
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
    record_current(cache, &text)?;
    record_agent(cache, &agent)
}

/// Keeps a copy of the agent the images were built with
/// (`<cache>/agent/sandbox-agent-<sha>`, named in `current.json`): templates
/// built from users' images later get the same agent.
fn record_agent(cache: &Path, agent: &Path) -> Result<(), String> {
    use sha2::Digest;
    let bin = std::fs::read(agent).map_err(|e| format!("{}: {e}", agent.display()))?;
    let sha = format!("{:x}", sha2::Sha256::digest(&bin));
    let dir = cache.join("agent");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let dest = dir.join(format!("sandbox-agent-{}", &sha[..16]));
    if !dest.exists() {
        crate::vm::build::write_atomic(&dest, &bin)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("{}: {e}", dest.display()))?;
    }
    let path = cache.join("current.json");
    let mut cur: serde_json::Value = std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_else(|| serde_json::json!({"rootfs": {}}));
    cur["agent"] = dest.display().to_string().into();
    let body = serde_json::to_vec_pretty(&cur).map_err(|e| e.to_string())?;
    std::fs::write(&path, body).map_err(|e| format!("{}: {e}", path.display()))
}

/// The agent the cache's images were built with (`current.json`'s `agent`).
pub fn current_agent(cache: &Path) -> Option<PathBuf> {
    let cur: serde_json::Value =
        serde_json::from_slice(&std::fs::read(cache.join("current.json")).ok()?).ok()?;
    let p = PathBuf::from(cur["agent"].as_str()?);
    p.is_file().then_some(p)
}

/// What `template build` is told besides the spec.
pub struct TemplateBuildOpts {
    pub agent: Option<PathBuf>,
    /// Print every event as a JSON line instead of a progress bar.
    pub json: bool,
    /// Make the template's snapshot after the build.
    pub snapshot: bool,
    /// Bound on layers and the unpacked tree.
    pub max_bytes: u64,
}

/// The agent for `template build`: given, else the images' own, else built
/// from this checkout.
fn template_agent(cache: &Path, given: Option<PathBuf>) -> Result<PathBuf, String> {
    if let Some(a) = given {
        return Ok(a);
    }
    if let Some(a) = current_agent(cache) {
        return Ok(a);
    }
    build_agent(&images_dir()).map_err(|e| {
        format!("{e}; run `agent-sandbox image build` first (templates from images use its agent) or pass --agent")
    })
}

/// `agent-sandbox template build NAME --from REF | --dockerfile PATH`.
pub fn template_build(
    cfg: &Config,
    spec: &crate::vm::build::BuildSpec,
    opts: TemplateBuildOpts,
) -> Result<(), String> {
    use crate::vm::build::{self, Event};
    let cache = wiring::cfg_cache_dir(cfg);
    let paths = build::Paths {
        cache_dir: cache.clone(),
        builtin_templates: cfg
            .artifacts
            .templates_dir
            .clone()
            .unwrap_or_else(wiring::templates_dir),
        agent: template_agent(&cache, opts.agent)?,
        max_bytes: opts.max_bytes,
    };
    let extra = usize::from(opts.snapshot);
    let mut bar: Option<indicatif::ProgressBar> = None;
    let mut emit = |ev: Event| {
        if opts.json {
            if let Ok(l) = serde_json::to_string(&ev) {
                println!("{l}");
            }
            return;
        }
        match ev {
            Event::Step { name, index, total } => {
                let b = bar.get_or_insert_with(|| {
                    let b = indicatif::ProgressBar::new((total + extra) as u64);
                    b.set_style(
                        indicatif::ProgressStyle::with_template(
                            "{spinner} [{elapsed_precise}] [{bar:30}] {pos}/{len} {msg}",
                        )
                        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                        .progress_chars("=> "),
                    );
                    b.enable_steady_tick(std::time::Duration::from_millis(200));
                    b
                });
                b.set_position(index as u64 - 1);
                b.set_message(name);
            }
            Event::Bytes { done, total } => {
                if let Some(b) = &bar {
                    b.set_message(format!("verify {} / {} MiB", done >> 20, total >> 20));
                }
            }
            Event::Log { line } => {
                if let Some(b) = &bar {
                    let step = b.message();
                    let step = step.split(':').next().unwrap_or("").to_string();
                    let l: String = line.chars().take(70).collect();
                    b.set_message(format!("{step}: {l}"));
                }
            }
            Event::Ready(_) | Event::Failed(_) => {}
        }
    };
    let res = build::build(spec, &paths, &mut emit);
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let built = match res {
        Ok(b) => b,
        Err(e) => {
            if opts.json {
                if let Ok(l) = serde_json::to_string(&Event::Failed(e.clone())) {
                    println!("{l}");
                }
            } else if !e.log_tail.is_empty() {
                eprintln!("--- last lines of the builder ---");
                for l in &e.log_tail {
                    eprintln!("{l}");
                }
            }
            return Err(format!("template {}: {e}", spec.name));
        }
    };
    if !opts.json {
        println!(
            "template {}: {} MiB erofs {} ({:.1} s{}), image {}",
            built.template,
            built.image_bytes >> 20,
            built.rootfs.display(),
            built.seconds,
            if built.cached { ", cached" } else { "" },
            built.digest
        );
    }
    if opts.snapshot {
        if let Err(e) = snapshot_create(cfg, &cfg.backend, std::slice::from_ref(&spec.name), false)
        {
            // A template that cannot boot is not left half there.
            let _ = crate::vm::build::remove(&cache, &spec.name);
            return Err(format!(
                "template {}: step snapshot: {e} (the template was removed again)",
                spec.name
            ));
        }
    }
    Ok(())
}

/// `agent-sandbox template list`.
pub fn template_list(cfg: &Config) -> Result<(), String> {
    let be = wiring::backend(&cfg.backend, cfg).map_err(|e| e.to_string())?;
    let reg = Registry::new(wiring::registry_config(cfg), be);
    for t in reg.list().map_err(|e| e.to_string())? {
        let src = reg
            .template(&t.name)
            .ok()
            .and_then(|x| x.source)
            .map(|s| format!("{} {}", s.from, crate::vm::build::oci::short(&s.digest)))
            .unwrap_or_else(|| "built-in".into());
        let snap = match &t.snapshot {
            crate::vm::templates::SnapshotState::Fresh => "snapshot fresh".to_string(),
            crate::vm::templates::SnapshotState::Stale(_) => "snapshot stale".into(),
            crate::vm::templates::SnapshotState::Missing => "no snapshot".into(),
        };
        let image = if t.rootfs.is_some() {
            "built"
        } else {
            "not built"
        };
        println!(
            "{:<16} {:<24} {image:<9} {snap:<14} {src}",
            t.name, t.display_name
        );
    }
    Ok(())
}

/// `agent-sandbox template rm NAME`: a template built from an image, its
/// image and its snapshots.
pub fn template_rm(cfg: &Config, name: &str) -> Result<(), String> {
    let cache = wiring::cfg_cache_dir(cfg);
    if !crate::vm::build::remove(&cache, name)? {
        return Err(format!("no template {name} built from an image"));
    }
    let rc = wiring::registry_config(cfg);
    for backend in ["qemu", "firecracker"] {
        let d = rc.state_dir.join("snapshots").join(backend).join(name);
        let _ = std::fs::remove_dir_all(d);
    }
    println!("removed template {name}");
    Ok(())
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
    let be_name = be.name();
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
        .map_err(|e| {
            // A guest that did not come up: the doctor's full KVM verdict
            // (a guest boot under KVM), which the daemon's error can only
            // point to.
            let kvm = match &e {
                crate::vm::VmError::Timeout { .. } | crate::vm::VmError::Api { .. }
                    if be_name == "firecracker" =>
                {
                    let c = doctor::kvm_check(&doctor::Options {
                        kvm_probe_kernel: reg.kernel().ok(),
                        qemu: cfg
                            .artifacts
                            .qemu
                            .clone()
                            .unwrap_or_else(|| "qemu-system-x86_64".into()),
                        ..Default::default()
                    });
                    format!("\ndoctor:\n{}", doctor::Report { checks: vec![c] })
                }
                _ => String::new(),
            };
            format!("{t}: {e}{kvm}")
        })?;
        println!(
            "{t}: {} {} ({:.1} s)",
            if info.rebuilt { "made" } else { "fresh" },
            info.dir.display(),
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// Shared locks (`flock`) a daemon holds on the images it may restore from
/// for as long as it runs, so that `image gc` leaves them alone even after
/// a newer build has replaced them in `current.json`.
pub struct ImagesInUse {
    _files: Vec<std::fs::File>,
}

/// Takes [`ImagesInUse`] on `paths` (missing ones are skipped: the daemon
/// reports those when it needs them). Must run before the seccomp filter,
/// which it does in `serve`.
pub fn lock_images<'a>(paths: impl IntoIterator<Item = &'a Path>) -> ImagesInUse {
    use std::os::fd::AsRawFd;
    let mut files = Vec::new();
    for p in paths {
        let Ok(f) = std::fs::File::open(p) else {
            continue;
        };
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH) } < 0 {
            log::warn!(
                "flock {}: {} (image gc may remove it while we run)",
                p.display(),
                std::io::Error::last_os_error()
            );
        }
        files.push(f);
    }
    ImagesInUse { _files: files }
}

/// What `image gc` removed (or would remove) and kept.
#[derive(Debug, Default)]
pub struct GcReport {
    pub removed: Vec<(PathBuf, u64)>,
    /// Superseded, but locked by a running daemon.
    pub in_use: Vec<PathBuf>,
    pub kept: Vec<PathBuf>,
}

/// `agent-sandbox image gc [--dry-run]`: removes kernels and root
/// filesystems (with their `.json` manifests) that `current.json` does not
/// name, except what a running daemon holds (see [`lock_images`]). Without
/// a `current.json` entry the newest artifact of its kind is kept, as the
/// daemon would pick it. Artifacts without a manifest, or finished after
/// `current.json` was last written, are kept: a build may be finishing.
/// Snapshots are one per template and rebuilt when stale, so they need no
/// collection; neither does the kernel build tree.
pub fn image_gc(cache: &Path, dry_run: bool) -> Result<GcReport, String> {
    use crate::vm::templates::{artifact_name, newest_artifact};
    use std::os::fd::AsRawFd;
    let cur: serde_json::Value = match std::fs::read(cache.join("current.json")) {
        Ok(b) => serde_json::from_slice(&b)
            .map_err(|e| format!("{}: {e}", cache.join("current.json").display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::json!({}),
        Err(e) => return Err(format!("{}: {e}", cache.join("current.json").display())),
    };
    let recorded = std::fs::metadata(cache.join("current.json"))
        .and_then(|m| m.modified())
        .ok();
    let mut report = GcReport::default();
    for (dir, suffixes) in [("kernel", &[""][..]), ("rootfs", &[".erofs", ".ext4"][..])] {
        let dir = cache.join(dir);
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(format!("{}: {e}", dir.display())),
        };
        let mut names: Vec<String> = rd
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        names.sort();
        for name in names {
            let Some((kind, suffix)) = suffixes
                .iter()
                .find_map(|s| artifact_name(&name, s).map(|k| (k, *s)))
            else {
                continue;
            };
            let path = dir.join(&name);
            let pinned = if suffix.is_empty() {
                cur["kernel"].as_str()
            } else {
                cur["rootfs"][kind].as_str()
            };
            let keep = match pinned {
                // The same file, however either path was spelled (a cache
                // reached through a symlink or a relative path).
                Some(p) => same_file(Path::new(p), &path),
                None => {
                    let prefix = if suffix.is_empty() {
                        "vmlinux-".to_string()
                    } else {
                        format!("{kind}-")
                    };
                    newest_artifact(&dir, &prefix, suffix).as_deref() == Some(path.as_path())
                }
            };
            let manifest = PathBuf::from(format!("{}.json", path.display()));
            let built = std::fs::metadata(&manifest).and_then(|m| m.modified()).ok();
            let in_progress = match (built, recorded) {
                (None, _) => true,
                (Some(b), Some(r)) => b > r,
                (Some(_), None) => false,
            };
            if keep || in_progress {
                report.kept.push(path);
                continue;
            }
            let f = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            // SAFETY: flock on a descriptor we own.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } < 0 {
                report.in_use.push(path);
                continue;
            }
            let size = f.metadata().map(|m| m.len()).unwrap_or(0);
            if !dry_run {
                // Under our exclusive lock: a daemon starting now waits for
                // it, then finds the file gone and says so when it needs it.
                std::fs::remove_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
                if let Err(e) = std::fs::remove_file(&manifest) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        return Err(format!("{}: {e}", manifest.display()));
                    }
                }
            }
            report.removed.push((path, size));
        }
    }
    Ok(report)
}

/// Whether `a` and `b` name the same existing file.
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => (x.dev(), x.ino()) == (y.dev(), y.ino()),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    /// An artifact (and, unless `manifest` is None, its manifest with that
    /// age in seconds before now).
    fn artifact(dir: &Path, name: &str, manifest: Option<u64>) -> PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, b"image").unwrap();
        if let Some(age) = manifest {
            let m = std::fs::File::create(format!("{}.json", p.display())).unwrap();
            m.set_modified(SystemTime::now() - Duration::from_secs(age))
                .unwrap();
        }
        p
    }

    #[test]
    fn gc_keeps_current_newest_unpinned_in_progress_and_in_use() {
        let cache = tempfile::tempdir().unwrap();
        let (k, r) = (cache.path().join("kernel"), cache.path().join("rootfs"));
        let k_old = artifact(&k, "vmlinux-aaaa", Some(300));
        let k_cur = artifact(&k, "vmlinux-bbbb", Some(400));
        std::fs::create_dir_all(k.join("tree")).unwrap();
        let base_old = artifact(&r, "base-1111.erofs", Some(100));
        let base_cur = artifact(&r, "base-2222.erofs", Some(200));
        let base_building = artifact(&r, "base-3333.erofs", None);
        let node_old = artifact(&r, "node-4444.erofs", Some(200));
        let node_new = artifact(&r, "node-5555.erofs", Some(100));
        let py_old = artifact(&r, "python-6666.erofs", Some(300));
        let py_cur = artifact(&r, "python-7777.erofs", Some(300));
        let other = artifact(&r, "notes.txt", None);
        let cur = serde_json::json!({
            "kernel": k_cur,
            "rootfs": { "base": base_cur, "python": py_cur },
        });
        std::fs::write(cache.path().join("current.json"), cur.to_string()).unwrap();
        // Built after the last recorded build: a build may be finishing.
        let base_fresh = artifact(&r, "base-8888.erofs", Some(0));
        std::fs::File::options()
            .write(true)
            .open(format!("{}.json", base_fresh.display()))
            .unwrap()
            .set_modified(SystemTime::now() + Duration::from_secs(60))
            .unwrap();
        // A daemon started before python-7777 was built still uses 6666.
        let held = lock_images([py_old.as_path()]);

        let dry = image_gc(cache.path(), true).unwrap();
        assert_eq!(dry.removed.len(), 3, "{dry:?}");
        assert!(k_old.exists() && base_old.exists() && node_old.exists());

        let r = image_gc(cache.path(), false).unwrap();
        let mut removed: Vec<&PathBuf> = r.removed.iter().map(|(p, _)| p).collect();
        removed.sort();
        assert_eq!(removed, [&k_old, &base_old, &node_old], "{r:?}");
        for p in removed {
            assert!(!p.exists(), "{}", p.display());
            assert!(!Path::new(&format!("{}.json", p.display())).exists());
        }
        assert_eq!(r.in_use, std::slice::from_ref(&py_old));
        for p in [
            &k_cur,
            &base_cur,
            &base_building,
            &node_new,
            &py_cur,
            &base_fresh,
            &other,
        ] {
            assert!(p.exists(), "{}", p.display());
        }
        assert!(k.join("tree").is_dir());

        // Once the daemon is gone, its old image goes too.
        drop(held);
        let r = image_gc(cache.path(), false).unwrap();
        assert_eq!(r.removed.len(), 1, "{r:?}");
        assert!(!py_old.exists());

        // The cache reached through another spelling (a symlink) still
        // keeps what current.json names.
        let link = tempfile::tempdir().unwrap();
        let via = link.path().join("cache");
        std::os::unix::fs::symlink(cache.path(), &via).unwrap();
        let r = image_gc(&via, false).unwrap();
        assert!(r.removed.is_empty(), "{r:?}");
        assert!(k_cur.exists() && base_cur.exists() && py_cur.exists());
    }
}
