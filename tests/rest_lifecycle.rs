//! Daemon lifecycle: graceful SIGTERM/SIGINT and the orphan sweep after a
//! crash.

mod common;

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
        assert!(wait_until(Duration::from_secs(5), || common::sleepers(
            &marker
        ) == 1));
        assert!(d.sandbox_procs().len() >= 2);
        let t0 = Instant::now();
        let st = d.terminate(sig).expect("daemon did not exit");
        assert!(st.success(), "exit status {st:?}; log:\n{}", d.log());
        assert!(t0.elapsed() < Duration::from_secs(10));
        let status = inflight.join().unwrap();
        assert!(status >= 500, "in-flight exec answered {status}");
        assert!(
            d.sandbox_procs().is_empty(),
            "left behind: {:?}",
            d.sandbox_procs()
        );
        assert_eq!(
            common::sleepers(&marker),
            0,
            "the command survived shutdown"
        );
        let run = d.state_dir().join("run");
        let left: Vec<_> = std::fs::read_dir(&run)
            .map(|r| r.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "runtime dirs left: {left:?}");
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
    // The agents outlive a daemon that was killed outright...
    assert!(orphans
        .iter()
        .all(|p| std::path::Path::new(&format!("/proc/{p}")).exists()));
    // ...until the next start sweeps them.
    let dir = std::mem::replace(&mut d.dir, tempfile::tempdir().unwrap());
    drop(d);
    let d2 = Daemon::start_in(dir, &[]);
    assert!(
        wait_until(Duration::from_secs(5), || d2.sandbox_procs().is_empty()),
        "orphans still alive: {:?}",
        d2.sandbox_procs()
    );
    assert!(d2.log().contains("orphan sweep removed"));
    // The key file survived; the printed key is not shown again.
    assert!(d2.key.is_empty());
}
