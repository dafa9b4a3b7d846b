//! Jailer argv, id rules, chroot layout and teardown, without a jailer.
//! Runs as any user; the ownership checks use uid 4242 as root and the
//! caller otherwise.

use std::ffi::OsString;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use agent_sandbox::vm::jailer::{
    self, build_argv, in_jail, prepare_chroot, teardown, JailFile, JailPaths, JailerConfig,
    LaunchSpec, DOCUMENTED_JAILER_FLAGS,
};
use agent_sandbox::vm::launch::{validate_id, DirectSpawner, Spawner};
use agent_sandbox::vm::VmError;

/// The jailer's flags as documented for v1.16 in Firecracker's
/// docs/jailer.md ("Jailer Usage"), written out here independently of the
/// constant the library uses.
const JAILER_DOC_FLAGS: &[&str] = &[
    "--id",
    "--exec-file",
    "--uid",
    "--gid",
    "--cgroup-version",
    "--cgroup",
    "--parent-cgroup",
    "--chroot-base-dir",
    "--netns",
    "--resource-limit",
    "--daemonize",
    "--new-pid-ns",
];

/// Jailer flags that take no value.
const JAILER_SWITCHES: &[&str] = &["--daemonize", "--new-pid-ns"];

/// Firecracker's own command-line flags we may pass after `--`
/// (`firecracker --help`, v1.x).
const FIRECRACKER_FLAGS: &[&str] = &["--api-sock", "--level", "--log-path", "--config-file"];

/// Resources `--resource-limit` accepts (docs/jailer.md).
const RESOURCE_LIMITS: &[&str] = &["fsize", "no-file"];

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "fcj-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn vm_user() -> (u32, u32) {
    // SAFETY: no preconditions.
    unsafe {
        if libc::geteuid() == 0 {
            (4242, 4242)
        } else {
            (libc::getuid(), libc::getgid())
        }
    }
}

fn spec(netns: Option<&str>) -> LaunchSpec {
    LaunchSpec {
        id: "sess-0123-abcd".into(),
        uid: 4242,
        gid: 4343,
        netns: netns.map(PathBuf::from),
        vcpus: 2,
        mem_mib: 256,
    }
}

