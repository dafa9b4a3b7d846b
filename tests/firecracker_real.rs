//! The Firecracker backend against the real Firecracker and jailer, as far
//! as a host allows: `AGENT_SANDBOX_FIRECRACKER` and `AGENT_SANDBOX_JAILER`
//! name the binaries (static builds: the jailer's chroot holds nothing
//! else). Without them every test here is an allowlisted skip ("needs real
//! Firecracker binaries"): CI installs none and the project builds none.
//!
//! On a host whose KVM runs no guest (nested paravirtual KVM, where these
//! were written), Firecracker still takes every call and runs its vCPU, so
//! all but the guest's boot is real here: the jail (chroot, uid/gid, cgroups,
//! network namespace, rlimits), the API, InstanceStart, pause, snapshot
//! create and load into a second jail, teardown and the crash sweep.

#[path = "common/process.rs"]
mod process;
#[path = "common/skip.rs"]
mod skip;

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agent_sandbox::config::Config;
use agent_sandbox::sandbox::seams::{ResolvedTemplate, TemplateSource};
use agent_sandbox::sandbox::standby::Standby;
use agent_sandbox::sandbox::vm::VmSandboxFactory;
use agent_sandbox::sandbox::{wiring, SandboxFactory, TemplateInfo};
use agent_sandbox::vm::firecracker::FirecrackerBackend;
use agent_sandbox::vm::ids::{IdRange, VmIds};
use agent_sandbox::vm::jailer::{JailPaths, JailerConfig};
use agent_sandbox::vm::launch::DirectSpawner;
use agent_sandbox::vm::templates::Registry;
use agent_sandbox::vm::{Backend, NetAttachment, VmConfig};
use process::process_gone;

const SKIP: &str =
    "needs real Firecracker binaries (AGENT_SANDBOX_FIRECRACKER, AGENT_SANDBOX_JAILER)";

/// What every test here needs; `None` (after recording the skip) without it.
struct Real {
    tmp: tempfile::TempDir,
    /// The chroot base when `tmp` is on another filesystem than the images
    /// (the jail hard-links them).
    _jail_tmp: Option<tempfile::TempDir>,
    jc: JailerConfig,
    backend: Arc<FirecrackerBackend>,
    kernel: PathBuf,
    rootfs: PathBuf,
}

fn real() -> Option<Real> {
    real_with(|_| {})
}

/// As [`real`], with the daemon's config changed by `f` first.
fn real_with(f: impl FnOnce(&mut Config)) -> Option<Real> {
    let bin = |k: &str| {
        std::env::var_os(k)
            .map(PathBuf::from)
            .filter(|p| p.is_file())
    };
    let (Some(fc), Some(jailer)) = (
        bin("AGENT_SANDBOX_FIRECRACKER"),
        bin("AGENT_SANDBOX_JAILER"),
    ) else {
        skip::skipped(SKIP);
        return None;
    };
    // Binaries given, but this host cannot run them: a skip of its own,
    // which CI does not accept (it runs none of these).
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip::skipped("the jailer needs root (chroot, uid switch, cgroups, netns)");
        return None;
    }
    if !Path::new("/dev/kvm").exists() {
        skip::skipped("Firecracker needs /dev/kvm, which this host does not have");
        return None;
    }
    let tmp = tempfile::Builder::new()
        .prefix("fc-real")
        .tempdir()
        .expect("tempdir");
    let mut cfg = Config {
        state_dir: tmp.path().to_path_buf(),
        ..Config::default()
    };
    cfg.artifacts.firecracker = Some(fc);
    cfg.artifacts.jailer = Some(jailer);
    f(&mut cfg);
    // The daemon's own jailer settings for this host (cgroup v1 or v2).
    let mut jc = wiring::jailer_config(&cfg);
    let backend = Arc::new(FirecrackerBackend::new(jc.clone(), Arc::new(DirectSpawner)));
    let reg = Registry::new(wiring::registry_config(&cfg), backend.clone());
    let kernel = reg
        .kernel()
        .expect("a built guest kernel (agent-sandbox image build)");
    let rootfs = reg
        .rootfs("base")
        .expect("the base image (agent-sandbox image build)");
    // The jail on the images' filesystem, so that they are hard-linked in
    // as in production (the cache and the state dir share /var).
    let dev = |p: &Path| fs::metadata(p).map(|m| m.dev()).ok();
    let mut jail_tmp = None;
    if dev(tmp.path()) != dev(&kernel) {
        let cache_root = kernel
            .ancestors()
            .nth(3)
            .expect("kernel path under a cache dir");
        let t = tempfile::Builder::new()
            .prefix("fc-real-jail")
            .tempdir_in(cache_root)
            .expect("jail tempdir next to the image cache");
        jc.chroot_base = t.path().to_path_buf();
        jail_tmp = Some(t);
    }
    let backend = Arc::new(FirecrackerBackend::new(jc.clone(), Arc::new(DirectSpawner)));
    Some(Real {
        tmp,
        _jail_tmp: jail_tmp,
        jc,
        backend,
        kernel,
        rootfs,
    })
}

