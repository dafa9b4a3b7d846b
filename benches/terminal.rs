//! Terminals and the audit log (issue #26), same run: a keystroke's round
//! trip over the WebSocket PTY (sent, echoed by the guest's tty, back),
//! and a trivial command's latency with the audit log on (the default:
//! host records plus the guest's process tree and file scan) against
//! `--audit off`. Prints p50/p99. Needs a VM backend
//! (AGENT_SANDBOX_TEST_BACKEND=qemu):
//!
//!   cargo bench --bench terminal [-- N]

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/skip.rs"]
mod skip;
#[path = "../tests/common/ws.rs"]
mod ws;

use common::daemon::Daemon;
use serde_json::json;
use std::time::{Duration, Instant};

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)].as_secs_f64() * 1e3
}

fn exec_times(d: &Daemon, n: usize) -> Vec<Duration> {
    let h = d.http();
    let r = h.post("/v1/sessions", &json!({"id": "e"}));
    assert_eq!(r.status, 201, "{}", r.text());
    let mut v = Vec::with_capacity(n);
    for i in 0..n + 3 {
        let t0 = Instant::now();
        let r = h.post("/v1/sessions/e/exec", &json!({"argv": ["true"]}));
        assert_eq!(r.status, 200, "{}", r.text());
        if i >= 3 {
            v.push(t0.elapsed());
        }
    }
    v
}

fn main() {
    if !common::daemon::vm_backend() {
        println!("SKIP bench terminal: needs a VM backend (AGENT_SANDBOX_TEST_BACKEND=qemu)");
        return;
    }
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(100);

    let d = Daemon::start(&[]);
    let h = d.http();
    let r = h.post("/v1/sessions", &json!({"id": "t"}));
    assert_eq!(r.status, 201, "{}", r.text());
    let addr = d.base.trim_start_matches("http://").to_string();
    let mut w = ws::Ws::connect(
        &addr,
        "/v1/sessions/t/pty/ws?command=exec+cat",
        &format!("Authorization: Bearer {}\r\n", d.key),
    )
    .expect("upgrade");
    assert_eq!(w.recv_json().expect("started")["type"], "started");
    let mut keys = Vec::with_capacity(n);
    for i in 0..n + 5 {
        let k = (b'a' + (i % 26) as u8) as char;
        let t0 = Instant::now();
        w.json(&json!({"type": "stdin", "data": k.to_string()}));
        loop {
            let v = w.recv_json().expect("an echo");
            if v["type"] == "stream" && v["data"].as_str().is_some_and(|s| s.contains(k)) {
                break;
            }
        }
        if i >= 5 {
            keys.push(t0.elapsed());
        }
    }
    println!(
        "FIGURE terminal_keystroke_roundtrip_ms p50 {:.2} p99 {:.2} (n={n}, WebSocket PTY, cat)",
        pct(&mut keys, 0.5),
        pct(&mut keys, 0.99)
    );
    drop(w);

    let mut on = exec_times(&d, n);
    drop(d);
    let off_d = Daemon::start(&["--audit", "off"]);
    let mut off = exec_times(&off_d, n);
    println!(
        "FIGURE exec_true_ms audit_on p50 {:.1} p99 {:.1} | audit_off p50 {:.1} p99 {:.1} (n={n})",
        pct(&mut on, 0.5),
        pct(&mut on, 0.99),
        pct(&mut off, 0.5),
        pct(&mut off, 0.99)
    );
}
