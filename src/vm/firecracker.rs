//! Firecracker backend: one jailed Firecracker process per VM, driven over
//! its API socket (see `http`), with the agent reached through Firecracker's
//! vsock-over-UDS bridge.
//!
//! Every request body here is checked in `tests/firecracker.rs` against
//! Firecracker's published v1.16.1 API spec.

use std::ffi::OsString;
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::jailer::{self, in_jail, JailFile, JailPaths, JailerConfig, LaunchSpec};
use super::launch::{Pidfd, Spawner};
use super::snapshot::{self, Manifest};
use super::{Backend, CheckpointStats, PreparedRestore, Result, Vm, VmConfig, VmError};

const NAME: &str = super::BackendKind::Firecracker.as_str();

/// Snapshot file names inside a snapshot directory.
pub const SNAP_STATE_FILE: &str = "vmstate";
pub const SNAP_MEM_FILE: &str = "memory";

/// Files of a checkpoint in its directory while it is written: both get
/// their final names only once complete, and the manifest comes last.
const PART_SUFFIX: &str = ".part";

/// The serial console of a booted VM (`PUT /serial`): a file in its jail,
/// read for error messages. Firecracker's rate limiter bounds it: a burst
/// of this much (a boot prints ~50 KiB) ...
const SERIAL_BURST: u64 = 1 << 20;
/// ... then this many bytes a second (a flooding guest adds 14 MiB an
/// hour, under the jailer's fsize limit). Restored VMs get no serial file.
const SERIAL_RATE: u64 = 4096;

/// Guest vsock CID (3 is the first one not reserved).
pub const GUEST_CID: u32 = 3;

/// Kernel command line before `cmdline_extra`.
pub const DEFAULT_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=1 pci=off root=/dev/vda ro rootfstype=erofs init=/sbin/sandbox-agent";

/// Largest API response body read (errors are a line of JSON).
const MAX_API_BODY: usize = 64 * 1024;

#[derive(Debug, Clone)]
pub struct Timeouts {
    /// Jailer process run to exit.
    pub jailer: Duration,
    /// Jailer exit to API socket accepting.
    pub api_socket: Duration,
    /// One ordinary API request.
    pub request: Duration,
    /// Snapshot create / load (writes or maps the whole guest memory).
    pub snapshot: Duration,
    /// Kill to exit, and cgroup removal.
    pub teardown: Duration,
    /// InstanceStart to the guest's first byte on its serial console. A
    /// kernel under KVM prints within a second; one that printed nothing
    /// by then is not booting (a KVM that runs no guest), and waiting the
    /// whole agent timeout for it would only hide that.
    pub first_output: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            jailer: Duration::from_secs(5),
            api_socket: Duration::from_secs(5),
            request: Duration::from_secs(5),
            snapshot: Duration::from_secs(120),
            teardown: Duration::from_secs(5),
            first_output: Duration::from_secs(10),
        }
    }
}

pub struct FirecrackerBackend {
    jailer: JailerConfig,
    spawner: Arc<dyn Spawner>,
    timeouts: Timeouts,
    /// Guest port the agent listens on.
    agent_port: u32,
    log_level: &'static str,
    version: Mutex<Option<String>>,
}

impl FirecrackerBackend {
    pub fn new(jailer: JailerConfig, spawner: Arc<dyn Spawner>) -> Self {
        FirecrackerBackend {
            jailer,
            spawner,
            timeouts: Timeouts::default(),
            agent_port: crate::proto::DEFAULT_VSOCK_PORT,
            log_level: "Warning",
            version: Mutex::new(None),
        }
    }

    pub fn with_timeouts(mut self, t: Timeouts) -> Self {
        self.timeouts = t;
        self
    }

    pub fn with_agent_port(mut self, port: u32) -> Self {
        self.agent_port = port;
        self
    }

    pub fn jailer_config(&self) -> &JailerConfig {
        &self.jailer
    }

    /// Remove what a VM with this id left behind (after a daemon crash).
    pub fn cleanup_stale(&self, id: &str) -> Result<()> {
        let paths = JailPaths::new(&self.jailer, id)?;
        jailer::teardown(&paths, None, Instant::now() + self.timeouts.teardown)
    }

