//! Agent protocol benchmark: `cargo bench --bench agent`.
//!
//! Starts the real (release) agent on a Unix socket and prints:
//! - the floor: p50/p99 of a bare posix_spawn + waitpid of /bin/true;
//! - ping and `true` exec round trips through the agent, p50/p99;
//! - stdout streaming, file write and file read throughput in MiB/s.
//!
//! Set BENCH_N to change the number of round trips (default 2000).

#[path = "../tests/common/mod.rs"]
mod common;

use agent_sandbox::proto::{ExecRequest, Request};
use std::ffi::CString;
use std::time::{Duration, Instant};

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn spawn_true() {
    let path = CString::new("/bin/true").unwrap();
    let argv = [path.as_ptr() as *mut libc::c_char, std::ptr::null_mut()];
    let envp = [std::ptr::null_mut::<libc::c_char>()];
    let mut pid: libc::pid_t = 0;
    // SAFETY: valid NUL-terminated argv/envp arrays; defaults for attrs.
    let rc = unsafe {
        libc::posix_spawn(
            &mut pid,
            path.as_ptr(),
            std::ptr::null(),
            std::ptr::null(),
            argv.as_ptr(),
            envp.as_ptr(),
        )
    };
    assert_eq!(rc, 0, "posix_spawn");
    let mut st = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut st, 0) };
}

fn main() {
    let n: usize = std::env::var("BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        // Keep file benchmarks about the protocol, not the disk.
        std::env::set_var("TMPDIR", shm);
    }
    let a = common::TestAgent::start();
    let c = a.client();
    println!(
        "agent benchmark: {n} round trips, workspace {}",
        a.workspace.display()
    );
    println!("machine: {} cores, {}", num_cpus(), kernel());

    // Floor.
    for _ in 0..50 {
        spawn_true();
    }
    let mut floor: Vec<Duration> = (0..n)
        .map(|_| {
            let t = Instant::now();
            spawn_true();
            t.elapsed()
        })
        .collect();
    let floor_p50 = pct(&mut floor, 0.5);
    println!(
        "floor posix_spawn+wait /bin/true   p50 {}  p99 {}",
        us(floor_p50),
        us(pct(&mut floor, 0.99))
    );

    let mut ping: Vec<Duration> = (0..n)
        .map(|_| c.ping(Duration::from_secs(5)).expect("ping"))
        .collect();
    println!(
        "agent ping round trip              p50 {}  p99 {}",
        us(pct(&mut ping, 0.5)),
        us(pct(&mut ping, 0.99))
    );

    let req = ExecRequest {
        argv: vec!["/bin/true".into()],
        ..Default::default()
    };
    for _ in 0..50 {
        c.exec(req.clone(), 1024).expect("warm-up exec");
    }
    let mut exec: Vec<Duration> = (0..n)
        .map(|_| {
            let t = Instant::now();
            let out = c.exec(req.clone(), 1024).expect("exec");
            assert_eq!(out.status.code, Some(0));
            t.elapsed()
        })
        .collect();
    let exec_p50 = pct(&mut exec, 0.5);
    println!(
        "agent exec `true` round trip       p50 {}  p99 {}  (p50 over floor: {})",
        us(exec_p50),
        us(pct(&mut exec, 0.99)),
        us(exec_p50.saturating_sub(floor_p50))
    );

    // Streaming: 1 GiB of stdout.
    let bytes: u64 = 1 << 30;
    let t = Instant::now();
    let out = c
        .exec(
            ExecRequest {
                argv: vec![
                    "head".into(),
                    "-c".into(),
                    bytes.to_string(),
                    "/dev/zero".into(),
                ],
                ..Default::default()
            },
            0,
        )
        .expect("stream exec");
    let dt = t.elapsed();
    assert!(out.truncated || bytes == 0);
    println!(
        "stdout streaming                   {:.0} MiB/s ({} MiB in {:.2} s)",
        (bytes as f64 / (1 << 20) as f64) / dt.as_secs_f64(),
        bytes >> 20,
        dt.as_secs_f64()
    );

    // Files: 256 MiB write then read.
    let size = 256usize << 20;
    let data = vec![0x5au8; size];
    let t = Instant::now();
    c.write_file("bench.bin", &data, None).expect("write");
    let w = t.elapsed();
    let t = Instant::now();
    let back = c.read_file("bench.bin", size as u64).expect("read");
    let r = t.elapsed();
    assert_eq!(back.len(), size);
    println!(
        "file write                         {:.0} MiB/s",
        256.0 / w.as_secs_f64()
    );
    println!(
        "file read                          {:.0} MiB/s",
        256.0 / r.as_secs_f64()
    );
    let _ = c.simple(
        &Request::Remove {
            path: "bench.bin".into(),
            recursive: false,
        },
        Duration::from_secs(10),
    );
    println!(
        "agent RSS after run                {} KiB",
        std::fs::read_to_string(format!("/proc/{}/status", a.pid()))
            .unwrap_or_default()
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap_or("?")
    );
}

fn num_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| format!("Linux {}", s.trim()))
        .unwrap_or_default()
}
