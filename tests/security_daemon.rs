//! The running daemon is hardened, for real: the `serve` binary with the
//! QEMU backend (or `local-process` when no guest images are built), as
//! root. Checks `/proc/<pid>/status` of the daemon and of every one of its
//! threads, then drives a session through the real paths (so the filters
//! are shown to allow them), checks the VMM's confinement and cgroup, and
//! what happens when the spawner dies.

mod common;
#[path = "common/netns.rs"]
mod netns;
#[path = "common/skip.rs"]
mod skip;

use agent_sandbox::harden::caps;
use common::daemon::{stdout_of, Daemon};
use common::wait_until;
use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn status_of(path: &str) -> Vec<(String, String)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

fn field<'a>(st: &'a [(String, String)], k: &str) -> &'a str {
    st.iter()
        .find(|(key, _)| key == k)
        .map_or("", |(_, v)| v.as_str())
}

fn hex(v: &str) -> u64 {
    u64::from_str_radix(v, 16).unwrap_or(u64::MAX)
}

/// What every thread of the daemon must show.
fn check_hardened(pid: i32, what: &str) -> Vec<String> {
    check_hardened_with(pid, what, caps::DAEMON)
}

fn check_hardened_with(pid: i32, what: &str, needs: &[caps::Need]) -> Vec<String> {
    let want = caps::mask(
        &caps::plan(needs)
            .into_iter()
            .map(|(c, _)| c)
            .collect::<Vec<_>>(),
    );
    let mut bad = Vec::new();
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|rd| rd.flatten().map(|e| e.path()).collect::<Vec<PathBuf>>())
        .unwrap_or_default();
    assert!(!tasks.is_empty(), "{what}: no tasks of pid {pid}");
    for t in tasks {
        let st = status_of(&t.join("status").display().to_string());
        if st.is_empty() {
            continue; // the thread ended meanwhile
        }
        let name = field(&st, "Name").to_string();
        let checks = [
            ("CapEff", hex(field(&st, "CapEff")) == want),
            ("CapPrm", hex(field(&st, "CapPrm")) == want),
            ("CapBnd", hex(field(&st, "CapBnd")) == want),
            ("CapInh", hex(field(&st, "CapInh")) == 0),
            ("CapAmb", hex(field(&st, "CapAmb")) == 0),
            ("NoNewPrivs", field(&st, "NoNewPrivs") == "1"),
            ("Seccomp", field(&st, "Seccomp") == "2"),
        ];
        for (k, ok) in checks {
            if !ok {
                bad.push(format!(
                    "{what}: thread {} ({name}) {k}: {}",
                    t.display(),
                    field(&st, k)
                ));
            }
        }
    }
    bad
}

