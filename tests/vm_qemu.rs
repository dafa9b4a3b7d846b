//! End-to-end tests: real guests under QEMU (TCG here, KVM where it works),
//! no network device. Snapshots are shared between tests (and runs) through
//! the template registry; VMs of different tests run one at a time.

mod common;
#[path = "common/skip.rs"]
mod skip;
#[path = "common/vm.rs"]
mod vm;

use agent_sandbox::vm::qemu::{QemuBackend, QemuConfig, Timeouts};
use agent_sandbox::vm::templates::{Registry, RegistryConfig, SnapshotState};
use agent_sandbox::vm::{connect_agent, snapshot, Backend, Vm, VmError};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use vm::{env, serial, sh, stdout, VmEnv};

const AGENT_TIMEOUT: Duration = Duration::from_secs(60);

fn assert_gone(vm_pid: Option<i32>, run_dir: &Path) {
    if let Some(pid) = vm_pid {
        assert!(!vm::pid_alive(pid), "QEMU pid {pid} still exists");
    }
    assert!(!run_dir.exists(), "{} still exists", run_dir.display());
}

fn restore(
    e: &VmEnv,
    template: &str,
    id: &str,
) -> (Box<dyn Vm>, agent_sandbox::agent::AgentClient) {
    let info = e
        .registry
        .ensure_snapshot(template)
        .unwrap_or_else(|err| panic!("snapshot of {template}: {err}"));
    let run_dir = e.run_dir(id);
    let _ = std::fs::remove_dir_all(&run_dir);
    let cfg = info.vm_config(id, run_dir, vm::VM_UID, vm::VM_GID);
    let mut v = e.backend.restore(&cfg, &info.dir).expect("restore");
    let c = connect_agent(v.as_mut(), true, AGENT_TIMEOUT).expect("agent after restore");
    (v, c)
}

#[test]
fn cold_boot_runs_the_guest_kernel_and_round_trips_files() {
    let Some(e) = env() else { return };
    let _g = serial();
    let cfg = e.cold_config("cold-files", "base", 256);
    let run_dir = cfg.run_dir.clone();
    let t = Instant::now();
    let mut v = e.backend.boot(&cfg).expect("cold boot");
    let booted = t.elapsed();
    let c = connect_agent(v.as_mut(), false, AGENT_TIMEOUT).expect("agent");
    eprintln!(
        "cold boot to READY {booted:?}, agent hello {:?}",
        t.elapsed()
    );

    let guest = stdout(&sh(&c, "uname -r"));
    let host = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    assert!(guest.starts_with("6.1."), "guest kernel {guest:?}");
    assert_ne!(guest, host.trim(), "uname -r shows the host kernel");

    // 1 MiB + a bit of every byte value, through the overlay root.
    let data: Vec<u8> = (0..(1 << 20) + 4099).map(|i| (i * 7 % 251) as u8).collect();
    c.write_file("/root/data.bin", &data, Some(0o600))
        .expect("write_file");
    let back = c.read_file("/root/data.bin", 4 << 20).expect("read_file");
    assert_eq!(back.len(), data.len());
    assert!(back == data, "file came back different");
    assert_eq!(
        stdout(&sh(&c, "sha256sum < /root/data.bin | cut -c1-16")).len(),
        16
    );
    // The image itself is read-only; the overlay makes / writable.
    assert_eq!(stdout(&sh(&c, "touch /usr/bin/new && echo ok")), "ok");

    let pid = v.pid();
    assert!(pid.is_some());
    drop(c);
    v.destroy().expect("destroy");
    v.destroy().expect("destroy is idempotent");
    assert_gone(pid, &run_dir);
}

