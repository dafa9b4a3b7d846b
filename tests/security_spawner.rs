//! The spawner process, driven for real: processes as another uid inside a
//! network namespace this test makes, fd passing, exit statuses, kills,
//! policy refusals checked by the spawner itself, malformed requests, and a
//! killed spawner noticed by the client.
//!
//! Run as root: `cargo test --test security_spawner`.

#[path = "common/mod.rs"]
mod agentcommon;
#[path = "common/harden.rs"]
mod common;
#[path = "common/skip.rs"]
mod skip;

use agent_sandbox::harden::caps;
use agent_sandbox::harden::spawner::{
    fork_spawner, Bind, Jail, Policy, ProcLimits, Program, SpawnError, SpawnRequest, SpawnerClient,
};
use agent_sandbox::harden::Mode;
use agent_sandbox::vm::launch::Spawner as _;
use common::{is_root, Netns, Runner};
use std::io::Read;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const NOBODY: u32 = 65534;
const QEMU: &str = "/usr/bin/qemu-system-x86_64";

/// A guest kernel to boot: `AGENT_SANDBOX_TEST_KERNEL`, else the newest
/// built one in /var/cache/agent-sandbox/kernel.
fn test_kernel() -> Option<String> {
    if !std::path::Path::new(QEMU).exists() {
        return None;
    }
    if let Ok(k) = std::env::var("AGENT_SANDBOX_TEST_KERNEL") {
        return Some(k);
    }
    let mut ks: Vec<(std::time::SystemTime, PathBuf)> =
        std::fs::read_dir("/var/cache/agent-sandbox/kernel")
            .ok()?
            .flatten()
            .filter(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                n.starts_with("vmlinux-") && !n.contains('.')
            })
            .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
            .collect();
    ks.sort();
    ks.pop().map(|(_, p)| p.to_string_lossy().into_owned())
}

fn prog(p: &str, root: bool) -> Program {
    Program {
        path: PathBuf::from(p),
        may_run_as_root: root,
    }
}

fn pipe() -> (OwnedFd, OwnedFd) {
    let mut p = [0; 2];
    // SAFETY: pipe2 into a local array.
    assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: new fds.
    unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) }
}

fn read_all(fd: OwnedFd) -> String {
    let mut s = String::new();
    let _ = std::fs::File::from(fd).read_to_string(&mut s);
    s
}

fn sh(script: &str) -> SpawnRequest {
    SpawnRequest {
        argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        cwd: Some("/".into()),
        uid: NOBODY,
        gid: NOBODY,
        ..SpawnRequest::default()
    }
}

