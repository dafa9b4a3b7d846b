//! `serve` as a systemd unit runs it (issue #23). Cgroups: started in a cgroup of
//! its own in every hierarchy, delegated to it (the `trusted.delegate`
//! xattr systemd sets for `Delegate=yes`), every VMM lands inside that
//! subtree, and stopping the unit (SIGTERM to the daemon, then SIGKILL to
//! whatever is left in the subtree: `KillMode=mixed`), or killing the whole
//! subtree of a hung daemon, leaves no VMM running; after the hang, the
//! next start removes what is left (namespaces, run dirs).

mod common;
#[path = "common/process.rs"]
mod process;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::{unique_prefix, Daemon};
use common::wait_until;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Duration;

use agent_sandbox::vm::cgroup::{self, Hierarchy, DAEMON_LEAF, VMS_DIR};

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A stand-in for a unit's cgroup: `<test's own cgroup>/<name>` in each
/// hierarchy the daemon uses (as systemd makes `<slice>/<unit>`), removed
/// on drop after every process in it is killed.
struct Unit {
    dirs: Vec<(Hierarchy, PathBuf)>,
}

impl Unit {
    fn new(name: &str) -> Unit {
        Self::make(name, false)
    }

    /// At one path in every hierarchy, as systemd makes a unit's cgroups
    /// (the jailer needs that); `new` nests below the test's own cgroups.
    fn at_root(name: &str) -> Unit {
        Self::make(name, true)
    }

    fn make(name: &str, root: bool) -> Unit {
        let me = std::fs::read_to_string("/proc/self/cgroup").expect("/proc/self/cgroup");
        let mut dirs = Vec::new();
        for h in cgroup::hierarchies() {
            let own = if root {
                PathBuf::new()
            } else {
                cgroup::own_rel(&h, &me).unwrap_or_default()
            };
            let dir = h.mount.join(own).join(name);
            std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
            dirs.push((h, dir));
        }
        Unit { dirs }
    }

    fn v2(&self) -> Option<&Path> {
        self.dirs
            .iter()
            .find(|(h, _)| h.v1.is_none())
            .map(|(_, d)| d.as_path())
    }

    fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs
            .iter()
            .map(|(_, d)| d.join("cgroup.procs"))
            .collect()
    }

    /// Every process in the subtree, in any hierarchy.
    fn pids(&self) -> Vec<i32> {
        let mut out = Vec::new();
        for (_, d) in &self.dirs {
            collect(d, &mut out);
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// What systemd does after the stop timeout (or at once for a hung
    /// main process under `KillMode=control-group`): SIGKILL everything.
    fn kill_all(&self) {
        for _ in 0..50 {
            let pids = self.pids();
            if pids.is_empty() {
                return;
            }
            for p in pids {
                // SAFETY: processes of the test's own unit cgroup.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn collect(dir: &Path, out: &mut Vec<i32>) {
    if let Ok(t) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        out.extend(t.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
    }
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            collect(&e.path(), out);
        }
    }
}

fn rmdir_tree(dir: &Path) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            rmdir_tree(&e.path());
        }
    }
    let _ = std::fs::remove_dir(dir);
}

impl Drop for Unit {
    fn drop(&mut self) {
        self.kill_all();
        for (_, d) in &self.dirs {
            rmdir_tree(d);
        }
    }
}

/// `pid`'s cgroup path in hierarchy `h` (absolute, below the mount).
fn cgroup_of(pid: i32, h: &Hierarchy) -> Option<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    cgroup::own_rel(h, &text).map(|r| h.mount.join(r))
}

/// The raw cgroup line of `pid` in `h` (`own_rel` maps a `daemon` leaf to
/// its parent, which this check must see).
fn raw_cgroup_of(pid: i32, h: &Hierarchy) -> Option<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (id, ctls, path) = (f.next()?, f.next()?, f.next()?);
        let hit = match &h.v1 {
            None => id == "0" && ctls.is_empty(),
            Some(ours) => {
                let name = if ours[0] == "io" { "blkio" } else { ours[0] };
                ctls.split(',').any(|c| c == name)
            }
        };
        hit.then(|| h.mount.join(path.trim_start_matches('/')))
    })
}

fn unit_daemon(unit: &Unit, dir: tempfile::TempDir, prefix: &str) -> Daemon {
    Daemon::start_in_cgroups(
        dir,
        &unit.procs_files(),
        &["--net-prefix", prefix, "--standby-vmms", "1"],
    )
}

/// A daemon's state dir (a temp dir: its path marks the daemon's processes).
fn state_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("sbx-unit")
        .tempdir()
        .expect("tempdir")
}

fn vm_ready() -> bool {
    if !is_root() || !common::daemon::vm_backend() {
        return false;
    }
    true
}

/// Marks `dir` delegated as systemd does for `Delegate=yes`.
fn mark_delegated(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let p = std::ffi::CString::new(dir.as_os_str().as_bytes()).expect("path");
    // SAFETY: NUL-terminated strings, a 1-byte value.
    unsafe {
        libc::setxattr(
            p.as_ptr(),
            c"trusted.delegate".as_ptr(),
            b"1".as_ptr().cast(),
            1,
            0,
        ) == 0
    }
}

#[test]
fn every_vmm_runs_inside_the_units_cgroup_and_stopping_it_leaves_nothing() {
    if !vm_ready() {
        skip!("needs root and the QEMU backend (guest images)");
    }
    let prefix = unique_prefix();
    let unit = Unit::new(&format!("{prefix}-unit.service"));
    let v2 = unit.v2().expect("a cgroup v2 mount").to_path_buf();
    assert!(
        mark_delegated(&v2),
        "set trusted.delegate on {}: {}",
        v2.display(),
        std::io::Error::last_os_error()
    );
    let dir = state_dir();
    // No --cgroup-placement: `auto` must see the delegation.
    let mut d = unit_daemon(&unit, dir, &prefix);
    assert!(
        d.log().contains("cgroup_placement own"),
        "auto did not place VMs below the daemon's cgroup:\n{}",
        d.log()
    );
    let h = d.http();
    let r = h.post("/v1/sessions", &json!({"id": "u1"}));
    assert_eq!(r.status, 201, "{}", r.text());
    let out = h.exec("u1", "echo hi");
    assert_eq!(common::daemon::stdout_of(&out), "hi\n", "{out}");
    let vmm = d.vmm_of("u1").expect("the session's VMM");
    assert!(
        wait_until(Duration::from_secs(60), || d.sandbox_procs().len() >= 2),
        "no standby VMM beside the session's: {:?}",
        d.sandbox_procs()
    );
    // The daemon (and its spawner) in the leaf, every VMM below vms/.
    let daemon = d.pid();
    for (hier, udir) in &unit.dirs {
        assert_eq!(
            raw_cgroup_of(daemon, hier).as_deref(),
            Some(udir.join(DAEMON_LEAF).as_path()),
            "daemon in {}",
            hier.mount.display()
        );
    }
    let procs = d.sandbox_procs();
    assert!(procs.contains(&vmm), "{procs:?} lacks {vmm}");
    for p in &procs {
        for (hier, udir) in &unit.dirs {
            let Some(cg) = cgroup_of(*p, hier) else {
                continue;
            };
            // A VM cgroup exists where the daemon made parents; elsewhere
            // the VMM stays where the daemon is (still inside the unit).
            assert!(
                cg.starts_with(udir),
                "VMM {p} in {} outside the unit {}",
                cg.display(),
                udir.display()
            );
        }
        let (h2, u2) = unit.dirs.iter().find(|(h, _)| h.v1.is_none()).expect("v2");
        let cg = cgroup_of(*p, h2).expect("v2 cgroup");
        assert!(
            cg.starts_with(u2.join(VMS_DIR)),
            "VMM {p} in {} not below vms/",
            cg.display()
        );
    }
    // `systemctl stop`, KillMode=mixed: SIGTERM to the main process, then
    // SIGKILL to what is left of the unit.
    let st = d.terminate(libc::SIGTERM);
    assert!(
        st.is_some_and(|s| s.success()),
        "daemon did not stop cleanly: {st:?}"
    );
    let left = unit.pids();
    unit.kill_all();
    assert!(
        left.is_empty(),
        "processes left in the unit after SIGTERM: {left:?}"
    );
    assert_eq!(d.leftovers(), Vec::<String>::new());
    for p in procs {
        assert!(process::process_gone(p), "VMM {p} outlived the unit");
    }
}

#[test]
fn killing_a_hung_daemons_unit_stops_every_vmm_and_the_next_start_sweeps() {
    if !vm_ready() {
        skip!("needs root and the QEMU backend (guest images)");
    }
    let prefix = unique_prefix();
    let unit = Unit::new(&format!("{prefix}-unit.service"));
    let dir = state_dir();
    let mut d = Daemon::start_in_cgroups(
        dir,
        &unit.procs_files(),
        &[
            "--net-prefix",
            &prefix,
            "--standby-vmms",
            "1",
            "--cgroup-placement",
            "own",
        ],
    );
    let h = d.http();
    let r = h.post("/v1/sessions", &json!({"id": "u2"}));
    assert_eq!(r.status, 201, "{}", r.text());
    let procs = d.sandbox_procs();
    assert!(!procs.is_empty(), "no VMM");
    // Hung: it answers no signal. systemd's stop timeout ends in SIGKILL
    // for every process of the unit.
    // SAFETY: our own child.
    unsafe { libc::kill(d.pid(), libc::SIGSTOP) };
    unit.kill_all();
    if let Some(mut c) = d.child.take() {
        let _ = c.wait();
    }
    for p in &procs {
        assert!(
            wait_until(Duration::from_secs(10), || process::process_gone(*p)),
            "VMM {p} outlived its unit's SIGKILL"
        );
    }
    assert!(unit.pids().is_empty(), "left: {:?}", unit.pids());
    // What the killed daemon could not remove (named namespaces outlive
    // their processes; run dirs).
    let left = d.leftovers();
    assert!(
        left.iter().any(|l| l.starts_with("netns")),
        "a SIGKILLed daemon left no namespace? {left:?}"
    );
    // The unit restarts (a fresh cgroup, as systemd makes): its sweep
    // removes the namespaces and run dirs the killed daemon left.
    let dir = d.into_dir();
    let unit2 = Unit::new(&format!("{prefix}-unit2.service"));
    let d2 = Daemon::start_in_cgroups(
        dir,
        &unit2.procs_files(),
        &[
            "--net-prefix",
            &prefix,
            "--standby-vmms",
            "0",
            "--cgroup-placement",
            "own",
        ],
    );
    let still = || -> Vec<String> {
        let now = d2.leftovers();
        left.iter().filter(|l| now.contains(l)).cloned().collect()
    };
    assert!(
        wait_until(Duration::from_secs(20), || still().is_empty()),
        "after the restart, still there: {:?}",
        still()
    );
    drop(d2);
}

#[test]
fn own_placement_in_the_root_cgroup_is_refused_with_the_way_out() {
    if !is_root() {
        skip!("needs root (cgroups)");
    }
    // Moved to the root cgroup of every hierarchy, then `serve` asked for
    // `own`: a clear refusal, not VMs at the root.
    let procs: Vec<PathBuf> = cgroup::hierarchies()
        .iter()
        .map(|h| h.mount.join("cgroup.procs"))
        .collect();
    let mut script = String::new();
    for p in &procs {
        script.push_str(&format!("echo $$ > '{}' && ", p.display()));
    }
    script.push_str("exec \"$@\"");
    let dir = tempfile::tempdir().expect("tempdir");
    let out = std::process::Command::new("sh")
        .args([
            "-c",
            &script,
            "sh",
            env!("CARGO_BIN_EXE_agent-sandbox"),
            "serve",
        ])
        .args(["--listen", "127.0.0.1:0", "--state-dir"])
        .arg(dir.path())
        .args([
            "--backend",
            "qemu",
            "--network",
            "off",
            "--cgroup-placement",
            "own",
        ])
        .output()
        .expect("run serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "serve started in the root cgroup");
    assert!(
        err.contains("root cgroup") && err.contains("Delegate=yes"),
        "{err}"
    );
}

/// A named network namespace that plays the host, removed on drop.
struct HostNs {
    name: String,
}

impl HostNs {
    fn new(name: &str) -> HostNs {
        let run = |args: &[&str]| {
            let st = std::process::Command::new("ip")
                .args(args)
                .status()
                .expect("run ip");
            assert!(st.success(), "ip {args:?}");
        };
        run(&["netns", "add", name]);
        let ns = HostNs { name: name.into() };
        run(&["-n", name, "link", "set", "lo", "up"]);
        // An uplink whose other end stays in the namespace: what is routed
        // there goes nowhere else.
        run(&[
            "-n", name, "link", "add", "up0", "type", "veth", "peer", "name", "up0p",
        ]);
        run(&["-n", name, "link", "set", "up0p", "up"]);
        run(&["-n", name, "addr", "add", "198.51.100.1/24", "dev", "up0"]);
        run(&["-n", name, "link", "set", "up0", "up"]);
        ns
    }

    fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }
}

impl Drop for HostNs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

#[test]
fn a_daemon_started_before_its_uplink_waits_for_it_then_serves() {
    if !vm_ready() {
        skip!("needs root and the QEMU backend (guest images)");
    }
    let prefix = unique_prefix();
    let host = HostNs::new(&format!("uw{prefix}"));
    // The default route comes 3 s after the start (DHCP, late).
    let name = host.name.clone();
    let later = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(3));
        std::process::Command::new("ip")
            .args(["-n", &name, "route", "add", "default"])
            .args(["via", "198.51.100.254", "dev", "up0"])
            .status()
            .expect("ip route add")
    });
    let t0 = std::time::Instant::now();
    let d = Daemon::start(&[
        "--network",
        "on",
        "--net-host-netns",
        &host.path(),
        "--net-prefix",
        &prefix,
        "--standby-vmms",
        "0",
    ]);
    assert!(later.join().expect("route thread").success());
    assert!(
        t0.elapsed() >= Duration::from_secs(3),
        "served before the uplink existed"
    );
    let log = d.log();
    assert!(log.contains("no default route yet"), "{log}");
    assert!(log.contains("default route via up0"), "{log}");
    let h = d.http();
    let r = h.post("/v1/sessions", &json!({"id": "n1"}));
    assert_eq!(r.status, 201, "{}", r.text());
    let out = h.exec("n1", "echo up");
    assert_eq!(common::daemon::stdout_of(&out), "up\n", "{out}");
}

#[test]
fn without_a_route_a_config_check_still_says_so_at_once() {
    if !is_root() {
        skip!("needs root (network namespaces)");
    }
    let prefix = unique_prefix();
    let host = HostNs::new(&format!("uc{prefix}"));
    let dir = tempfile::tempdir().expect("tempdir");
    let t0 = std::time::Instant::now();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(["serve", "--check", "--state-dir"])
        .arg(dir.path())
        .args(["--backend", "qemu", "--network", "on", "--net-host-netns"])
        .arg(host.path())
        .output()
        .expect("serve --check");
    assert!(t0.elapsed() < Duration::from_secs(10), "--check waited");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no default route"), "{err}");
}

#[test]
fn a_jailed_firecracker_runs_inside_the_units_cgroup() {
    let bins = ["AGENT_SANDBOX_FIRECRACKER", "AGENT_SANDBOX_JAILER"]
        .map(|k| std::env::var_os(k).filter(|p| Path::new(p).exists()));
    if bins.iter().any(Option::is_none) {
        skip!("needs real Firecracker binaries (AGENT_SANDBOX_FIRECRACKER, AGENT_SANDBOX_JAILER)");
    }
    if !is_root() || !Path::new("/dev/kvm").exists() {
        skip!("needs root and /dev/kvm for the jailer");
    }
    let prefix = unique_prefix();
    let unit = Unit::at_root(&format!("{prefix}-unit.service"));
    let dir = state_dir();
    // The standby VMM's snapshot build starts a jailed Firecracker at
    // once (whether its guest boots on this host does not matter here).
    let d = Daemon::start_in_cgroups(
        dir,
        &unit.procs_files(),
        &[
            "--backend",
            "firecracker",
            "--net-prefix",
            &prefix,
            "--standby-vmms",
            "1",
            "--cgroup-placement",
            "own",
        ],
    );
    // A jailed Firecracker below vms/ in the jailer's hierarchies (v1 here,
    // or v2), read with the rest of its cgroups at one moment (a snapshot
    // build's VMM may come and go).
    let below = |p: i32| -> Option<Vec<(PathBuf, PathBuf)>> {
        let comm = std::fs::read_to_string(format!("/proc/{p}/comm")).ok()?;
        if comm.trim() != "firecracker" {
            return None;
        }
        let cgs: Vec<(PathBuf, PathBuf)> = unit
            .dirs
            .iter()
            .map(|(h, u)| Some((raw_cgroup_of(p, h)?, u.clone())))
            .collect::<Option<_>>()?;
        cgs.iter()
            .any(|(c, u)| c.starts_with(u.join(VMS_DIR)))
            .then_some(cgs)
    };
    let mut seen = None;
    let found = wait_until(Duration::from_secs(30), || {
        seen = unit
            .pids()
            .into_iter()
            .find_map(|p| below(p).map(|c| (p, c)));
        seen.is_some()
    });
    assert!(
        found,
        "no jailed Firecracker below the unit's vms/; log:\n{}",
        d.log()
    );
    let (fc, cgs) = seen.expect("found");
    for (cg, udir) in &cgs {
        assert!(
            cg.starts_with(udir),
            "Firecracker {fc} in {} outside the unit {}",
            cg.display(),
            udir.display()
        );
    }
    drop(d);
    assert!(
        wait_until(Duration::from_secs(10), || process::process_gone(fc)),
        "Firecracker {fc} outlived the daemon"
    );
}