impl Real {
    fn config(&self, id: &str, uid: u32, net: Option<NetAttachment>) -> VmConfig {
        let run_dir = self.tmp.path().join("run").join(id);
        fs::create_dir_all(&run_dir).expect("run dir");
        VmConfig {
            id: id.into(),
            kernel: self.kernel.clone(),
            rootfs: self.rootfs.clone(),
            vcpus: 1,
            mem_mib: 256,
            cmdline_extra: String::new(),
            net,
            uid,
            gid: uid,
            run_dir,
        }
    }

    fn paths(&self, id: &str) -> JailPaths {
        JailPaths::new(&self.jc, id).expect("jail paths")
    }
}

/// A unique VM id per test and run (jails and cgroups are host-wide).
fn vm_id(tag: &str) -> String {
    format!("asbx-fcreal-{tag}-{}", std::process::id())
}

/// One raw API request; the status line and body.
fn api(sock: &Path, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let mut s = UnixStream::connect(sock).expect("connect API socket");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = Vec::new();
    // Firecracker keeps the connection open: read what comes in a moment.
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                out.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&out);
                if let Some((head, rest)) = text.split_once("\r\n\r\n") {
                    let len = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                        })
                        .unwrap_or(0);
                    if rest.len() >= len {
                        break;
                    }
                }
            }
            Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

fn instance_state(p: &JailPaths) -> String {
    let (status, body) = api(&p.api_sock(), "GET", "/", None);
    assert_eq!(status, 200, "GET /: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("instance info JSON");
    v["state"].as_str().unwrap_or("").to_string()
}

fn status_field(pid: i32, field: &str) -> String {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!("{field}:"))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_default()
}

