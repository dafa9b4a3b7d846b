//! VM lifecycle benchmark: cold boot to the agent's READY line and
//! restore to the first exec answered (into a fresh QEMU, and into a
//! standby QEMU started ahead), p50/p99, with the QEMU backend
//! (TCG here, KVM where it works). Prints numbers; asserts nothing.
//!
//!   cargo bench --bench vm [-- ITERATIONS] [restore] [template=NAME]
//!
//! `restore` skips the cold boots; `template=` restores that template's
//! snapshot (and boots its image cold) instead of `base`'s.
//!
//! `AGENT_SANDBOX_BENCH_LAUNCHER=spawner` starts QEMU as the daemon does
//! (through the spawner, jailed; root only), `spawner-nojail` the same
//! without the jail.
//!
//! Under TCG it also counts the guest code blocks QEMU translated per
//! phase (`info jit`), a measure of the restored guest's work that does
//! not move with the host's speed.

#[path = "../tests/common/skip.rs"]
mod skip;
#[path = "../tests/common/vm.rs"]
mod vm;

mod common;
use common::{exec_true, report, report_count};

use agent_sandbox::agent::{AgentClient, Started};
use agent_sandbox::harden::spawner::{fork_spawner, Policy, Program, SpawnerClient};
use agent_sandbox::harden::Mode;
use agent_sandbox::vm::launch;
use agent_sandbox::vm::launch::{Launch, Launcher, VmmProcess};
use agent_sandbox::vm::{connect_agent, Backend, PreparedRestore, Vm};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// CPU time of all threads of `pid`: under TCG the guest's work (mostly
/// translating code after a restore) is this, and unlike wall time it
/// hardly depends on what else the host runs.
fn cpu_time(pid: Option<i32>) -> Duration {
    let Some(pid) = pid else {
        return Duration::ZERO;
    };
    let mut ns = 0u64;
    if let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for e in rd.flatten() {
            if let Ok(s) = std::fs::read_to_string(e.path().join("schedstat")) {
                ns += s
                    .split_whitespace()
                    .next()
                    .and_then(|x| x.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
    }
    Duration::from_nanos(ns)
}

/// A spawner that does not jail: the A/B baseline of `spawner`.
struct NoJail(SpawnerClient);

impl launch::Spawner for NoJail {
    fn run(
        &self,
        argv: &[std::ffi::OsString],
        deadline: Instant,
    ) -> agent_sandbox::vm::Result<launch::Output> {
        launch::Spawner::run(&self.0, argv, deadline)
    }
}

impl Launcher for NoJail {
    fn start(
        &self,
        l: &Launch,
        fds: &[(std::os::fd::BorrowedFd<'_>, std::os::fd::RawFd)],
    ) -> agent_sandbox::vm::Result<Box<dyn VmmProcess>> {
        self.0.start(l, fds)
    }
    fn kind(&self) -> &'static str {
        "spawner"
    }
    fn can_jail(&self) -> bool {
        false
    }
    fn run_env(
        &self,
        argv: &[std::ffi::OsString],
        env: &[(String, String)],
        deadline: Instant,
    ) -> agent_sandbox::vm::Result<launch::Output> {
        Launcher::run_env(&self.0, argv, env, deadline)
    }
}

/// `AGENT_SANDBOX_BENCH_LAUNCHER=spawner` (QEMU jailed, as the daemon
/// runs it; needs root) or `spawner-nojail`; else QEMU starts directly.
/// Forks the spawner while this process is still single-threaded.
fn choose_launcher() {
    let which = std::env::var("AGENT_SANDBOX_BENCH_LAUNCHER").unwrap_or_default();
    if which.is_empty() || which == "direct" {
        return;
    }
    let qemu = agent_sandbox::vm::qemu::find_in_path(std::path::Path::new("qemu-system-x86_64"))
        .expect("qemu-system-x86_64 in PATH");
    let policy = Policy {
        programs: vec![Program {
            path: qemu,
            may_run_as_root: false,
        }],
        uids: vm::VM_UID..=vm::VM_UID,
        gids: vm::VM_GID..=vm::VM_GID,
        tool_uid: vm::VM_UID,
        tool_gid: vm::VM_GID,
        netns_dirs: vec!["/run/netns".into()],
        cgroup_dirs: vec![],
    };
    let client = fork_spawner(policy, Mode::Enforce)
        .and_then(|f| f.start_client())
        .expect("spawner (run as root)");
    let l: Arc<dyn Launcher> = match which.as_str() {
        "spawner" => Arc::new(client),
        "spawner-nojail" => Arc::new(NoJail(client)),
        other => panic!("AGENT_SANDBOX_BENCH_LAUNCHER={other}: spawner, spawner-nojail or direct"),
    };
    println!("QEMU starts through: {which}");
    let _ = vm::LAUNCHER.set(l);
}

fn main() {
    choose_launcher();
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(10);
    let template = std::env::args()
        .find_map(|a| a.strip_prefix("template=").map(str::to_string))
        .unwrap_or_else(|| "base".into());
    let Some(e) = vm::env() else { return };
    let accel = e
        .backend
        .vmm_version_for(&e.kernel)
        .unwrap_or_else(|err| format!("? ({err})"));
    println!("QEMU backend: {accel}; template {template}; {n} iterations each; 1 vCPU, 256 MiB (cold), template shape (restore)");

    // `-- N restore` skips the cold boots.
    let cold_n = if std::env::args().any(|a| a == "restore") {
        0
    } else {
        n
    };
    let (mut cold, mut cold_hello, mut cold_rss) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..cold_n {
        let cfg = e.cold_config(&format!("bench-cold-{i}"), &template, 256);
        let t = Instant::now();
        let mut v = e.backend.boot(&cfg).expect("boot");
        cold.push(t.elapsed());
        let c = connect_agent(v.as_mut(), false, Duration::from_secs(60)).expect("agent");
        exec_true(&c);
        cold_hello.push(t.elapsed());
        if let Some(pid) = v.pid() {
            cold_rss.push(rss_kib(pid));
        }
        drop(c);
        v.destroy().expect("destroy");
    }

    let t = Instant::now();
    let info = e.registry.ensure_snapshot(&template).expect("snapshot");
    println!(
        "snapshot of {template}: {} in {:.1} s ({} vCPU, {} MiB)",
        if info.rebuilt {
            "made"
        } else {
            "fresh, reused"
        },
        t.elapsed().as_secs_f64(),
        info.vcpus,
        info.mem_mib
    );
    let (mut restore, mut hello, mut first, mut exec_rtt, mut rest_rss) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut cpu_restore, mut cpu_hello, mut cpu_first) = (Vec::new(), Vec::new(), Vec::new());
    let (mut tb_hello, mut tb_first) = (Vec::new(), Vec::new());
    for i in 0..n {
        let id = format!("bench-restore-{i}");
        let cfg = info.vm_config(&id, e.run_dir(&id), vm::VM_UID, vm::VM_GID);
        let _ = std::fs::remove_dir_all(&cfg.run_dir);
        let t = Instant::now();
        let mut v = e.backend.restore_vm(&cfg, &info.dir).expect("restore");
        restore.push(t.elapsed());
        let c0 = cpu_time(v.pid());
        cpu_restore.push(c0);
        // Counting translated blocks is a QMP round trip: kept out of the
        // wall-clock figures.
        let q = Instant::now();
        let tb0 = v.translated_blocks();
        let mut asked = q.elapsed();
        let c = connect_agent(&mut v, true, Duration::from_secs(60)).expect("agent");
        hello.push(t.elapsed() - asked);
        let c1 = cpu_time(v.pid());
        cpu_hello.push(c1.saturating_sub(c0));
        let q = Instant::now();
        let tb1 = v.translated_blocks();
        asked += q.elapsed();
        exec_true(&c);
        first.push(t.elapsed() - asked);
        cpu_first.push(cpu_time(v.pid()).saturating_sub(c1));
        if let (Some(a), Some(b), Some(c)) = (tb0, tb1, v.translated_blocks()) {
            tb_hello.push(b.saturating_sub(a));
            tb_first.push(c.saturating_sub(b));
        }
        let t2 = Instant::now();
        exec_true(&c);
        exec_rtt.push(t2.elapsed());
        if let Some(pid) = v.pid() {
            rest_rss.push(rss_kib(pid));
        }
        drop(c);
        Vm::destroy(&mut v).expect("destroy");
    }
    // Restores into a standby VMM (`sandbox::standby`): the daemon starts
    // the QEMU for the next session of a shape ahead of time, so a session
    // pays only the state load, the hello and its first exec.
    let (mut sb_load, mut sb_hello, mut sb_first, mut sb_rss) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let id = format!("bench-standby-{i}");
        let cfg = info.vm_config(&id, e.run_dir(&id), vm::VM_UID, vm::VM_GID);
        let _ = std::fs::remove_dir_all(&cfg.run_dir);
        let p = e
            .backend
            .prepare_restore_vm(&cfg, &info.dir)
            .expect("prepare restore");
        // As a standby waits between sessions: idle, nothing loaded.
        std::thread::sleep(Duration::from_millis(300));
        if let Some(pid) = PreparedRestore::pid(&p) {
            sb_rss.push(rss_kib(pid));
        }
        let t = Instant::now();
        let mut v = p.finish_vm().expect("finish restore");
        sb_load.push(t.elapsed());
        let c = connect_agent(&mut v, true, Duration::from_secs(60)).expect("agent");
        sb_hello.push(t.elapsed());
        exec_true(&c);
        sb_first.push(t.elapsed());
        drop(c);
        Vm::destroy(&mut v).expect("destroy");
    }
    // A client usually pauses between creating a session and its first
    // command; under TCG the agent uses such a pause to warm the exec path
    // up (`RestoreFixup::warm_up`). Same restore, then an idle pause, then
    // the first exec: without and with the warm-up.
    let idle = Duration::from_millis(400);
    let (mut idle_cold, mut idle_warm) = (Vec::new(), Vec::new());
    let (mut tb_idle_cold, mut tb_idle_warm) = (Vec::new(), Vec::new());
    for i in 0..n {
        for warm_up in [false, true] {
            let id = format!("bench-idle-{i}-{warm_up}");
            let cfg = info.vm_config(&id, e.run_dir(&id), vm::VM_UID, vm::VM_GID);
            let _ = std::fs::remove_dir_all(&cfg.run_dir);
            let mut v = e.backend.restore_vm(&cfg, &info.dir).expect("restore");
            let s = Vm::connect_agent(&mut v, Instant::now() + Duration::from_secs(60))
                .expect("agent socket");
            let c = AgentClient::connect_with(
                s,
                Duration::from_secs(60),
                Started::Restored {
                    warm_up: warm_up && v.translates_guest_code(),
                },
            )
            .expect("agent hello");
            std::thread::sleep(idle);
            let tb0 = v.translated_blocks();
            let t = Instant::now();
            exec_true(&c);
            let took = t.elapsed();
            let tb = v
                .translated_blocks()
                .zip(tb0)
                .map(|(b, a)| b.saturating_sub(a));
            let (times, blocks) = if warm_up {
                (&mut idle_warm, &mut tb_idle_warm)
            } else {
                (&mut idle_cold, &mut tb_idle_cold)
            };
            times.push(took);
            blocks.extend(tb);
            drop(c);
            Vm::destroy(&mut v).expect("destroy");
        }
    }
    if !cold.is_empty() {
        report("cold boot to READY", &mut cold);
        report("cold boot to first exec answered", &mut cold_hello);
    }
    report("restore (QEMU up, state loaded, running)", &mut restore);
    report("restore to hello answered (fixup applied)", &mut hello);
    report("restore to first exec answered", &mut first);
    report("exec `true` round trip (restored VM)", &mut exec_rtt);
    report("standby VMM: state loaded, running", &mut sb_load);
    report("standby VMM: to hello answered", &mut sb_hello);
    report("standby VMM: to first exec answered", &mut sb_first);
    report("QEMU CPU: start + load state", &mut cpu_restore);
    report("QEMU CPU: hello (fixup)", &mut cpu_hello);
    report("QEMU CPU: first exec", &mut cpu_first);
    // Under TCG the restored guest's work is mostly translation; the block
    // counts do not swing with the host's speed as the times above do.
    report_count("TCG blocks translated: hello", &mut tb_hello);
    report_count("TCG blocks translated: first exec", &mut tb_first);
    report("first exec after 400 ms idle, no warm-up", &mut idle_cold);
    report("first exec after 400 ms idle, warmed up", &mut idle_warm);
    report_count("TCG blocks: exec after idle, no warm-up", &mut tb_idle_cold);
    report_count("TCG blocks: exec after idle, warmed up", &mut tb_idle_warm);
    let avg = |v: &[u64]| v.iter().sum::<u64>() / v.len().max(1) as u64;
    println!(
        "QEMU RSS after first exec: cold {} MiB, restored {} MiB; standby VMM waiting {} MiB",
        avg(&cold_rss) / 1024,
        avg(&rest_rss) / 1024,
        avg(&sb_rss) / 1024
    );
}
