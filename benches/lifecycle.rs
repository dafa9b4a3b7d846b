//! Stateful sessions through the daemon (issue #21): checkpoint time and
//! the guest's pause in it, pause, resume to first exec, fork of 1 and 10
//! (time until every copy answered an exec), snapshot MiB, and the PSS of
//! a forked session's VMM against a fresh session's. Real `serve` binary,
//! backend from AGENT_SANDBOX_TEST_BACKEND (else qemu when images are
//! built); sessions run at their template snapshot's shape.
//!
//!   cargo bench --bench lifecycle [-- ITERATIONS] [template=NAME]   (default 10, base)

#[path = "common/mod.rs"]
mod bench;
#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/skip.rs"]
mod skip;

use bench::{report, report_count};
use common::daemon::{Daemon, Http};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn ok(h: &Http, path: &str, body: &Value, want: u16) -> Value {
    let r = h.post(path, body);
    assert_eq!(r.status, want, "POST {path} {body}: {}", r.text());
    r.json()
}

fn exec_true(h: &Http, id: &str) {
    let v = ok(
        h,
        &format!("/v1/sessions/{id}/exec"),
        &json!({"command": "true"}),
        200,
    );
    assert_eq!(v["exitCode"], 0, "{v}");
}

/// (Pss, Rss, Private_Dirty) in KiB of `pid`.
fn mem_kib(pid: i32) -> (u64, u64, u64) {
    let t = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let get = |k: &str| {
        t.lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|r| r.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    (get("Pss:"), get("Rss:"), get("Private_Dirty:"))
}

fn ids_of(v: &Value) -> Vec<String> {
    v["sessions"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s["id"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Every session answers an exec, concurrently.
fn all_answer(h: &Http, ids: &[String]) {
    std::thread::scope(|s| {
        for id in ids {
            let h = h.clone();
            s.spawn(move || exec_true(&h, id));
        }
    });
}

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(10)
        .max(1);
    let template = std::env::args()
        .find_map(|a| a.strip_prefix("template=").map(str::to_string))
        .unwrap_or_else(|| "base".into());
    let d = Daemon::start(&[
        "--default-template",
        &template,
        "--max-sessions-per-key",
        "32",
    ]);
    let h = d.http();
    println!(
        "backend {}; template {template}; {n} iterations",
        common::test_backend()
    );
    let src = ok(&h, "/v1/sessions", &json!({"id": "src"}), 201);
    println!("guest: {} vCPU, {} MiB", src["vcpus"], src["memoryMib"]);
    exec_true(&h, "src");

    // Checkpoints of a running session.
    let (mut took, mut paused, mut mib) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let t = Instant::now();
        let v = ok(
            &h,
            "/v1/sessions/src/snapshots",
            &json!({ "name": format!("b{i}") }),
            201,
        );
        took.push(t.elapsed());
        paused.push(Duration::from_millis(v["pausedMs"].as_u64().unwrap_or(0)));
        mib.push(v["sizeBytes"].as_u64().unwrap_or(0) >> 20);
        let sid = v["id"].as_str().unwrap_or_default().to_string();
        h.delete(&format!("/v1/snapshots/{sid}"));
        exec_true(&h, "src");
    }
    report("checkpoint (POST .../snapshots)", &mut took);
    report("  guest paused for it", &mut paused);
    report_count("  snapshot MiB on disk", &mut mib);

    // Pause, then resume by the first exec.
    let (mut pause, mut resume) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let t = Instant::now();
        ok(&h, "/v1/sessions/src/pause", &json!({}), 200);
        pause.push(t.elapsed());
        let t = Instant::now();
        exec_true(&h, "src");
        resume.push(t.elapsed());
    }
    report("pause (POST .../pause)", &mut pause);
    report("resume to first exec answered", &mut resume);

    // Forks: until every copy answered.
    for count in [1usize, 10] {
        let runs = if count == 1 { n } else { n.clamp(1, 3) };
        let mut all = Vec::new();
        let mut src_paused = Vec::new();
        for _ in 0..runs {
            let t = Instant::now();
            let v = ok(&h, "/v1/sessions/src/fork", &json!({ "count": count }), 201);
            let ids = ids_of(&v);
            assert_eq!(ids.len(), count, "{v}");
            all_answer(&h, &ids);
            all.push(t.elapsed());
            src_paused.push(Duration::from_millis(v["pausedMs"].as_u64().unwrap_or(0)));
            if count == 10 && all.len() == runs {
                // Memory of the last set, while they are up.
                let fresh = ok(&h, "/v1/sessions", &json!({"id": "fresh"}), 201);
                let _ = fresh;
                exec_true(&h, "fresh");
                let f = d.vmm_of("fresh").map(mem_kib);
                let forks: Vec<(u64, u64, u64)> = ids
                    .iter()
                    .filter_map(|id| d.vmm_of(id))
                    .map(mem_kib)
                    .collect();
                if let (Some((fp, fr, fd)), false) = (f, forks.is_empty()) {
                    let k = forks.len() as u64;
                    let (pss, rss, dirty) = forks
                        .iter()
                        .fold((0, 0, 0), |a, x| (a.0 + x.0, a.1 + x.1, a.2 + x.2));
                    println!(
                        "VMM memory, fresh session:  PSS {:>6} KiB  RSS {:>6} KiB  private dirty {:>6} KiB",
                        fp, fr, fd
                    );
                    println!(
                        "VMM memory, per fork (n={k}): PSS {:>6} KiB  RSS {:>6} KiB  private dirty {:>6} KiB  PSS beyond dirty {:>6} KiB",
                        pss / k,
                        rss / k,
                        dirty / k,
                        (pss - dirty.min(pss)) / k
                    );
                } else {
                    println!("VMM memory: no VMM processes found (backend without VMMs?)");
                }
                h.delete("/v1/sessions/fresh");
            }
            for id in &ids {
                h.delete(&format!("/v1/sessions/{id}"));
            }
        }
        report(&format!("fork {count}: all answering"), &mut all);
        report("  source paused", &mut src_paused);
    }
}