fn threads(pid: i32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|rd| {
            rd.flatten()
                .map(|e| {
                    std::fs::read_to_string(e.path().join("comm"))
                        .unwrap_or_default()
                        .trim()
                        .to_string()
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The process name of the template builder (`sandbox::builds`), the
/// daemon's other child.
const BUILDER_COMM: &str = "asbx-builder";

/// The daemon's children: the spawner (a fork of the daemon), and the
/// template builder when the daemon runs as root with VMs.
fn spawner_of(daemon: i32) -> Option<i32> {
    let children = std::fs::read_to_string(format!("/proc/{daemon}/task/{daemon}/children"))
        .unwrap_or_default();
    children
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .find(|p| comm(*p) != BUILDER_COMM)
}

fn children_of(pid: i32) -> Vec<i32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|rd| {
            rd.flatten()
                .flat_map(|t| {
                    std::fs::read_to_string(t.path().join("children"))
                        .unwrap_or_default()
                        .split_whitespace()
                        .filter_map(|p| p.parse().ok())
                        .collect::<Vec<i32>>()
                })
                .collect()
        })
        .unwrap_or_default()
}

fn comm(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap_or_default()
        .trim()
        .to_string()
}

fn alive(pid: i32) -> bool {
    // A zombie still has /proc/<pid>; count it as gone.
    let st = status_of(&format!("/proc/{pid}/status"));
    !st.is_empty() && !field(&st, "State").starts_with('Z')
}

/// `/proc/<pid>/cgroup`'s v2 path, as a directory under the v2 mount.
fn cgroup_dir(pid: i32) -> Option<PathBuf> {
    let line = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let rel = line.lines().find_map(|l| l.strip_prefix("0::"))?;
    let mount = agent_sandbox::vm::jailer::cgroup2_mount()?;
    Some(mount.join(rel.trim_start_matches('/')))
}

/// Every cgroup `pid` is in, v2 and v1: the dir under each hierarchy's
/// mount, with the controllers (v2 names; none for v2) it holds.
fn cgroup_dirs(pid: i32) -> Vec<(PathBuf, Option<Vec<&'static str>>)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let hs = agent_sandbox::vm::cgroup::hierarchies();
    let mut out = Vec::new();
    for l in text.lines() {
        let mut f = l.splitn(3, ':');
        let (Some(_), Some(ctls), Some(rel)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let rel = rel.trim_start_matches('/');
        let h = if ctls.is_empty() {
            hs.iter().find(|h| h.v1.is_none())
        } else {
            let ctls: Vec<&str> = ctls.split(',').collect();
            hs.iter().find(|h| {
                h.v1.as_ref().is_some_and(|v| {
                    v.iter()
                        .any(|c| ctls.contains(&if *c == "io" { "blkio" } else { c }))
                })
            })
        };
        if let Some(h) = h {
            out.push((h.mount.join(rel), h.v1.clone()));
        }
    }
    out
}

/// The dir of `pid`'s cgroup holding `ctl` (v2 name), v2 when it offers it
/// there, else the v1 one, with whether it is v1.
fn cgroup_of(pid: i32, ctl: &str) -> Option<(PathBuf, bool)> {
    let all = cgroup_dirs(pid);
    let v2 = all.iter().find(|(d, v)| {
        v.is_none()
            && std::fs::read_to_string(d.join("cgroup.controllers"))
                .unwrap_or_default()
                .split_whitespace()
                .any(|c| c == ctl)
    });
    if let Some((d, _)) = v2 {
        return Some((d.clone(), false));
    }
    all.into_iter()
        .find(|(_, v)| v.as_ref().is_some_and(|v| v.contains(&ctl)))
        .map(|(d, _)| (d, true))
}

fn read(p: &std::path::Path) -> String {
    std::fs::read_to_string(p)
        .unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
        .trim()
        .to_string()
}

/// Checks the limits of `qemu`'s cgroups for a VM of `mem_mib` with
/// `overhead_mib`, one vCPU, and the `io` rule `wbps=104857600 wiops=4000`
/// when `io`: in v2 or v1, wherever this host has each controller. Returns
/// the files read.
fn check_vmm_limits(qemu: i32, mem_mib: u64, overhead_mib: u64, io: bool) -> Vec<PathBuf> {
    let mut read_files = Vec::new();
    let mut get = |ctl: &str, v2: &str, v1: &str| -> String {
        let (dir, is_v1) = cgroup_of(qemu, ctl)
            .unwrap_or_else(|| panic!("QEMU pid {qemu} is in no cgroup with {ctl}"));
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
        assert!(
            name.as_deref().is_some_and(|n| n.starts_with("asbx-")),
            "QEMU's {ctl} cgroup is not a per-session one: {}",
            dir.display()
        );
        let f = dir.join(if is_v1 { v1 } else { v2 });
        let v = read(&f);
        read_files.push(f);
        v
    };
    let mem = ((mem_mib + overhead_mib) << 20).to_string();
    assert_eq!(get("memory", "memory.max", "memory.limit_in_bytes"), mem);
    assert_eq!(get("pids", "pids.max", "pids.max"), "256");
    let cpu = get("cpu", "cpu.max", "cpu.cfs_quota_us");
    if cpu.contains(' ') {
        assert_eq!(cpu, "100000 100000");
    } else {
        assert_eq!(cpu, "100000", "cfs quota");
        assert_eq!(get("cpu", "cpu.max", "cpu.cfs_period_us"), "100000");
    }
    if io {
        let wbps = get("io", "io.max", "blkio.throttle.write_bps_device");
        if wbps.contains("wbps=") {
            assert!(
                wbps.contains("wbps=104857600") && wbps.contains("wiops=4000"),
                "io.max {wbps:?}"
            );
        } else {
            // v1: "MAJ:MIN VALUE" per disk.
            assert!(wbps.ends_with(" 104857600"), "write_bps_device {wbps:?}");
            let wiops = get("io", "io.max", "blkio.throttle.write_iops_device");
            assert!(wiops.ends_with(" 4000"), "write_iops_device {wiops:?}");
        }
    }
    read_files
}

fn create_session(d: &Daemon) -> String {
    let r = d.http().post("/v1/sessions", &json!({}));
    assert!(
        (200..300).contains(&r.status),
        "create session: {} {}\n{}",
        r.status,
        r.text(),
        d.log()
    );
    r.json()["id"].as_str().expect("session id").to_string()
}

fn exec(d: &Daemon, id: &str, cmd: &str) -> String {
    let r = d.http().post(
        &format!("/v1/sessions/{id}/exec"),
        &json!({ "command": cmd }),
    );
    assert_eq!(r.status, 200, "exec {cmd:?}: {}\n{}", r.text(), d.log());
    let v = r.json();
    assert_eq!(v["exitCode"], 0, "exec {cmd:?}: {v}");
    stdout_of(&v)
}

#[test]
fn serve_is_hardened_in_every_thread_and_real_paths_fit_the_filters() {
    if !is_root() {
        skip!("needs root (capabilities, spawner, cgroups)");
    }
    // Its own range of VM ids: each session's VMM must get one of them.
    let (first, count) = (1_500_000_000u32, 8u32);
    // No standby VMMs: this test tells sessions' VMMs apart by order
    // (a_standby_vmm_serves_the_next_session... covers them).
    let d = Daemon::start(&[
        "--vm-ids",
        &format!("{first}:{count}"),
        "--max-sessions",
        "4",
        "--vm-io-max",
        "wbps=104857600 wiops=4000",
        "--standby-vmms",
        "0",
    ]);
    let pid = d.pid();
    let vm = common::daemon::vm_backend();
    let log = d.log();
    assert!(
        log.contains("hardening: spawner pid") && log.contains("seccomp Enforce"),
        "start-up log:\n{log}"
    );
    let bad = check_hardened(pid, "idle daemon");
    assert!(bad.is_empty(), "{bad:#?}");
    // A thread takes its name once it runs: until then it shows its
    // creator's (a brokered thread: "thread-broker"). CI saw the reaper
    // unnamed yet right after start on a loaded host.
    let wanted = ["thread-broker", "spawner-client", "reaper", "http-accept"];
    let mut names = threads(pid);
    wait_until(Duration::from_secs(10), || {
        names = threads(pid);
        wanted.iter().all(|w| names.iter().any(|n| n == w))
    });
    for want in wanted {
        assert!(names.iter().any(|n| n == want), "no {want} in {names:?}");
    }

    // A session, through the real create/restore and exec paths.
    let id = create_session(&d);
    assert_eq!(exec(&d, &id, "echo hardened-ok"), "hardened-ok\n");
    let bad = check_hardened(pid, "daemon with a session");
    assert!(bad.is_empty(), "{bad:#?}\n{}", d.log());
    let names = threads(pid);
    assert!(
        names.iter().any(|n| n.starts_with("session-")),
        "no session thread in {names:?}"
    );
    assert!(
        names.iter().any(|n| n == "agent-reader"),
        "no agent-reader in {names:?}"
    );

    // The sandbox's process is the spawner's child, not the daemon's.
    let spawner = spawner_of(pid).expect("spawner process");
    let kids = children_of(spawner);
    assert!(!kids.is_empty(), "the spawner started nothing");
    assert!(
        children_of(pid)
            .iter()
            .all(|p| *p == spawner || comm(*p) == BUILDER_COMM),
        "the daemon has children besides the spawner and the builder: {:?}",
        children_of(pid)
    );
    if vm {
        let qemu = kids
            .iter()
            .copied()
            .find(|p| comm(*p).starts_with("qemu"))
            .unwrap_or_else(|| panic!("no QEMU among the spawner's children {kids:?}"));
        let st = status_of(&format!("/proc/{qemu}/status"));
        // Real, effective, saved and fs uid (and gid) are the session's own.
        let ids = |st: &[(String, String)], k: &str| -> Vec<u32> {
            field(st, k)
                .split_whitespace()
                .map(|v| v.parse().expect("id"))
                .collect()
        };
        let uid = ids(&st, "Uid")[0];
        assert!(
            (first + 1..first + count).contains(&uid),
            "QEMU uid {uid} outside the session ids of {first}:{count}"
        );
        assert_eq!(ids(&st, "Uid"), vec![uid; 4], "{st:?}");
        assert_eq!(ids(&st, "Gid"), vec![uid; 4], "{st:?}");
        assert_eq!(field(&st, "Groups"), "", "no supplementary groups");
        // File-size and open-file limits, as the jailer gives Firecracker.
        let limits = std::fs::read_to_string(format!("/proc/{qemu}/limits")).expect("limits");
        let limit = |name: &str| -> Vec<String> {
            limits
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|r| r.split_whitespace().take(2).map(String::from).collect())
                .unwrap_or_default()
        };
        // The VM's memory (the template snapshot's shape) from `-m <N>M`.
        let args: Vec<String> = std::fs::read(format!("/proc/{qemu}/cmdline"))
            .expect("cmdline")
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let mem_mib: u64 = args
            .iter()
            .position(|a| a == "-m")
            .and_then(|i| args.get(i + 1))
            .and_then(|m| m.strip_suffix('M'))
            .and_then(|m| m.parse().ok())
            .unwrap_or_else(|| panic!("no -m in {args:?}"));
        let fsize = ((mem_mib + 64) << 20).to_string();
        assert_eq!(limit("Max file size"), [fsize.clone(), fsize], "{limits}");
        assert_eq!(limit("Max open files"), ["1024", "1024"], "{limits}");
        // Its run dir (named on its command line) is its own.
        let cmd = std::fs::read(format!("/proc/{qemu}/cmdline")).expect("cmdline");
        let cmd = String::from_utf8_lossy(&cmd);
        let run = d.state_dir().join("run");
        let owned: Vec<u32> = std::fs::read_dir(&run)
            .expect("run root")
            .flatten()
            .filter(|e| cmd.contains(&*e.path().to_string_lossy()))
            .map(|e| std::os::unix::fs::MetadataExt::uid(&e.metadata().expect("stat")))
            .collect();
        assert_eq!(
            owned,
            vec![uid],
            "owner of QEMU's run dir under {}",
            run.display()
        );
        // A second session's VMM runs under another uid of the range.
        let id2 = create_session(&d);
        assert_eq!(exec(&d, &id2, "echo second"), "second\n");
        let qemu2 = children_of(spawner)
            .into_iter()
            .find(|p| *p != qemu && comm(*p).starts_with("qemu"))
            .expect("second QEMU");
        let uid2 = ids(&status_of(&format!("/proc/{qemu2}/status")), "Uid")[0];
        assert!(
            (first + 1..first + count).contains(&uid2) && uid2 != uid,
            "second VMM uid {uid2} (first's {uid})"
        );
        let r = d.http().delete(&format!("/v1/sessions/{id2}"));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(field(&st, "NoNewPrivs"), "1");
        assert_eq!(field(&st, "Seccomp"), "2", "QEMU runs under filters");
        assert_eq!(hex(field(&st, "CapEff")), 0, "QEMU has no capabilities");
        // Its own cgroups (v2, and v1 where this host binds controllers
        // there), with every limit: serve refuses to start without them.
        // The default overhead: 256 MiB, plus under TCG the capped
        // translation cache (vm::cgroup::TCG_TB_MIB) and the guest's RAM.
        let tcg = std::fs::read(format!("/proc/{qemu}/cmdline"))
            .map(|c| String::from_utf8_lossy(&c).contains("tcg,tb-size="))
            .unwrap_or(false);
        let overhead = agent_sandbox::vm::cgroup::MEMORY_OVERHEAD_MIB
            + if tcg {
                agent_sandbox::vm::cgroup::TCG_TB_MIB + mem_mib
            } else {
                0
            };
        let files = check_vmm_limits(qemu, mem_mib, overhead, true);
        eprintln!("QEMU pid {qemu}: cgroup limits checked in {files:#?}");
        let dirs: Vec<PathBuf> = cgroup_dirs(qemu)
            .into_iter()
            .map(|(d, _)| d)
            .filter(|d| d.to_string_lossy().contains("/asbx-"))
            .collect();
        assert!(dirs.len() >= files.len().min(2), "{dirs:?}");
        let r = d.http().delete(&format!("/v1/sessions/{id}"));
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(
            wait_until(Duration::from_secs(10), || dirs.iter().all(|d| !d.exists())
                && !alive(qemu)),
            "after DELETE: cgroups {dirs:?} left {:?}, QEMU alive {}",
            dirs.iter().filter(|d| d.exists()).collect::<Vec<_>>(),
            alive(qemu)
        );
    } else {
        let r = d.http().delete(&format!("/v1/sessions/{id}"));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let log = d.log();
    assert!(!log.contains("forbidden syscall"), "log:\n{log}");
    let mut d = d;
    let st = d.terminate(libc::SIGTERM).expect("daemon exit");
    assert!(st.success(), "daemon exit {st:?}\n{}", d.log());
}

/// The sandbox id a session runs as, from the daemon's log.
fn sandbox_of(d: &Daemon, session: &str) -> Option<String> {
    let needle = format!("/{session}: ready as ");
    d.log().lines().find_map(|l| {
        let rest = &l[l.find(&needle)? + needle.len()..];
        rest.split_whitespace().next().map(str::to_string)
    })
}

/// The QEMU children of the spawner, by the VM id in their `-name`.
fn qemus_by_id(spawner: i32) -> Vec<(String, i32)> {
    children_of(spawner)
        .into_iter()
        .filter(|p| comm(*p).starts_with("qemu"))
        .filter_map(|p| Some((common::daemon::vm_id_of(p)?, p)))
        .collect()
}

/// The daemon keeps a VMM started for the next session of a shape
/// (`--standby-vmms`; the default template's primed at start): confined
/// like any VMM, no guest yet. The next session is restored into that very
/// process, works, is counted in the metrics; a new standby follows; a dead
/// one is never what a session runs in; nothing outlives the daemon.
#[test]
fn a_standby_vmm_serves_the_next_session_and_goes_with_the_daemon() {
    if !is_root() || !common::daemon::vm_backend() {
        skip!("needs root and guest images (a VM backend)");
    }
    let (first, count) = (1_500_000_100u32, 8u32);
    let mut d = Daemon::start(&[
        "--vm-ids",
        &format!("{first}:{count}"),
        "--max-sessions",
        "4",
    ]);
    let spawner = spawner_of(d.pid()).expect("spawner process");
    // At start the daemon primes one for the default template: a QEMU
    // before any session.
    // Ready once the daemon says so (its QEMU runs a little earlier).
    let standby_of = |not: &[&str]| {
        let mut found = None;
        wait_until(Duration::from_secs(30), || {
            let log = d.log();
            found = qemus_by_id(spawner).into_iter().find(|(id, _)| {
                !not.contains(&id.as_str())
                    && log.contains(&format!("standby VMM {id} ready for template"))
            });
            found.is_some()
        });
        found
    };
    let (sb_id, sb_pid) =
        standby_of(&[]).unwrap_or_else(|| panic!("no standby VMM after start\n{}", d.log()));
    let st = status_of(&format!("/proc/{sb_pid}/status"));
    let uid: u32 = field(&st, "Uid")
        .split_whitespace()
        .next()
        .and_then(|u| u.parse().ok())
        .expect("uid");
    assert!(
        (first + 1..first + count).contains(&uid),
        "standby VMM uid {uid} outside {first}:{count}"
    );
    assert_eq!(
        field(&st, "Seccomp"),
        "2",
        "standby QEMU runs under filters"
    );
    assert_eq!(hex(field(&st, "CapEff")), 0);
    let cg = cgroup_dir(sb_pid).expect("standby's cgroup");
    assert!(
        cg.ends_with(&sb_id),
        "standby VMM not in its own cgroup: {}",
        cg.display()
    );
    // It has loaded no guest: QEMU waits for the migration stream.
    let cmd = String::from_utf8_lossy(
        &std::fs::read(format!("/proc/{sb_pid}/cmdline")).expect("cmdline"),
    )
    .into_owned();
    assert!(cmd.contains("-incoming\0defer"), "{cmd:?}");
    let used = || d.standby_used();

    // The first session runs in that very process.
    let one = create_session(&d);
    assert_eq!(exec(&d, &one, "echo one"), "one\n");
    let vm_one = sandbox_of(&d, &one).expect("first session's sandbox id in the log");
    assert_eq!(vm_one, sb_id);
    assert!(alive(sb_pid), "the standby's QEMU is gone");
    assert_eq!(used(), 1);
    // Then one is made for the next session of that shape, which runs in it.
    let (sb_id, sb_pid) = standby_of(&[vm_one.as_str()])
        .unwrap_or_else(|| panic!("no standby VMM after the first session\n{}", d.log()));
    let two = create_session(&d);
    assert_eq!(exec(&d, &two, "echo two"), "two\n");
    assert_eq!(sandbox_of(&d, &two).as_deref(), Some(sb_id.as_str()));
    assert!(
        qemus_by_id(spawner).contains(&(sb_id.clone(), sb_pid)),
        "{:?}",
        qemus_by_id(spawner)
    );
    assert_eq!(used(), 2);
    // And a new standby is made for the session after.
    assert!(
        wait_until(Duration::from_secs(20), || qemus_by_id(spawner).len() == 3),
        "{:?}",
        qemus_by_id(spawner)
    );
    let run = d.state_dir().join("run");
    assert_eq!(
        std::fs::read_dir(&run).map_or(0, |r| r.count()),
        3,
        "run dirs of two sessions and a standby"
    );
    // A standby whose VMM died meanwhile is not what the next session
    // runs in: it is removed when taken, or, when it dies between being
    // taken and loading the guest, the session restores afresh. Either
    // way the session works.
    let vm_two = sandbox_of(&d, &two).expect("second session's sandbox id");
    // Killed once it is ready: killed while it still starts, the daemon
    // logs a failed start instead (also handled, but not this case).
    let (dead_id, dead_pid) = standby_of(&[vm_one.as_str(), vm_two.as_str()])
        .unwrap_or_else(|| panic!("the new standby never got ready\n{}", d.log()));
    // SAFETY: a QEMU this test's daemon started.
    unsafe { libc::kill(dead_pid, libc::SIGKILL) };
    assert!(wait_until(Duration::from_secs(5), || !alive(dead_pid)));
    let three = create_session(&d);
    assert_eq!(exec(&d, &three, "echo three"), "three\n");
    let vm_three = sandbox_of(&d, &three).expect("third session's sandbox id");
    assert_ne!(vm_three, dead_id);
    for l in d.log().lines().filter(|l| l.contains("standby VMM")) {
        eprintln!("{l}");
    }
    assert!(
        d.log().contains(&format!("standby VMM {dead_id}")),
        "the dead standby is not mentioned:\n{}",
        d.log()
    );
    assert!(
        wait_until(Duration::from_secs(10), || !run.join(&dead_id).exists()),
        "the dead standby's run dir is left"
    );
    assert!(
        wait_until(Duration::from_secs(20), || qemus_by_id(spawner).len() == 4),
        "no standby after the third session: {:?}",
        qemus_by_id(spawner)
    );
    let all: Vec<i32> = qemus_by_id(spawner).into_iter().map(|(_, p)| p).collect();
    let log = d.log();
    assert!(!log.contains("forbidden syscall"), "log:\n{log}");
    let st = d.terminate(libc::SIGTERM).expect("daemon exit");
    assert!(st.success(), "daemon exit {st:?}\n{}", d.log());
    assert!(
        all.iter().all(|p| !alive(*p)),
        "VMMs outlived the daemon: {all:?}"
    );
    let left: Vec<_> = std::fs::read_dir(&run)
        .map(|r| r.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "run dirs left: {left:?}");
    assert!(!cg.exists(), "cgroup left: {}", cg.display());
}

#[test]
fn a_killed_spawner_takes_its_vms_and_the_daemon_exits_non_zero() {
    if !is_root() {
        skip!("needs root");
    }
    let mut d = Daemon::start(&[]);
    let pid = d.pid();
    let id = create_session(&d);
    assert_eq!(exec(&d, &id, "echo up"), "up\n");
    let spawner = spawner_of(pid).expect("spawner");
    let kids = children_of(spawner);
    assert!(!kids.is_empty());
    let cgroups: Vec<PathBuf> = kids.iter().filter_map(|p| cgroup_dir(*p)).collect();
    // SAFETY: the spawner of the daemon this test started.
    unsafe { libc::kill(spawner, libc::SIGKILL) };
    assert!(
        wait_until(Duration::from_secs(5), || kids.iter().all(|p| !alive(*p))),
        "sandbox processes {kids:?} outlived the spawner"
    );
    let st = d.terminate(0).expect("daemon exits by itself");
    assert_eq!(st.code(), Some(75), "exit status {st:?}\n{}", d.log());
    assert!(d.log().contains("spawner died"), "{}", d.log());
    // Whatever is left (the session's cgroup) goes with the next start's
    // sweep of the same state dir.
    let dir = d.into_dir();
    let leftover: Vec<&PathBuf> = cgroups
        .iter()
        .filter(|c| {
            c.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("asbx-"))
        })
        .collect();
    if !leftover.is_empty() {
        let mut d2 = Daemon::start_in(dir, &[]);
        for c in &leftover {
            assert!(!c.exists(), "{} not swept\n{}", c.display(), d2.log());
        }
        let st = d2.terminate(libc::SIGTERM).expect("exit");
        assert!(st.success());
    }
}

/// The VMM of an idle session dies: the agent connection's background
/// reader (a thread whose filter allows no `openat`) is the one to see it
/// close, and the close note (the VMM's OOM counter, read from its cgroup)
/// must work there. The daemon stays up and says the session is gone.
#[test]
fn an_idle_sessions_dead_vmm_is_noticed_by_the_hardened_reader() {
    if !is_root() || !common::daemon::vm_backend() {
        skip!("needs root and guest images (a VM backend)");
    }
    let mut d = Daemon::start(&[]);
    let id = create_session(&d);
    assert_eq!(exec(&d, &id, "echo up"), "up\n");
    let vm = sandbox_of(&d, &id).expect("the session's sandbox id in the log");
    let spawner = spawner_of(d.pid()).expect("spawner");
    let (_, qemu) = qemus_by_id(spawner)
        .into_iter()
        .find(|(v, _)| *v == vm)
        .expect("the session's QEMU");
    // Idle well past the reader's grace: the background reader holds the
    // connection.
    std::thread::sleep(Duration::from_secs(2));
    // SAFETY: a QEMU this test's daemon started.
    unsafe { libc::kill(qemu, libc::SIGKILL) };
    assert!(
        wait_until(Duration::from_secs(10), || d.log().contains("sandbox died")),
        "the dead VMM was not noticed:\n{}",
        d.log()
    );
    assert!(alive(d.pid()), "the daemon died:\n{}", d.log());
    let log = d.log();
    assert!(!log.contains("forbidden syscall"), "log:\n{log}");
    let r = d.http().get(&format!("/v1/sessions/{id}"));
    assert_eq!(r.status, 404, "{}", r.text());
    let st = d.terminate(libc::SIGTERM).expect("daemon exit");
    assert!(st.success(), "daemon exit {st:?}\n{}", d.log());
}

#[test]
fn a_networked_daemon_resolves_through_its_hardened_dns_thread() {
    if !is_root() || !common::daemon::vm_backend() {
        skip!("needs root and the QEMU backend (guest images)");
    }
    // As tests/net_guest.rs: the daemon's "host" is a test namespace whose
    // only uplink leads to a test "internet" holding the resolver.
    let resolver = std::net::Ipv4Addr::new(198, 51, 100, 53);
    let prefix = common::daemon::unique_prefix();
    let topo = netns::Topology::new("hd");
    netns::add_internet_addr(&topo, resolver);
    let _dns = netns::DnsServer::start(
        &topo.internet,
        resolver,
        &[("files.pypi.org", netns::Rr::A(netns::INTERNET, 60))],
    );
    let host = topo.host_path();
    let mut d = Daemon::start(&[
        "--network",
        "on",
        "--uplink",
        "up0",
        "--net-host-netns",
        host.to_str().expect("utf-8 path"),
        "--dns-upstream",
        "198.51.100.53:53",
        "--net-prefix",
        &prefix,
    ]);
    let pid = d.pid();
    let r = d.http().post(
        "/v1/sessions",
        &json!({"egress": {"mode": "allowlist", "domains": ["*.pypi.org"]}}),
    );
    assert!((200..300).contains(&r.status), "{}\n{}", r.text(), d.log());
    let id = r.json()["id"].as_str().expect("id").to_string();
    let out = exec(&d, &id, "timeout 5 getent hosts files.pypi.org");
    assert!(
        out.starts_with(&netns::INTERNET.to_string()),
        "resolved {out:?}\n{}",
        d.log()
    );
    // Networking on: the daemon also keeps NET_BIND_SERVICE (port 53).
    let mut needs = caps::DAEMON.to_vec();
    needs.push(caps::Need::BindLowPort);
    let bad = check_hardened_with(pid, "networked daemon", &needs);
    assert!(bad.is_empty(), "{bad:#?}");
    let names = threads(pid);
    for want in ["net-reaper", "dns-"] {
        assert!(
            names.iter().any(|n| n.starts_with(want)),
            "no {want} thread in {names:?}"
        );
    }
    let r = d.http().delete(&format!("/v1/sessions/{id}"));
    assert_eq!(r.status, 200, "{}", r.text());
    let log = d.log();
    assert!(!log.contains("forbidden syscall"), "log:\n{log}");
    let st = d.terminate(libc::SIGTERM).expect("daemon exit");
    assert!(st.success(), "daemon exit {st:?}\n{}", d.log());
}

/// Whether process `pid` holds a shared `flock` on `path` through one of
/// its own descriptors (`/proc/<pid>/fdinfo` lists the locks of that open
/// file only, so other daemons holding the same image do not count).
fn holds_shared_lock(pid: i32, path: &std::path::Path) -> bool {
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    rd.flatten().any(|e| {
        std::fs::read_link(e.path()).is_ok_and(|t| t == path)
            && std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                e.file_name().to_string_lossy()
            ))
            .is_ok_and(|i| i.lines().any(|l| l.contains("FLOCK") && l.contains("READ")))
    })
}