    /// Start a jailed VMM with `files` in its chroot and wait until its API
    /// socket answers. On error everything created is removed.
    fn launch(&self, cfg: &VmConfig, files: Vec<JailFile>, writable: &[&str]) -> Result<FcVm> {
        let paths = JailPaths::new(&self.jailer, &cfg.id)?;
        jailer::check_socket_path(&paths.api_sock())?;
        jailer::check_socket_path(&paths.vsock())?;
        if paths.jail_dir.exists() {
            return Err(VmError::BadFile {
                path: paths.jail_dir.clone(),
                problem: "left over from an earlier VM with this id".into(),
                fix: "clean it up (FirecrackerBackend::cleanup_stale) or use a new id".into(),
            });
        }
        let spec = LaunchSpec {
            id: cfg.id.clone(),
            uid: cfg.uid,
            gid: cfg.gid,
            netns: cfg.net.as_ref().map(|n| n.netns.clone()),
            vcpus: cfg.vcpus,
            mem_mib: cfg.mem_mib,
        };
        let argv = jailer::build_argv(&self.jailer, &spec)?;
        let mut vm = FcVm {
            id: cfg.id.clone(),
            paths,
            vmm: None,
            timeouts: self.timeouts.clone(),
            agent_port: self.agent_port,
            cfg: cfg.clone(),
            vmm_version: String::new(),
            destroyed: false,
            booted: None,
            answered: false,
        };
        // From here on `vm` owns the cleanup: its Drop tears everything down.
        jailer::prepare_chroot(&vm.paths, cfg.uid, cfg.gid, &files, writable)?;
        jailer::prepare_v1_parents(&self.jailer)?;
        self.start(&mut vm, &argv)?;
        vm.api(
            "PUT",
            "/logger",
            &json!({ "log_path": in_jail::LOG, "level": self.log_level, "show_level": true }),
            self.timeouts.request,
        )?;
        Ok(vm)
    }

