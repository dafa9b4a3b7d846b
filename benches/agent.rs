//! Agent protocol benchmark: `cargo bench --bench agent`.
//!
//! Starts the real (release) agent on a Unix socket and prints:
//! - the floor: p50/p99 of a bare posix_spawn + waitpid of /bin/true;
//! - ping and `true` exec round trips through the agent, p50/p99;
//! - stdout streaming, file write and file read throughput in MiB/s.
//!
//! The floor, the client and the raw-socket exec are then measured again
//! taking turns ("interleaved"), which is robust to a machine whose load
//! moves: compare those lines with each other.
//!
//! Set BENCH_N to change the number of round trips (default 2000), and
//! BENCH_BASELINE_AGENT=/path/to/sandbox-agent to add another agent build
//! to the interleaved run.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/skip.rs"]
mod skip;

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
    // The agent (not PID 1 here) hands its own environment to every
    // process it starts, and `cargo bench` sets LD_LIBRARY_PATH: the
    // dynamic loader of every `true` then searches cargo's directories
    // first, ~185 µs per exec on these machines, which a VM's agent (clean
    // template environment) never pays and the floor (empty environment)
    // does not pay either.
    std::env::remove_var("LD_LIBRARY_PATH");
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

    // The same exec with no host client library: one thread writes the
    // request and reads the answer off the socket itself. The difference
    // to the client figure is what the client library adds (routing, and a
    // thread hop whenever the caller cannot lead the reading itself).
    let raw_p50 = raw_exec_rtt(&a, &req, n);
    println!(
        "agent exec `true`, raw socket      p50 {}  (p50 over floor: {})",
        us(raw_p50),
        us(raw_p50.saturating_sub(floor_p50))
    );

    // The same three, taking turns: on a shared machine whose load moves
    // during the run, the blocks above can each see a different machine.
    compare(
        &a,
        &c,
        std::env::var("BENCH_BASELINE_AGENT").ok().as_deref(),
        &req,
        n,
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

/// A connection driven by the calling thread alone: it writes the request
/// and reads the answer off the socket itself, with no client threads.
struct RawConn {
    s: std::os::unix::net::UnixStream,
    r: agent_sandbox::proto::FrameReader<std::io::BufReader<std::os::unix::net::UnixStream>>,
    body: Vec<u8>,
    next: u64,
}

impl RawConn {
    fn new(a: &common::TestAgent, req: &ExecRequest) -> RawConn {
        use agent_sandbox::proto::{self, encode_json, FrameReader, Hello, Kind};
        use std::io::Write;
        let mut s = a.stream();
        let mut r = FrameReader::new(std::io::BufReader::new(s.try_clone().expect("clone")));
        s.write_all(&encode_json(
            Kind::Hello,
            0,
            &Hello {
                version: proto::PROTOCOL_VERSION,
                min_version: proto::MIN_PROTOCOL_VERSION,
                nonce: 1,
                software: "bench".into(),
                max_payload: proto::MAX_PAYLOAD as u32,
                ..Default::default()
            },
        ))
        .expect("hello");
        r.read_frame().expect("hello reply").expect("hello reply");
        let body = serde_json::to_vec(&Request::Exec(req.clone())).expect("json");
        RawConn {
            s,
            r,
            body,
            next: 1,
        }
    }

    fn exec(&mut self) -> Duration {
        use agent_sandbox::proto::{encode_frame, Kind};
        use std::io::Write;
        let id = self.next;
        self.next += 1;
        let t = Instant::now();
        self.s
            .write_all(&encode_frame(Kind::Request, id, 0, &self.body))
            .expect("send");
        loop {
            let f = self.r.read_frame().expect("frame").expect("frame");
            if f.header.id == id && matches!(f.kind(), Some(Kind::Response | Kind::Error)) {
                assert_eq!(f.kind(), Some(Kind::Response));
                return t.elapsed();
            }
        }
    }
}

fn raw_exec_rtt(a: &common::TestAgent, req: &ExecRequest, n: usize) -> Duration {
    let mut raw = RawConn::new(a, req);
    for _ in 0..50 {
        raw.exec();
    }
    let mut v: Vec<Duration> = (0..n).map(|_| raw.exec()).collect();
    pct(&mut v, 0.5)
}

/// Floor, this agent through the client, and this agent over a raw socket
/// take turns, so a machine whose load changes during the run skews all
/// alike. With `other` (another agent binary, e.g. one built from an
/// earlier commit) that one takes its turn too.
fn compare(
    a: &common::TestAgent,
    c: &agent_sandbox::agent::AgentClient,
    other: Option<&str>,
    req: &ExecRequest,
    n: usize,
) {
    use std::io::BufRead;
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("agent.sock");
    let mut child = other.map(|other| {
        let mut child = std::process::Command::new(other)
            .arg("--listen")
            .arg(format!("unix:{}", sock.display()))
            .arg("--workspace")
            .arg(dir.path().join("ws"))
            .env("SANDBOX_AGENT_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start the baseline agent");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("READY");
        child
    });
    let b = child.as_ref().map(|_| {
        agent_sandbox::agent::AgentClient::connect(
            std::os::unix::net::UnixStream::connect(&sock).expect("connect"),
            Duration::from_secs(10),
        )
        .expect("hello")
    });
    let mut raw = RawConn::new(a, req);
    let (mut f, mut x, mut y, mut z) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let time = |cl: &agent_sandbox::agent::AgentClient| {
        let t = Instant::now();
        cl.exec(req.clone(), 1024).expect("exec");
        t.elapsed()
    };
    for i in 0..n {
        let t = Instant::now();
        spawn_true();
        f.push(t.elapsed());
        // Alternate which agent goes first.
        match &b {
            Some(b) if i % 2 == 1 => {
                y.push(time(b));
                x.push(time(c));
            }
            Some(b) => {
                x.push(time(c));
                y.push(time(b));
            }
            None => x.push(time(c)),
        }
        z.push(raw.exec());
    }
    let fp = pct(&mut f, 0.5);
    let (xp, zp) = (pct(&mut x, 0.5), pct(&mut z, 0.5));
    println!(
        "interleaved: floor p50 {}  p99 {}",
        us(fp),
        us(pct(&mut f, 0.99))
    );
    println!(
        "interleaved: this agent p50 {} (+{})  p99 {}",
        us(xp),
        us(xp.saturating_sub(fp)),
        us(pct(&mut x, 0.99))
    );
    println!(
        "interleaved: this agent, raw socket p50 {} (+{})  p99 {}",
        us(zp),
        us(zp.saturating_sub(fp)),
        us(pct(&mut z, 0.99))
    );
    if let (Some(other), Some(b)) = (other, b) {
        let yp = pct(&mut y, 0.5);
        println!(
            "interleaved: {other} p50 {} (+{})  p99 {}",
            us(yp),
            us(yp.saturating_sub(fp)),
            us(pct(&mut y, 0.99))
        );
        b.close();
    }
    if let Some(child) = child.as_mut() {
        let _ = child.kill();
        let _ = child.wait();
    }
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