fn limit(pid: i32, name: &str) -> String {
    fs::read_to_string(format!("/proc/{pid}/limits"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(name))
        .map(|l| {
            l[name.len()..]
                .split_whitespace()
                .next()
                .unwrap_or("")
                .to_string()
        })
        .unwrap_or_default()
}

/// (device, inode) of a directory, following links such as /proc/PID/root.
fn dir_id(p: &str) -> (u64, u64) {
    let m = fs::metadata(p).unwrap_or_else(|e| panic!("stat {p}: {e}"));
    (m.dev(), m.ino())
}

/// A network namespace with a persistent TAP the VM uid may open, as the
/// daemon's network layer makes one; removed on drop.
struct Netns(String);

impl Netns {
    fn new(tag: &str, uid: u32) -> Netns {
        let name = format!("fcreal-{tag}-{}", std::process::id());
        let _ = Command::new("ip")
            .args(["netns", "del", &name])
            .stderr(std::process::Stdio::null())
            .status();
        let ok = |args: &[&str]| {
            let st = Command::new("ip").args(args).status().expect("ip");
            assert!(st.success(), "ip {args:?}");
        };
        ok(&["netns", "add", &name]);
        let n = Netns(name);
        let (u, g) = (uid.to_string(), uid.to_string());
        ok(&[
            "-n", &n.0, "tuntap", "add", "tap0", "mode", "tap", "vnet_hdr", "user", &u, "group", &g,
        ]);
        n
    }

    fn attachment(&self) -> NetAttachment {
        NetAttachment {
            netns: PathBuf::from(format!("/run/netns/{}", self.0)),
            tap: "tap0".into(),
            guest_mac: "06:00:ac:10:00:02".into(),
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// Every cgroup hierarchy mounted here (v1 controllers and the unified
/// one), from /proc/self/mountinfo.
fn cgroup_mounts() -> Vec<PathBuf> {
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let fstype = post.split_whitespace().next()?;
            let mount = pre.split_whitespace().nth(4)?;
            (fstype == "cgroup" || fstype == "cgroup2").then(|| PathBuf::from(mount))
        })
        .collect()
}

/// Nothing of VM `id` is left: jail, a cgroup dir named after it in any
/// hierarchy, a process whose command line names it, a mount.
fn assert_nothing_left(r: &Real, id: &str) {
    let p = r.paths(id);
    assert!(!p.jail_dir.exists(), "jail {} left", p.jail_dir.display());
    for d in &p.cgroup_dirs {
        assert!(!d.exists(), "cgroup {} left", d.display());
    }
    for m in cgroup_mounts() {
        let d = m.join(&r.jc.parent_cgroup).join(id);
        assert!(!d.exists(), "cgroup {} left", d.display());
    }
    // A jailed Firecracker's command line is `/firecracker --id <id> ...`.
    let needle = format!("--id\0{id}\0");
    for e in fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let cmd = fs::read(e.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmd).contains(&needle) && !process_gone(pid) {
            panic!("process {pid} of VM {id} left");
        }
    }
    let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    assert!(
        !mounts.contains(&p.jail_dir.display().to_string()),
        "a mount under the jail is left"
    );
}

/// The jailer's work, checked from outside: the VMM runs chrooted in our
/// jail with our files linked in, as the VM's uid/gid, in the network
/// namespace given, inside its cgroups (v1 or v2, whichever this host has)
/// with our limits, under our rlimits; its API socket answers.
#[test]
fn the_jail_holds_the_vmm_as_configured() {
    let Some(r) = real() else { return };
    let uid = 424_201;
    let ns = Netns::new("jail", uid);
    let id = vm_id("jail");
    let cfg = r.config(&id, uid, Some(ns.attachment()));
    let mut vm = r
        .backend
        .boot(&cfg)
        .expect("boot: every pre-boot call and InstanceStart");
    let p = r.paths(&id);
    let pid = vm.pid().expect("VMM pid");
    assert_eq!(instance_state(&p), "Running");

    // chroot: the VMM's root is the jail's root (the jailer pivots into it
    // in a mount namespace of its own, so /proc/PID/root reads "/": compare
    // the directories themselves); our files are linked in.
    assert_eq!(
        dir_id(&format!("/proc/{pid}/root")),
        dir_id(&p.root.display().to_string()),
        "the VMM's root"
    );
    assert_ne!(
        fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap(),
        fs::read_link("/proc/self/ns/mnt").unwrap(),
        "the VMM's mount namespace"
    );
    for (src, name) in [(&r.kernel, "vmlinux"), (&r.rootfs, "rootfs")] {
        let (a, b) = (
            fs::metadata(src).expect("source"),
            fs::metadata(p.root.join(name)).expect("linked into the jail"),
        );
        assert_eq!(
            (a.dev(), a.ino()),
            (b.dev(), b.ino()),
            "{name} is a hard link of {}",
            src.display()
        );
    }
    // uid/gid switch.
    for f in ["Uid", "Gid"] {
        let ids: Vec<String> = status_field(pid, f)
            .split_whitespace()
            .map(str::to_string)
            .collect();
        assert_eq!(ids, vec![uid.to_string(); 4], "{f}");
    }
    // Network namespace: the one the VM was given.
    let want = fs::metadata(format!("/run/netns/{}", ns.0)).unwrap().ino();
    let got = fs::metadata(format!("/proc/{pid}/ns/net")).unwrap().ino();
    assert_eq!(got, want, "the VMM's network namespace");
    // cgroups: in <parent>/<id> of every hierarchy used, with our limits.
    let cg = fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let rel = format!("/{}/{id}", r.jc.parent_cgroup);
    if r.jc.cgroup_version == 1 {
        for c in ["cpu", "memory", "pids"] {
            assert!(
                cg.lines().any(|l| {
                    let mut it = l.splitn(3, ':');
                    let (_, ctl, path) = (it.next(), it.next().unwrap_or(""), it.next());
                    ctl.split(',').any(|x| x == c) && path == Some(rel.as_str())
                }),
                "{c} cgroup of the VMM is not {rel}: {cg}"
            );
        }
        let dir = |c: &str| {
            p.cgroup_dirs
                .iter()
                .find(|d| d.starts_with(format!("/sys/fs/cgroup/{c}")))
                .unwrap_or_else(|| panic!("no {c} dir in {:?}", p.cgroup_dirs))
                .clone()
        };
        let read = |c: &str, f: &str| {
            fs::read_to_string(dir(c).join(f))
                .unwrap_or_else(|e| panic!("{c}/{f}: {e}"))
                .trim()
                .to_string()
        };
        assert_eq!(read("cpu", "cpu.cfs_period_us"), "100000");
        assert_eq!(read("cpu", "cpu.cfs_quota_us"), "125000", "1 vCPU + 25 %");
        let mem = ((256 + u64::from(r.jc.mem_overhead_mib)) << 20).to_string();
        assert_eq!(read("memory", "memory.limit_in_bytes"), mem);
        if dir("memory").join("memory.memsw.limit_in_bytes").exists() {
            assert_eq!(read("memory", "memory.memsw.limit_in_bytes"), mem);
        }
        assert_eq!(read("pids", "pids.max"), r.jc.pids_max.to_string());
    } else {
        assert!(cg.lines().any(|l| l == format!("0::{rel}")), "{cg}");
        let d = &p.cgroup_dirs[0];
        let read = |f: &str| fs::read_to_string(d.join(f)).unwrap().trim().to_string();
        assert_eq!(read("cpu.max"), "125000 100000");
        assert_eq!(
            read("memory.max"),
            ((256 + u64::from(r.jc.mem_overhead_mib)) << 20).to_string()
        );
        assert_eq!(read("pids.max"), r.jc.pids_max.to_string());
    }
    // Resource limits: no-file and fsize as the jailer was told.
    assert_eq!(limit(pid, "Max open files"), r.jc.no_file.to_string());
    let fsize = (256u64 << 20) + r.jc.fsize_slack_bytes;
    assert_eq!(limit(pid, "Max file size"), fsize.to_string());
    // The console and log files are the VM user's, in the jail.
    for f in ["serial.log", "firecracker.log"] {
        let m = fs::metadata(p.root.join(f)).expect(f);
        assert_eq!((m.uid(), m.gid()), (uid, uid), "{f}");
    }

    vm.destroy().expect("destroy");
    assert!(process_gone(pid), "VMM still running");
    assert_nothing_left(&r, &id);
}

/// `vm_io_max` reaches the VMM's cgroup through the jailer as QEMU's VMM
/// gets it: `blkio.throttle.*_device` per disk of the state and image dirs
/// on cgroup v1, `io.max` on v2.
#[test]
fn the_jail_applies_the_io_limit() {
    let rule = "rbps=104857600 wiops=1000";
    let Some(r) = real_with(|c| c.vm_io_max = Some(rule.into())) else {
        return;
    };
    assert!(!r.jc.io_max.is_empty(), "no disk found for {rule}");
    let id = vm_id("io");
    let mut vm = r
        .backend
        .boot(&r.config(&id, 424_271, None))
        .expect("boot with an io limit");
    let pid = vm.pid().expect("pid");
    let p = r.paths(&id);
    let cg = fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let rel = format!("/{}/{id}", r.jc.parent_cgroup);
    let devs: Vec<&str> =
        r.jc.io_max
            .iter()
            .filter_map(|l| l.split_whitespace().next())
            .collect();
    if r.jc.cgroup_version == 1 {
        assert!(
            cg.lines()
                .any(|l| l.contains(":blkio:") && l.ends_with(rel.as_str())),
            "blkio cgroup of the VMM is not {rel}: {cg}"
        );
        let dir = p
            .cgroup_dirs
            .iter()
            .find(|d| d.starts_with("/sys/fs/cgroup/blkio"))
            .unwrap_or_else(|| panic!("no blkio dir in {:?}", p.cgroup_dirs));
        let read = |f: &str| fs::read_to_string(dir.join(f)).unwrap_or_default();
        for dev in &devs {
            let bps = read("blkio.throttle.read_bps_device");
            assert!(bps.contains(&format!("{dev} 104857600")), "{dev}: {bps}");
            let iops = read("blkio.throttle.write_iops_device");
            assert!(iops.contains(&format!("{dev} 1000")), "{dev}: {iops}");
        }
    } else {
        let io = fs::read_to_string(p.cgroup_dirs[0].join("io.max")).unwrap_or_default();
        for dev in &devs {
            assert!(
                io.lines()
                    .any(|l| l.starts_with(dev) && l.contains("rbps=104857600")),
                "{dev}: {io}"
            );
        }
    }
    vm.destroy().expect("destroy");
    assert_nothing_left(&r, &id);
}

/// Every pre-boot call `Backend::boot` makes (logger, serial, boot source,
/// root drive, machine config, network interface on a TAP in the VM's
/// namespace, vsock) and InstanceStart are accepted by the real API, and
/// the VMM's own view of its configuration (`GET /vm/config`) is what we
/// asked for.
#[test]
fn every_pre_boot_call_and_instance_start_are_accepted() {
    let Some(r) = real() else { return };
    let uid = 424_261;
    let ns = Netns::new("calls", uid);
    let id = vm_id("calls");
    let net = ns.attachment();
    let cfg = r.config(&id, uid, Some(net.clone()));
    let mut vm = r
        .backend
        .boot(&cfg)
        .expect("boot: every pre-boot call and InstanceStart");
    let p = r.paths(&id);
    assert_eq!(instance_state(&p), "Running");
    let (status, body) = api(&p.api_sock(), "GET", "/vm/config", None);
    assert_eq!(status, 200, "GET /vm/config: {body}");
    let c: serde_json::Value = serde_json::from_str(&body).expect("vm config JSON");
    let field = |ptr: &str| c.pointer(ptr).cloned().unwrap_or_default();
    assert_eq!(
        field("/boot-source/kernel_image_path"),
        "/vmlinux",
        "{body}"
    );
    let args = field("/boot-source/boot_args");
    assert!(
        args.as_str().is_some_and(|a| a.contains("root=/dev/vda")),
        "{body}"
    );
    assert_eq!(field("/drives/0/drive_id"), "rootfs", "{body}");
    assert_eq!(field("/drives/0/path_on_host"), "/rootfs", "{body}");
    assert_eq!(field("/drives/0/is_root_device"), true, "{body}");
    assert_eq!(field("/drives/0/is_read_only"), true, "{body}");
    assert_eq!(field("/machine-config/vcpu_count"), 1, "{body}");
    assert_eq!(field("/machine-config/mem_size_mib"), 256, "{body}");
    assert_eq!(field("/machine-config/smt"), false, "{body}");
    assert_eq!(field("/network-interfaces/0/iface_id"), "eth0", "{body}");
    assert_eq!(
        field("/network-interfaces/0/host_dev_name"),
        net.tap.as_str(),
        "{body}"
    );
    assert_eq!(
        field("/network-interfaces/0/guest_mac"),
        net.guest_mac.as_str(),
        "{body}"
    );
    assert_eq!(field("/vsock/guest_cid"), 3, "{body}");
    assert_eq!(field("/vsock/uds_path"), "/v.sock", "{body}");
    // The logger is not part of /vm/config (null there although PUT
    // /logger was accepted): its file shows it instead. The vsock's UDS is
    // made by the VMM in the jail.
    let log = fs::read_to_string(p.root.join("firecracker.log")).unwrap_or_default();
    assert!(!log.is_empty(), "nothing in the VMM's log");
    assert!(
        p.vsock().exists(),
        "no vsock UDS at {}",
        p.vsock().display()
    );
    assert_eq!(deprecations(&p), Vec::<String>::new(), "deprecated calls");
    vm.destroy().expect("destroy");
    assert_nothing_left(&r, &id);
}

/// Lines of the VMM's log (in its jail) that mention a deprecation: a
/// field or endpoint of ours the real API still takes but means to drop.
fn deprecations(p: &JailPaths) -> Vec<String> {
    fs::read_to_string(p.root.join("firecracker.log"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.to_ascii_lowercase().contains("deprecat"))
        .map(str::to_string)
        .collect()
}

/// PATCH /vm Paused, PUT /snapshot/create and PATCH Resumed on a running
/// VM with a network interface (a checkpoint), the files moved out of the
/// jail with their manifest; then PUT /snapshot/load of them, with
/// `network_overrides` naming the TAP in another namespace, into a second
/// jailed Firecracker (other id, uid, netns), which runs the loaded VM and
/// can be checkpointed again. The template path (`Vm::snapshot`) too, and
/// a load of that.
#[test]
fn checkpoint_loads_into_a_second_jail() {
    let Some(r) = real() else { return };
    let (uid, uid2, uid3) = (424_211, 424_212, 424_213);
    let (ns, ns2) = (Netns::new("ckpt", uid), Netns::new("ckpt2", uid2));
    let id = vm_id("ckpt");
    let cfg = r.config(&id, uid, Some(ns.attachment()));
    let mut vm = r.backend.boot(&cfg).expect("boot");
    let dir = r.tmp.path().join("checkpoint");
    let stats = vm
        .checkpoint(&dir)
        .expect("checkpoint (pause, create, resume)");
    assert!(stats.bytes > 0, "{stats:?}");
    assert!(stats.paused < Duration::from_secs(30), "{stats:?}");
    for f in ["vmstate", "memory", "manifest.json"] {
        assert!(dir.join(f).is_file(), "{f} missing in {}", dir.display());
    }
    assert_eq!(
        instance_state(&r.paths(&id)),
        "Running",
        "resumed after the checkpoint"
    );

    // Load into a second jail (new id, new uid, its own netns and TAP).
    let id2 = vm_id("ckpt2");
    let cfg2 = r.config(&id2, uid2, Some(ns2.attachment()));
    let prepared = r
        .backend
        .prepare_restore(&cfg2, &dir)
        .expect("second jail up with the checkpoint's files");
    let mut vm2 = prepared
        .finish()
        .expect("PUT /snapshot/load (network_overrides) accepted");
    let p2 = r.paths(&id2);
    assert_eq!(instance_state(&p2), "Running", "the loaded VM runs");
    assert_ne!(vm2.pid(), vm.pid());
    let want = fs::metadata(format!("/run/netns/{}", ns2.0)).unwrap().ino();
    let pid2 = vm2.pid().expect("pid");
    let got = fs::metadata(format!("/proc/{pid2}/ns/net")).unwrap().ino();
    assert_eq!(got, want, "the loaded VMM's network namespace");
    // A restored VM is checkpointed again (a resumed session paused).
    let again = r.tmp.path().join("checkpoint-again");
    vm2.checkpoint(&again).expect("checkpoint of the loaded VM");
    assert!(again.join("vmstate").is_file());
    assert_eq!(instance_state(&p2), "Running");
    assert_eq!(deprecations(&p2), Vec::<String>::new(), "deprecated calls");
    vm2.destroy().expect("destroy the restored VM");
    assert_nothing_left(&r, &id2);

    // The template path: pause, create, files out of the jail, manifest.
    let tdir = r.tmp.path().join("template");
    vm.snapshot(&tdir).expect("snapshot");
    for f in ["vmstate", "memory", "manifest.json"] {
        assert!(tdir.join(f).is_file(), "{f} missing in {}", tdir.display());
    }
    assert_eq!(
        deprecations(&r.paths(&id)),
        Vec::<String>::new(),
        "deprecated calls"
    );
    vm.destroy().expect("destroy");
    assert_nothing_left(&r, &id);
    // ... and the template snapshot loads as a session's restore does.
    let id3 = vm_id("ckpt3");
    let ns3 = Netns::new("ckpt3", uid3);
    let mut vm3 = r
        .backend
        .prepare_restore(&r.config(&id3, uid3, Some(ns3.attachment())), &tdir)
        .expect("third jail up with the template snapshot")
        .finish()
        .expect("PUT /snapshot/load of the template snapshot");
    assert_eq!(instance_state(&r.paths(&id3)), "Running");
    vm3.destroy().expect("destroy");
    assert_nothing_left(&r, &id3);
}

/// A VMM killed from outside is still torn down completely.
#[test]
fn teardown_after_the_vmm_died_leaves_nothing() {
    let Some(r) = real() else { return };
    let id = vm_id("dead");
    let cfg = r.config(&id, 424_221, None);
    let mut vm = r.backend.boot(&cfg).expect("boot");
    let pid = vm.pid().expect("pid");
    // SAFETY: kill of the VMM this test started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let t = Instant::now();
    while !process_gone(pid) && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    vm.destroy().expect("destroy after the VMM died");
    assert_nothing_left(&r, &id);
}

/// Tears down, when dropped, the jail of a VM the test let go of
/// (`mem::forget`): nothing outlives a failed test.
struct Forgotten<'a>(&'a FirecrackerBackend, String);

impl Drop for Forgotten<'_> {
    fn drop(&mut self) {
        let _ = self.0.cleanup_stale(&self.1);
    }
}

