//! Guests that attack their own limits (issue 7), through the real daemon
//! and real QEMU/TCG guests: a fork bomb, a memory hog, a disk filler and a
//! stdout flood in one session, while another session keeps answering and
//! the daemon's memory stays bounded; `kill -9` of a VMM mid-exec and of the
//! daemon itself, with a check that nothing of ours is left behind.
//!
//! VM-only: without guest images (`agent-sandbox image build`) these tests
//! print a notice and pass. Figures are printed (`--nocapture`) for
//! docs/security.md.

mod common;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::{stdout_of, Daemon, Http};
use common::wait_until;
use serde_json::{json, Value};
use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What this host lacks for the containment tests, if anything.
fn missing() -> Option<&'static str> {
    if !common::daemon::vm_backend() {
        return Some("no guest images; needs the qemu backend");
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root");
    }
    None
}

fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn create(h: &Http, id: &str) {
    let r = h.post("/v1/sessions", &json!({ "id": id }));
    assert_eq!(r.status, 201, "create {id}: {}", r.text());
}

fn exec(h: &Http, id: &str, body: Value) -> Value {
    let r = h.post(&format!("/v1/sessions/{id}/exec"), &body);
    assert_eq!(r.status, 200, "exec in {id} {body}: {}", r.text());
    r.json()
}

fn sh(h: &Http, id: &str, cmd: &str) -> String {
    let v = exec(h, id, json!({ "command": cmd, "timeout": 60_000 }));
    assert_eq!(v["exitCode"], 0, "{cmd}: {v}");
    stdout_of(&v)
}

fn stderr_of(v: &Value) -> String {
    v["output"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|e| e["stream"] == "stderr")
                .filter_map(|e| e["data"].as_str())
                .collect()
        })
        .unwrap_or_default()
}

/// `key value` lines of a cgroup file (`pids.events`, `memory.events`).
fn cg_field(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
        .unwrap_or(0)
}

/// Execs `true` in a session in a loop until stopped: every one must
/// succeed; the latencies are returned.
struct Bystander {
    stop: Arc<AtomicBool>,
    t: std::thread::JoinHandle<Vec<Duration>>,
}

impl Bystander {
    fn start(h: &Http, id: &str) -> Bystander {
        let stop = Arc::new(AtomicBool::new(false));
        let (h, id, s) = (h.clone(), id.to_string(), stop.clone());
        let t = std::thread::spawn(move || {
            let mut lat = Vec::new();
            while !s.load(Ordering::Relaxed) {
                let t0 = Instant::now();
                let v = exec(&h, &id, json!({ "argv": ["true"], "timeout": 60_000 }));
                assert_eq!(v["exitCode"], 0, "bystander exec: {v}");
                lat.push(t0.elapsed());
                std::thread::sleep(Duration::from_millis(100));
            }
            lat
        });
        Bystander { stop, t }
    }

    /// (count, p50, max)
    fn finish(self) -> (usize, Duration, Duration) {
        self.stop.store(true, Ordering::Relaxed);
        let mut lat = self.t.join().expect("bystander thread panicked");
        lat.sort();
        assert!(!lat.is_empty(), "the bystander never got an answer");
        (lat.len(), lat[lat.len() / 2], lat[lat.len() - 1])
    }
}

/// Runs one attack with a bystander session and RSS samples around it.
fn attack<T>(d: &Daemon, name: &str, f: impl FnOnce() -> T) -> T {
    let h = d.http();
    let rss0 = rss_kib(d.pid());
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(rss0));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, done, pid) = (peak.clone(), done.clone(), d.pid());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                peak.fetch_max(rss_kib(pid), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let by = Bystander::start(&h, "bystander");
    let t0 = Instant::now();
    let out = f();
    let took = t0.elapsed();
    let (n, p50, max) = by.finish();
    done.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    let rss1 = rss_kib(d.pid());
    let peak = peak.load(Ordering::Relaxed);
    eprintln!(
        "FIGURE {name}: took {took:.1?}; bystander {n} execs, p50 {p50:.1?}, max {max:.1?}; \
         daemon RSS {} -> {} KiB (peak {peak})",
        rss0, rss1
    );
    // 16 MiB of buffered output (max_output) is the largest thing the
    // daemon holds for one call; as JSON chunks it takes about 3x that.
    assert!(
        peak < rss0 + 96 * 1024,
        "{name}: daemon RSS grew from {rss0} to {peak} KiB"
    );
    assert!(
        max < Duration::from_secs(20),
        "{name}: bystander exec took {max:?}"
    );
    out
}