#[test]
fn snapshot_restore_first_exec_and_clock() {
    let Some(e) = env() else { return };
    let _g = serial();
    let t = Instant::now();
    let (mut v, c) = restore(e, "base", "restore-clock");
    // The fixup rode on the hello (protocol 2), not on a separate request.
    assert_eq!(c.hello.version, agent_sandbox::proto::PROTOCOL_VERSION);
    // The first exec also reports its cgroup (made on the restored VM's
    // first spawn) and that cgroup's limits.
    let out = sh(
        &c,
        "date +%s%N; uname -r; cg=$(cut -d: -f3 /proc/self/cgroup); echo $cg; \
         cat /sys/fs/cgroup$cg/pids.max /sys/fs/cgroup$cg/memory.oom.group",
    );
    eprintln!(
        "restore to first exec {:?} (incl. snapshot check)",
        t.elapsed()
    );
    let text = stdout(&out);
    let mut lines = text.lines();
    let guest_ns: i128 = lines
        .next()
        .and_then(|l| l.parse().ok())
        .expect("date output");
    let host_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_nanos() as i128;
    let skew = (host_ns - guest_ns).abs();
    assert!(
        skew < 1_000_000_000,
        "guest clock off by {} ms after the restore hello",
        skew / 1_000_000
    );
    assert!(lines.next().is_some_and(|l| l.starts_with("6.1.")));
    // Its own cgroup below the sandbox one, with the per-exec limits.
    let first_cg = lines.next().expect("cgroup line").to_string();
    assert!(first_cg.starts_with("/sandbox/x"), "{text}");
    let pids: u64 = lines
        .next()
        .and_then(|l| l.parse().ok())
        .unwrap_or_else(|| panic!("exec pids.max is a number: {text}"));
    // 15/16 of the sandbox's default 4096, so a bomb leaves the next exec room.
    assert_eq!(pids, 4096 - 4096 / 16, "{text}");
    assert_eq!(lines.next(), Some("1"), "memory.oom.group: {text}");
    // The next exec gets a fresh one; the first is gone.
    let next = stdout(&sh(
        &c,
        &format!(
            "cut -d: -f3 /proc/self/cgroup; test -e /sys/fs/cgroup{first_cg} && echo left || echo gone"
        ),
    ));
    let mut next = next.lines();
    let second_cg = next.next().unwrap_or_default();
    assert!(
        second_cg.starts_with("/sandbox/x") && second_cg != first_cg,
        "second exec in {second_cg:?}, first in {first_cg:?}"
    );
    assert_eq!(next.next(), Some("gone"), "first exec's cgroup removed");
    // The next exec's cgroup is made after an answer, not on the next
    // request: a child this exec leaves running sees the spare appear
    // beside its own (still populated) cgroup, and the next exec runs in it.
    let third_cg = stdout(&sh(
        &c,
        "cut -d: -f3 /proc/self/cgroup; \
         (for i in $(seq 100); do [ $(ls -d /sys/fs/cgroup/sandbox/x* | wc -l) -ge 2 ] && break; \
          sleep 0.1; done; ls -d /sys/fs/cgroup/sandbox/x* > /tmp/seen.new; mv /tmp/seen.new /tmp/seen) \
         >/dev/null 2>&1 &",
    ));
    // Waited for by file reads, which make no cgroup (an exec's own
    // cgroup would be the second entry).
    let deadline = Instant::now() + Duration::from_secs(30);
    let seen = loop {
        match c.read_file("/tmp/seen", 4096) {
            Ok(b) => break String::from_utf8_lossy(&b).into_owned(),
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            Err(err) => panic!("the detached child wrote no /tmp/seen: {err}"),
        }
    };
    let seen: Vec<String> = seen
        .lines()
        .map(|p| p.trim_start_matches("/sys/fs/cgroup").to_string())
        .collect();
    let fourth_cg = stdout(&sh(&c, "cut -d: -f3 /proc/self/cgroup"));
    assert!(
        seen.len() == 2 && seen.contains(&third_cg),
        "spare not made after the answer: {seen:?} (exec in {third_cg})"
    );
    assert!(
        fourth_cg != third_cg && seen.contains(&fourth_cg),
        "next exec in {fourth_cg}, not in the spare of {seen:?}"
    );
    // A second connection (after the first closes) works too.
    c.close();
    let c2 = connect_agent(v.as_mut(), false, AGENT_TIMEOUT).expect("second connection");
    assert_eq!(stdout(&sh(&c2, "echo again")), "again");
    let pid = v.pid();
    let run_dir = e.run_dir("restore-clock");
    v.destroy().expect("destroy");
    assert_gone(pid, &run_dir);
}

