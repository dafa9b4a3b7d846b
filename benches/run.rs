//! `POST /v1/run` end to end: p50/p99 of a bash `echo hi` run (a fresh
//! sandbox from the template's snapshot, the program, the sandbox
//! destroyed), measured at the client. Runs the real `serve` binary
//! (backend as the tests pick it: QEMU when guest images are built).
//!
//!   cargo bench --bench run [-- RUNS]   (default 10)

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/skip.rs"]
mod skip;

use common::daemon::Daemon;
use serde_json::json;
use std::time::{Duration, Instant};

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn main() {
    let runs: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(10);
    let d = Daemon::start(&[]);
    let h = d.http();
    let body = json!({"language": "bash", "code": "echo hi"});
    let once = || {
        let t = Instant::now();
        let r = h.post("/v1/run", &body);
        let took = t.elapsed();
        assert_eq!(r.status, 200, "POST /v1/run: {}", r.text());
        assert_eq!(r.json()["stdout"], "hi\n", "{}", r.text());
        took
    };
    // The first run may build the template's snapshot: not counted.
    let first = once();
    println!("first run (may include the snapshot build): {first:?}");
    let mut t: Vec<Duration> = (0..runs).map(|_| once()).collect();
    t.sort();
    let (p50, p99) = (pct(&t, 0.5), pct(&t, 0.99));
    println!(
        "POST /v1/run bash `echo hi`, {runs} runs, backend {}: p50 {p50:?} p99 {p99:?}",
        common::test_backend()
    );
    eprintln!(
        "FIGURE v1_run_p50_ms={} v1_run_p99_ms={} runs={runs}",
        p50.as_millis(),
        p99.as_millis()
    );
}