fn strs(argv: &[OsString]) -> Vec<String> {
    argv.iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

/// Pairs (flag, value) of the jailer part, checking every flag is documented.
fn parse_jailer(argv: &[String]) -> (Vec<(String, Option<String>)>, Vec<String>) {
    let sep = argv.iter().position(|a| a == "--").expect("argv has --");
    let mut out = Vec::new();
    let mut i = 1;
    while i < sep {
        let f = &argv[i];
        assert!(
            JAILER_DOC_FLAGS.contains(&f.as_str()),
            "undocumented jailer flag {f}"
        );
        if JAILER_SWITCHES.contains(&f.as_str()) {
            out.push((f.clone(), None));
            i += 1;
        } else {
            let v = argv
                .get(i + 1)
                .filter(|v| !v.starts_with("--"))
                .expect("flag value");
            out.push((f.clone(), Some(v.clone())));
            i += 2;
        }
    }
    (out, argv[sep + 1..].to_vec())
}

#[test]
fn library_flag_list_matches_the_docs() {
    let mut a: Vec<_> = DOCUMENTED_JAILER_FLAGS.to_vec();
    let mut b: Vec<_> = JAILER_DOC_FLAGS.to_vec();
    a.sort();
    b.sort();
    assert_eq!(a, b);
}

#[test]
fn argv_uses_only_documented_flags_with_the_right_values() {
    let cfg = JailerConfig::default();
    let argv = strs(&build_argv(&cfg, &spec(Some("/run/netns/asbx-s1"))).unwrap());
    assert_eq!(argv[0], "/usr/local/bin/jailer");
    let (flags, fc) = parse_jailer(&argv);
    let get = |f: &str| -> Vec<Option<String>> {
        flags
            .iter()
            .filter(|(k, _)| k == f)
            .map(|(_, v)| v.clone())
            .collect()
    };
    let one = |f: &str| get(f).into_iter().next().flatten().unwrap_or_default();
    assert_eq!(one("--id"), "sess-0123-abcd");
    assert_eq!(one("--exec-file"), "/usr/local/bin/firecracker");
    assert_eq!(one("--uid"), "4242");
    assert_eq!(one("--gid"), "4343");
    assert_eq!(one("--chroot-base-dir"), "/srv/jailer");
    assert_eq!(one("--netns"), "/run/netns/asbx-s1");
    assert_eq!(one("--cgroup-version"), "2");
    assert_eq!(one("--parent-cgroup"), "agent-sandbox");
    let cgroups: Vec<String> = get("--cgroup").into_iter().flatten().collect();
    // 2 vCPUs + 25 % for the VMM's own threads; 256 + 64 MiB.
    assert_eq!(
        cgroups,
        [
            "cpu.max=225000 100000",
            "memory.max=335544320",
            "pids.max=64"
        ]
    );
    for c in &cgroups {
        // <controller>.<file>=<value>, as the jailer parses it.
        let (file, value) = c.split_once('=').unwrap();
        assert_eq!(file.split('.').count(), 2, "{c}");
        assert!(!value.is_empty());
    }
    let limits: Vec<String> = get("--resource-limit").into_iter().flatten().collect();
    // fsize must fit the snapshot memory file: 256 MiB + 64 MiB slack.
    assert_eq!(limits, ["fsize=335544320", "no-file=1024"]);
    for l in &limits {
        let (res, v) = l.split_once('=').unwrap();
        assert!(RESOURCE_LIMITS.contains(&res), "{l}");
        v.parse::<u64>().unwrap();
    }
    assert_eq!(get("--new-pid-ns"), [None]);
    assert_eq!(get("--daemonize"), [None]);
    assert_eq!(fc, ["--api-sock", "/api.sock"]);
    for f in fc.iter().filter(|a| a.starts_with("--")) {
        assert!(
            FIRECRACKER_FLAGS.contains(&f.as_str()),
            "unknown firecracker flag {f}"
        );
    }
    // Each flag once, except the repeatable ones.
    for (f, _) in &flags {
        if f != "--cgroup" && f != "--resource-limit" {
            assert_eq!(get(f).len(), 1, "{f} repeated");
        }
    }

    let argv = strs(&build_argv(&cfg, &spec(None)).unwrap());
    assert!(!argv.iter().any(|a| a == "--netns"));

    // An io.max rule (vm_io_max) becomes one --cgroup per disk.
    let cfg = JailerConfig {
        io_max: vec!["253:0 wbps=1048576".into(), "8:0 wbps=1048576".into()],
        ..JailerConfig::default()
    };
    let argv = strs(&build_argv(&cfg, &spec(None)).unwrap());
    let (flags, _) = parse_jailer(&argv);
    let io: Vec<&str> = flags
        .iter()
        .filter_map(|(k, v)| (k == "--cgroup").then_some(v.as_deref()).flatten())
        .filter(|v| v.starts_with("io."))
        .collect();
    assert_eq!(io, ["io.max=253:0 wbps=1048576", "io.max=8:0 wbps=1048576"]);
}

/// The real jailer (v1.17.0-dev) copies each v1 file from the parent
/// cgroup first and fails on an empty one, as a `blkio.throttle.*` file is
/// without rules: the parent gets a rule that never binds for each device
/// and file, once, and an operator's own rule is left as it is.
#[test]
fn a_v1_blkio_parent_gets_rules_that_never_bind_before_the_jailer_runs() {
    let root = tempfile::tempdir().expect("tempdir");
    let files = [
        "blkio.throttle.read_bps_device",
        "blkio.throttle.write_bps_device",
        "blkio.throttle.read_iops_device",
        "blkio.throttle.write_iops_device",
    ];
    for f in files {
        fs::write(root.path().join(f), "").unwrap();
    }
    let cfg = JailerConfig {
        cgroup_version: 1,
        cgroup_v1_roots: vec![root.path().to_path_buf()],
        io_max: vec![
            "8:0 rbps=1048576 wiops=100 riops=max".into(),
            "253:1 wbps=5".into(),
        ],
        ..JailerConfig::default()
    };
    let parent = root.path().join(&cfg.parent_cgroup);
    fs::create_dir_all(&parent).unwrap();
    for f in files {
        fs::write(parent.join(f), "").unwrap();
    }
    // An operator's rule for 253:1 stays.
    fs::write(parent.join(files[1]), "253:1 7\n").unwrap();
    jailer::prepare_v1_parents(&cfg).expect("prepare");
    jailer::prepare_v1_parents(&cfg).expect("again: nothing to add");
    let read = |f: &str| fs::read_to_string(parent.join(f)).unwrap();
    assert_eq!(read(files[0]), format!("8:0 {}\n", u64::MAX - 1));
    assert_eq!(read(files[1]), "253:1 7\n");
    assert_eq!(read(files[2]), "", "riops=max is no v1 rule");
    assert_eq!(read(files[3]), format!("8:0 {}\n", u32::MAX - 1));
    // Nothing on v2, nor without io_max.
    let v2 = JailerConfig {
        cgroup_version: 2,
        ..cfg.clone()
    };
    jailer::prepare_v1_parents(&v2).expect("v2");
    let none = JailerConfig {
        io_max: Vec::new(),
        cgroup_v1_roots: vec!["/nonexistent".into()],
        ..cfg
    };
    jailer::prepare_v1_parents(&none).expect("no io_max");
}

#[test]
fn argv_on_a_cgroup_v1_host_carries_the_same_limits_as_v1_files() {
    let cfg = JailerConfig {
        cgroup_version: 1,
        cgroup_v1_roots: vec!["/sys/fs/cgroup/cpu".into(), "/sys/fs/cgroup/memory".into()],
        io_max: vec!["8:0 wbps=1048576 riops=max wiops=100".into()],
        ..JailerConfig::default()
    };
    let argv = strs(&build_argv(&cfg, &spec(None)).unwrap());
    let (flags, _) = parse_jailer(&argv);
    let get = |f: &str| -> Vec<String> {
        flags
            .iter()
            .filter(|(k, _)| k == f)
            .filter_map(|(_, v)| v.clone())
            .collect()
    };
    assert_eq!(get("--cgroup-version"), ["1"]);
    // The same figures as the v2 argv above: 2 vCPUs + 25 %, 256 + 64 MiB,
    // 64 pids; io.max's "max" is no v1 rule at all. memsw (swap included)
    // where this host's memory hierarchy has it, right after the limit.
    let mut want = vec![
        "cpu.cfs_period_us=100000",
        "cpu.cfs_quota_us=225000",
        "memory.limit_in_bytes=335544320",
        "pids.max=64",
        "blkio.throttle.write_bps_device=8:0 1048576",
        "blkio.throttle.write_iops_device=8:0 100",
    ];
    if Path::new("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes").exists() {
        want.insert(3, "memory.memsw.limit_in_bytes=335544320");
    }
    assert_eq!(get("--cgroup"), want);
    // A memory hierarchy without swap accounting gets no memsw.
    let bare = tempfile::tempdir().expect("tempdir");
    let no_swap = JailerConfig {
        cgroup_v1_roots: vec![bare.path().to_path_buf()],
        ..cfg.clone()
    };
    let argv = strs(&build_argv(&no_swap, &spec(None)).unwrap());
    assert!(!argv.iter().any(|a| a.contains("memsw")), "{argv:?}");
    // <controller>.<file>=<value>: the jailer takes the controller from
    // the part before the first dot.
    for c in get("--cgroup") {
        let ctl = c.split('.').next().unwrap();
        assert!(["cpu", "memory", "pids", "blkio"].contains(&ctl), "{c}");
    }
    // Its dirs, one per v1 hierarchy, removed by teardown.
    let p = JailPaths::new(&cfg, "vm-1").unwrap();
    assert_eq!(
        p.cgroup_dirs,
        [
            Path::new("/sys/fs/cgroup/cpu/agent-sandbox/vm-1"),
            Path::new("/sys/fs/cgroup/memory/agent-sandbox/vm-1")
        ]
    );
    let bad = JailerConfig {
        cgroup_version: 3,
        ..JailerConfig::default()
    };
    assert!(build_argv(&bad, &spec(None)).is_err());
}

#[test]
fn argv_rejects_bad_settings() {
    let ok = JailerConfig::default();
    let cases: Vec<(JailerConfig, LaunchSpec, &str)> = vec![
        (
            ok.clone(),
            LaunchSpec {
                id: "a_b".into(),
                ..spec(None)
            },
            "invalid VM id",
        ),
        (ok.clone(), spec(Some("run/netns/x")), "absolute"),
        (
            JailerConfig {
                chroot_base: "srv".into(),
                ..ok.clone()
            },
            spec(None),
            "absolute",
        ),
        (
            JailerConfig {
                parent_cgroup: "../x".into(),
                ..ok.clone()
            },
            spec(None),
            "parent cgroup",
        ),
        (
            JailerConfig {
                parent_cgroup: "/abs".into(),
                ..ok.clone()
            },
            spec(None),
            "parent cgroup",
        ),
        (
            JailerConfig {
                firecracker_bin: "/usr/bin/vmm".into(),
                ..ok.clone()
            },
            spec(None),
            "firecracker",
        ),
        (
            ok.clone(),
            LaunchSpec {
                vcpus: 0,
                ..spec(None)
            },
            "non-zero",
        ),
    ];
    for (cfg, s, want) in cases {
        let e = build_argv(&cfg, &s).unwrap_err().to_string();
        assert!(e.contains(want), "{e:?} should mention {want:?}");
    }
}

#[test]
fn ids_follow_the_jailer_rule() {
    for good in [
        "a",
        "abc-DEF-123",
        "551e7604-e35c-42b3-b825-416853441234",
        &"x".repeat(64),
    ] {
        validate_id(good).unwrap_or_else(|e| panic!("{good}: {e}"));
    }
    for bad in [
        "",
        &"x".repeat(65),
        "a_b",
        "a/b",
        "..",
        "a b",
        "é",
        "a\0b",
        "a.b",
    ] {
        assert!(validate_id(bad).is_err(), "{bad:?} accepted");
    }
}

#[test]
fn paths_follow_the_jailer_layout() {
    let cfg = JailerConfig {
        chroot_base: "/srv/jailer".into(),
        cgroup_root: "/sys/fs/cgroup".into(),
        ..JailerConfig::default()
    };
    let p = JailPaths::new(&cfg, "vm-1").unwrap();
    assert_eq!(p.jail_dir, Path::new("/srv/jailer/firecracker/vm-1"));
    assert_eq!(p.root, Path::new("/srv/jailer/firecracker/vm-1/root"));
    assert_eq!(
        p.api_sock(),
        Path::new("/srv/jailer/firecracker/vm-1/root/api.sock")
    );
    assert_eq!(
        p.vsock(),
        Path::new("/srv/jailer/firecracker/vm-1/root/v.sock")
    );
    assert_eq!(
        p.pid_file(),
        Path::new("/srv/jailer/firecracker/vm-1/root/firecracker.pid")
    );
    assert_eq!(
        p.cgroup_dirs,
        [Path::new("/sys/fs/cgroup/agent-sandbox/vm-1")]
    );
    assert_eq!(
        p.host(in_jail::ROOTFS),
        Path::new("/srv/jailer/firecracker/vm-1/root/rootfs")
    );
    assert!(JailPaths::new(&cfg, "../etc").is_err());
    // The longest id still gives socket paths that fit sun_path.
    let long = JailPaths::new(&cfg, &"x".repeat(64)).unwrap();
    jailer::check_socket_path(&long.api_sock()).unwrap();
    let deep = JailerConfig {
        chroot_base: PathBuf::from("/").join("d".repeat(60)),
        ..cfg
    };
    let deep = JailPaths::new(&deep, &"x".repeat(64)).unwrap();
    assert!(jailer::check_socket_path(&deep.api_sock()).is_err());
}

#[test]
fn chroot_gets_linked_files_and_owned_writable_files() {
    let t = TempDir::new("chroot");
    let (uid, gid) = vm_user();
    let cfg = JailerConfig {
        chroot_base: t.0.join("jail"),
        cgroup_root: t.0.join("cg"),
        ..JailerConfig::default()
    };
    let paths = JailPaths::new(&cfg, "vm-c").unwrap();
    let kernel = t.0.join("vmlinux");
    let rootfs = t.0.join("rootfs.erofs");
    fs::write(&kernel, b"kernel").unwrap();
    fs::write(&rootfs, b"rootfs").unwrap();
    for f in [&kernel, &rootfs] {
        fs::set_permissions(f, fs::Permissions::from_mode(0o444)).unwrap();
    }
    let files = [
        JailFile {
            src: kernel.clone(),
            in_jail: in_jail::KERNEL,
        },
        JailFile {
            src: rootfs.clone(),
            in_jail: in_jail::ROOTFS,
        },
    ];
    prepare_chroot(&paths, uid, gid, &files, &[in_jail::LOG]).unwrap();
    let k = fs::metadata(paths.host(in_jail::KERNEL)).unwrap();
    assert_eq!(
        k.ino(),
        fs::metadata(&kernel).unwrap().ino(),
        "kernel is hard-linked"
    );
    assert_eq!(
        fs::metadata(paths.host(in_jail::ROOTFS)).unwrap().ino(),
        fs::metadata(&rootfs).unwrap().ino()
    );
    let log = fs::metadata(paths.host(in_jail::LOG)).unwrap();
    assert_eq!(
        (log.uid(), log.gid(), log.mode() & 0o777),
        (uid, gid, 0o600)
    );

    // A shared file the VM user could write is refused, naming the fix.
    fs::set_permissions(&rootfs, fs::Permissions::from_mode(0o666)).unwrap();
    let e = prepare_chroot(&paths, uid, gid, &files, &[]).unwrap_err();
    assert!(
        matches!(&e, VmError::BadFile { path, fix, .. } if path == &rootfs && fix.contains("chmod")),
        "{e}"
    );
    // A missing file is named.
    let gone = [JailFile {
        src: t.0.join("nope"),
        in_jail: in_jail::KERNEL,
    }];
    let e = prepare_chroot(&paths, uid, gid, &gone, &[]).unwrap_err();
    assert!(
        matches!(&e, VmError::BadFile { path, .. } if path.ends_with("nope")),
        "{e}"
    );
    teardown(&paths, None, Instant::now() + Duration::from_secs(1)).unwrap();
    assert!(!paths.jail_dir.exists());
}

/// A fake jail as the jailer leaves it: chroot with dev nodes' dirs, the
/// VMM binary, its pid file, a running "VMM", and the cgroup dir.
/// `v1`: as `--cgroup-version 1` leaves it, a dir in two hierarchies.
fn fake_jail(t: &TempDir, id: &str, v1: bool) -> (JailPaths, i32) {
    let cfg = JailerConfig {
        chroot_base: t.0.join("jail"),
        cgroup_root: t.0.join("cg"),
        cgroup_version: if v1 { 1 } else { 2 },
        cgroup_v1_roots: vec![t.0.join("cg1/memory"), t.0.join("cg1/pids")],
        ..JailerConfig::default()
    };
    let paths = JailPaths::new(&cfg, id).unwrap();
    fs::create_dir_all(paths.root.join("dev/net")).unwrap();
    fs::write(paths.root.join("dev/net/tun"), b"").unwrap();
    fs::write(paths.host(in_jail::ROOTFS), b"x").unwrap();
    for d in &paths.cgroup_dirs {
        fs::create_dir_all(d).unwrap();
    }
    let exe = paths.root.join("firecracker");
    fs::copy("/bin/sleep", &exe).unwrap();
    #[allow(clippy::zombie_processes)] // teardown reaps it
    let child = std::process::Command::new(&exe).arg("60").spawn().unwrap();
    let pid = child.id() as i32;
    // spawn() can return a moment before exec renames the process.
    let until = Instant::now() + Duration::from_secs(2);
    while fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default() != "firecracker\n" {
        assert!(Instant::now() < until, "stand-in VMM never exec'd");
        std::thread::sleep(Duration::from_millis(1));
    }
    fs::write(paths.pid_file(), pid.to_string()).unwrap();
    (paths, pid)
}

fn running(pid: i32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        Ok(s) => !s
            .rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with('Z')),
    }
}