fn main() {
    match common::case_arg().as_deref() {
        Some("daemon_exits") => daemon_exits(),
        Some("daemon_like") => daemon_like(),
        _ => {}
    }
    let mut t = Runner::new();
    if !is_root() {
        t.skip_rest("the spawner tests need root");
    }
    // Made while still single-threaded (ip runs as a child, no threads).
    let ns = Netns::new("spawner");
    let witness = format!("/tmp/asbx-test-spawner-{}", std::process::id());
    let _ = std::fs::remove_file(&witness);
    let policy = Policy {
        programs: vec![
            prog("/bin/sh", false),
            prog("/bin/sleep", false),
            prog("/bin/echo", false),
            // Stands in for the jailer: starts as root, drops to a uid itself.
            prog("/usr/bin/setpriv", true),
            prog("/bin/cat", true),
            prog(QEMU, false),
        ],
        uids: 60000..=NOBODY,
        gids: 60000..=NOBODY,
        tool_uid: NOBODY,
        tool_gid: NOBODY,
        netns_dirs: vec!["/run/netns".into()],
        cgroup_dirs: vec!["/sys/fs/cgroup".into()],
    };
    let forked = fork_spawner(policy, Mode::Enforce).expect("fork spawner");
    let spawner_pid = forked.pid();
    let client = forked.start_client().expect("start client");

    t.check("spawns_as_another_uid_in_a_netns_with_passed_fds", || {
        let (out_r, out_w) = pipe();
        let (side_r, side_w) = pipe();
        let mut req = sh("id -u; id -g; id -G; readlink /proc/self/ns/net; echo side >&5; exit 7");
        req.netns = Some(ns.path());
        req.fds = vec![1, 5];
        let child = client
            .spawn(&req, &[out_w.as_fd(), side_w.as_fd()])
            .map_err(|e| e.to_string())?;
        drop((out_w, side_w));
        let out = read_all(out_r);
        let side = read_all(side_r);
        let st = child
            .wait_until(Instant::now() + Duration::from_secs(10))
            .map_err(|e| e.to_string())?
            .ok_or("no exit within 10 s")?;
        let want = format!("65534\n65534\n65534\nnet:[{}]\n", ns.inode());
        if out != want {
            return Err(format!("stdout {out:?}, want {want:?}"));
        }
        if side != "side\n" {
            return Err(format!("fd 5 carried {side:?}"));
        }
        if st.code != Some(7) {
            return Err(format!("status {st:?}, want code 7"));
        }
        Ok(())
    });

    t.check("a_denylisted_syscall_is_refused_and_audited", || {
        // syslog(SYSLOG_ACTION_SIZE_BUFFER) is harmless if it ran; the
        // spawner's denylist answers EPERM and, with FLAG_LOG, the kernel
        // writes an audit record (code=0x50001) that .ci/seccomp-audit
        // counts as its proof that it sees refused syscalls.
        let (r, w) = pipe();
        let req = SpawnRequest {
            argv: vec![
                // python3 itself is not a program the spawner starts.
                "/usr/bin/setpriv".into(),
                "--reuid=65534".into(),
                "--regid=65534".into(),
                "--clear-groups".into(),
                "/usr/bin/python3".into(),
                "-c".into(),
                "import ctypes; l = ctypes.CDLL(None, use_errno=True); \
                 print(l.syscall(103, 10, 0, 0), ctypes.get_errno())"
                    .into(),
            ],
            uid: 0,
            gid: 0,
            fds: vec![1],
            ..SpawnRequest::default()
        };
        let c = client
            .spawn(&req, &[w.as_fd()])
            .map_err(|e| e.to_string())?;
        drop(w);
        let out = read_all(r);
        let st = c.wait_until(Instant::now() + Duration::from_secs(20));
        if out.trim() != format!("-1 {}", libc::EPERM) {
            return Err(format!("syslog(2) under the spawner gave {out:?} ({st:?})"));
        }
        Ok(())
    });

    t.check("applies_file_size_and_open_file_limits", || {
        let (out_r, out_w) = pipe();
        // Both the soft and hard limits, and a write past the file size
        // limit fails (SIGXFSZ ignored, so dd reports EFBIG).
        let mut req = sh(&format!(
            "ulimit -S -f; ulimit -H -f; ulimit -S -n; ulimit -H -n; trap '' XFSZ; \
             dd if=/dev/zero of={witness}.big bs=1024 count=200 2>/dev/null && echo wrote; \
             stat -c %s {witness}.big; rm -f {witness}.big"
        ));
        req.uid = NOBODY;
        req.gid = NOBODY;
        req.cwd = Some("/tmp".into());
        req.fds = vec![1];
        req.limits = ProcLimits {
            fsize: Some(100 * 1024),
            nofile: Some(64),
        };
        let child = client
            .spawn(&req, &[out_w.as_fd()])
            .map_err(|e| e.to_string())?;
        drop(out_w);
        let out = read_all(out_r);
        child
            .wait_until(Instant::now() + Duration::from_secs(10))
            .map_err(|e| e.to_string())?
            .ok_or("no exit within 10 s")?;
        // dash's ulimit -f counts 512-byte blocks; dd fails (no "wrote")
        // and the file stops at the limit.
        let want = "200\n200\n64\n64\n102400\n";
        if out != want {
            return Err(format!("stdout {out:?}, want {want:?}"));
        }
        Ok(())
    });

    t.check("kill_reports_the_signal", || {
        let mut req = sh("exec sleep 100");
        req.argv = vec!["/bin/sleep".into(), "100".into()];
        req.new_process_group = true;
        let child = client.spawn(&req, &[]).map_err(|e| e.to_string())?;
        std::thread::sleep(Duration::from_millis(50));
        child.kill(libc::SIGTERM).map_err(|e| e.to_string())?;
        let st = child
            .wait_until(Instant::now() + Duration::from_secs(10))
            .map_err(|e| e.to_string())?
            .ok_or("no exit within 10 s of SIGTERM")?;
        if st.signal != Some(libc::SIGTERM) {
            return Err(format!("status {st:?}, want SIGTERM"));
        }
        // The spawner refuses to signal a pid it did not start (or no longer runs).
        match client.kill(child.pid(), libc::SIGKILL, false) {
            Err(SpawnError::Failed(m)) if m.contains("not a running process") => Ok(()),
            other => Err(format!("kill of a reaped pid: {other:?}")),
        }
    });

    t.check("policy_refusals", || {
        let cases: Vec<(SpawnRequest, &str)> = vec![
            (
                SpawnRequest {
                    argv: vec!["/usr/bin/python3".into()],
                    uid: NOBODY,
                    gid: NOBODY,
                    ..SpawnRequest::default()
                },
                "not in the spawner's allowlist",
            ),
            (
                SpawnRequest {
                    uid: 0,
                    gid: 0,
                    ..sh("true")
                },
                "may not run as uid/gid 0",
            ),
            (
                SpawnRequest {
                    uid: 1000,
                    ..sh("true")
                },
                "outside the allowed ranges",
            ),
            (
                SpawnRequest {
                    netns: Some("/proc/1/ns/net".into()),
                    ..sh("true")
                },
                "is not under",
            ),
            (
                SpawnRequest {
                    netns: Some("/run/netns/../../proc/1/ns/net".into()),
                    ..sh("true")
                },
                "is not under",
            ),
        ];
        for (req, want) in cases {
            match client.spawn(&req, &[]) {
                Err(SpawnError::Failed(m)) if m.contains(want) => {}
                other => return Err(format!("{req:?}: got {other:?}, want error with {want:?}")),
            }
        }
        Ok(())
    });

    t.check(
        "jailed_child_has_its_own_namespaces_and_only_its_binds",
        || {
            let dir = tempfile::Builder::new()
                .prefix("asbx-jail-test")
                .tempdir()
                .map_err(|e| e.to_string())?;
            let work = dir.path().join("w");
            let root = dir.path().join("root");
            for d in [&work, &root] {
                std::fs::create_dir(d).map_err(|e| e.to_string())?;
            }
            std::os::unix::fs::chown(&work, Some(NOBODY), Some(NOBODY))
                .map_err(|e| e.to_string())?;
            // dash, its loader and libc, a writable dir, /dev/null: only shell
            // builtins inside. It waits on stdin so its namespaces can be read.
            let mut binds: Vec<Bind> = ["/bin/sh", "/lib64/ld-linux-x86-64.so.2", "/dev/null"]
                .iter()
                .chain(&["/lib/x86_64-linux-gnu/libc.so.6"])
                .map(|p| Bind {
                    path: p.to_string(),
                    writable: false,
                })
                .collect();
            binds.push(Bind {
                path: work.display().to_string(),
                writable: true,
            });
            let w = work.display();
            let mut req = sh(&format!(
                "echo pid=$$; for f in /* /*/* /proc/*; do echo \"$f\"; done; \
             [ -e /etc/passwd ] && echo passwd-visible; \
             echo hi > {w}/out && echo wrote-work; \
             (echo x > /new) 2>/dev/null || echo root-read-only; \
             echo x > /dev/null && echo devnull-writable; \
             read _ignored"
            ));
            req.cwd = Some(work.display().to_string());
            req.jail = Some(Jail {
                root: root.display().to_string(),
                binds,
                proc: true,
            });
            req.fds = vec![0, 1];
            let (in_r, in_w) = pipe();
            let (out_r, out_w) = pipe();
            let child = client
                .spawn(&req, &[in_r.as_fd(), out_w.as_fd()])
                .map_err(|e| e.to_string())?;
            drop((in_r, out_w));
            let mut same = Vec::new();
            for ns in ["net", "mnt", "pid", "ipc"] {
                let theirs = std::fs::read_link(format!("/proc/{}/ns/{ns}", child.pid()))
                    .map_err(|e| format!("ns/{ns} of the child: {e}"))?;
                let ours =
                    std::fs::read_link(format!("/proc/self/ns/{ns}")).map_err(|e| e.to_string())?;
                if theirs == ours {
                    same.push(ns);
                }
            }
            drop(in_w);
            let out = read_all(out_r);
            child
                .wait_until(Instant::now() + Duration::from_secs(10))
                .map_err(|e| e.to_string())?
                .ok_or("no exit within 10 s")?;
            if !same.is_empty() {
                return Err(format!(
                    "child shares the namespaces {same:?} with the test"
                ));
            }
            let lines: Vec<&str> = out.lines().collect();
            let top: Vec<&str> = lines
                .iter()
                .copied()
                .filter(|l| l.starts_with('/') && l.matches('/').count() == 1)
                .collect();
            // The work dir's top-level ancestor (/tmp) is the only other one.
            let first = format!("/{}", w.to_string().split('/').nth(1).unwrap_or(""));
            let mut want_top = vec!["/bin", "/dev", "/lib", "/lib64", "/proc", first.as_str()];
            want_top.sort();
            want_top.dedup();
            let mut got_top = top.clone();
            got_top.sort();
            let checks = [
                (
                    lines.first() == Some(&"pid=1"),
                    "pid 1 in its own pid namespace",
                ),
                (
                    got_top == want_top,
                    "only the bound paths at the top of its root",
                ),
                (!out.contains("passwd-visible"), "no /etc/passwd"),
                (
                    lines.contains(&"/dev/null") && !lines.contains(&"/dev/sda"),
                    "only /dev/null in /dev",
                ),
                (
                    lines.contains(&"/proc/1") && !lines.iter().any(|l| l.starts_with("/proc/sys")),
                    "a pid-only /proc",
                ),
                (out.contains("wrote-work"), "a writable work dir"),
                (out.contains("root-read-only"), "a read-only root"),
                (out.contains("devnull-writable"), "a writable /dev/null"),
            ];
            for (ok, what) in checks {
                if !ok {
                    return Err(format!("jailed child lacks {what}; its output:\n{out}"));
                }
            }
            if std::fs::read_to_string(work.join("out")).map_err(|e| e.to_string())? != "hi\n" {
                return Err("the work dir write did not reach the host".into());
            }
            if std::fs::read_dir(&root)
                .map_err(|e| e.to_string())?
                .next()
                .is_some()
            {
                return Err("the jail's root mount is visible on the host".into());
            }
            Ok(())
        },
    );

    t.check("jail_requests_are_checked", || {
        let jail = |binds: &[&str]| Jail {
            root: "/tmp/asbx-jail-root".into(),
            binds: binds
                .iter()
                .map(|p| Bind {
                    path: p.to_string(),
                    writable: false,
                })
                .collect(),
            proc: true,
        };
        let cases = [
            (jail(&["/proc/1/root"]), "no host /proc"),
            (jail(&["/usr", "/usr/bin"]), "overlap"),
            (jail(&["/tmp/asbx-jail-root/x"]), "under the jail root"),
            (jail(&["/usr/../etc"]), "not a plain absolute path"),
            (jail(&["lib"]), "not a plain absolute path"),
            (
                Jail {
                    root: "/".into(),
                    ..jail(&[])
                },
                "not a plain absolute path",
            ),
        ];
        for (j, want) in cases {
            let req = SpawnRequest {
                jail: Some(j),
                ..sh("true")
            };
            match client.spawn(&req, &[]) {
                Err(SpawnError::Failed(m)) if m.contains(want) => {}
                other => return Err(format!("{req:?}: got {other:?}, want error with {want:?}")),
            }
        }
        Ok(())
    });

    t.check("spawner_checks_policy_itself_and_survives_malformed_requests", || {
        // Bypass the client's own check: a raw request to run a shell as
        // root that would create the witness file.
        let raw = format!(
            r#"{{"op":"spawn","id":4242,"req":{{"argv":["/bin/sh","-c","touch {witness}"],"uid":0,"gid":0}}}}"#
        );
        for bad in [
            raw.as_bytes(),
            b"{not json".as_slice(),
            br#"{"op":"format_disk","id":1}"#.as_slice(),
            br#"{"op":"kill","id":2,"pid":1,"signal":9}"#.as_slice(),
            &[0xff; 70000][..60000],
        ] {
            client.send_raw(bad).map_err(|e| format!("send: {e}"))?;
        }
        std::thread::sleep(Duration::from_millis(200));
        if std::path::Path::new(&witness).exists() {
            return Err("the spawner ran a refused request".into());
        }
        if let Some(d) = client.dead() {
            return Err(format!("spawner died: {d}"));
        }
        let child = client.spawn(&sh("exit 3"), &[]).map_err(|e| e.to_string())?;
        let st = child
            .wait_until(Instant::now() + Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        match st {
            Some(s) if s.code == Some(3) => Ok(()),
            other => Err(format!("after malformed requests: {other:?}")),
        }
    });

    t.check("jailer_spawner_trait_runs_to_completion", || {
        let argv = ["/bin/echo".into(), "hello".into()];
        let out = client
            .run(&argv, Instant::now() + Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        if out.code != Some(0) || out.stdout != b"hello\n" {
            return Err(format!("{out:?}"));
        }
        let argv = [
            "/bin/sh".into(),
            "-c".into(),
            "echo out; echo err >&2; exit 3".into(),
        ];
        let out = client
            .run(&argv, Instant::now() + Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        if out.code != Some(3) || out.stdout != b"out\n" || out.stderr != b"err\n" {
            return Err(format!("{out:?}"));
        }
        // Ended at its deadline, not after the sleep's 30 s.
        let t0 = Instant::now();
        let argv = ["/bin/sleep".into(), "30".into()];
        match client.run(&argv, Instant::now() + Duration::from_millis(200)) {
            Err(agent_sandbox::vm::VmError::Timeout { .. })
                if t0.elapsed() < Duration::from_secs(15) => {}
            other => return Err(format!("sleep 30 with a 200 ms deadline: {other:?}")),
        }
        let argv = ["/nonexistent/jailer".into()];
        match client.run(&argv, Instant::now() + Duration::from_secs(1)) {
            Err(e) if e.to_string().contains("/nonexistent/jailer") => Ok(()),
            other => Err(format!("unknown program: {other:?}")),
        }
    });

    t.check(
        "root_program_keeps_only_spawner_caps_and_can_drop_uid",
        || {
            // What the jailer gets: started as root under no_new_privs with the
            // spawner's bounding set and denylist filter, and it can still
            // setuid itself.
            let (r, w) = pipe();
            let req = SpawnRequest {
                argv: vec!["/bin/cat".into(), "/proc/self/status".into()],
                uid: 0,
                gid: 0,
                fds: vec![1],
                ..SpawnRequest::default()
            };
            let c = client
                .spawn(&req, &[w.as_fd()])
                .map_err(|e| e.to_string())?;
            drop(w);
            let status = read_all(r);
            let _ = c.wait_until(Instant::now() + Duration::from_secs(10));
            let want = caps::mask(
                &caps::plan(caps::SPAWNER)
                    .into_iter()
                    .map(|(c, _)| c)
                    .collect::<Vec<_>>(),
            ) & common::own_permitted();
            for line in [
                format!("CapBnd:\t{want:016x}"),
                format!("CapEff:\t{want:016x}"),
                "CapAmb:\t0000000000000000".into(),
                "NoNewPrivs:\t1".into(),
                "Seccomp:\t2".into(),
            ] {
                if !status.contains(&line) {
                    return Err(format!("missing {line:?} in\n{status}"));
                }
            }
            let (r, w) = pipe();
            let req = SpawnRequest {
                argv: vec![
                    "/usr/bin/setpriv".into(),
                    "--reuid=65534".into(),
                    "--regid=65534".into(),
                    "--clear-groups".into(),
                    "/bin/sh".into(),
                    "-c".into(),
                    "id -u; grep CapEff /proc/self/status".into(),
                ],
                uid: 0,
                gid: 0,
                fds: vec![1],
                ..SpawnRequest::default()
            };
            let c = client
                .spawn(&req, &[w.as_fd()])
                .map_err(|e| e.to_string())?;
            drop(w);
            let out = read_all(r);
            let st = c.wait_until(Instant::now() + Duration::from_secs(10));
            if out != "65534\nCapEff:\t0000000000000000\n" {
                return Err(format!(
                    "setpriv under the spawner printed {out:?} ({st:?})"
                ));
            }
            Ok(())
        },
    );

    t.check(
        "qemu_boots_under_the_spawner_as_nobody_with_sandbox_on",
        || {
            // QEMU inherits the spawner's no_new_privs and denylist filter and
            // adds its own -sandbox filter on top; a kernel that gets as far as
            // panicking over the missing root disk has booted under all three.
            let Some(kernel) = test_kernel() else {
                return common::skip_case("no qemu-system-x86_64 or guest kernel here");
            };
            let (r, w) = pipe();
            let req = SpawnRequest {
                argv: [
                    QEMU,
                    "-M",
                    "microvm,acpi=off",
                    "-accel",
                    "tcg",
                    "-m",
                    "64",
                    "-nodefaults",
                    "-no-user-config",
                    "-nographic",
                    "-no-reboot",
                    "-serial",
                    "stdio",
                    "-sandbox",
                    "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
                    "-append",
                    "console=ttyS0 panic=-1",
                    "-kernel",
                    &kernel,
                ]
                .iter()
                .map(|s| s.to_string())
                .collect(),
                cwd: Some("/".into()),
                uid: NOBODY,
                gid: NOBODY,
                netns: Some(ns.path()),
                fds: vec![1, 2],
                new_process_group: true,
                ..SpawnRequest::default()
            };
            let w2 = w.try_clone().map_err(|e| e.to_string())?;
            let child = client
                .spawn(&req, &[w.as_fd(), w2.as_fd()])
                .map_err(|e| e.to_string())?;
            drop((w, w2));
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let mut f = std::fs::File::from(r);
                let mut buf = [0u8; 4096];
                while let Ok(n) = f.read(&mut buf) {
                    if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                        break;
                    }
                }
            });
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut console = Vec::new();
            let booted = loop {
                let text = String::from_utf8_lossy(&console);
                if text.contains("Kernel panic") || text.contains("VFS: Unable to mount root") {
                    break true;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                match rx.recv_timeout(left.min(Duration::from_millis(200))) {
                    Ok(b) => console.extend_from_slice(&b),
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) if !left.is_zero() => {}
                    Err(_) => break false,
                }
            };
            let _ = child.kill(libc::SIGKILL);
            let st = child.wait_until(Instant::now() + Duration::from_secs(10));
            let text = String::from_utf8_lossy(&console);
            if booted {
                Ok(())
            } else if text.contains("invalid kernel header") {
                // QEMU ran as nobody under the filters and read the file;
                // the kernel lacks a PVH entry point: nothing to watch boot.
                common::skip_case(&format!(
                    "{kernel} is not a PVH kernel QEMU microvm can boot"
                ))
            } else {
                let tail: String = text
                    .chars()
                    .rev()
                    .take(2000)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect();
                Err(format!(
                    "no kernel panic within 60 s ({st:?}); console tail:\n{tail}"
                ))
            }
        },
    );

    t.check("daemon_exit_makes_the_spawner_kill_its_children", || {
        let o = common::run_case("daemon_exits");
        let out = String::from_utf8_lossy(&o.stdout);
        let pid: i32 = out
            .lines()
            .find_map(|l| l.strip_prefix("child "))
            .and_then(|p| p.trim().parse().ok())
            .ok_or_else(|| format!("no child pid\n{}", common::describe(&o)))?;
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::path::Path::new(&format!("/proc/{pid}")).exists() {
            if Instant::now() > deadline {
                let _ = std::process::Command::new("kill")
                    .args(["-9", &pid.to_string()])
                    .status();
                return Err(format!(
                    "child {pid} still runs 5 s after the daemon exited"
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    });

    t.check("hardened_daemon_runs_the_agent_through_the_spawner", || {
        // The whole daemon arrangement: spawner forked, apply(), then a
        // Session thread starts the real guest agent as nobody through the
        // spawner and drives it with the real AgentClient.
        let bin = agentcommon::agent_bin();
        let dir = tempfile::Builder::new()
            .prefix("asbx-test-hd")
            .tempdir()
            .map_err(|e| e.to_string())?;
        std::os::unix::fs::chown(dir.path(), Some(NOBODY), Some(NOBODY))
            .map_err(|e| e.to_string())?;
        let o = std::process::Command::new(std::env::current_exe().map_err(|e| e.to_string())?)
            .args(["--case", "daemon_like"])
            .env("HD_AGENT_BIN", &bin)
            .env("HD_DIR", dir.path())
            .output()
            .map_err(|e| e.to_string())?;
        let out = String::from_utf8_lossy(&o.stdout);
        if o.status.success() && out.contains("agent says: hi from 65534") {
            Ok(())
        } else {
            Err(common::describe(&o))
        }
    });

    t.check("a_killed_spawner_is_noticed_and_its_children_die", || {
        killed(&client, spawner_pid)
    });
    let _ = std::fs::remove_file(&witness);
    drop(ns);
    t.finish();
}

fn killed(client: &SpawnerClient, pid: i32) -> Result<(), String> {
    let hook = Arc::new(AtomicBool::new(false));
    let h = hook.clone();
    client.on_death(move |_| h.store(true, Ordering::SeqCst));
    let running = client
        .spawn(&sh("exec sleep 100"), &[])
        .map_err(|e| e.to_string())?;
    // SAFETY: signalling the spawner this test forked.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(5);
    while client.dead().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let dead = client.dead().ok_or("client did not notice within 5 s")?;
    if !dead.contains("killed by signal 9") {
        return Err(format!("death reason {dead:?}"));
    }
    if !hook.load(Ordering::SeqCst) {
        return Err("death hook not called".into());
    }
    // A waiter on a child learns it, too.
    match running.wait_until(Instant::now() + Duration::from_secs(1)) {
        Err(SpawnError::Died(_)) => {}
        other => return Err(format!("waiter got {other:?}")),
    }
    // What it started dies with it (PR_SET_PDEATHSIG in every child), even
    // though it was killed outright and could not kill its children.
    let gone = |p: i32| {
        std::fs::read_to_string(format!("/proc/{p}/stat"))
            .map(|s| {
                s.rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z')
            })
            .unwrap_or(true)
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !gone(running.pid()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    if !gone(running.pid()) {
        let _ = std::process::Command::new("kill")
            .args(["-9", &running.pid().to_string()])
            .status();
        return Err(format!("pid {} outlived the killed spawner", running.pid()));
    }
    match client.spawn(&sh("true"), &[]) {
        Err(e @ SpawnError::Died(_)) => {
            let m = e.to_string();
            if m.contains("cannot be started") {
                Ok(())
            } else {
                Err(format!("unclear error {m:?}"))
            }
        }
        other => Err(format!("spawn after death: {other:?}")),
    }
}

/// Child run: start a spawner and a long-running process, then exit
/// without cleaning up, as a crashing daemon would.
fn daemon_exits() -> ! {
    let policy = Policy {
        programs: vec![prog("/bin/sleep", false)],
        uids: NOBODY..=NOBODY,
        gids: NOBODY..=NOBODY,
        tool_uid: NOBODY,
        tool_gid: NOBODY,
        netns_dirs: vec![],
        cgroup_dirs: vec![],
    };
    let client = fork_spawner(policy, Mode::Enforce)
        .and_then(|f| f.start_client())
        .expect("spawner");
    let req = SpawnRequest {
        argv: vec!["/bin/sleep".into(), "100".into()],
        uid: NOBODY,
        gid: NOBODY,
        new_process_group: true,
        ..SpawnRequest::default()
    };
    let child = client.spawn(&req, &[]).expect("spawn sleep");
    println!("child {}", child.pid());
    std::process::exit(0)
}

/// Child run: the daemon's start-up order, then an agent session.
fn daemon_like() -> ! {
    use agent_sandbox::agent::AgentClient;
    use agent_sandbox::harden::{self, ThreadKind};
    use agent_sandbox::proto::ExecRequest;
    let bin = std::env::var("HD_AGENT_BIN").expect("HD_AGENT_BIN");
    let dir = std::env::var("HD_DIR").expect("HD_DIR");
    let policy = Policy {
        programs: vec![prog(&bin, false)],
        uids: NOBODY..=NOBODY,
        gids: NOBODY..=NOBODY,
        tool_uid: NOBODY,
        tool_gid: NOBODY,
        netns_dirs: vec![],
        cgroup_dirs: vec![],
    };
    let forked = fork_spawner(policy, Mode::Enforce).expect("fork spawner");
    let opts = harden::Options {
        needs: caps::DAEMON.to_vec(),
        seccomp: Mode::Enforce,
        nofile: None,
    };
    harden::apply(&opts).expect("apply");
    let client = forked.start_client().expect("client");
    let h = harden::thread::spawn(
        ThreadKind::Session,
        std::thread::Builder::new().name("session-1".into()),
        move || -> Result<String, String> {
            let sock = format!("{dir}/agent.sock");
            let (r, w) = pipe();
            let req = SpawnRequest {
                argv: vec![
                    bin.clone(),
                    "--listen".into(),
                    format!("unix:{sock}"),
                    "--workspace".into(),
                    format!("{dir}/ws"),
                ],
                env: vec![("SANDBOX_AGENT_LOG".into(), "warn".into())],
                cwd: Some(dir.clone()),
                uid: NOBODY,
                gid: NOBODY,
                fds: vec![1],
                new_process_group: true,
                ..SpawnRequest::default()
            };
            let child = client
                .spawn(&req, &[w.as_fd()])
                .map_err(|e| e.to_string())?;
            drop(w);
            let mut f = std::fs::File::from(r);
            let mut line = Vec::new();
            let mut b = [0u8; 1];
            while f.read(&mut b).map_err(|e| e.to_string())? == 1 && b[0] != b'\n' {
                line.push(b[0]);
            }
            let stream = std::os::unix::net::UnixStream::connect(&sock)
                .map_err(|e| format!("connect {sock}: {e}"))?;
            let agent =
                AgentClient::connect(stream, Duration::from_secs(10)).map_err(|e| e.to_string())?;
            let out = agent
                .exec(
                    ExecRequest {
                        shell: Some("echo hi from $(id -u)".into()),
                        ..Default::default()
                    },
                    1 << 20,
                )
                .map_err(|e| e.to_string())?;
            agent.close();
            child.kill(libc::SIGKILL).map_err(|e| e.to_string())?;
            let _ = child.wait_until(Instant::now() + Duration::from_secs(5));
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        },
    )
    .expect("spawn session thread");
    match h.join() {
        Ok(Ok(s)) => println!("agent says: {s}"),
        Ok(Err(e)) => {
            println!("session failed: {e}");
            std::process::exit(1)
        }
        Err(_) => std::process::exit(2),
    }
    std::process::exit(0)
}