/// Waits until the guest stops making QEMU translate new code (the count
/// holds for 500 ms), at most 60 s; returns the count.
fn settled_blocks(v: &mut agent_sandbox::vm::qemu::QemuVm) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = v.translated_blocks().expect("info jit");
    loop {
        std::thread::sleep(Duration::from_millis(500));
        let n = v.translated_blocks().expect("info jit");
        if n == last || Instant::now() > deadline {
            return n;
        }
        last = n;
    }
}

/// Under TCG a restored guest's first exec pays for translating the whole
/// fork/exec/exit path. A restore hello asking for a warm-up has the
/// agent run one throwaway exec when the host stays silent; the client's
/// first command after such a pause then translates a fraction of that.
/// The warm-up leaves nothing behind: no registered process, no cgroup.
#[test]
fn idle_restored_guest_warms_the_exec_path_up() {
    use agent_sandbox::agent::{AgentClient, Started};
    let Some(e) = env() else { return };
    let _g = serial();
    let info = e.registry.ensure_snapshot("base").expect("snapshot");
    let mut blocks = Vec::new();
    for warm_up in [false, true] {
        let id = format!("warm-up-{warm_up}");
        let run_dir = e.run_dir(&id);
        let _ = std::fs::remove_dir_all(&run_dir);
        let cfg = info.vm_config(&id, run_dir.clone(), vm::VM_UID, vm::VM_GID);
        let mut v = e.backend.restore_vm(&cfg, &info.dir).expect("restore");
        if !v.translates_guest_code() {
            v.destroy().expect("destroy");
            skip!("under KVM no guest code is translated: no warm-up to test");
        }
        let s = Vm::connect_agent(&mut v, Instant::now() + AGENT_TIMEOUT).expect("agent socket");
        let c = AgentClient::connect_with(s, AGENT_TIMEOUT, Started::Restored { warm_up })
            .expect("hello");
        // The daemon pings a new session before answering its creation: a
        // ping does not count as the host being busy.
        c.ping(AGENT_TIMEOUT).expect("ping");
        let before = settled_blocks(&mut v);
        let out = c
            .exec(
                agent_sandbox::proto::ExecRequest {
                    argv: vec!["true".into()],
                    ..Default::default()
                },
                1024,
            )
            .expect("exec true");
        let after = v.translated_blocks().expect("info jit");
        assert_eq!(out.status.code, Some(0), "warm_up={warm_up}");
        // The warm-up's cgroup is gone: during an exec there is its own
        // cgroup only (the spare, refilled after the last exec, is the one
        // it took).
        let out = sh(&c, "ls -d /sys/fs/cgroup/sandbox/x* | wc -l");
        assert_eq!(stdout(&out), "1", "warm_up={warm_up}");
        let procs = c.simple(&agent_sandbox::proto::Request::ListProcs, AGENT_TIMEOUT);
        assert!(
            matches!(&procs, Ok(agent_sandbox::proto::Response::Procs { procs }) if procs.is_empty()),
            "warm_up={warm_up}: {procs:?}"
        );
        eprintln!(
            "warm_up={warm_up}: first exec after idle translated {} blocks",
            after - before
        );
        blocks.push(after - before);
        c.close();
        let pid = v.pid();
        v.destroy().expect("destroy");
        assert_gone(pid, &run_dir);
    }
    assert!(
        blocks[1] * 2 < blocks[0],
        "warm-up did not take the exec path's translation off the first command: \
         {} blocks without, {} with",
        blocks[0],
        blocks[1]
    );
}