#[test]
fn teardown_kills_reaps_removes_and_is_idempotent() {
    let t = TempDir::new("teardown");
    let (paths, pid) = fake_jail(&t, "vm-t", false);
    assert!(running(pid));
    let deadline = || Instant::now() + Duration::from_secs(2);
    teardown(&paths, None, deadline()).unwrap();
    assert!(!running(pid), "VMM still running");
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "VMM not reaped"
    );
    assert!(!paths.jail_dir.exists());
    for d in &paths.cgroup_dirs {
        assert!(!d.exists(), "{} left", d.display());
        assert!(d.parent().unwrap().exists(), "shared parent cgroup kept");
    }
    teardown(&paths, None, deadline()).unwrap();
    teardown(&paths, None, deadline()).unwrap();

    // With a pidfd taken at launch, as the backend does.
    let (paths, pid) = fake_jail(&t, "vm-t2", true);
    assert_eq!(paths.cgroup_dirs.len(), 2);
    let vmm = jailer::open_vmm(&paths).unwrap().expect("comm matches");
    assert_eq!(vmm.pid(), pid);
    teardown(&paths, Some(&vmm), deadline()).unwrap();
    assert!(!running(pid));
    assert!(
        paths.cgroup_dirs.iter().all(|d| !d.exists()),
        "v1 dirs left"
    );
    teardown(&paths, Some(&vmm), deadline()).unwrap();
}