#[test]
fn attacks_in_one_session_are_contained() {
    if let Some(why) = missing() {
        skip!("{why}");
    }
    let d = Daemon::start(&[]);
    let h = d.http();
    create(&h, "victim");
    create(&h, "bystander");
    let limits = sh(
        &h,
        "victim",
        "cat /sys/fs/cgroup/sandbox/pids.max /sys/fs/cgroup/sandbox/memory.max \
         /proc/1/oom_score /proc/self/oom_score_adj; grep -c sandbox /proc/self/cgroup; \
         ulimit -n; ulimit -Hn; awk '/MemTotal/ {print $2 * 1024}' /proc/meminfo; \
         cat /sys/fs/cgroup$(cut -d: -f3 /proc/self/cgroup)/memory.max; \
         cat /proc/self/oom_score",
    );
    eprintln!("FIGURE limits: {}", limits.replace('\n', " "));
    let l: Vec<&str> = limits.lines().collect();
    assert_eq!(l[0], "4096", "pids.max: {limits}");
    let mem_max: u64 = l[1].parse().expect("memory.max is a number");
    let total: u64 = l[7].parse().expect("MemTotal");
    assert!(mem_max < total && mem_max >= total / 2, "{limits}");
    // The agent is PID 1, which the OOM killer never picks: the kernel
    // reports 0 for an unkillable task, while anything it may kill at
    // oom_score_adj 0 scores about 667 and up (its 0..2000 scale).
    assert_eq!(l[2], "0", "agent oom_score (unkillable init): {limits}");
    assert_eq!(l[3], "0", "user oom_score_adj: {limits}");
    let user_score: u32 = l[9].parse().expect("user oom_score");
    assert!(user_score >= 600, "user process not killable: {limits}");
    assert_eq!(
        l[4], "1",
        "user process outside the sandbox cgroup: {limits}"
    );
    assert_eq!((l[5], l[6]), ("1024", "65536"), "{limits}");
    // Each exec's own cgroup gets 15/16 of the sandbox's memory: one exec
    // held at its limit leaves the next room to start.
    assert_eq!(
        l[8],
        ((mem_max - mem_max / 16) & !4095).to_string(),
        "{limits}"
    );

    // Under TCG a bash bomb rarely reaches 4096 tasks within its timeout:
    // show pids.max biting with a lower limit (root in the guest may change
    // its own limits; they protect the session from runaway code, the VM
    // protects everyone else).
    // (16, not more: on a loaded TCG host forks can take ~100 ms each, and
    // the limit must bite well within the timeout.)
    sh(&h, "victim", "echo 16 > /sys/fs/cgroup/sandbox/pids.max");
    let v = exec(
        &h,
        "victim",
        json!({ "argv": ["bash", "-c", "for i in $(seq 40); do sleep 60 & done; wait"], "timeout": 15_000 }),
    );
    sh(&h, "victim", "echo 4096 > /sys/fs/cgroup/sandbox/pids.max");
    assert_eq!(v["timedOut"], true, "{v}");
    assert!(
        stderr_of(&v).contains("Resource temporarily unavailable"),
        "{v}"
    );
    // (pids.events counts in the forking task's own cgroup on 6.1, the
    // exec's, which is gone by now: bash's EAGAIN above is the evidence.)

    // Fork bomb: stops at pids.max (or memory.max); the sandbox cgroup's
    // CPU share keeps the agent responsive; the exec's timeout kills the
    // group (the bomb's processes never leave it: bash -c has no job
    // control). The leader waits, or the exec would end at once and leave
    // the bomb running detached (see docs/security.md).
    let (v, answered) = attack(&d, "fork bomb", || {
        let t0 = Instant::now();
        let v = exec(
            &h,
            "victim",
            json!({ "argv": ["bash", "-c", ":(){ :|:& };: ; sleep 60"], "timeout": 20_000 }),
        );
        (v, t0.elapsed())
    });
    // Under TCG the bomb may run into memory.max (a bash is ~0.5 MiB of
    // page tables, stack and dirty data) before pids.max; then the exec's
    // cgroup (at 15/16 of the sandbox's memory) is OOM-killed as a group.
    let pev = sh(&h, "victim", "cat /sys/fs/cgroup/sandbox/pids.events");
    let mev = sh(&h, "victim", "cat /sys/fs/cgroup/sandbox/memory.events");
    eprintln!(
        "FIGURE fork bomb: answered {answered:.1?} after the exec (timeout 20 s): {}; \
         pids.max hit {} times, memory.max hit {} times, OOM kills {} (group kills {})",
        if v["timedOut"] == true {
            "timed out"
        } else {
            "OOM-killed"
        },
        cg_field(&pev, "max"),
        cg_field(&mev, "max"),
        cg_field(&mev, "oom_kill"),
        cg_field(&mev, "oom_group_kill")
    );
    // Either way the whole exec is SIGKILLed, and the answer comes at most
    // a short grace (2 s) after the kill, however long the bomb's
    // thousands of processes take to die under TCG (22-25 s seen; the
    // agent's thread competes with them for the one vCPU; before the grace
    // existed, 42-50 s and more).
    assert_eq!(v["signal"], "SIGKILL", "{v}");
    assert!(
        v["timedOut"] == true || cg_field(&mev, "oom_group_kill") > 0,
        "killed, neither by its timeout nor by a group OOM kill: {v} {mev}"
    );
    assert!(
        answered < Duration::from_secs(38),
        "answered after {answered:?}"
    );
    // How far a bash bomb gets in 20 s under TCG varies with the host's
    // load (sometimes no limit is reached); pids.max itself is proven
    // above with a lower limit.
    let oom_before = cg_field(&mev, "oom_kill");
    assert!(
        wait_until(Duration::from_secs(60), || {
            let n = sh(&h, "victim", "cat /sys/fs/cgroup/sandbox/pids.current");
            eprintln!("pids.current after the bomb: {}", n.trim());
            n.trim().parse::<u64>().is_ok_and(|n| n < 10)
        }),
        "fork bomb processes outlived the kill"
    );

    // Memory hog: tail buffers an endless line; the OOM killer takes it,
    // not the agent.
    let v = attack(&d, "memory hog", || {
        exec(
            &h,
            "victim",
            json!({ "argv": ["tail", "/dev/zero"], "timeout": 120_000 }),
        )
    });
    assert_eq!(v["signal"], "SIGKILL", "{v}");
    assert_eq!(v["timedOut"], false, "{v}");
    let ev = sh(&h, "victim", "cat /sys/fs/cgroup/sandbox/memory.events");
    assert!(
        cg_field(&ev, "oom_kill") > oom_before,
        "no OOM kill recorded: {ev}"
    );

    // Disk filler: the writable layer (root overlay and /workspace share
    // it) ends in ENOSPC, not in memory exhaustion.
    for target in ["/fill", "/workspace/fill"] {
        let v = attack(&d, &format!("disk filler {target}"), || {
            exec(
                &h,
                "victim",
                json!({
                    "command": format!("dd if=/dev/zero of={target} bs=1M; sync; ls -s --block-size=M {target}"),
                    "timeout": 120_000,
                }),
            )
        });
        assert!(
            stderr_of(&v).contains("No space left on device"),
            "{target}: {v}"
        );
        eprintln!("FIGURE disk filler {target}: {}", stdout_of(&v).trim());
        sh(&h, "victim", &format!("rm -f {target}"));
    }

    // Buffered 10 GB flood: truncated at max_output (16 MiB) and said so;
    // the timeout ends the writer.
    let v = attack(&d, "stdout flood (buffered)", || {
        exec(
            &h,
            "victim",
            json!({ "command": "head -c 10G /dev/zero | tr '\\0' y", "timeout": 15_000 }),
        )
    });
    assert_eq!(v["truncated"], true, "not truncated");
    assert_eq!(v["timedOut"], true);
    let kept: usize = v["output"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|e| e["data"].as_str())
                .map(str::len)
                .sum()
        })
        .unwrap_or(0);
    assert!(kept <= 16 << 20, "kept {kept} bytes");
    drop(v);

    // Streamed flood: read as fast as we can for a while (the rate), then
    // stop reading (backpressure: the daemon must not buffer), then hang up
    // (the command must die).
    attack(&d, "stdout flood (streamed)", || {
        let (status, mut body) = h.post_stream(
            "/v1/sessions/victim/exec?format=ndjson",
            &json!({ "command": "head -c 10G /dev/zero | tr '\\0' y", "timeout": 600_000 }),
            "application/x-ndjson",
        );
        assert_eq!(status, 200);
        let mut buf = vec![0u8; 1 << 16];
        let (mut n, t0) = (0u64, Instant::now());
        while t0.elapsed() < Duration::from_secs(10) {
            let k = body.read(&mut buf).expect("read stream");
            assert!(k > 0, "stream ended early");
            n += k as u64;
        }
        let rate = n as f64 / t0.elapsed().as_secs_f64() / 1e6;
        eprintln!("FIGURE streamed flood: {n} bytes of NDJSON in 10 s = {rate:.1} MB/s");
        let before = rss_kib(d.pid());
        std::thread::sleep(Duration::from_secs(5));
        let after = rss_kib(d.pid());
        eprintln!("FIGURE stalled reader: daemon RSS {before} -> {after} KiB over 5 s");
        assert!(
            after < before + 16 * 1024,
            "daemon buffers a stalled stream"
        );
        drop(body);
    });
    assert!(
        wait_until(Duration::from_secs(90), || {
            let v = exec(
                &h,
                "victim",
                json!({ "command": "pgrep -x head || true", "timeout": 30_000 }),
            );
            stdout_of(&v).trim().is_empty()
        }),
        "the flood survived its client's disconnect"
    );

    // The victim still answers, with a working shell, and nothing of the
    // attacks above is still running (only this shell and its children).
    let left = sh(
        &h,
        "victim",
        "cat /sys/fs/cgroup/sandbox/pids.current; ls -d /sys/fs/cgroup/sandbox/x* | wc -l",
    );
    eprintln!(
        "FIGURE after the attacks: pids.current, exec cgroups: {}",
        left.replace('\n', " ")
    );
    let n: u64 = left
        .lines()
        .next()
        .and_then(|l| l.parse().ok())
        .unwrap_or(99);
    assert!(n <= 5, "processes left from the attacks: {left}");
    assert_eq!(sh(&h, "victim", "echo alive").trim(), "alive");

    // Last, the classic detached bomb: the exec ends at once and the bomb
    // runs on in the background, in that exec's cgroup. The agent keeps
    // answering, and a new exec runs in a cgroup of its own with its own
    // CPU share.
    let v = exec(
        &h,
        "victim",
        json!({ "argv": ["bash", "-c", ":(){ :|:& };:"], "timeout": 10_000 }),
    );
    assert_eq!(v["exitCode"], 0, "{v}");
    attack(&d, "detached fork bomb", || {
        std::thread::sleep(Duration::from_secs(20));
        let t0 = Instant::now();
        let r = h.get("/v1/sessions/victim/files/stat?path=/etc/hostname");
        eprintln!(
            "FIGURE detached bomb: file stat answered {} in {:.1?}",
            r.status,
            t0.elapsed()
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let t0 = Instant::now();
        let r = h.post(
            "/v1/sessions/victim/exec",
            &json!({ "argv": ["true"], "timeout": 30_000 }),
        );
        eprintln!(
            "FIGURE detached bomb: exec answered {} in {:.1?}: {}",
            r.status,
            t0.elapsed(),
            r.text()
        );
        // It runs in a cgroup of its own, so it gets CPU, and memory: the
        // bomb's cgroup stops at 15/16 of the sandbox's memory.max. Were
        // the sandbox full anyway, a freshly forked child (still the
        // agent's size until it execs) could be the OOM victim, and in a
        // rare run (one in 13 by 2026-11-30) the bomb's thrashing kept even
        // `true` from finishing within its 30 s timeout. Either way the
        // answer comes within the timeout plus the 2 s kill grace and says
        // what happened (the way out is below: kill everything).
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert!(
            v["exitCode"] == 0 || v["signal"] == "SIGKILL",
            "{}",
            r.text()
        );
        // An answer, not a hang: the exec's 30 s timeout and the kill
        // grace are the expected case; twice that only a lost answer.
        assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
    });
    // The way out that keeps the session and its files: kill everything in
    // it (`cgroup.kill` on the sandbox cgroup, no process spawned).
    let t0 = Instant::now();
    let r = h.delete("/v1/sessions/victim/processes");
    eprintln!(
        "FIGURE detached bomb: kill-all answered {} in {:.1?}: {}",
        r.status,
        t0.elapsed(),
        r.text()
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let k = r.json();
    assert!(k["killed"].as_u64().unwrap_or(0) > 16, "{k}");
    let t0 = Instant::now();
    let mut left = String::new();
    let calm = common::wait_until(Duration::from_secs(30), || {
        left = sh(&h, "victim", "cat /sys/fs/cgroup/sandbox/pids.current");
        left.trim().parse::<u64>().is_ok_and(|n| n <= 3)
    });
    eprintln!(
        "FIGURE detached bomb: {} task(s) in the sandbox {:.1?} after kill-all",
        left.trim(),
        t0.elapsed()
    );
    if !calm {
        // What the survivors are doing: run state and pending signals of a
        // few, and the exec cgroups' events, for the failure report.
        let why = sh(
            &h,
            "victim",
            "cd /sys/fs/cgroup/sandbox; for c in x*; do echo \"$c $(cat $c/cgroup.events $c/memory.events $c/cgroup.freeze 2>&1 | tr '\\n' ' ')\"; done; \
             for p in $(cat x*/cgroup.procs | head -8); do grep -hE '^(State|SigPnd|ShdPnd)' /proc/$p/status | tr '\\n' ' '; cat /proc/$p/wchan 2>/dev/null; echo; done",
        );
        eprintln!("FIGURE detached bomb survivors:\n{why}");
    }
    assert!(calm, "bomb still there after kill-all: pids.current {left}");
    assert_eq!(sh(&h, "victim", "echo alive").trim(), "alive");
    let r = h.delete("/v1/sessions/victim");
    assert!(r.status < 300, "delete: {}", r.text());
}

/// Everything of ours that could leak, for a state dir and the sandbox ids
/// its daemons created: VMM processes (found by run dir), run dirs,
/// sockets, and network/cgroup objects named after our sandboxes or new
/// since `baseline` (netns /run/netns/asbx-*, links asbx*, nft table asbx,
/// cgroups asbx-*). Other tests on this machine may create objects with the
/// same prefix concurrently: the baseline keeps theirs out where names
/// carry no sandbox id (links, the shared nft table).
fn leftovers(
    state_dir: &Path,
    daemon_pids: &[i32],
    baseline: &[String],
    prefix: &str,
) -> Vec<String> {
    let mut out = Vec::new();
    let run = state_dir.join("run");
    let exe = std::fs::canonicalize(env!("CARGO_BIN_EXE_agent-sandbox")).ok();
    for pid in common::procs_with(&run.display().to_string()) {
        // The daemon and its spawner (a fork of it) carry the state dir too.
        let pexe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
        if daemon_pids.contains(&pid) || (pexe.is_some() && pexe == exe) {
            continue;
        }
        out.push(format!("process {pid}"));
    }
    if let Ok(rd) = std::fs::read_dir(&run) {
        for e in rd.flatten() {
            out.push(format!("run dir {}", e.path().display()));
        }
    }
    out.extend(
        net_and_cgroup_objects(prefix)
            .into_iter()
            .filter(|o| !baseline.contains(o))
            // A live daemon's own snapshot namespace (`{prefix}-s<pid>-…`)
            // lives as long as it does.
            .filter(|o| {
                !snapshot_ns_pid(o, prefix)
                    .is_some_and(|p| Path::new(&format!("/proc/{p}")).exists())
            })
            // A name that embeds a daemon pid (`asbx-<pid>-<n>-<rand>`) is
            // ours only if the pid is one of our daemons'.
            .filter(|o| embedded_pid(o).is_none_or(|p| daemon_pids.contains(&p))),
    );
    out
}

fn snapshot_ns_pid(o: &str, prefix: &str) -> Option<i32> {
    let rest = o.strip_prefix(&format!("netns {prefix}-s"))?;
    rest.split('-').next()?.parse().ok()
}

fn embedded_pid(name: &str) -> Option<i32> {
    name.match_indices("asbx-").find_map(|(i, m)| {
        let rest = &name[i + m.len()..];
        let (num, _) = rest.split_once('-')?;
        // Sandbox ids are `asbx-<pid>-…` or `asbx-i<pid>-…`.
        num.strip_prefix('i').unwrap_or(num).parse().ok()
    })
}

/// Namespaces, links and nftables tables named by the daemon's network
/// prefix, and cgroups of our VMs, on this host.
fn net_and_cgroup_objects(prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/run/netns") {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with(&format!("{prefix}-")) {
                out.push(format!("netns {n}"));
            }
        }
    }
    if let Ok(rd) = std::fs::read_dir("/sys/class/net") {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with(prefix) {
                out.push(format!("link {n}"));
            }
        }
    }
    if let Ok(o) = std::process::Command::new("nft")
        .args(["list", "tables"])
        .output()
    {
        for l in String::from_utf8_lossy(&o.stdout).lines() {
            if l.split_whitespace().last() == Some(prefix) {
                out.push(format!("nft {l}"));
            }
        }
    }
    fn walk(dir: &Path, depth: u32, out: &mut Vec<String>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with("asbx-") {
                out.push(format!("cgroup {}", e.path().display()));
            } else if depth > 0 {
                walk(&e.path(), depth - 1, out);
            }
        }
    }
    walk(Path::new("/sys/fs/cgroup"), 3, &mut out);
    out
}