/// No templates: the sweep needs none.
struct NoTemplates;

impl TemplateSource for NoTemplates {
    fn list(&self) -> Vec<TemplateInfo> {
        Vec::new()
    }
    fn resolve(
        &self,
        name: &str,
        _: u32,
        _: u32,
    ) -> agent_sandbox::sandbox::Result<ResolvedTemplate> {
        panic!("the sweep resolved template {name}")
    }
}

/// A jailed Firecracker a crashed daemon left behind (its command line
/// names none of our dirs) is found by the next daemon's start-up sweep
/// (the VM factory's, over a new backend on the same jail dir) through its
/// jail: process killed, jail and cgroups removed. A jailed Firecracker in
/// the same jail dir whose id is none of ours is left alone.
#[test]
fn the_crash_sweep_finds_a_jailed_firecracker() {
    let Some(r) = real() else { return };
    let id = vm_id("orphan");
    let foreign = format!("fcreal-foreign-{}", std::process::id());
    let _guards = (
        Forgotten(&r.backend, id.clone()),
        Forgotten(&r.backend, foreign.clone()),
    );
    let vm = r.backend.boot(&r.config(&id, 424_231, None)).expect("boot");
    let pid = vm.pid().expect("pid");
    let other = r
        .backend
        .boot(&r.config(&foreign, 424_232, None))
        .expect("boot the foreign VM");
    let other_pid = other.pid().expect("pid");
    // The daemon "crashes": nothing tears these VMs down.
    std::mem::forget(vm);
    std::mem::forget(other);
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    assert!(
        !String::from_utf8_lossy(&cmdline).contains(&r.tmp.path().display().to_string()),
        "a jailed Firecracker's command line names our dirs after all"
    );
    // The next daemon: a new backend on the same state dir, in the factory
    // `serve` sweeps through at start (no cgroup parents: the jailer's are
    // host-wide, shared with the other tests' VMs; the backend removes its
    // VMs' own cgroups).
    let run_root = r.tmp.path().join("run");
    let factory = VmSandboxFactory {
        backend: Arc::new(FirecrackerBackend::new(
            r.jc.clone(),
            Arc::new(DirectSpawner),
        )),
        templates: Arc::new(NoTemplates),
        net: None,
        run_root: run_root.clone(),
        cgroup_parents: Vec::new(),
        ids: VmIds::new(
            IdRange {
                first: 424_233,
                count: 2,
            },
            &r.tmp.path().join("ids.lock"),
        )
        .expect("VM ids"),
        agent_timeout: Duration::from_secs(5),
        builds: None,
        standby: Standby::new(0),
    };
    let swept = factory.sweep_orphans().expect("sweep");
    // The orphan's VMM and its run dir.
    assert!(swept >= 1, "the orphan is not found ({swept})");
    let t = Instant::now();
    while !process_gone(pid) && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(process_gone(pid), "orphaned VMM still running");
    assert_nothing_left(&r, &id);
    // Not ours: untouched.
    assert!(!process_gone(other_pid), "the foreign VMM was killed");
    assert!(
        r.paths(&foreign).root.is_dir(),
        "the foreign jail was removed"
    );
    assert_eq!(
        factory.backend.sweep_orphans(&["asbx-", "snap-"]),
        0,
        "nothing left to sweep"
    );
    r.backend
        .cleanup_stale(&foreign)
        .expect("tear the foreign VM down");
    assert!(process_gone(other_pid), "foreign VMM still running");
    assert_nothing_left(&r, &foreign);
}

