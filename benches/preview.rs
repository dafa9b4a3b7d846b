//! Preview URLs (issue #26): a guest's web server reached through the
//! daemon's preview listener against `curl` inside the guest, same run.
//! Prints p50/p99 of one small GET (connect .. last byte; curl's
//! `time_total` in the guest) and requests/s with 4 clients at once.
//! Needs root and a VM backend (AGENT_SANDBOX_TEST_BACKEND=qemu):
//!
//!   cargo bench --bench preview [-- REQUESTS]

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/netns.rs"]
mod netns;
#[path = "../tests/common/skip.rs"]
mod skip;

use common::daemon::{stdout_of, Daemon};
use serde_json::json;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)].as_secs_f64() * 1e3
}

fn get(addr: &str, path: &str) -> usize {
    let mut c = TcpStream::connect(addr).expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        c,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = Vec::new();
    let _ = c.read_to_end(&mut out);
    assert!(out.starts_with(b"HTTP/1.0 200") || out.starts_with(b"HTTP/1.1 200"));
    out.len()
}

fn main() {
    if !netns::is_root() || !common::daemon::vm_backend() {
        println!(
            "SKIP bench preview: needs root and a VM backend (AGENT_SANDBOX_TEST_BACKEND=qemu)"
        );
        return;
    }
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(200);
    let topo = netns::Topology::new("bprv");
    let mut args = common::daemon::net_args(&topo.host_path(), None);
    args.extend(["--preview-listen", "127.0.0.1:0"].map(String::from));
    let d = Daemon::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let h = d.http();
    let r = h.post("/v1/sessions", &json!({"id": "b", "template": "dev"}));
    assert_eq!(r.status, 201, "{}", r.text());
    let sh = |cmd: &str| {
        let r = h.post(
            "/v1/sessions/b/exec",
            &json!({"command": cmd, "timeout": 600_000}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        stdout_of(&r.json())
    };
    sh("head -c 1024 /dev/zero > /workspace/f");
    let r = h.post(
        "/v1/sessions/b/exec",
        &json!({"argv": ["python3", "-m", "http.server", "8000", "-d", "/workspace"], "background": true}),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    sh("for i in $(seq 100); do curl -sf -o /dev/null http://127.0.0.1:8000/f && exit 0; sleep 0.1; done; exit 1");
    let p = h
        .post(
            "/v1/sessions/b/ports",
            &json!({"port": 8000, "public": true}),
        )
        .json();
    let url = p["url"].as_str().expect("url").to_string();
    let rest = url.trim_start_matches("http://");
    let (addr, path) = rest.split_at(rest.find('/').unwrap());
    let (addr, file) = (addr.to_string(), format!("{path}f"));
    get(&addr, &file);

    println!("GET of 1 KiB from python3 -m http.server in the guest, n={n}:");
    let mut via: Vec<Duration> = (0..n)
        .map(|_| {
            let t = Instant::now();
            get(&addr, &file);
            t.elapsed()
        })
        .collect();
    let out = sh(&format!(
        "for i in $(seq {n}); do curl -s -o /dev/null -w '%{{time_total}}\\n' http://127.0.0.1:8000/f; done"
    ));
    let mut inside: Vec<Duration> = out
        .lines()
        .filter_map(|l| l.trim().parse::<f64>().ok())
        .map(Duration::from_secs_f64)
        .collect();
    let (v50, v99, i50, i99) = (
        pct(&mut via, 0.5),
        pct(&mut via, 0.99),
        pct(&mut inside, 0.5),
        pct(&mut inside, 0.99),
    );
    println!("  curl in the guest      p50 {i50:>8.2} ms   p99 {i99:>8.2} ms");
    println!("  through the preview    p50 {v50:>8.2} ms   p99 {v99:>8.2} ms");

    let clients = 4;
    let per = n / clients;
    let t = Instant::now();
    let hs: Vec<_> = (0..clients)
        .map(|_| {
            let (a, f) = (addr.clone(), file.clone());
            std::thread::spawn(move || {
                for _ in 0..per {
                    get(&a, &f);
                }
            })
        })
        .collect();
    for x in hs {
        x.join().unwrap();
    }
    let via_rps = (per * clients) as f64 / t.elapsed().as_secs_f64();
    let out = sh(&format!(
        "s=$(date +%s.%N); for c in $(seq {clients}); do (for i in $(seq {per}); do curl -s -o /dev/null http://127.0.0.1:8000/f; done) & done; wait; \
         e=$(date +%s.%N); echo \"$s $e\""
    ));
    let mut it = out.split_whitespace().filter_map(|x| x.parse::<f64>().ok());
    let (s, e) = (it.next().unwrap_or(0.0), it.next().unwrap_or(1.0));
    let in_rps = (per * clients) as f64 / (e - s);
    println!("requests/s, {clients} clients at once:");
    println!("  curl in the guest      {in_rps:>8.1}");
    println!("  through the preview    {via_rps:>8.1}");
}
