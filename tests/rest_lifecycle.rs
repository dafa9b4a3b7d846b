//! Daemon lifecycle: graceful SIGTERM/SIGINT and the orphan sweep after a
//! crash.

mod common;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::Daemon;
use common::wait_until;
use serde_json::json;
use std::time::{Duration, Instant};

#[test]
fn sigterm_exits_zero_and_leaves_nothing() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let mut d = Daemon::start(&[]);
        let h = d.http();
        h.exec("a", "true");
        h.exec("b", "true");
        // A command in flight when the signal comes is cancelled.
        let marker = common::marker();
        let h2 = h.clone();
        let cmd = format!("sleep {marker}");
        let inflight = std::thread::spawn(move || {
            h2.post("/exec/a/execute", &json!({ "command": cmd }))
                .status
        });
        // Seen running from inside the sandbox (the guest's process table
        // under a VM backend), by another exec in the same session.
        assert!(
            wait_until(Duration::from_secs(120), || h.sleepers_in("a", &marker)
                == 1),
            "the in-flight command did not start in the sandbox; log:\n{}",
            d.log()
        );
        if !common::daemon::vm_backend() {
            assert_eq!(common::sleepers(&marker), 1);
        }
        assert!(d.sandbox_procs().len() >= 2);
        // The VMM that runs it: with the VM the guest's processes die.
        let vmm = d.vmm_of("a");
        if common::daemon::vm_backend() {
            assert!(
                vmm.is_some(),
                "no VMM found for session a; log:\n{}",
                d.log()
            );
        }
        eprintln!("session a: `sleep {marker}` seen in the sandbox, VMM {vmm:?}");
        // terminate() gives up after 20 s (None): exiting at all, with the
        // command that would run for days cancelled, is the behaviour.
        let t0 = Instant::now();
        let st = d.terminate(sig).expect("daemon did not exit");
        assert!(st.success(), "exit status {st:?}; log:\n{}", d.log());
        eprintln!("shutdown on signal {sig}: {:?}", t0.elapsed());
        let status = inflight.join().unwrap();
        assert!(status >= 500, "in-flight exec answered {status}");
        if let Some(pid) = vmm {
            assert!(
                wait_until(Duration::from_secs(10), || common::pid_gone(pid)),
                "the VMM {pid} running the command survived shutdown"
            );
        }
        assert_eq!(
            common::sleepers(&marker),
            0,
            "the command survived shutdown"
        );
        let left = d.leftovers();
        assert!(left.is_empty(), "left behind: {left:?}");
        assert!(d.log().contains("shutdown complete"));
    }
}

#[test]
fn orphan_sweep_after_kill_9() {
    let mut d = Daemon::start(&[]);
    d.http().exec("x", "true");
    let orphans = d.sandbox_procs();
    assert!(!orphans.is_empty());
    d.terminate(libc::SIGKILL);
    // Even a daemon killed outright takes its sandboxes along: its spawner
    // gets the parent-death signal and kills everything it started...
    assert!(
        wait_until(Duration::from_secs(5), || orphans
            .iter()
            .all(|p| common::pid_gone(*p))),
        "sandbox processes outlived the daemon: {orphans:?}"
    );
    // ...and the next start sweeps what is left on disk.
    let dir = std::mem::replace(&mut d.dir, tempfile::tempdir().unwrap());
    drop(d);
    // Without standby VMMs of its own: what runs is the crash's.
    let d2 = Daemon::start_in(dir, &["--standby-vmms", "0"]);
    assert!(
        wait_until(Duration::from_secs(5), || d2.sandbox_procs().is_empty()),
        "orphans still alive: {:?}",
        d2.sandbox_procs()
    );
    assert!(d2.log().contains("orphan sweep removed"));
    // The key file survived; the printed key is not shown again.
    assert!(d2.key.is_empty());
}

fn cli(args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(args)
        .output()
        .expect("run agent-sandbox");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn keys_cli_takes_effect_on_a_running_daemon() {
    use std::os::unix::fs::PermissionsExt;
    let d = Daemon::start(&[]);
    let file = d.state_dir().join("keys.json");
    let f = file.to_str().unwrap();
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let (ok, token, err) = cli(&[
        "keys",
        "create",
        "--name",
        "ci",
        "--scopes",
        "exec",
        "--key-file",
        f,
    ]);
    assert!(ok, "{err}");
    let token = token.trim().to_string();
    let id = token.split('_').nth(1).unwrap().to_string();
    let h = d.http().with_key(&token);
    assert_eq!(h.get("/exec").status, 200);
    let (ok, list, _) = cli(&["keys", "list", "--key-file", f]);
    assert!(ok && list.contains(&id) && list.contains("ci") && !list.contains(&token));
    let (ok, rotated, _) = cli(&["keys", "rotate", &id, "--key-file", f]);
    assert!(ok);
    let h2 = d.http().with_key(rotated.trim());
    assert!(wait_until(Duration::from_secs(20), || h
        .get("/exec")
        .status
        == 401));
    assert_eq!(h2.get("/exec").status, 200);
    // A session of the key: revoking it from the CLI ends the session too
    // (the daemon notices the key file), not only its requests.
    h2.exec("cli-owned", "true");
    assert!(h2.get("/exec").text().contains("cli-owned"));
    let (ok, _, _) = cli(&["keys", "revoke", &id, "--key-file", f]);
    assert!(ok);
    assert!(wait_until(Duration::from_secs(20), || h2
        .get("/exec")
        .status
        == 401));
    assert!(
        wait_until(Duration::from_secs(20), || d
            .log()
            .contains("cli-owned: its key is revoked")),
        "the revoked key's session was not ended:\n{}",
        d.log()
    );
    let (ok, _, err) = cli(&["keys", "create", "--scopes", "root", "--key-file", f]);
    assert!(!ok && err.contains("unknown scope"));
    assert!(!std::fs::read_to_string(&file)
        .unwrap()
        .contains(rotated.trim()));
}

#[test]
fn no_auth_only_on_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args([
            "serve",
            "--no-auth",
            "--listen",
            "0.0.0.0:0",
            "--backend",
            "local-process",
        ])
        .arg("--state-dir")
        .arg(dir.path())
        .arg("--agent-bin")
        .arg(common::agent_bin())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("loopback"));
    let d = Daemon::start(&["--no-auth"]);
    assert_eq!(d.http().anonymous().get("/exec").status, 200);
}