#[test]
fn teardown_never_kills_a_process_that_is_not_the_vmm() {
    let t = TempDir::new("notvmm");
    let (paths, vmm_pid) = fake_jail(&t, "vm-n", false);
    // Stale pid file naming some other process (pid reuse).
    let mut other = std::process::Command::new("/bin/sleep")
        .arg("60")
        .spawn()
        .unwrap();
    fs::write(paths.pid_file(), other.id().to_string()).unwrap();
    teardown(&paths, None, Instant::now() + Duration::from_secs(1)).unwrap();
    assert!(running(other.id() as i32), "unrelated process was killed");
    assert!(!paths.jail_dir.exists());
    other.kill().unwrap();
    other.wait().unwrap();
    // Clean up the real stand-in VMM we orphaned from its pid file.
    let mut st = 0;
    // SAFETY: signalling and waiting for our own child, by its pid.
    unsafe {
        libc::kill(vmm_pid, libc::SIGKILL);
        libc::waitpid(vmm_pid, &mut st, 0);
    }
}

#[test]
fn direct_spawner_captures_output_and_bounds_time() {
    let argv: Vec<OsString> = ["/bin/sh", "-c", "echo out; echo err >&2; exit 3"]
        .iter()
        .map(OsString::from)
        .collect();
    let out = DirectSpawner
        .run(&argv, Instant::now() + Duration::from_secs(5))
        .unwrap();
    assert_eq!(out.code, Some(3));
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");

    let argv: Vec<OsString> = ["/bin/sleep", "30"].iter().map(OsString::from).collect();
    let t = Instant::now();
    let e = DirectSpawner
        .run(&argv, Instant::now() + Duration::from_millis(200))
        .unwrap_err();
    assert!(matches!(e, VmError::Timeout { .. }), "{e}");
    // Killed at its deadline, not waited for (30 s).
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());

    let argv: Vec<OsString> = vec!["/nonexistent/jailer".into()];
    let e = DirectSpawner
        .run(&argv, Instant::now() + Duration::from_secs(1))
        .unwrap_err();
    assert!(e.to_string().contains("/nonexistent/jailer"), "{e}");
}

