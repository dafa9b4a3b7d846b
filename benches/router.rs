//! Several hosts behind HAProxy (issue #28), same run, real daemons and
//! VMs (backend from AGENT_SANDBOX_TEST_BACKEND, else qemu when images are
//! built):
//! - what the router adds to a request: `GET /v1/sessions/:id` (no guest)
//!   and an exec of `true` round trip, direct to the host vs through
//!   HAProxy, interleaved, p50/p99 and the added p50;
//! - sessions created per second (`POST /v1/sessions`, 3 client threads,
//!   each create answered once its VM answers) against one host directly
//!   and through the router to three hosts.
//!
//!   cargo bench --bench router [-- ITERATIONS] [creates=N]   (default 200, 12)

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/skip.rs"]
mod skip;

use common::daemon::{Daemon, Http};
use common::router::Haproxy;
use serde_json::json;
use std::time::{Duration, Instant};

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn report(name: &str, v: &mut [Duration]) -> Duration {
    v.sort();
    println!(
        "{name:<40} n={:<4} p50 {:>8.3} ms   p99 {:>8.3} ms",
        v.len(),
        ms(pct(v, 0.5)),
        ms(pct(v, 0.99)),
    );
    pct(v, 0.5)
}

/// Both paths' lines, the added p50 and the median of paired differences.
fn compare(name: &str, direct: &mut [Duration], routed: &mut [Duration], diffs: &mut [f64]) {
    let a = report(&format!("{name} direct"), direct);
    let b = report(&format!("{name} through haproxy"), routed);
    diffs.sort_by(f64::total_cmp);
    println!(
        "{:<40} {:>+8.3} ms",
        "  added by the router (p50)",
        ms(b) - ms(a)
    );
    println!(
        "{:<40} {:>+8.3} ms",
        "  median of paired differences",
        diffs[diffs.len() / 2]
    );
}

/// `n` creates from 3 threads; sessions per second, then deletes them.
fn creates_per_sec(h: &Http, n: usize) -> f64 {
    let t = Instant::now();
    let ids: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|k| {
                s.spawn(move || {
                    (k..n)
                        .step_by(3)
                        .map(|_| {
                            let r = h.post("/v1/sessions", &json!({}));
                            assert_eq!(r.status, 201, "{}", r.text());
                            r.json()["id"].as_str().unwrap_or_default().to_string()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        hs.into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    });
    let rate = ids.len() as f64 / t.elapsed().as_secs_f64();
    for id in &ids {
        h.delete(&format!("/v1/sessions/{id}"));
    }
    rate
}

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(200)
        .max(1);
    let creates: usize = std::env::args()
        .find_map(|a| a.strip_prefix("creates=").and_then(|v| v.parse().ok()))
        .unwrap_or(12);
    let extra = common::router::QUOTA_ARGS;
    let d1 = Daemon::start(&[&["--host-id", "h1"][..], extra].concat());
    let keys = d1.state_dir().join("keys.json").display().to_string();
    let more = |id: &'static str| {
        Daemon::start(&[&["--host-id", id, "--key-file", keys.as_str()][..], extra].concat())
    };
    let (d2, d3) = (more("h2"), more("h3"));
    let router = Haproxy::start(&[("h1", &d1), ("h2", &d2), ("h3", &d3)]);
    let direct = d1.http();
    let routed = Http::new(&router.base, Some(&d1.key));
    println!(
        "backend {}; haproxy in front of 3 hosts; {n} requests each",
        common::test_backend()
    );
    let c = direct.post("/v1/sessions", &json!({}));
    assert_eq!(c.status, 201, "{}", c.text());
    let id = c.json()["id"].as_str().unwrap_or_default().to_string();
    let (mut gd, mut gr, mut ed, mut er) = (vec![], vec![], vec![], vec![]);
    let exec = json!({"argv": ["true"]});
    // Warm both paths' connections.
    for h in [&direct, &routed] {
        h.get(&format!("/v1/sessions/{id}"));
        h.post(&format!("/v1/sessions/{id}/exec"), &exec);
    }
    // Alternate which path goes first, so neither gains from the other's
    // warm-up; the paired differences' median is printed too.
    let (mut gdiff, mut ediff) = (vec![], vec![]);
    for i in 0..n {
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        let mut g = [Duration::ZERO; 2];
        for k in order {
            let h = [&direct, &routed][k];
            let t = Instant::now();
            let r = h.get(&format!("/v1/sessions/{id}"));
            g[k] = t.elapsed();
            assert_eq!(r.status, 200);
        }
        let mut e = [Duration::ZERO; 2];
        for k in order {
            let h = [&direct, &routed][k];
            let t = Instant::now();
            let r = h.post(&format!("/v1/sessions/{id}/exec"), &exec);
            e[k] = t.elapsed();
            assert_eq!(r.status, 200, "{}", r.text());
        }
        gd.push(g[0]);
        gr.push(g[1]);
        ed.push(e[0]);
        er.push(e[1]);
        gdiff.push(ms(g[1]) - ms(g[0]));
        ediff.push(ms(e[1]) - ms(e[0]));
    }
    compare("GET /v1/sessions/:id", &mut gd, &mut gr, &mut gdiff);
    compare("exec `true`", &mut ed, &mut er, &mut ediff);
    direct.delete(&format!("/v1/sessions/{id}"));

    // Creates: one host directly, then three through the router.
    std::thread::sleep(Duration::from_secs(2));
    let one = creates_per_sec(&direct, creates);
    std::thread::sleep(Duration::from_secs(2));
    let three = creates_per_sec(&routed, creates);
    println!("sessions created per second, 1 host direct      {one:>6.2} /s ({creates} creates, 3 clients)");
    println!("sessions created per second, 3 hosts via router {three:>6.2} /s ({creates} creates, 3 clients)");
}
