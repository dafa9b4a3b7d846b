//! REST benchmark: requests/s and p50/p99 latency of exec of `true` through
//! `POST /exec/:id/execute` with 1, 8 and 32 concurrent sessions, and the
//! daemon's RSS idle and per idle session. Runs the real `serve` binary
//! (backend from AGENT_SANDBOX_TEST_BACKEND, default local-process).
//!
//!   cargo bench --bench rest [-- SECONDS_PER_LEVEL]

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/skip.rs"]
mod skip;

use common::daemon::Daemon;
use serde_json::json;
use std::time::{Duration, Instant};

fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn main() {
    let secs: u64 = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(5);
    let d = Daemon::start(&[
        "--rate-limit",
        "1000000",
        "--rate-burst",
        "1000000",
        "--max-sessions",
        "64",
        "--max-sessions-per-key",
        "64",
        "--max-vcpus-per-key",
        "64",
        "--max-mem-mib-per-key",
        "65536",
    ]);
    let h = d.http();
    let pid = d.pid();
    std::thread::sleep(Duration::from_millis(300));
    let idle = rss_kib(pid);
    println!("daemon RSS idle: {:.1} MiB", idle as f64 / 1024.0);

    // 32 idle sessions.
    for i in 0..32 {
        h.exec(&format!("idle{i}"), "true");
    }
    std::thread::sleep(Duration::from_millis(300));
    let with = rss_kib(pid);
    println!(
        "daemon RSS with 32 idle sessions: {:.1} MiB ({:.0} KiB per session, daemon only)",
        with as f64 / 1024.0,
        (with.saturating_sub(idle)) as f64 / 32.0
    );
    let sandboxes: u64 = d.sandbox_procs().iter().map(|&p| rss_kib(p)).sum();
    println!(
        "sandbox processes (agents/VMMs) RSS: {:.1} MiB total",
        sandboxes as f64 / 1024.0
    );
    for i in 0..32 {
        h.delete(&format!("/exec/idle{i}"));
    }

    let body = json!({"command": "true", "args": []});
    println!("exec of `true` via POST /exec/:id/execute, {secs} s per level:");
    println!(
        "{:>12} {:>10} {:>10} {:>10} {:>8}",
        "concurrency", "req/s", "p50 ms", "p99 ms", "n"
    );
    for conc in [1usize, 8, 32] {
        for i in 0..conc {
            h.exec(&format!("b{conc}-{i}"), "true");
        }
        let end = Instant::now() + Duration::from_secs(secs);
        let t0 = Instant::now();
        let threads: Vec<_> = (0..conc)
            .map(|i| {
                let h = h.clone();
                let body = body.clone();
                std::thread::spawn(move || {
                    let mut lat = Vec::new();
                    let path = format!("/exec/b{conc}-{i}/execute");
                    while Instant::now() < end {
                        let t = Instant::now();
                        let r = h.post(&path, &body);
                        assert_eq!(r.status, 200, "{}", r.text());
                        lat.push(t.elapsed());
                    }
                    lat
                })
            })
            .collect();
        let mut all: Vec<Duration> = threads
            .into_iter()
            .flat_map(|t| t.join().expect("bench thread"))
            .collect();
        let wall = t0.elapsed();
        all.sort();
        println!(
            "{:>12} {:>10.0} {:>10.2} {:>10.2} {:>8}",
            conc,
            all.len() as f64 / wall.as_secs_f64(),
            pct(&all, 0.5).as_secs_f64() * 1e3,
            pct(&all, 0.99).as_secs_f64() * 1e3,
            all.len()
        );
        for i in 0..conc {
            h.delete(&format!("/exec/b{conc}-{i}"));
        }
    }
    println!(
        "daemon RSS after the run: {:.1} MiB",
        rss_kib(pid) as f64 / 1024.0
    );
}