#[test]
fn cgroup2_mount_is_found_like_the_jailer_finds_it() {
    let mounts = fs::read_to_string("/proc/mounts").unwrap();
    let want = mounts
        .lines()
        .find(|l| l.split(' ').nth(2) == Some("cgroup2"))
        .and_then(|l| l.split(' ').nth(1))
        .map(PathBuf::from);
    assert_eq!(jailer::cgroup2_mount(), want);
}

/// The jailer copies only the exec file into an empty chroot: a
/// dynamically linked Firecracker is named as such before anyone looks
/// for why the jail's VMM "exited while starting".
#[test]
fn a_dynamically_linked_vmm_binary_is_named() {
    let sh = Path::new("/bin/sh");
    let interp = jailer::elf_interpreter(sh).expect("read /bin/sh");
    assert!(
        interp.as_deref().is_some_and(|i| i.contains("ld-linux")),
        "{interp:?}"
    );
    let e = jailer::check_static_exec(sh).expect_err("/bin/sh is dynamic");
    assert!(e.to_string().contains("dynamically linked"), "{e}");
    // busybox-static (an install-deps package) is a static ELF.
    let bb = Path::new("/bin/busybox");
    assert_eq!(jailer::elf_interpreter(bb).expect("read busybox"), None);
    jailer::check_static_exec(bb).expect("static busybox");
    // Not an ELF: left for exec to judge.
    let dir = tempfile::tempdir().expect("tempdir");
    let text = dir.path().join("script");
    fs::write(&text, "#!/bin/sh\n").expect("write");
    assert_eq!(jailer::elf_interpreter(&text).expect("read"), None);
}
