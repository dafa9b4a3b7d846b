//! What the VM benchmarks share: percentiles, the report line, `true`.
#![allow(dead_code)]

use agent_sandbox::agent::AgentClient;
use agent_sandbox::proto::ExecRequest;
use std::time::Duration;

/// The `p` quantile (0..=1) of `v` (sorted in place).
pub fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

/// One line: n, p50, p99, min in milliseconds (nothing for no samples).
pub fn report(name: &str, v: &mut [Duration]) {
    if v.is_empty() {
        return;
    }
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "{name:<40} n={:<3} p50 {:>8.1} ms   p99 {:>8.1} ms   min {:>8.1} ms",
        v.len(),
        ms(pct(v, 0.5)),
        ms(pct(v, 0.99)),
        ms(pct(v, 0.0)),
    );
}

/// Like [`report`], for counts (skipped when empty).
pub fn report_count(name: &str, v: &mut [u64]) {
    if v.is_empty() {
        return;
    }
    v.sort_unstable();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    println!(
        "{name:<40} n={:<3} p50 {:>8}      p99 {:>8}      min {:>8}",
        v.len(),
        at(0.5),
        at(0.99),
        v[0],
    );
}

/// Runs `true` in the guest and waits for its answer.
pub fn exec_true(c: &AgentClient) {
    c.exec(
        ExecRequest {
            argv: vec!["true".into()],
            ..Default::default()
        },
        1024,
    )
    .expect("exec true");
}