#[test]
fn python_template_prints_4() {
    let Some(e) = env() else { return };
    let _g = serial();
    let (mut v, c) = restore(e, "python", "py-print");
    let t = Instant::now();
    let out = sh(&c, "python3 -c 'print(2+2)'");
    eprintln!("python3 -c 'print(2+2)' after restore: {:?}", t.elapsed());
    assert_eq!(
        stdout(&out),
        "4",
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    v.destroy().expect("destroy");
}

#[test]
fn pip_installs_a_local_wheel_into_the_root_fs() {
    let Some(e) = env() else { return };
    let tmp = tempfile::tempdir().expect("tempdir");
    let whl = common::make_wheel(tmp.path());
    let bytes = std::fs::read(&whl).expect("read wheel");
    let _g = serial();
    let (mut v, c) = restore(e, "python", "py-pip");
    c.write_file("/tmp/tinypkg-0.1-py3-none-any.whl", &bytes, None)
        .expect("copy wheel in");
    let out = sh(
        &c,
        "PIP_ROOT_USER_ACTION=ignore pip install -q --no-index /tmp/tinypkg-0.1-py3-none-any.whl && \
         python3 -c 'import tinypkg; print(tinypkg.ANSWER, tinypkg.__file__)'",
    );
    let text = stdout(&out);
    assert_eq!(
        out.status.code,
        Some(0),
        "pip failed: {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut words = text.split_whitespace();
    assert_eq!(words.next(), Some("42"), "{text}");
    let file = words.next().unwrap_or_default();
    assert!(
        file.starts_with("/usr/"),
        "installed outside the root fs: {file}"
    );
    v.destroy().expect("destroy");
}

/// Every template file is in the VM tests' image set, so a new template
/// is built and booted by them (`.ci/run` builds all of them anyway).
#[test]
fn every_template_is_built_by_the_vm_tests() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("images/templates");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|err| panic!("list {}: {err}", dir.display()))
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_str()?.strip_suffix(".json")?.to_string();
            (n != "schema").then_some(n)
        })
        .collect();
    files.sort();
    let mut built: Vec<String> = vm::TEMPLATES.iter().map(|t| t.to_string()).collect();
    built.sort();
    assert_eq!(
        built,
        files,
        "tests/common/vm.rs TEMPLATES vs {}",
        dir.display()
    );
}

/// A session of `template` as the daemon makes one (`{"template": ...}`):
/// the snapshot is made on first use (boot, warm commands, save), then
/// restored. Prints how long each took. Commands get the template's `env`
/// from the guest agent, which reads it from the image
/// (`/etc/agent-sandbox/template.json`), as a daemon session's do.
fn template_session(
    e: &VmEnv,
    template: &str,
    id: &str,
) -> (Box<dyn Vm>, agent_sandbox::agent::AgentClient) {
    let t = Instant::now();
    let info = e
        .registry
        .ensure_snapshot(template)
        .unwrap_or_else(|err| panic!("snapshot of {template}: {err}"));
    eprintln!(
        "{template}: snapshot {} in {:?} (rootfs {})",
        if info.rebuilt { "made" } else { "fresh" },
        t.elapsed(),
        info.rootfs.display()
    );
    let t = Instant::now();
    let (v, c) = restore(e, template, id);
    eprintln!("{template}: restore to agent hello {:?}", t.elapsed());
    (v, c)
}

