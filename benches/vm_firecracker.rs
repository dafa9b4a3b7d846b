//! The VM lifecycle benchmark for the Firecracker backend, on a host with
//! working KVM and Firecracker: cold boot to the agent's READY and to the
//! first exec, restore to the hello and to the first exec (also into a
//! standby VMM prepared ahead), p50/p99. Same
//! figures as `cargo bench --bench vm` prints for QEMU, through the same
//! code the daemon runs (jailer, per-VM uid, isolated TAP, snapshot
//! registry). Prints numbers; asserts nothing. Run as root:
//!
//!   AGENT_SANDBOX_FIRECRACKER=/usr/local/bin/firecracker \
//!   AGENT_SANDBOX_JAILER=/usr/local/bin/jailer \
//!   cargo bench --bench vm_firecracker [-- ITERATIONS]
//!
//! Images come from the cache `agent-sandbox image build` fills
//! (`AGENT_SANDBOX_CACHE`, default /var/cache/agent-sandbox). Where
//! Firecracker, its jailer, root or a usable /dev/kvm is missing (the CI
//! machines: no Firecracker, nested KVM that cannot boot a kernel) it says
//! so and exits 0.

mod common;
use common::{exec_true, report};

use agent_sandbox::config::Config;
use agent_sandbox::net::Isolated;
use agent_sandbox::sandbox::wiring;
use agent_sandbox::vm::connect_agent;
use agent_sandbox::vm::ids::VmIds;
use agent_sandbox::vm::templates::Registry;
use agent_sandbox::vm::{NetAttachment, VmConfig};
use std::time::{Duration, Instant};

/// Why this host cannot run the benchmark, if it cannot.
fn missing(cfg: &Config) -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (jailer)".into());
    }
    let jc = wiring::jailer_config(cfg);
    for (what, p) in [
        ("firecracker", &jc.firecracker_bin),
        ("jailer", &jc.jailer_bin),
    ] {
        if !p.is_file() {
            return Some(format!(
                "no {what} at {} (set AGENT_SANDBOX_FIRECRACKER / AGENT_SANDBOX_JAILER)",
                p.display()
            ));
        }
    }
    if !agent_sandbox::vm::qemu::kvm_device_usable() {
        return Some("/dev/kvm is missing or does not answer".into());
    }
    None
}

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(10);
    let state = tempfile::tempdir().expect("state dir");
    let mut cfg = Config {
        state_dir: state.path().to_path_buf(),
        backend: "firecracker".into(),
        ..Config::default()
    };
    cfg.artifacts.fill_from_env();
    if let Some(why) = missing(&cfg) {
        println!("Firecracker benchmark skipped: {why}");
        return;
    }
    // Snapshots of this run only: beside nothing else's.
    cfg.artifacts.snapshot_dir = Some(state.path().join("snapshots"));
    let be = wiring::backend("firecracker", &cfg).expect("firecracker backend");
    let version = be.vmm_version().unwrap_or_else(|e| format!("? ({e})"));
    let mut rc = wiring::registry_config(&cfg);
    let _snap_net = wiring::snapshot_net(&cfg, &mut rc).expect("snapshot network namespace");
    let reg = Registry::new(rc, be.clone());
    let ids = wiring::vm_ids(&cfg).expect("VM ids");
    let net_cfg = wiring::net_config(&cfg);
    println!("Firecracker backend: {version}; {n} iterations each; template shape");

    // Every VM's NIC on a dead-end TAP of its own, owned by its uid, as
    // the daemon gives sessions with networking off.
    let vm = |id: &str, cfg0: VmConfig, ids: &VmIds| {
        let lease = ids.acquire().expect("VM uid");
        let iso = Isolated::create_for(&net_cfg, (lease.uid, lease.gid)).expect("isolated netns");
        let mac = cfg0
            .net
            .as_ref()
            .map(|n| n.guest_mac.clone())
            .unwrap_or_default();
        let c = VmConfig {
            uid: lease.uid,
            gid: lease.gid,
            run_dir: state.path().join("run").join(id),
            net: Some(NetAttachment {
                netns: iso.path(),
                tap: iso.tap().to_string(),
                guest_mac: mac,
            }),
            ..cfg0
        };
        (c, lease, iso)
    };

    let t = Instant::now();
    let info = reg.ensure_snapshot("base").expect("snapshot of base");
    println!(
        "snapshot of base: made in {:.1} s ({} vCPU, {} MiB)",
        t.elapsed().as_secs_f64(),
        info.vcpus,
        info.mem_mib
    );
    let template_cfg = |id: &str| {
        let mut c = info.vm_config(id, state.path().join("run").join(id), 0, 0);
        c.net = reg_net(&cfg);
        c
    };

    let (mut cold, mut cold_first) = (Vec::new(), Vec::new());
    for i in 0..n {
        let id = format!("bench-fc-cold-{i}");
        let (c, _lease, _iso) = vm(&id, template_cfg(&id), &ids);
        let t = Instant::now();
        let mut v = be.boot(&c).expect("boot");
        let client = connect_agent(v.as_mut(), false, Duration::from_secs(30)).expect("agent");
        cold.push(t.elapsed());
        exec_true(&client);
        cold_first.push(t.elapsed());
        drop(client);
        v.destroy().expect("destroy");
    }

    let (mut restore, mut hello, mut first, mut rtt) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let id = format!("bench-fc-restore-{i}");
        let (c, _lease, _iso) = vm(&id, template_cfg(&id), &ids);
        let t = Instant::now();
        let mut v = be.restore(&c, &info.dir).expect("restore");
        restore.push(t.elapsed());
        let client = connect_agent(v.as_mut(), true, Duration::from_secs(30)).expect("agent");
        hello.push(t.elapsed());
        exec_true(&client);
        first.push(t.elapsed());
        let t2 = Instant::now();
        exec_true(&client);
        rtt.push(t2.elapsed());
        drop(client);
        v.destroy().expect("destroy");
    }
    // Into a standby VMM (jailer run, API up, files linked: what the
    // daemon prepares ahead for the next session of a shape).
    let (mut sb_load, mut sb_first) = (Vec::new(), Vec::new());
    for i in 0..n {
        let id = format!("bench-fc-standby-{i}");
        let (c, _lease, _iso) = vm(&id, template_cfg(&id), &ids);
        let p = be.prepare_restore(&c, &info.dir).expect("prepare restore");
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        let mut v = p.finish().expect("finish restore");
        sb_load.push(t.elapsed());
        let client = connect_agent(v.as_mut(), true, Duration::from_secs(30)).expect("agent");
        exec_true(&client);
        sb_first.push(t.elapsed());
        drop(client);
        v.destroy().expect("destroy");
    }
    report("cold boot to agent hello", &mut cold);
    report("cold boot to first exec answered", &mut cold_first);
    report("restore (VMM up, snapshot loaded)", &mut restore);
    report("restore to hello answered (fixup applied)", &mut hello);
    report("restore to first exec answered", &mut first);
    report("exec `true` round trip (restored VM)", &mut rtt);
    report("standby VMM: snapshot loaded", &mut sb_load);
    report("standby VMM: to first exec answered", &mut sb_first);
}

/// The NIC shape snapshots are made with (MAC, and so the devices a
/// restore must match): the registry's, attached per VM above.
fn reg_net(cfg: &Config) -> Option<NetAttachment> {
    wiring::registry_config(cfg).net
}
