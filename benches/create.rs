//! Session creation through the daemon: `POST /v1/sessions` answered, and
//! created + first exec (`true`) answered, p50/p99, for one template (the
//! real `serve` binary; backend from AGENT_SANDBOX_TEST_BACKEND, else qemu
//! when images are built). Sessions are made one at a time, 1 s apart, as
//! the standby VMM for the next one is prepared in between (docs/operations.md).
//!
//!   cargo bench --bench create [-- ITERATIONS] [template=NAME] [config=FILE]   (default 10, base)

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/skip.rs"]
mod skip;

use common::daemon::Daemon;
use serde_json::json;
use std::time::{Duration, Instant};

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn report(name: &str, v: &mut [Duration]) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "{name:<36} n={:<3} p50 {:>8.1} ms   p99 {:>8.1} ms   min {:>8.1} ms",
        v.len(),
        ms(pct(v, 0.5)),
        ms(pct(v, 0.99)),
        ms(v[0]),
    );
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
    // config=FILE: a daemon config of its own (a template built from an
    // image into a cache of its own, docs/images.md).
    let config = std::env::args().find_map(|a| a.strip_prefix("config=").map(str::to_string));
    let mut args = vec!["--default-template", template.as_str()];
    if let Some(c) = &config {
        args.extend(["--config", c.as_str()]);
    }
    let d = Daemon::start(&args);
    let h = d.http();
    println!(
        "backend {}; template {template}; {n} sessions",
        common::test_backend()
    );
    // The first session may make the snapshot: not counted.
    let t = Instant::now();
    let r = h.post("/v1/sessions", &json!({"id": "warm"}));
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["template"], template.as_str(), "{}", r.text());
    println!(
        "first session (snapshot made if missing): {:.1} s",
        t.elapsed().as_secs_f64()
    );
    h.delete("/v1/sessions/warm");
    let (mut create, mut first) = (Vec::new(), Vec::new());
    for i in 0..n {
        std::thread::sleep(Duration::from_secs(1));
        let id = format!("c{i}");
        let t = Instant::now();
        let r = h.post("/v1/sessions", &json!({ "id": id }));
        assert_eq!(r.status, 201, "{}", r.text());
        create.push(t.elapsed());
        let r = h.post(
            &format!("/v1/sessions/{id}/exec"),
            &json!({"command": "true", "args": []}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["exitCode"], 0, "{}", r.text());
        first.push(t.elapsed());
        h.delete(&format!("/v1/sessions/{id}"));
    }
    report("create (POST /v1/sessions)", &mut create);
    report("create + first exec answered", &mut first);
}