    fn start(&self, vm: &mut FcVm, argv: &[OsString]) -> Result<()> {
        let out = self
            .spawner
            .run(argv, Instant::now() + self.timeouts.jailer)?;
        if out.code != Some(0) {
            return Err(VmError::Api {
                backend: NAME,
                msg: format!(
                    "jailer for {} failed ({}): {}",
                    vm.id,
                    match out.code {
                        Some(c) => format!("exit code {c}"),
                        None => "killed by a signal".into(),
                    },
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            });
        }
        let started = Instant::now();
        let deadline = started + self.timeouts.api_socket;
        let mut pause = Duration::from_millis(1);
        // The jailer wrote the pid file before it exited; the VMM may still
        // be starting. Poll the socket: there is nothing to block on until it
        // exists, and this wait is short and bounded.
        loop {
            if vm.vmm.is_none() {
                match jailer::open_pid_file(&vm.paths) {
                    Ok(Some(p)) => vm.vmm = Some(p),
                    Ok(None) => {}
                    Err(e) => {
                        return Err(VmError::Io {
                            backend: NAME,
                            what: format!("read VMM pid file {}", vm.paths.pid_file().display()),
                            source: e,
                        })
                    }
                }
            }
            if let Some(p) = &vm.vmm {
                if !p.is_alive() {
                    // A dynamic binary dies in the chroot without a word
                    // (the jailer's exec error goes to /dev/null): name it.
                    if let Err(e) = jailer::check_static_exec(&self.jailer.firecracker_bin) {
                        return Err(VmError::Api {
                            backend: NAME,
                            msg: format!("VM {}: firecracker exited while starting: {e}", vm.id),
                        });
                    }
                    return Err(vm.died("while starting"));
                }
                if UnixStream::connect(vm.paths.api_sock()).is_ok() {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                let what = if vm.vmm.is_none() {
                    format!("VMM pid file {}", vm.paths.pid_file().display())
                } else {
                    format!("API socket {}", vm.paths.api_sock().display())
                };
                return Err(VmError::Timeout {
                    backend: NAME,
                    what,
                    ms: ms(started, deadline),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    fn check_input(path: &Path, what: &str) -> Result<()> {
        match fs::metadata(path) {
            Ok(m) if m.is_file() => Ok(()),
            Ok(_) => Err(VmError::BadFile {
                path: path.to_path_buf(),
                problem: format!("{what} is not a regular file"),
                fix: "agent-sandbox image build".into(),
            }),
            Err(e) => Err(VmError::BadFile {
                path: path.to_path_buf(),
                problem: format!("{what}: {e}"),
                fix: "agent-sandbox image build".into(),
            }),
        }
    }
}

/// The host CPU model as `/proc/cpuinfo`'s first processor names it
/// (vendor, family, model, stepping, name); empty where it is unreadable.
fn host_cpu() -> String {
    let info = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let keys = ["vendor_id", "cpu family", "model", "stepping", "model name"];
    info.lines()
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_once(':'))
        .filter(|(k, _)| keys.contains(&k.trim()))
        .map(|(k, v)| format!("{}={}", k.trim(), v.trim()))
        .collect::<Vec<_>>()
        .join(";")
}

fn ms(from: Instant, to: Instant) -> u64 {
    to.saturating_duration_since(from).as_millis() as u64
}

fn cmdline(cfg: &VmConfig) -> String {
    let extra = cfg.cmdline_extra.trim();
    if extra.is_empty() {
        DEFAULT_CMDLINE.to_string()
    } else {
        format!("{DEFAULT_CMDLINE} {extra}")
    }
}

impl Backend for FirecrackerBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn vmm_version(&self) -> Result<String> {
        let mut cached = self
            .version
            .lock()
            .map_err(|_| VmError::Other("firecracker version cache poisoned".into()))?;
        if let Some(v) = cached.as_ref() {
            return Ok(v.clone());
        }
        let argv = vec![
            self.jailer.firecracker_bin.clone().into_os_string(),
            OsString::from("--version"),
        ];
        let out = self
            .spawner
            .run(&argv, Instant::now() + self.timeouts.jailer)?;
        // `Firecracker v1.16.1` on the first line.
        let v = out.version_line(NAME, &self.jailer.firecracker_bin)?;
        // The fixed command line is part of what a snapshot holds (see
        // `snapshot::machine_tag`), and Firecracker restores a snapshot only
        // on the CPU model it was taken on: a checkpoint kept across a move
        // to other hardware is then reported stale, not loaded.
        let v = format!(
            "{v}; {}",
            snapshot::machine_tag(&[DEFAULT_CMDLINE, &host_cpu()])
        );
        *cached = Some(v.clone());
        Ok(v)
    }

    fn boot(&self, cfg: &VmConfig) -> Result<Box<dyn Vm>> {
        Self::check_input(&cfg.kernel, "kernel")?;
        Self::check_input(&cfg.rootfs, "rootfs")?;
        let version = self.vmm_version()?;
        let files = vec![
            JailFile {
                src: cfg.kernel.clone(),
                in_jail: in_jail::KERNEL,
            },
            JailFile {
                src: cfg.rootfs.clone(),
                in_jail: in_jail::ROOTFS,
            },
        ];
        let mut vm = self.launch(cfg, files, &[in_jail::LOG, in_jail::SERIAL])?;
        vm.vmm_version = version;
        let t = self.timeouts.request;
        vm.api(
            "PUT",
            "/serial",
            &json!({
                "serial_out_path": in_jail::SERIAL,
                // A TokenBucket itself here, not a RateLimiter's bandwidth.
                "rate_limiter": {
                    "size": SERIAL_RATE,
                    "one_time_burst": SERIAL_BURST,
                    "refill_time": 1000,
                },
            }),
            t,
        )?;
        vm.api(
            "PUT",
            "/boot-source",
            &json!({ "kernel_image_path": in_jail::KERNEL, "boot_args": cmdline(cfg) }),
            t,
        )?;
        vm.api(
            "PUT",
            "/drives/rootfs",
            &json!({
                "drive_id": "rootfs",
                "path_on_host": in_jail::ROOTFS,
                "is_root_device": true,
                "is_read_only": true,
            }),
            t,
        )?;
        vm.api(
            "PUT",
            "/machine-config",
            &json!({ "vcpu_count": cfg.vcpus, "mem_size_mib": cfg.mem_mib, "smt": false }),
            t,
        )?;
        if let Some(net) = &cfg.net {
            vm.api(
                "PUT",
                "/network-interfaces/eth0",
                &json!({
                    "iface_id": "eth0",
                    "host_dev_name": net.tap,
                    "guest_mac": net.guest_mac,
                }),
                t,
            )?;
        }
        vm.api(
            "PUT",
            "/vsock",
            &json!({ "guest_cid": GUEST_CID, "uds_path": in_jail::VSOCK }),
            t,
        )?;
        vm.api(
            "PUT",
            "/actions",
            &json!({ "action_type": "InstanceStart" }),
            t,
        )?;
        vm.booted = Some(Instant::now());
        Ok(Box::new(vm))
    }

    fn sweep_orphans(&self, prefixes: &[&str]) -> usize {
        // A jailed Firecracker's command line names none of our dirs
        // (`/firecracker --id ...` in its chroot): it is found by its jail,
        // `<chroot_base>/<exec name>/<id>/`, whose pid file `teardown`
        // checks against the process before it kills anything.
        let Some(base) = JailPaths::new(&self.jailer, "sweep")
            .ok()
            .and_then(|p| p.jail_dir.parent().map(Path::to_path_buf))
        else {
            return 0;
        };
        let Ok(rd) = fs::read_dir(&base) else {
            return 0;
        };
        let mut n = 0;
        for e in rd.flatten() {
            let id = e.file_name().to_string_lossy().into_owned();
            if !prefixes.iter().any(|p| id.starts_with(p)) {
                continue;
            }
            match self.cleanup_stale(&id) {
                Ok(()) => {
                    log::warn!("sweep: removed the jail of orphaned Firecracker VM {id}");
                    n += 1;
                }
                Err(e) => log::warn!("sweep: Firecracker VM {id}: {e}"),
            }
        }
        n
    }

    fn prepare_restore(
        &self,
        cfg: &VmConfig,
        snapshot_dir: &Path,
    ) -> Result<Box<dyn PreparedRestore>> {
        let version = self.vmm_version()?;
        snapshot::check_fresh(snapshot_dir, &snapshot::Inputs::of(NAME, &version, cfg))?;
        // The kernel is inside the saved memory; only the rootfs is reopened.
        let files = vec![
            JailFile {
                src: cfg.rootfs.clone(),
                in_jail: in_jail::ROOTFS,
            },
            JailFile {
                src: snapshot_dir.join(SNAP_STATE_FILE),
                in_jail: in_jail::SNAP_STATE,
            },
            JailFile {
                src: snapshot_dir.join(SNAP_MEM_FILE),
                in_jail: in_jail::SNAP_MEM,
            },
        ];
        let mut vm = self.launch(cfg, files, &[in_jail::LOG])?;
        vm.vmm_version = version;
        Ok(Box::new(FcPrepared { vm }))
    }
}

/// A jailed Firecracker with its API up and the snapshot's files linked
/// into its chroot, before `PUT /snapshot/load`.
pub struct FcPrepared {
    vm: FcVm,
}

impl PreparedRestore for FcPrepared {
    fn id(&self) -> &str {
        &self.vm.id
    }

    fn pid(&self) -> Option<i32> {
        self.vm.pid()
    }

    fn alive(&self) -> bool {
        self.vm.alive()
    }

    fn finish(self: Box<Self>) -> Result<Box<dyn Vm>> {
        let vm = self.vm;
        let mut body = json!({
            "snapshot_path": in_jail::SNAP_STATE,
            "mem_backend": { "backend_type": "File", "backend_path": in_jail::SNAP_MEM },
            "resume_vm": true,
        });
        if let Some(net) = &vm.cfg.net {
            // Same TAP name in every namespace, so this is a no-op for
            // snapshots made by this daemon; it keeps a renamed TAP working.
            body["network_overrides"] = json!([{ "iface_id": "eth0", "host_dev_name": net.tap }]);
        }
        // On error `vm` is dropped, which tears the jail down.
        vm.api("PUT", "/snapshot/load", &body, vm.timeouts.snapshot)?;
        Ok(Box::new(vm))
    }

    fn destroy(&mut self) -> Result<()> {
        self.vm.destroy()
    }
}

pub struct FcVm {
    id: String,
    paths: JailPaths,
    vmm: Option<Pidfd>,
    timeouts: Timeouts,
    agent_port: u32,
    cfg: VmConfig,
    vmm_version: String,
    destroyed: bool,
    /// When InstanceStart was accepted: a booted VM (its serial console is
    /// in the jail), not a restored one.
    booted: Option<Instant>,
    /// The agent answered once: later connects (after a checkpoint's vsock
    /// reset) get no first-output window.
    answered: bool,
}

impl FcVm {
    pub fn paths(&self) -> &JailPaths {
        &self.paths
    }

    /// One API call; any non-2xx answer becomes a `VmError` naming the call
    /// and Firecracker's `fault_message`.
    fn api(&self, method: &str, path: &str, body: &Value, timeout: Duration) -> Result<()> {
        let bytes = serde_json::to_vec(body)
            .map_err(|e| VmError::Other(format!("serialize {method} {path}: {e}")))?;
        let started = Instant::now();
        let deadline = started + timeout;
        let resp = super::http::request(
            &self.paths.api_sock(),
            method,
            path,
            Some(&bytes),
            deadline,
            MAX_API_BODY,
        );
        let resp = match resp {
            Ok(r) => r,
            Err(e) => {
                if self.vmm.as_ref().is_some_and(|p| !p.is_alive()) {
                    return Err(self.died(&format!("during {method} {path}")));
                }
                return Err(match e {
                    super::http::HttpError::Timeout { .. } => VmError::Timeout {
                        backend: NAME,
                        what: format!("VM {}: answer to {method} {path}", self.id),
                        ms: ms(started, deadline),
                    },
                    other => VmError::Api {
                        backend: NAME,
                        msg: format!("VM {}: {method} {path}: {other}", self.id),
                    },
                });
            }
        };
        if resp.is_success() {
            return Ok(());
        }
        let fault = serde_json::from_slice::<Value>(&resp.body)
            .ok()
            .and_then(|v| {
                v.get("fault_message")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
            .unwrap_or_else(|| String::from_utf8_lossy(&resp.body).trim().to_string());
        Err(VmError::Api {
            backend: NAME,
            msg: format!(
                "VM {}: {method} {path} rejected (HTTP {}): {fault}",
                self.id, resp.status
            ),
        })
    }

    /// Error for a VMM that exited, with the tail of its log (and of a
    /// booted guest's console, with what this host's KVM looks like).
    fn died(&self, when: &str) -> VmError {
        let pid = self.vmm.as_ref().map(Pidfd::pid).unwrap_or(0);
        VmError::Api {
            backend: NAME,
            msg: format!(
                "VM {}: firecracker (pid {pid}) exited {when}{}",
                self.id,
                self.evidence()
            ),
        }
    }

    /// What the VMM and a booted guest said, for an error: `; log: ...`,
    /// `; console: ...` and, for a booted guest, the KVM verdict.
    fn evidence(&self) -> String {
        let mut out = String::new();
        let log = log_tail(&self.paths.host(in_jail::LOG), 1024);
        if !log.is_empty() {
            out.push_str(&format!("; log: {log}"));
        }
        if self.booted.is_some() {
            let console = serial_tail(&self.paths.host(in_jail::SERIAL));
            if console.is_empty() {
                out.push_str("; no console output");
            } else {
                out.push_str(&format!("; console: {console}"));
            }
            out.push_str(&format!("; kvm: {}", super::doctor::kvm_quick_verdict()));
        }
        out
    }

    /// The error for a booted guest that printed nothing on its console
    /// and did not answer by `first_output`.
    fn silent(&self, started: Instant) -> VmError {
        VmError::Timeout {
            backend: NAME,
            what: format!(
                "VM {}: the guest's first console output or its agent (a kernel under KVM \
                 prints within a second; this one is not booting){}",
                self.id,
                self.evidence()
            ),
            ms: ms(started, Instant::now()),
        }
    }

    fn alive(&self) -> bool {
        self.vmm.as_ref().is_some_and(Pidfd::is_alive)
    }

    fn take_snapshot_file(&self, in_jail_name: &str, dst: &Path) -> Result<()> {
        let src = self.paths.host(in_jail_name);
        if fs::rename(&src, dst).is_err() {
            // Across filesystems: copy (keeping the memory file's holes),
            // then drop the jail's copy. A torn copy is removed.
            if let Err(e) = copy_sparse(&src, dst) {
                let _ = fs::remove_file(dst);
                return Err(VmError::Io {
                    backend: NAME,
                    what: format!("copy {} to {}", src.display(), dst.display()),
                    source: e,
                });
            }
            let _ = fs::remove_file(&src);
        }
        // Restored VMs hard-link these files, each VM under its own uid and
        // gid: root's and read-only to all, so no VMM can write into the
        // snapshot others restore from. A template snapshot holds a freshly
        // booted template, like the images not a secret; a checkpoint holds
        // a session's state and relies on the directories above it (the
        // state dir, each jail) being closed to other users.
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            jailer::chown(dst, 0, 0)?;
        }
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(dst, fs::Permissions::from_mode(0o444)).map_err(|e| VmError::Io {
            backend: NAME,
            what: format!("chmod {}", dst.display()),
            source: e,
        })
    }

    /// Remove the files a `PUT /snapshot/create` writes into the jail.
    fn remove_new_snapshot_files(&self) {
        for f in [in_jail::NEW_SNAP_STATE, in_jail::NEW_SNAP_MEM] {
            let _ = fs::remove_file(self.paths.host(f));
        }
    }

    /// `PUT /snapshot/create`, Full, into the jail's new-snapshot files.
    fn create_full_snapshot(&self) -> Result<()> {
        self.api(
            "PUT",
            "/snapshot/create",
            &json!({
                "snapshot_type": "Full",
                "snapshot_path": in_jail::NEW_SNAP_STATE,
                "mem_file_path": in_jail::NEW_SNAP_MEM,
            }),
            self.timeouts.snapshot,
        )
        .map(|_| ())
    }

    fn set_state(&self, state: &str) -> Result<()> {
        self.api(
            "PATCH",
            "/vm",
            &json!({ "state": state }),
            self.timeouts.request,
        )
    }

    /// Pause, write a full snapshot into the jail, resume: the part of a
    /// checkpoint the guest is stopped for. The VM is resumed on every
    /// error after the pause was asked for (a pause without an answer may
    /// have happened). Returns how long the guest was paused.
    fn pause_snapshot_resume(&self) -> Result<Duration> {
        let t0 = Instant::now();
        if let Err(e) = self.set_state("Paused") {
            // It may have paused without answering in time: resume to be
            // sure (a running VM stays running).
            let _ = self.set_state("Resumed");
            return Err(e);
        }
        // Full, each checkpoint standing alone: Diff needs dirty page
        // tracking (`track_dirty_pages`, a KVM dirty-log cost on guest
        // writes, which we do not turn on) and a restore that merges the
        // diff onto its base, which Firecracker leaves to its user.
        let created = self.create_full_snapshot();
        let resumed = self.set_state("Resumed");
        let paused = t0.elapsed();
        match (created, resumed) {
            (Ok(()), Ok(())) => Ok(paused),
            (Err(e), Ok(())) => Err(self.snapshot_create_error(e)),
            (created, Err(r)) => Err(VmError::Api {
                backend: NAME,
                msg: format!(
                    "VM {}: left paused after a checkpoint{}: {r} (destroy it)",
                    self.id,
                    match created {
                        Ok(()) => String::new(),
                        Err(e) => format!(" that failed ({})", self.snapshot_create_error(e)),
                    }
                ),
            }),
        }
    }

    /// A failed `PUT /snapshot/create`, naming the files it wrote; a full
    /// disk becomes an `Io` error of kind `StorageFull` (Firecracker only
    /// says so in its fault message).
    fn snapshot_create_error(&self, e: VmError) -> VmError {
        let files = format!(
            "{} and {}",
            self.paths.host(in_jail::NEW_SNAP_STATE).display(),
            self.paths.host(in_jail::NEW_SNAP_MEM).display()
        );
        let msg = e.to_string();
        let errno = [
            (libc::ENOSPC, "No space left on device"),
            (libc::EDQUOT, "Disk quota exceeded"),
        ]
        .into_iter()
        .find(|(_, text)| msg.contains(text))
        .map(|(n, _)| n);
        match errno {
            Some(n) => VmError::Io {
                backend: NAME,
                what: format!("VM {}: write snapshot {files} ({msg})", self.id),
                source: io::Error::from_raw_os_error(n),
            },
            None => VmError::Api {
                backend: NAME,
                msg: format!("{msg} (writing {files})"),
            },
        }
    }

    /// The checkpoint's files into `dir` after [`Self::pause_snapshot_resume`]:
    /// moved out of the jail under temporary names, renamed when both are
    /// there, the manifest last.
    fn seal_checkpoint(&self, dir: &Path) -> Result<u64> {
        let files = [
            (in_jail::NEW_SNAP_STATE, SNAP_STATE_FILE),
            (in_jail::NEW_SNAP_MEM, SNAP_MEM_FILE),
        ];
        for (from, name) in files {
            self.take_snapshot_file(from, &part_path(dir, name))?;
        }
        for (_, name) in files {
            let (part, dst) = (part_path(dir, name), dir.join(name));
            fs::rename(&part, &dst).map_err(|e| VmError::Io {
                backend: NAME,
                what: format!("rename {} to {}", part.display(), dst.display()),
                source: e,
            })?;
        }
        let mut bytes = 0;
        for name in [SNAP_STATE_FILE, SNAP_MEM_FILE] {
            let p = dir.join(name);
            bytes += allocated_bytes(&p).map_err(|e| VmError::Io {
                backend: NAME,
                what: format!("stat {}", p.display()),
                source: e,
            })?;
        }
        Manifest::seal(
            dir,
            &snapshot::Inputs::of(NAME, &self.vmm_version, &self.cfg),
            &[SNAP_STATE_FILE, SNAP_MEM_FILE],
        )?;
        // Sealed: from here on nothing fails (a checkpoint is complete now).
        Ok(bytes + allocated_bytes(&dir.join(snapshot::MANIFEST_FILE)).unwrap_or(0))
    }
}

fn part_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!(".{name}{PART_SUFFIX}"))
}

/// Remove a checkpoint's files, whole or partial, from a `dir` that has no
/// manifest (so they are no checkpoint).
fn clear_checkpoint_files(dir: &Path) {
    for name in [SNAP_STATE_FILE, SNAP_MEM_FILE] {
        let _ = fs::remove_file(part_path(dir, name));
        let _ = fs::remove_file(dir.join(name));
    }
}

/// Bytes a file takes on disk (allocated blocks, not its length).
fn allocated_bytes(path: &Path) -> io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    Ok(fs::metadata(path)?.blocks() * 512)
}

/// Copy `src` to a new `dst`, leaving `src`'s holes holes (the snapshot
/// memory file of a guest that touched little of its RAM is mostly holes).
fn copy_sparse(src: &Path, dst: &Path) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let from = fs::File::open(src)?;
    let len = from.metadata()?.len();
    let to = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dst)?;
    to.set_len(len)?;
    let seek = |off: u64, whence: libc::c_int| -> io::Result<u64> {
        let off = libc::off_t::try_from(off)
            .map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
        // SAFETY: lseek on a descriptor `from` owns; no memory is passed.
        let r = unsafe { libc::lseek(from.as_raw_fd(), off, whence) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r as u64)
        }
    };
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0u64;
    while off < len {
        let data = match seek(off, libc::SEEK_DATA) {
            Ok(d) => d,
            // No data after `off`: the rest is a hole.
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => break,
            Err(e) => return Err(e),
        };
        let end = seek(data, libc::SEEK_HOLE)?.min(len);
        let mut at = data;
        while at < end {
            let want = usize::try_from(end - at)
                .unwrap_or(usize::MAX)
                .min(buf.len());
            let n = from.read_at(&mut buf[..want], at)?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("{} shrank while being copied", src.display()),
                ));
            }
            to.write_all_at(&buf[..n], at)?;
            at += n as u64;
        }
        off = end;
    }
    to.sync_all()
}

