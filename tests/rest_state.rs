//! Stateful sessions through the real daemon and real VMs (issue #21):
//! checkpoints, sessions from a checkpoint, fork, pause/resume, and paused
//! sessions surviving a daemon restart.

mod common;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::{stdout_of, Daemon, Http};
use common::wait_until;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::time::{Duration, Instant};

/// Runs `cmd` in session `id` through `/v1` and returns its stdout;
/// fails the test on a non-zero exit.
fn sh(h: &Http, id: &str, cmd: &str) -> String {
    let r = h.post(
        &format!("/v1/sessions/{id}/exec"),
        &json!({ "command": cmd, "timeout": 120_000 }),
    );
    assert_eq!(r.status, 200, "exec {cmd:?} in {id}: {}", r.text());
    let v = r.json();
    assert_eq!(v["exitCode"], 0, "exec {cmd:?} in {id}: {v}");
    stdout_of(&v)
}

fn create(h: &Http, body: Value) -> Value {
    let r = h.post("/v1/sessions", &body);
    assert_eq!(r.status, 201, "create {body}: {}", r.text());
    r.json()
}

fn state_of(h: &Http, id: &str) -> Value {
    let r = h.get(&format!("/v1/sessions/{id}"));
    assert_eq!(r.status, 200, "get {id}: {}", r.text());
    r.json()
}

fn vm_daemon(extra: &[&str]) -> Option<Daemon> {
    if !common::daemon::vm_backend() {
        return None;
    }
    Some(Daemon::start(extra))
}

/// A Python process that keeps a counter in memory, driven through a
/// FIFO: `inc` adds one, `dump` writes it to /tmp/counter. It holds the
/// FIFO open for writing too, so it never reads an EOF: a reader that
/// closed at each EOF and reopened lost the line of a writer that came in
/// between (CI: 1 counted of 3 `inc`s).
const COUNTER: &str = r#"mkfifo /tmp/ctl; exec python3 -c '
import os
n = 0
with os.fdopen(os.open("/tmp/ctl", os.O_RDWR), "r") as f:
    for line in f:
        if line.strip() == "inc":
            n += 1
        elif line.strip() == "dump":
            with open("/tmp/counter.tmp", "w") as o:
                o.write(str(n))
            os.rename("/tmp/counter.tmp", "/tmp/counter")
'"#;

/// Starts `cmd` as a background process of session `id`.
fn bg(h: &Http, id: &str, cmd: &str) {
    let r = h.post(
        &format!("/v1/sessions/{id}/exec"),
        &json!({ "command": cmd, "background": true }),
    );
    assert_eq!(r.status, 202, "start {cmd:?} in {id}: {}", r.text());
}

fn counter(h: &Http, id: &str) -> String {
    sh(h, id, "rm -f /tmp/counter; echo dump > /tmp/ctl; for i in $(seq 100); do test -f /tmp/counter && break; sleep 0.1; done; cat /tmp/counter")
}