fn assert_ok(out: &agent_sandbox::agent::ExecOutput, what: &str) {
    assert_eq!(
        out.status.code,
        Some(0),
        "{what}: {:?}; stdout: {}; stderr: {}",
        out.status,
        stdout(out),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn node_template_runs_node_and_npm() {
    let Some(e) = env() else { return };
    let _g = serial();
    let (mut v, c) = template_session(e, "node", "node-run");
    let t = Instant::now();
    let out = sh(&c, "node -e 'console.log(6*7)'");
    eprintln!("node: first command (node -e) {:?}", t.elapsed());
    assert_ok(&out, "node -e");
    assert_eq!(stdout(&out), "42");
    let t = Instant::now();
    let out = sh(&c, "npm --version");
    eprintln!("node: npm --version {:?}: {}", t.elapsed(), stdout(&out));
    assert_ok(&out, "npm --version");
    // A version, not an empty line or a banner.
    let version = stdout(&out);
    assert!(
        version.split('.').count() == 3 && version.split('.').all(|p| p.parse::<u32>().is_ok()),
        "npm --version printed {version:?}"
    );
    v.destroy().expect("destroy");
}

/// The `tests` of `template` with its `extends` chain applied, as
/// `images/template.sh resolve` prints them.
fn template_tests(template: &str) -> Vec<String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("images/template.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .args(["resolve", template])
        .output()
        .unwrap_or_else(|err| panic!("run {}: {err}", script.display()));
    assert!(
        out.status.success(),
        "template.sh resolve {template}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("resolved template");
    v["tests"]
        .as_array()
        .expect("tests")
        .iter()
        .map(|t| t.as_str().expect("test command").to_string())
        .collect()
}

/// The default template, a developer machine: its own tests and those of
/// base and python it extends (python, pip, venv, node, npm, gcc and g++
/// compile and run, make, git, jq, sqlite3, zip, the tools on PATH) pass in
/// a restored session, with the template's env as a session has it.
#[test]
fn dev_template_passes_its_tests() {
    let Some(e) = env() else { return };
    let _g = serial();
    let tests = template_tests("dev");
    assert!(tests.len() >= 10, "dev has {} tests", tests.len());
    let (mut v, c) = template_session(e, "dev", "dev-run");
    let out = sh(&c, "echo \"$PYTHONUNBUFFERED $NPM_CONFIG_FUND\"");
    assert_eq!(stdout(&out), "1 false", "the template's env");
    for cmd in &tests {
        let t = Instant::now();
        let out = vm::sh_within(&c, cmd, Duration::from_secs(300));
        eprintln!("dev: {} ms: {cmd}", t.elapsed().as_millis());
        assert_ok(&out, cmd);
    }
    v.destroy().expect("destroy");
}

#[test]
fn go_template_runs_a_hello_world() {
    let Some(e) = env() else { return };
    let _g = serial();
    let (mut v, c) = template_session(e, "go", "go-run");
    c.write_file(
        "/tmp/hello/hello.go",
        b"package main\n\nimport \"fmt\"\n\nfunc main() { fmt.Println(\"hello\") }\n",
        None,
    )
    .expect("write hello.go");
    // `go run` compiles and links under TCG: minutes on a loaded host.
    let t = Instant::now();
    let out = vm::sh_within(
        &c,
        "cd /tmp/hello && go run hello.go",
        Duration::from_secs(300),
    );
    eprintln!("go: first command (go run hello.go) {:?}", t.elapsed());
    assert_ok(&out, "go run hello.go");
    assert_eq!(stdout(&out), "hello");
    v.destroy().expect("destroy");
}

#[test]
fn rust_template_runs_a_hello_world() {
    let Some(e) = env() else { return };
    let _g = serial();
    let (mut v, c) = template_session(e, "rust", "rust-run");
    c.write_file(
        "/tmp/hello/Cargo.toml",
        b"[package]\nname = \"hello\"\nversion = \"0.1.0\"\nedition = \"2021\"\n",
        None,
    )
    .expect("write Cargo.toml");
    c.write_file(
        "/tmp/hello/src/main.rs",
        b"fn main() {\n    println!(\"hello from {}\", env!(\"CARGO_PKG_NAME\"));\n}\n",
        None,
    )
    .expect("write main.rs");
    // `cargo run` compiles and links under TCG: minutes on a loaded host.
    // Offline: the crate has no dependencies and the guest may have no net.
    let t = Instant::now();
    let out = vm::sh_within(
        &c,
        "cd /tmp/hello && cargo run -q --offline",
        Duration::from_secs(300),
    );
    eprintln!("rust: first command (cargo run) {:?}", t.elapsed());
    assert_ok(&out, "cargo run");
    assert_eq!(stdout(&out), "hello from hello");
    v.destroy().expect("destroy");
}

#[test]
fn vmm_killed_mid_exec_fails_fast_and_leaves_nothing() {
    let Some(e) = env() else { return };
    let _g = serial();
    let (mut v, c) = restore(e, "base", "killed");
    let pid = v.pid().expect("pid");
    let run_dir = e.run_dir("killed");
    let c2 = c.clone();
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::spawn(move || {
        let r = c2.exec(
            agent_sandbox::proto::ExecRequest {
                shell: Some("sleep 60".into()),
                ..Default::default()
            },
            1024,
        );
        let _ = tx.send(r);
    });
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: SIGKILL to the QEMU process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let t = Instant::now();
    let r = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("exec still hanging 10 s after the VMM died");
    assert!(r.is_err(), "exec succeeded on a dead VM: {r:?}");
    eprintln!(
        "exec failed {:?} after SIGKILL: {}",
        t.elapsed(),
        r.err().map(|e| e.to_string()).unwrap_or_default()
    );
    // The socket closes a moment before the process is marked dead.
    let until = Instant::now() + Duration::from_secs(2);
    while v.pid().is_some() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(v.pid().is_none(), "pid() still reports a dead VMM");
    v.destroy().expect("destroy after the VMM died");
    assert_gone(Some(pid), &run_dir);
}

#[test]
fn vmm_dying_or_hanging_at_boot_gives_a_clear_error_and_cleans_up() {
    let Some(e) = env() else { return };
    let _g = serial();
    // The kernel takes the last init=: one that exits makes it panic and
    // QEMU (-no-reboot) exit.
    let mut cfg = e.cold_config("dies-at-boot", "base", 256);
    cfg.cmdline_extra = "init=/bin/false".into();
    let t = Instant::now();
    let err = e.backend.boot(&cfg).err().expect("boot with a dying init");
    let msg = err.to_string();
    eprintln!("dying boot: {:?}: {msg}", t.elapsed());
    assert!(msg.contains("QEMU exited"), "{msg}");
    assert!(msg.contains("console:"), "no console tail: {msg}");
    assert!(!cfg.run_dir.exists());

    // An init that never exits and never prints READY: bounded by the boot timeout.
    let backend = QemuBackend::new(QemuConfig {
        timeouts: Timeouts {
            boot: Duration::from_secs(4),
            ..Timeouts::default()
        },
        accel_cache: Some(e.work.join("accel.json")),
        ..QemuConfig::default()
    });
    let mut cfg = e.cold_config("hangs-at-boot", "base", 256);
    cfg.cmdline_extra = "init=/bin/sleep 1000".into();
    let t = Instant::now();
    let err = backend.boot(&cfg).err().expect("boot with a silent init");
    let took = t.elapsed();
    let msg = err.to_string();
    eprintln!("hanging boot: {took:?}: {msg}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert!(msg.contains("READY"), "{msg}");
    assert!(!cfg.run_dir.exists());
}

#[test]
fn missing_or_corrupt_files_are_named_in_the_error() {
    let Some(e) = env() else { return };
    let _g = serial();
    let info = e.registry.ensure_snapshot("base").expect("snapshot");
    let tmp = tempfile::tempdir().expect("tempdir");

    // Missing rootfs image.
    let mut cfg = e.cold_config("bad-image", "base", 256);
    cfg.rootfs = tmp.path().join("nope.erofs");
    match e.backend.boot(&cfg) {
        Err(VmError::BadFile { path, .. }) => assert_eq!(path, cfg.rootfs),
        other => panic!("missing rootfs: {:?}", other.err()),
    }
    // A kernel that is not a kernel: QEMU refuses it, the error says so.
    let junk = tmp.path().join("vmlinux-junk");
    std::fs::write(&junk, vec![0x5au8; 4096]).expect("write junk");
    std::fs::set_permissions(&junk, std::os::unix::fs::PermissionsExt::from_mode(0o644))
        .expect("chmod");
    let mut cfg = e.cold_config("bad-kernel", "base", 256);
    cfg.kernel = junk.clone();
    let msg = e.backend.boot(&cfg).err().expect("junk kernel").to_string();
    eprintln!("junk kernel: {msg}");
    assert!(msg.contains("vmlinux-junk"), "{msg}");
    assert!(!cfg.run_dir.exists());

    // Snapshot copies to break.
    let copy = |name: &str| {
        let d = tmp.path().join(name);
        std::fs::create_dir_all(&d).expect("mkdir");
        for f in ["manifest.json", "state", "memory"] {
            std::fs::copy(info.dir.join(f), d.join(f)).expect("copy snapshot");
        }
        d
    };
    let restore_cfg = |id: &str| info.vm_config(id, e.run_dir(id), vm::VM_UID, vm::VM_GID);

    let d = copy("no-manifest");
    std::fs::remove_file(d.join("manifest.json")).expect("rm");
    match e.backend.restore(&restore_cfg("no-manifest"), &d) {
        Err(VmError::BadFile { path, .. }) => assert_eq!(path, d.join("manifest.json")),
        other => panic!("missing manifest: {:?}", other.err()),
    }

    let d = copy("no-state");
    std::fs::remove_file(d.join("state")).expect("rm");
    match e.backend.restore(&restore_cfg("no-state"), &d) {
        Err(VmError::StaleSnapshot { reason, .. }) => {
            assert!(
                reason.contains(&d.join("state").display().to_string()),
                "{reason}"
            )
        }
        other => panic!("missing state: {:?}", other.err()),
    }

    let d = copy("corrupt-state");
    let len = std::fs::metadata(d.join("state")).expect("stat").len() as usize;
    std::fs::write(d.join("state"), vec![0xa5u8; len]).expect("corrupt");
    let cfg = restore_cfg("corrupt-state");
    let t = Instant::now();
    match e.backend.restore(&cfg, &d) {
        Err(VmError::BadFile { path, problem, .. }) => {
            eprintln!("corrupt state ({:?}): {problem}", t.elapsed());
            assert_eq!(path, d.join("state"));
        }
        other => panic!("corrupt state: {:?}", other.err()),
    }
    assert!(!cfg.run_dir.exists(), "failed restore left its run dir");

    let d = copy("garbage-manifest");
    std::fs::write(d.join("manifest.json"), b"{ not json").expect("write");
    match e.backend.restore(&restore_cfg("garbage-manifest"), &d) {
        Err(VmError::BadFile { path, .. }) => assert_eq!(path, d.join("manifest.json")),
        other => panic!("garbage manifest: {:?}", other.err()),
    }
}

#[test]
fn stale_manifest_triggers_a_rebuild() {
    let Some(e) = env() else { return };
    let _g = serial();
    let shared = e.registry.ensure_snapshot("base").expect("snapshot");
    // A registry of its own, seeded with a copy of the shared snapshot.
    let state = e.work.join("state-stale");
    let _ = std::fs::remove_dir_all(&state);
    let mut rc = RegistryConfig::new(
        e.images_dir.join("templates"),
        e.cache_dir.clone(),
        state.clone(),
    );
    rc.run_dir = e.work.join("run");
    rc.uid = vm::VM_UID;
    rc.gid = vm::VM_GID;
    rc.pinned_kernel = Some(e.kernel.clone());
    rc.pinned_rootfs = e.rootfs.clone();
    let reg = Registry::new(rc, e.backend.clone() as Arc<dyn Backend>);
    let dir = reg.snapshot_dir("base");
    std::fs::create_dir_all(&dir).expect("mkdir");
    for f in ["manifest.json", "state", "memory"] {
        std::fs::copy(shared.dir.join(f), dir.join(f)).expect("copy");
    }
    assert_eq!(
        reg.snapshot_state("base").expect("state"),
        SnapshotState::Fresh
    );

    // Pretend it was made by another QEMU.
    let mut m = snapshot::Manifest::read(&dir).expect("manifest");
    m.vmm_version = "QEMU emulator version 0.1; accel=tcg".into();
    m.write(&dir).expect("write manifest");
    match reg.snapshot_state("base").expect("state") {
        SnapshotState::Stale(r) => assert!(r.contains("VMM"), "{r}"),
        s => panic!("expected stale, got {s:?}"),
    }
    match e.backend.restore(
        &shared.vm_config("stale", e.run_dir("stale"), vm::VM_UID, vm::VM_GID),
        &dir,
    ) {
        Err(VmError::StaleSnapshot { .. }) => {}
        other => panic!("restore of a stale snapshot: {:?}", other.err()),
    }
    let info = reg.ensure_snapshot("base").expect("rebuild");
    assert!(info.rebuilt, "a stale snapshot was not rebuilt");
    assert_eq!(
        reg.snapshot_state("base").expect("state"),
        SnapshotState::Fresh
    );
    let again = reg.ensure_snapshot("base").expect("ensure");
    assert!(!again.rebuilt, "a fresh snapshot was rebuilt");
    let listed = reg.list().expect("list");
    assert!(listed
        .iter()
        .any(|t| t.name == "base" && t.snapshot == SnapshotState::Fresh));
    let _ = std::fs::remove_dir_all(&state);
}

/// A backend whose boots take a while and fail, counting how many run at
/// once: what the snapshot builds of a registry do to their one network.
struct CountingBoots {
    active: std::sync::atomic::AtomicUsize,
    most: std::sync::atomic::AtomicUsize,
    boots: std::sync::atomic::AtomicUsize,
}

impl Backend for CountingBoots {
    fn name(&self) -> &'static str {
        "qemu"
    }
    fn vmm_version(&self) -> agent_sandbox::vm::Result<String> {
        Ok("counting 1".into())
    }
    fn boot(&self, _cfg: &agent_sandbox::vm::VmConfig) -> agent_sandbox::vm::Result<Box<dyn Vm>> {
        use std::sync::atomic::Ordering::SeqCst;
        let now = self.active.fetch_add(1, SeqCst) + 1;
        self.most.fetch_max(now, SeqCst);
        self.boots.fetch_add(1, SeqCst);
        std::thread::sleep(Duration::from_millis(300));
        self.active.fetch_sub(1, SeqCst);
        Err(VmError::Other("counting backend: no VM".into()))
    }
    fn prepare_restore(
        &self,
        _cfg: &agent_sandbox::vm::VmConfig,
        _dir: &Path,
    ) -> agent_sandbox::vm::Result<Box<dyn agent_sandbox::vm::PreparedRestore>> {
        Err(VmError::Other("counting backend: no restore".into()))
    }
}

/// Every snapshot VM of a registry uses its one network (one TAP, which
/// one VMM can attach to: Firecracker answered EBUSY when `serve` built
/// `dev` and `base` at once), so builds of two templates take turns.
#[test]
fn snapshot_builds_of_two_templates_take_turns() {
    let Some(e) = env() else { return };
    let backend = Arc::new(CountingBoots {
        active: Default::default(),
        most: Default::default(),
        boots: Default::default(),
    });
    let state = tempfile::tempdir().expect("tempdir");
    let mut rc = RegistryConfig::new(
        e.images_dir.join("templates"),
        e.cache_dir.clone(),
        state.path().to_path_buf(),
    );
    rc.run_dir = state.path().join("run");
    rc.pinned_kernel = Some(e.kernel.clone());
    rc.pinned_rootfs = e.rootfs.clone();
    let reg = Arc::new(Registry::new(rc, backend.clone()));
    let builds: Vec<_> = ["base", "python"]
        .into_iter()
        .map(|t| {
            let reg = reg.clone();
            std::thread::spawn(move || reg.ensure_snapshot(t).map(|_| ()))
        })
        .collect();
    for b in builds {
        let r = b.join().expect("build thread");
        assert!(r.is_err(), "the counting backend makes no snapshot");
    }
    use std::sync::atomic::Ordering::SeqCst;
    assert_eq!(backend.boots.load(SeqCst), 2, "both templates were built");
    assert_eq!(backend.most.load(SeqCst), 1, "two snapshot VMs ran at once");
}