/// `image gc` removes superseded images but not those a running daemon
/// restores from: the daemon holds a shared lock on each for its lifetime.
/// (admin.rs unit-tests gc against such a lock.)
#[test]
fn a_daemon_holds_its_images_against_image_gc() {
    if !is_root() || !common::daemon::vm_backend() {
        skip!("needs root and the QEMU backend (guest images)");
    }
    let cache = agent_sandbox::sandbox::wiring::cache_dir();
    let cur: serde_json::Value =
        serde_json::from_slice(&std::fs::read(cache.join("current.json")).expect("current.json"))
            .expect("current.json is JSON");
    let mut images = vec![PathBuf::from(cur["kernel"].as_str().expect("kernel"))];
    for p in cur["rootfs"].as_object().expect("rootfs").values() {
        images.push(PathBuf::from(p.as_str().expect("path")));
    }
    let d = Daemon::start(&[]);
    for p in &images {
        assert!(
            holds_shared_lock(d.pid(), p),
            "{} not held by the daemon",
            p.display()
        );
    }
}

/// The memory limit is enforced, not only written: with a small VMM
/// overhead (`--vm-memory-overhead-mib 16`), a guest that fills most of its
/// RAM pushes QEMU's host memory (its own ~60-100 MiB plus the guest's
/// pages) past `guest RAM + 16 MiB`; the kernel's OOM killer kills QEMU
/// in its cgroup, and the session says so.
#[test]
fn a_vmm_past_its_memory_limit_is_killed_and_the_session_says_so() {
    if !is_root() {
        skip!("needs root (cgroups)");
    }
    if !common::daemon::vm_backend() {
        skip!("needs the QEMU backend (guest images)");
    }
    let d = Daemon::start(&[
        "--vm-memory-overhead-mib",
        "16",
        "--standby-vmms",
        "0",
        "--max-sessions",
        "2",
    ]);
    let id = create_session(&d);
    assert_eq!(exec(&d, &id, "echo up"), "up\n");
    let spawner = spawner_of(d.pid()).expect("spawner process");
    let qemu = children_of(spawner)
        .into_iter()
        .find(|p| comm(*p).starts_with("qemu"))
        .expect("the session's QEMU");
    let args = std::fs::read(format!("/proc/{qemu}/cmdline")).expect("cmdline");
    let args: Vec<String> = args
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let mem_mib: u64 = args
        .iter()
        .position(|a| a == "-m")
        .and_then(|i| args.get(i + 1))
        .and_then(|m| m.strip_suffix('M'))
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("no -m in {args:?}"));
    let files = check_vmm_limits(qemu, mem_mib, 16, false);
    let (memcg, v1) = cgroup_of(qemu, "memory").expect("memory cgroup");
    let usage = if v1 {
        "memory.usage_in_bytes"
    } else {
        "memory.current"
    };
    eprintln!(
        "QEMU pid {qemu} ({mem_mib} MiB guest) limits {files:?}; {usage} before {} of limit {}",
        read(&memcg.join(usage)),
        (mem_mib + 16) << 20
    );
    // dd's buffer is one allocation it writes all of: the guest's pages
    // become QEMU's (private copies of the restored snapshot's).
    let fill = (mem_mib * 3 / 4).max(64);
    let r = d.http().post(
        &format!("/v1/sessions/{id}/exec"),
        &json!({ "command": format!("dd if=/dev/zero of=/dev/null bs={fill}M count=1; echo survived") }),
    );
    eprintln!("exec while filling {fill} MiB: {} {}", r.status, r.text());
    assert!(
        wait_until(Duration::from_secs(30), || !alive(qemu)),
        "QEMU pid {qemu} survived a guest filling {fill} MiB of {mem_mib}: {}",
        r.text()
    );
    assert!(
        !r.text().contains("survived"),
        "the command finished: {}",
        r.text()
    );
    // The session's caller is told why.
    assert!(
        r.status >= 500 && r.text().contains("OOM killer at its cgroup memory limit"),
        "exec reply does not say the VMM was OOM-killed: {} {}",
        r.status,
        r.text()
    );
    // The kernel says whom it killed and why.
    let dmesg = std::process::Command::new("dmesg")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let line = dmesg
        .lines()
        .rev()
        .find(|l| l.contains(&format!("Killed process {qemu} ")))
        .unwrap_or_else(|| panic!("no OOM kill of {qemu} in dmesg"));
    eprintln!("kernel: {line}");
    assert!(
        dmesg.contains("Memory cgroup out of memory") || dmesg.contains("memory.max"),
        "not a cgroup OOM kill: {line}"
    );
    let log = d.log();
    assert!(!log.contains("forbidden syscall"), "log:\n{log}");
    let mut d = d;
    let st = d.terminate(libc::SIGTERM).expect("daemon exit");
    assert!(st.success(), "daemon exit {st:?}\n{}", d.log());
}