fn qemu_pids(d: &Daemon) -> Vec<i32> {
    d.sandbox_procs()
        .into_iter()
        .filter(|p| {
            std::fs::read_link(format!("/proc/{p}/exe"))
                .is_ok_and(|e| e.to_string_lossy().contains("qemu"))
        })
        .collect()
}

#[test]
fn vmm_kill_9_mid_exec() {
    if let Some(why) = missing() {
        skip!("{why}");
    }
    let prefix = common::daemon::unique_prefix();
    let baseline = net_and_cgroup_objects(&prefix);
    // No standby VMMs: the counts below are per session.
    let d = Daemon::start(&["--net-prefix", &prefix, "--standby-vmms", "0"]);
    let h = d.http();
    eprintln!("daemon pid: {}", d.pid());
    create(&h, "doomed");
    let before = qemu_pids(&d);
    create(&h, "other");
    let others: Vec<i32> = qemu_pids(&d)
        .into_iter()
        .filter(|p| !before.contains(p))
        .collect();
    let [vmm] = before[..] else {
        panic!("expected one VMM for the session, found {before:?}");
    };
    let h2 = h.clone();
    let inflight = std::thread::spawn(move || {
        let t0 = Instant::now();
        let r = h2.post(
            "/v1/sessions/doomed/exec",
            &json!({ "command": "echo started; sleep 300", "timeout": 600_000 }),
        );
        (r.status, r.text(), t0.elapsed())
    });
    std::thread::sleep(Duration::from_secs(2));
    let t_kill = Instant::now();
    // SAFETY: a QEMU process this test's daemon started.
    unsafe { libc::kill(vmm, libc::SIGKILL) };
    let (status, body, _) = inflight.join().expect("exec thread");
    let answered = t_kill.elapsed();
    eprintln!("FIGURE vmm kill: caller answered {status} after {answered:.1?}: {body}");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("sandbox_unavailable"), "{body}");
    // At once, not when the 300 s command or its 600 s timeout ends.
    assert!(answered < Duration::from_secs(60), "{answered:?}");
    // The session is gone, and so is everything it had.
    assert!(
        wait_until(Duration::from_secs(10), || h
            .get("/v1/sessions/doomed")
            .status
            == 404),
        "the dead session is still listed: {}",
        h.get("/v1/sessions/doomed").text()
    );
    let run = d.state_dir().join("run");
    assert!(
        wait_until(Duration::from_secs(10), || {
            std::fs::read_dir(&run).map_or(0, |r| r.count()) == 1
        }),
        "run dirs: {:?}",
        std::fs::read_dir(&run).map(|r| r.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
    );
    assert!(!Path::new(&format!("/proc/{vmm}")).exists());
    assert!(d.log().contains("sandbox died"), "{}", d.log());
    // The other session never noticed.
    assert_eq!(
        stdout_of(&exec(&h, "other", json!({ "command": "echo fine" }))).trim(),
        "fine"
    );
    assert_eq!(qemu_pids(&d), others);
    h.delete("/v1/sessions/other");
    let left = {
        let mut left = Vec::new();
        // Network teardown may finish in the background (seen: ~12 s).
        wait_until(Duration::from_secs(30), || {
            left = leftovers(&d.state_dir(), &[d.pid()], &baseline, &prefix);
            left.is_empty()
        });
        left
    };
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn daemon_kill_9_then_restart_leaves_nothing() {
    if let Some(why) = missing() {
        skip!("{why}");
    }
    let prefix = common::daemon::unique_prefix();
    let baseline = net_and_cgroup_objects(&prefix);
    let mut d = Daemon::start(&["--net-prefix", &prefix]);
    let first = d.pid();
    let key = d.key.clone();
    let h = d.http();
    create(&h, "one");
    create(&h, "two");
    // One of them mid-exec.
    // Raw HTTP: the daemon dies under this request, which the test client
    // would treat as a test failure.
    let (addr, k) = (
        h.base.trim_start_matches("http://").to_string(),
        key.clone(),
    );
    let inflight = std::thread::spawn(move || {
        use std::io::Write;
        let body = json!({ "command": "sleep 300", "timeout": 600_000 }).to_string();
        let mut s = std::net::TcpStream::connect(&addr).expect("connect");
        let _ = write!(
            s,
            "POST /v1/sessions/one/exec HTTP/1.1\r\nHost: {addr}\r\nX-API-Key: {k}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    });
    std::thread::sleep(Duration::from_secs(2));
    // Two sessions and the standby VMM started for the next session of
    // their shape: the sweep must find that one too.
    assert!(
        wait_until(Duration::from_secs(20), || qemu_pids(&d).len() == 3),
        "{:?}",
        qemu_pids(&d)
    );
    let vmms = qemu_pids(&d);
    // The leak check sees live sandboxes (it is not vacuous).
    let live = leftovers(&d.state_dir(), &[d.pid()], &baseline, &prefix);
    assert!(
        live.iter().filter(|l| l.starts_with("process ")).count() == 3
            && live.iter().filter(|l| l.starts_with("run dir ")).count() == 3
            && live.iter().filter(|l| l.starts_with("netns ")).count() == 3,
        "{live:?}"
    );
    d.terminate(libc::SIGKILL);
    let _ = inflight.join();
    let dir = std::mem::replace(&mut d.dir, tempfile::tempdir().expect("tempdir"));
    // What the crash left is for the restarted daemon to sweep.
    d.net_prefix = None;
    drop(d);
    let t0 = Instant::now();
    // Without standby VMMs of its own: what is left is the crash's.
    let d2 = Daemon::start_in(dir, &["--net-prefix", &prefix, "--standby-vmms", "0"]);
    let pids = [first, d2.pid()];
    eprintln!("daemon pids: {pids:?}");
    let mut left = Vec::new();
    wait_until(Duration::from_secs(30), || {
        left = leftovers(&d2.state_dir(), &pids, &baseline, &prefix);
        left.is_empty()
    });
    eprintln!(
        "FIGURE daemon kill -9: restart + sweep clean after {:.1?}",
        t0.elapsed()
    );
    assert!(left.is_empty(), "left behind after restart: {left:?}");
    for p in vmms {
        // Gone or a zombie on its way to being reaped by init.
        assert!(
            wait_until(Duration::from_secs(5), || {
                std::fs::read_to_string(format!("/proc/{p}/stat")).map_or(true, |s| {
                    s.rsplit_once(')')
                        .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
                })
            }),
            "VMM {p} alive"
        );
    }
    // The restarted daemon serves (with the key file it found).
    let h2 = d2.http().with_key(&key);
    create(&h2, "three");
    assert_eq!(
        stdout_of(&exec(&h2, "three", json!({ "command": "echo up" }))).trim(),
        "up"
    );
}
