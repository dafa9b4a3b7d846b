//! Process start through the spawner vs. directly: `/bin/true` started and
//! waited for, p50/p99. Run as root: `cargo bench --bench spawner`.

use agent_sandbox::harden::spawner::{fork_spawner, Policy, Program, SpawnRequest};
use agent_sandbox::harden::Mode;
use std::time::{Duration, Instant};

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn main() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("spawner bench needs root; skipped");
        return;
    }
    let n = 300;
    let policy = Policy {
        programs: vec![Program {
            path: "/bin/true".into(),
            may_run_as_root: false,
        }],
        uids: 65534..=65534,
        gids: 65534..=65534,
        tool_uid: 65534,
        tool_gid: 65534,
        netns_dirs: vec![],
        cgroup_dirs: vec![],
    };
    let client = fork_spawner(policy, Mode::Enforce)
        .and_then(|f| f.start_client())
        .expect("spawner");
    let req = SpawnRequest {
        argv: vec!["/bin/true".into()],
        uid: 65534,
        gid: 65534,
        ..SpawnRequest::default()
    };
    let mut spawned = Vec::with_capacity(n);
    let mut waited = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        let c = client.spawn(&req, &[]).expect("spawn");
        spawned.push(t0.elapsed());
        c.wait_until(Instant::now() + Duration::from_secs(5))
            .expect("wait")
            .expect("exit");
        waited.push(t0.elapsed());
    }
    let mut direct = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        std::process::Command::new("/bin/true")
            .status()
            .expect("spawn");
        direct.push(t0.elapsed());
    }
    for (name, v) in [
        ("spawner: spawn reply (exec done)", &mut spawned),
        ("spawner: spawn + exit notification", &mut waited),
        ("direct std::process::Command status()", &mut direct),
    ] {
        println!(
            "{name:40} p50 {:>8.3} ms  p99 {:>8.3} ms  (n={n})",
            pct(v, 0.5).as_secs_f64() * 1e3,
            pct(v, 0.99).as_secs_f64() * 1e3
        );
    }
}