/// Two VMs at once share nothing: uid, jail, cgroups, sockets.
#[test]
fn two_vms_share_no_jail_uid_or_cgroup() {
    let Some(r) = real() else { return };
    let (a, b) = (vm_id("two-a"), vm_id("two-b"));
    let mut va = r
        .backend
        .boot(&r.config(&a, 424_241, None))
        .expect("boot a");
    let mut vb = r
        .backend
        .boot(&r.config(&b, 424_242, None))
        .expect("boot b");
    let (pa, pb) = (va.pid().expect("pid a"), vb.pid().expect("pid b"));
    assert_ne!(status_field(pa, "Uid"), status_field(pb, "Uid"));
    let (ja, jb) = (r.paths(&a), r.paths(&b));
    assert_ne!(ja.root, jb.root);
    for (x, y) in ja.cgroup_dirs.iter().zip(&jb.cgroup_dirs) {
        assert_ne!(x, y);
    }
    assert_ne!(
        dir_id(&format!("/proc/{pa}/root")),
        dir_id(&format!("/proc/{pb}/root"))
    );
    va.destroy().expect("destroy a");
    vb.destroy().expect("destroy b");
    assert_nothing_left(&r, &a);
    assert_nothing_left(&r, &b);
}

/// A guest that does not come up fails in seconds, not at the agent
/// timeout, with the VMM's log and the KVM verdict. Only meaningful where
/// KVM runs no guest; on a host where the guest boots, it connects.
#[test]
fn a_guest_that_does_not_come_up_fails_in_seconds() {
    let Some(r) = real() else { return };
    let id = vm_id("silent");
    let cfg = r.config(&id, 424_251, None);
    let mut vm = r.backend.boot(&cfg).expect("boot");
    let t = Instant::now();
    match vm.connect_agent(Instant::now() + Duration::from_secs(60)) {
        Ok(_) => eprintln!("the guest booted here: nothing to check"),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "took {:?}: {msg}",
                t.elapsed()
            );
            assert!(msg.contains("kvm: "), "{msg}");
            assert!(
                msg.contains("log: ") || msg.contains("no console output"),
                "{msg}"
            );
        }
    }
    vm.destroy().expect("destroy");
    assert_nothing_left(&r, &id);
}