/// The last `max` bytes of a file (empty if it cannot be read).
fn read_tail(path: &Path, max: u64) -> Vec<u8> {
    use std::io::Seek;
    let mut buf = Vec::new();
    let Ok(mut f) = fs::File::open(path) else {
        return buf;
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    if f.seek(io::SeekFrom::Start(len.saturating_sub(max))).is_ok() {
        let _ = f.take(max).read_to_end(&mut buf);
    }
    buf
}

fn log_tail(path: &Path, max: u64) -> String {
    String::from_utf8_lossy(&read_tail(path, max))
        .trim()
        .replace('\n', " | ")
}

/// The last lines of a booted guest's serial console file (see
/// [`SERIAL_BURST`]), escaped; empty without output.
fn serial_tail(path: &Path) -> String {
    super::console::tail_text(&read_tail(path, 8 * 1024))
}

impl Vm for FcVm {
    fn id(&self) -> &str {
        &self.id
    }

    fn pid(&self) -> Option<i32> {
        self.vmm.as_ref().filter(|p| p.is_alive()).map(Pidfd::pid)
    }

    fn connect_agent(&mut self, deadline: Instant) -> Result<UnixStream> {
        let vmm = &self.vmm;
        let alive = || vmm.as_ref().is_some_and(Pidfd::is_alive);
        let (uds, port) = (self.paths.vsock(), self.agent_port);
        // A booted guest that neither printed on its console nor answered
        // by `first_output` is not booting: say so then, not at `deadline`.
        // One that printed gets the whole wait; so does one whose agent
        // answers first (console capture is a diagnosis, never a gate).
        let first = self
            .booted
            .filter(|_| !self.answered)
            .map(|s| (s, s + self.timeouts.first_output))
            .filter(|(_, until)| *until < deadline);
        let r = match first {
            Some((started, until)) => match vsock_connect(&uds, port, until, &alive) {
                Err(VmError::Timeout { .. })
                    if fs::metadata(self.paths.host(in_jail::SERIAL))
                        .is_ok_and(|m| m.len() == 0) =>
                {
                    return Err(self.silent(started));
                }
                Err(VmError::Timeout { .. }) => vsock_connect(&uds, port, deadline, &alive),
                other => other,
            },
            None => vsock_connect(&uds, port, deadline, &alive),
        };
        self.answered |= r.is_ok();
        r.map_err(|e| match e {
            VmError::Api { msg, .. } if !self.alive() => self.died(&format!("({msg})")),
            VmError::Timeout { what, ms, .. } if self.booted.is_some() => VmError::Timeout {
                backend: NAME,
                what: format!("{what}{}", self.evidence()),
                ms,
            },
            other => other,
        })
    }

    fn snapshot(&mut self, dir: &Path) -> Result<()> {
        fs::create_dir_all(dir).map_err(|e| VmError::Io {
            backend: NAME,
            what: format!("create snapshot dir {}", dir.display()),
            source: e,
        })?;
        // A stale manifest must not describe the files about to be replaced.
        let _ = fs::remove_file(dir.join(snapshot::MANIFEST_FILE));
        self.remove_new_snapshot_files();
        self.set_state("Paused")?;
        self.create_full_snapshot()?;
        self.take_snapshot_file(in_jail::NEW_SNAP_STATE, &dir.join(SNAP_STATE_FILE))?;
        self.take_snapshot_file(in_jail::NEW_SNAP_MEM, &dir.join(SNAP_MEM_FILE))?;
        Manifest::seal(
            dir,
            &snapshot::Inputs::of(NAME, &self.vmm_version, &self.cfg),
            &[SNAP_STATE_FILE, SNAP_MEM_FILE],
        )
    }

    fn checkpoint(&mut self, dir: &Path) -> Result<CheckpointStats> {
        if dir.join(snapshot::MANIFEST_FILE).exists() {
            return Err(VmError::BadFile {
                path: dir.to_path_buf(),
                problem: "holds a checkpoint already".into(),
                fix: "checkpoint into a new directory".into(),
            });
        }
        let made_dir = !dir.exists();
        fs::create_dir_all(dir).map_err(|e| VmError::Io {
            backend: NAME,
            what: format!("VM {}: create checkpoint dir {}", self.id, dir.display()),
            source: e,
        })?;
        // What a crash left here or in the jail would be taken for ours.
        clear_checkpoint_files(dir);
        self.remove_new_snapshot_files();
        let r = self
            .pause_snapshot_resume()
            .and_then(|paused| Ok((paused, self.seal_checkpoint(dir)?)));
        match r {
            Ok((paused, bytes)) => Ok(CheckpointStats { paused, bytes }),
            Err(e) => {
                // Complete or absent: nothing of it stays, here or in the jail.
                self.remove_new_snapshot_files();
                clear_checkpoint_files(dir);
                if made_dir {
                    let _ = fs::remove_dir(dir);
                }
                Err(e)
            }
        }
    }

    fn checkpoint_resets_agent(&self) -> bool {
        // Firecracker resets the vsock transport at `PUT /snapshot/create`.
        true
    }

    fn destroy(&mut self) -> Result<()> {
        if self.destroyed {
            return Ok(());
        }
        let r = jailer::teardown(
            &self.paths,
            self.vmm.as_ref(),
            Instant::now() + self.timeouts.teardown,
        );
        let r2 = match fs::remove_dir_all(&self.cfg.run_dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(VmError::Io {
                backend: NAME,
                what: format!("remove run dir {}", self.cfg.run_dir.display()),
                source: e,
            }),
        };
        r.and(r2)?;
        self.vmm = None;
        self.destroyed = true;
        Ok(())
    }
}

impl Drop for FcVm {
    fn drop(&mut self) {
        if let Err(e) = self.destroy() {
            log::warn!("firecracker VM {}: teardown on drop: {e}", self.id);
        }
    }
}

/// Open a stream to guest port `port` through Firecracker's vsock UDS:
/// connect, send `CONNECT <port>\n`, expect `OK <host port>\n`. Retries
/// while the socket is missing or the guest is not listening yet (Firecracker
/// then closes the connection); gives up at `deadline`, on a malformed
/// answer, or when `alive()` says the VMM is gone.
pub fn vsock_connect(
    uds: &Path,
    port: u32,
    deadline: Instant,
    alive: &dyn Fn() -> bool,
) -> Result<UnixStream> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(1);
    let mut last = String::new();
    loop {
        if !alive() {
            return Err(VmError::Api {
                backend: NAME,
                msg: format!(
                    "VMM gone while connecting to guest port {port} via {}",
                    uds.display()
                ),
            });
        }
        match handshake(uds, port, deadline) {
            Ok(s) => return Ok(s),
            // An empty reason (deadline hit before trying) keeps the last real one.
            Err(Attempt::Retry(why)) if why.is_empty() => {}
            Err(Attempt::Retry(why)) => last = why,
            // The read waits only until the deadline, so silence is the
            // last try: keep what the tries before it saw (on a loaded host
            // a server that closes at once may not run before the deadline).
            Err(Attempt::Silent) if last.is_empty() => last = SILENT.into(),
            Err(Attempt::Silent) if last.ends_with(SILENT) => {}
            Err(Attempt::Silent) => last = format!("{last}; then {SILENT}"),
            Err(Attempt::Fatal(e)) => return Err(e),
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(VmError::Timeout {
                backend: NAME,
                what: format!(
                    "guest agent on vsock port {port} via {} (last: {})",
                    uds.display(),
                    if last.is_empty() { "no answer" } else { &last }
                ),
                ms: ms(started, deadline),
            });
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

const SILENT: &str = "no answer to CONNECT";

enum Attempt {
    Retry(String),
    /// Connected, but no answer before the deadline.
    Silent,
    Fatal(VmError),
}

fn handshake(uds: &Path, port: u32, deadline: Instant) -> std::result::Result<UnixStream, Attempt> {
    let mut s = match UnixStream::connect(uds) {
        Ok(s) => s,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
            ) =>
        {
            return Err(Attempt::Retry(format!("connect: {e}")))
        }
        Err(e) => {
            return Err(Attempt::Fatal(VmError::Io {
                backend: NAME,
                what: format!("connect to vsock socket {}", uds.display()),
                source: e,
            }))
        }
    };
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(Attempt::Retry(String::new()));
    }
    let set = s
        .set_read_timeout(Some(left))
        .and_then(|_| s.set_write_timeout(Some(left)));
    if let Err(e) = set {
        return Err(Attempt::Fatal(VmError::Io {
            backend: NAME,
            what: "set vsock socket timeout".into(),
            source: e,
        }));
    }
    if let Err(e) = s.write_all(format!("CONNECT {port}\n").as_bytes()) {
        return Err(Attempt::Retry(format!("write CONNECT: {e}")));
    }
    // Read byte by byte up to the newline: anything after it belongs to the
    // guest's stream and must stay in the socket. The line is short.
    let mut line = Vec::with_capacity(24);
    let mut b = [0u8; 1];
    loop {
        match s.read(&mut b) {
            Ok(0) => {
                return Err(Attempt::Retry(if line.is_empty() {
                    "closed before answering (guest not listening yet?)".into()
                } else {
                    format!("closed after {:?}", String::from_utf8_lossy(&line))
                }))
            }
            Ok(_) if b[0] == b'\n' => break,
            Ok(_) => {
                line.push(b[0]);
                if line.len() > 32 {
                    return Err(Attempt::Fatal(bad_answer(uds, &line)));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(Attempt::Silent)
            }
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                return Err(Attempt::Retry(format!("read: {e}")))
            }
            Err(e) => {
                return Err(Attempt::Fatal(VmError::Io {
                    backend: NAME,
                    what: format!("read vsock answer from {}", uds.display()),
                    source: e,
                }))
            }
        }
    }
    let text = String::from_utf8_lossy(&line);
    let ok = text.strip_prefix("OK ").is_some_and(|n| {
        !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()) && n.parse::<u32>().is_ok()
    });
    if !ok {
        return Err(Attempt::Fatal(bad_answer(uds, &line)));
    }
    if let Err(e) = s
        .set_read_timeout(None)
        .and_then(|_| s.set_write_timeout(None))
    {
        return Err(Attempt::Fatal(VmError::Io {
            backend: NAME,
            what: "clear vsock socket timeout".into(),
            source: e,
        }));
    }
    Ok(s)
}

fn bad_answer(uds: &Path, line: &[u8]) -> VmError {
    VmError::Api {
        backend: NAME,
        msg: format!(
            "vsock socket {} answered {:?} to CONNECT, expected \"OK <port>\"",
            uds.display(),
            String::from_utf8_lossy(line)
        ),
    }
}

/// Where a VM's files are, for callers that need them (doctor, tests).
pub fn jail_root(cfg: &JailerConfig, id: &str) -> Result<PathBuf> {
    Ok(JailPaths::new(cfg, id)?.root)
}