#[test]
fn a_checkpoint_restores_memory_and_files_and_the_source_keeps_its_changes() {
    let Some(d) = vm_daemon(&[]) else {
        skip!("needs a VM backend (AGENT_SANDBOX_TEST_BACKEND=qemu)");
    };
    let h = d.http();
    create(&h, json!({"id": "src", "template": "python"}));
    bg(&h, "src", COUNTER);
    sh(
        &h,
        "src",
        "for i in $(seq 100); do test -p /tmp/ctl && break; sleep 0.1; done",
    );
    sh(
        &h,
        "src",
        "for i in 1 2 3; do echo inc > /tmp/ctl; done; \
         echo v1 > /workspace/a.txt; echo v1 > /usr/local/b.txt",
    );
    assert_eq!(counter(&h, "src"), "3");

    let r = h.post("/v1/sessions/src/snapshots", &json!({"name": "three"}));
    assert_eq!(r.status, 201, "checkpoint: {}", r.text());
    let snap = r.json();
    let sid = snap["id"].as_str().expect("snapshot id").to_string();
    assert_eq!(snap["name"], "three");
    assert_eq!(snap["sessionId"], "src");
    assert_eq!(snap["restorable"], true, "{snap}");
    assert!(snap["sizeBytes"].as_u64().unwrap_or(0) > 1 << 20, "{snap}");
    eprintln!(
        "FIGURE checkpoint_paused_ms {} ms; size {} MiB",
        snap["pausedMs"],
        snap["sizeBytes"].as_u64().unwrap_or(0) >> 20
    );
    // Listed for its key, not for another.
    let list = h.get("/v1/snapshots").json();
    assert!(
        list["snapshots"]
            .as_array()
            .is_some_and(|a| a.iter().any(|s| s["id"] == sid.as_str())),
        "{list}"
    );

    // The source runs on and changes everything.
    sh(
        &h,
        "src",
        "echo inc > /tmp/ctl; echo inc > /tmp/ctl; \
         echo v2 > /workspace/a.txt; echo v2 > /usr/local/b.txt",
    );
    assert_eq!(counter(&h, "src"), "5");

    let copy = create(&h, json!({"id": "copy", "fromSnapshot": sid}));
    assert_eq!(copy["template"], "python");
    assert_eq!(counter(&h, "copy"), "3", "the copy's in-memory counter");
    assert_eq!(
        sh(&h, "copy", "cat /workspace/a.txt /usr/local/b.txt"),
        "v1\nv1\n"
    );
    sh(&h, "copy", "echo inc > /tmp/ctl");
    assert_eq!(counter(&h, "copy"), "4");
    // The source still has its own state.
    assert_eq!(counter(&h, "src"), "5");
    assert_eq!(
        sh(&h, "src", "cat /workspace/a.txt /usr/local/b.txt"),
        "v2\nv2\n"
    );

    // Several at once, from the same checkpoint.
    let r = h.post("/v1/sessions", &json!({"fromSnapshot": sid, "count": 2}));
    assert_eq!(r.status, 201, "{}", r.text());
    let many = r.json();
    let ids: Vec<String> = many["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_string())
        .collect();
    assert_eq!(ids.len(), 2, "{many}");
    for id in &ids {
        assert_eq!(counter(&h, id), "3");
    }

    // Bad input: a clear 4xx each.
    let r = h.post("/v1/sessions", &json!({"fromSnapshot": sid, "vcpus": 3}));
    assert_eq!(r.status, 400, "{}", r.text());
    let r = h.post(
        "/v1/sessions",
        &json!({"fromSnapshot": "snap-000000000000"}),
    );
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(r.code(), "snapshot_not_found");
    let other = h.with_key(&mint_key(&h));
    let r = other.post("/v1/sessions", &json!({"fromSnapshot": sid}));
    assert_eq!(r.status, 404, "another key's snapshot: {}", r.text());
    assert_eq!(other.get(&format!("/v1/snapshots/{sid}")).status, 404);

    // Deleted: gone from the list; the sessions made from it run on.
    assert!(h.delete(&format!("/v1/snapshots/{sid}")).status < 300);
    assert_eq!(h.get(&format!("/v1/snapshots/{sid}")).status, 404);
    assert_eq!(counter(&h, "copy"), "4");
    let left = std::fs::read_dir(d.state_dir().join("checkpoints"))
        .map(|rd| rd.count())
        .unwrap_or(0);
    assert_eq!(left, 0, "checkpoint files left after delete");
}

/// A key with exec scope of its own (another owner).
fn mint_key(h: &Http) -> String {
    let r = h.post("/admin/keys", &json!({"name": "other", "scopes": ["exec"]}));
    assert_eq!(r.status, 201, "create key: {}", r.text());
    let v = r.json();
    v["key"]
        .as_str()
        .unwrap_or_else(|| panic!("no key in {v}"))
        .to_string()
}

#[test]
fn twenty_pause_resume_cycles_lose_nothing() {
    let Some(d) = vm_daemon(&[]) else {
        skip!("needs a VM backend (AGENT_SANDBOX_TEST_BACKEND=qemu)");
    };
    let h = d.http();
    create(&h, json!({"id": "p"}));
    // A background process that counts while the session runs.
    bg(
        &h,
        "p",
        // Written whole by a rename: `echo > /tmp/count` truncates first,
        // and a reader in between (after a resume, say) sees it empty.
        "echo $$ > /tmp/counter.pid; i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done",
    );
    sh(
        &h,
        "p",
        "for i in $(seq 100); do test -s /tmp/count && break; sleep 0.1; done",
    );
    let pid = sh(&h, "p", "cat /tmp/counter.pid").trim().to_string();
    let mut last = 0u64;
    let mut pause_ms = Vec::new();
    let mut resume_ms = Vec::new();
    for n in 1..=20 {
        sh(&h, "p", &format!("echo {n} > /workspace/cycle-{n}"));
        let t = Instant::now();
        let r = h.post("/v1/sessions/p/pause", &json!({}));
        assert_eq!(r.status, 200, "pause {n}: {}", r.text());
        pause_ms.push(t.elapsed().as_millis());
        let v = r.json();
        assert_eq!(v["state"], "paused", "{v}");
        assert!(v["snapshotBytes"].as_u64().unwrap_or(0) > 0, "{v}");
        assert_eq!(state_of(&h, "p")["state"], "paused");
        let t = Instant::now();
        if n % 2 == 0 {
            let r = h.post("/v1/sessions/p/resume", &json!({}));
            assert_eq!(r.status, 200, "resume {n}: {}", r.text());
            assert_eq!(r.json()["state"], "ready");
        }
        // Odd cycles: the exec itself resumes it.
        let out = sh(
            &h,
            "p",
            &format!("cat /workspace/cycle-*; kill -0 {pid} && echo count=$(cat /tmp/count)"),
        );
        resume_ms.push(t.elapsed().as_millis());
        // The count by its label: an unlabelled last line once took a
        // file's content for the count (CI: "cycle 1 lost cycle-1").
        let (files, count): (Vec<&str>, Vec<&str>) =
            out.lines().partition(|l| !l.starts_with("count="));
        let count: u64 = match count.as_slice() {
            [c] => c["count=".len()..]
                .trim()
                .parse()
                .unwrap_or_else(|_| panic!("cycle {n}: no count in {out:?}")),
            _ => panic!("cycle {n}: one count line expected in {out:?}"),
        };
        let files: HashSet<&str> = files.into_iter().collect();
        let want: HashSet<String> = (1..=n).map(|i| i.to_string()).collect();
        if files != want.iter().map(String::as_str).collect() {
            // Say what the guest sees before failing.
            let r = h.post(
                "/v1/sessions/p/exec",
                &json!({"command": "ls -la /workspace; cat /workspace/cycle-1; \
                                    grep -E ' / | /workspace ' /proc/mounts; dmesg | tail -30"}),
            );
            eprintln!("cycle {n}: the guest after the resume: {}", r.text());
            eprintln!("daemon log: {}", d.log());
        }
        assert_eq!(
            files,
            want.iter().map(String::as_str).collect(),
            "cycle {n}: files"
        );
        assert!(count > last, "cycle {n}: counter {count} after {last}");
        last = count;
    }
    eprintln!(
        "FIGURE pause_resume_cycles 20; pause ms {:?}; resume+exec ms {:?}",
        pause_ms, resume_ms
    );
    // The checkpoint of the last pause went with the resume.
    assert!(
        wait_until(Duration::from_secs(5), || std::fs::read_dir(
            d.state_dir().join("checkpoints")
        )
        .map(|rd| rd.count() == 0)
        .unwrap_or(true)),
        "pause checkpoints left behind"
    );
}

#[test]
fn eight_forks_share_the_state_but_not_their_entropy() {
    let Some(d) = vm_daemon(&[]) else {
        skip!("needs a VM backend (AGENT_SANDBOX_TEST_BACKEND=qemu)");
    };
    let h = d.http();
    create(&h, json!({"id": "root", "template": "python"}));
    sh(&h, "root", "echo from-root > /workspace/state");
    let t = Instant::now();
    let r = h.post("/v1/sessions/root/fork", &json!({"count": 8}));
    assert_eq!(r.status, 201, "fork: {}", r.text());
    let fork = r.json();
    eprintln!(
        "FIGURE fork_8_answering_ms {} ms; source paused {} ms",
        t.elapsed().as_millis(),
        fork["pausedMs"]
    );
    assert_eq!(fork["sourceId"], "root");
    let ids: Vec<String> = fork["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_string())
        .collect();
    assert_eq!(ids.len(), 8, "{fork}");
    let mut seen = HashSet::new();
    for id in &ids {
        let out = sh(
            &h,
            id,
            "cat /workspace/state; cat /proc/sys/kernel/random/uuid; \
             python3 -c 'import os; print(os.urandom(16).hex())'",
        );
        let l: Vec<&str> = out.lines().collect();
        assert_eq!(l.len(), 3, "{id}: {out:?}");
        assert_eq!(l[0], "from-root", "{id}");
        assert!(seen.insert(l[1].to_string()), "{id}: uuid {} repeats", l[1]);
        assert!(
            seen.insert(l[2].to_string()),
            "{id}: urandom {} repeats",
            l[2]
        );
    }
    // The source runs on.
    assert_eq!(sh(&h, "root", "cat /workspace/state"), "from-root\n");
    // A fork of a fork.
    sh(&h, &ids[0], "echo from-child > /workspace/state");
    let r = h.post(
        &format!("/v1/sessions/{}/fork", ids[0]),
        &json!({"count": 1}),
    );
    assert_eq!(r.status, 201, "fork of a fork: {}", r.text());
    let g = r.json()["sessions"][0]["id"]
        .as_str()
        .expect("id")
        .to_string();
    assert_eq!(sh(&h, &g, "cat /workspace/state"), "from-child\n");
    // Bad counts.
    for c in [json!(0), json!(101), json!("2")] {
        let r = h.post("/v1/sessions/root/fork", &json!({ "count": c }));
        assert_eq!(r.status, 400, "count {c}: {}", r.text());
    }
    // Fork checkpoints go once the copies are up.
    assert!(
        wait_until(Duration::from_secs(5), || std::fs::read_dir(
            d.state_dir().join("checkpoints")
        )
        .map(|rd| rd.count() == 0)
        .unwrap_or(true)),
        "fork checkpoints left behind"
    );
}

#[test]
fn a_paused_session_survives_sigterm_and_kill_9() {
    if !common::daemon::vm_backend() {
        skip!("needs a VM backend (AGENT_SANDBOX_TEST_BACKEND=qemu)");
    }
    let mut d = Daemon::start(&["--standby-vmms", "0"]);
    let key = d.key.clone();
    let h = d.http();
    create(&h, json!({"id": "keep"}));
    for (round, sig) in [(1, libc::SIGTERM), (2, libc::SIGKILL)] {
        sh(
            &h_of(&d, &key),
            "keep",
            &format!("echo round-{round} >> /workspace/log"),
        );
        let r = h_of(&d, &key).post("/v1/sessions/keep/pause", &json!({}));
        assert_eq!(r.status, 200, "pause: {}", r.text());
        let st = d.terminate(sig);
        if sig == libc::SIGTERM {
            assert!(st.is_some_and(|s| s.success()), "{}", d.log());
        }
        let dir = d.into_dir();
        d = Daemon::start_in(dir, &["--standby-vmms", "0"]);
        let h2 = h_of(&d, &key);
        let v = state_of(&h2, "keep");
        assert_eq!(v["state"], "paused", "after signal {sig}: {v}\n{}", d.log());
        let out = sh(&h2, "keep", "cat /workspace/log");
        let want: String = (1..=round).map(|r| format!("round-{r}\n")).collect();
        assert_eq!(out, want, "after signal {sig}");
        assert_eq!(state_of(&h2, "keep")["state"], "ready");
    }
    let _ = h;
}

fn h_of(d: &Daemon, key: &str) -> Http {
    Http::new(&d.base, Some(key))
}

fn tmp_dirs(d: &Daemon) -> Vec<String> {
    std::fs::read_dir(d.state_dir().join("checkpoints"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(".tmp-"))
                .collect()
        })
        .unwrap_or_default()
}

/// `kill -9` of the daemon while it pauses, and while it forks: after the
/// restart no half-written checkpoint, no VMM, cgroup or namespace is
/// left, and each session is either gone with the crash (a running one,
/// as before) or paused and resumable. Then the VMM is killed while it
/// loads a checkpoint: the resume fails clearly, the session stays paused
/// and a second resume works.
#[test]
fn kill_9_while_pausing_or_forking_and_a_vmm_killed_while_loading() {
    if !common::daemon::vm_backend() {
        skip!("needs a VM backend (AGENT_SANDBOX_TEST_BACKEND=qemu)");
    }
    let args = ["--standby-vmms", "0"];
    let mut d = Daemon::start(&args);
    let key = d.key.clone();
    for what in ["pause", "fork"] {
        let h = h_of(&d, &key);
        create(&h, json!({"id": what}));
        sh(&h, what, "echo kept > /workspace/f");
        let h2 = h.clone();
        let path = if what == "pause" {
            "/v1/sessions/pause/pause".to_string()
        } else {
            "/v1/sessions/fork/fork".to_string()
        };
        let body = if what == "pause" {
            json!({})
        } else {
            json!({"count": 2})
        };
        // Its answer is lost with the daemon (the client's error ends the
        // thread).
        let req = std::thread::spawn(move || h2.post(&path, &body).status);
        // Killed as soon as the checkpoint is being written.
        let caught = wait_until(Duration::from_secs(60), || !tmp_dirs(&d).is_empty());
        let _ = d.terminate(libc::SIGKILL);
        let _ = req.join();
        eprintln!(
            "{what}: killed {} the checkpoint was written",
            if caught { "while" } else { "after" }
        );
        let dir = d.into_dir();
        d = Daemon::start_in(dir, &args);
        assert!(tmp_dirs(&d).is_empty(), "half-written checkpoints left");
        let h = h_of(&d, &key);
        let r = h.get(&format!("/v1/sessions/{what}"));
        if r.status == 200 {
            assert_eq!(r.json()["state"], "paused", "{}", r.text());
            assert_eq!(sh(&h, what, "cat /workspace/f"), "kept\n");
            assert!(h.delete(&format!("/v1/sessions/{what}")).status < 300);
        } else {
            assert_eq!(r.status, 404, "{}", r.text());
        }
        let listed = h.get("/v1/sessions").json();
        assert!(
            listed["sessions"].as_array().is_some_and(Vec::is_empty),
            "{listed}"
        );
        assert!(
            wait_until(Duration::from_secs(10), || d.sandbox_procs().is_empty()),
            "VMMs left after kill -9 while {what}: {:?}",
            d.sandbox_procs()
        );
    }

    // A VMM killed while it loads the checkpoint.
    let h = h_of(&d, &key);
    create(&h, json!({"id": "load"}));
    sh(&h, "load", "echo kept > /workspace/f");
    assert_eq!(h.post("/v1/sessions/load/pause", &json!({})).status, 200);
    assert!(d.sandbox_procs().is_empty(), "a paused session runs no VMM");
    let h2 = h.clone();
    let resume = std::thread::spawn(move || h2.post("/v1/sessions/load/resume", &json!({})));
    let mut killed = None;
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(30) && killed.is_none() {
        if let Some(p) = d.sandbox_procs().first() {
            // SAFETY: kill(2) with a pid of this daemon's VMM.
            unsafe { libc::kill(*p, libc::SIGKILL) };
            killed = Some(*p);
        }
    }
    let r = resume.join().expect("resume thread");
    eprintln!(
        "resume with its VMM {killed:?} killed: {} {}",
        r.status,
        r.text()
    );
    if r.status == 200 {
        // The load won the race and the running VMM was killed: the
        // session notices, and says so instead of answering.
        eprintln!("the restore finished before the kill");
        let r = h.post(
            "/v1/sessions/load/exec",
            &json!({ "command": "true", "timeout": 60_000 }),
        );
        assert!(r.status >= 400, "a killed VMM answered: {}", r.text());
        assert!(
            wait_until(Duration::from_secs(10), || h
                .get("/v1/sessions/load")
                .status
                == 404),
            "the session of a dead VMM stayed listed: {}",
            h.get("/v1/sessions/load").text()
        );
    } else {
        assert!(r.status >= 500, "{}", r.text());
        assert_eq!(state_of(&h, "load")["state"], "paused");
        let r = h.post("/v1/sessions/load/resume", &json!({}));
        assert_eq!(r.status, 200, "second resume: {}", r.text());
        assert_eq!(sh(&h, "load", "cat /workspace/f"), "kept\n");
        assert!(h.delete("/v1/sessions/load").status < 300);
    }
    let st = d.terminate(libc::SIGTERM).expect("daemon exits");
    assert!(st.success(), "{}", d.log());
    let left = d.leftovers();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// A checkpoint that does not fit on the disk: 507 naming the path, the
/// session runs on, nothing of the checkpoint is left.
#[test]
fn a_full_disk_fails_the_checkpoint_and_harms_nothing() {
    if !common::daemon::vm_backend() {
        skip!("needs a VM backend (AGENT_SANDBOX_TEST_BACKEND=qemu)");
    }
    let d = Daemon::start(&["--standby-vmms", "0"]);
    let h = d.http();
    create(&h, json!({"id": "full"}));
    // The checkpoint store on a 4 MiB tmpfs: far less than a guest's RAM.
    let store = d.state_dir().join("checkpoints");
    std::fs::create_dir_all(&store).expect("mkdir");
    let st = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs"])
        .arg(&store)
        .status()
        .expect("mount");
    assert!(st.success(), "mount tmpfs on {}", store.display());
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _u = Unmount(store.clone());
    let r = h.post("/v1/sessions/full/snapshots", &json!({}));
    assert_eq!(r.status, 507, "{}", r.text());
    assert_eq!(r.code(), "checkpoint_failed");
    assert!(
        r.message().contains(&store.display().to_string()),
        "the error names the path: {}",
        r.text()
    );
    let left: Vec<_> = std::fs::read_dir(&store)
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left after a failed checkpoint: {left:?}");
    assert_eq!(sh(&h, "full", "echo alive"), "alive\n");
    let r = h.post("/v1/sessions/full/pause", &json!({}));
    assert_eq!(r.status, 507, "{}", r.text());
    assert_eq!(state_of(&h, "full")["state"], "ready");
    assert_eq!(sh(&h, "full", "echo still"), "still\n");
}

/// A paused session holds no sandbox: it leaves room under
/// `--max-sessions` for a create, and `/ready` (what a router places
/// creates by) says so; a running one fills it.
#[test]
fn a_paused_session_leaves_room_and_ready_says_so() {
    let Some(d) = vm_daemon(&["--max-sessions", "1"]) else {
        skip!("needs a VM backend (AGENT_SANDBOX_TEST_BACKEND=qemu)");
    };
    let h = d.http();
    create(&h, json!({"id": "a"}));
    let r = h.get("/ready");
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["checks"]["capacity"], false);
    let p = h.post("/v1/sessions/a/pause", &json!({}));
    assert_eq!(p.status, 200, "{}", p.text());
    let r = h.get("/ready");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["sessions"], 1);
    create(&h, json!({"id": "b"}));
    let r = h.get("/ready");
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["checks"]["capacity"], false);
}
