//! Checkpoints of running QEMU VMs (issue #21): a restored VM (a session)
//! and a booted one are saved while they run, go on running, and restore
//! (several times, in parallel) where they were: files in the RAM-backed
//! root and /workspace, a background process and its counter.

mod common;
#[path = "common/skip.rs"]
mod skip;
#[path = "common/vm.rs"]
mod vm;

use agent_sandbox::agent::AgentClient;
use agent_sandbox::vm::{connect_agent, snapshot, Backend, CheckpointStats, Vm, VmConfig};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use vm::{env, serial, sh, stdout, VmEnv};

const AGENT_TIMEOUT: Duration = Duration::from_secs(60);

/// A VM and its agent, destroyed on drop (also when the test fails).
struct Running {
    vm: Box<dyn Vm>,
    c: Option<AgentClient>,
}

impl Running {
    fn c(&self) -> &AgentClient {
        self.c.as_ref().expect("agent connection")
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.c = None;
        let _ = self.vm.destroy();
    }
}

/// A directory removed on drop, with the backend told to forget it.
struct Dir<'a>(PathBuf, &'a VmEnv);

impl Drop for Dir<'_> {
    fn drop(&mut self) {
        self.1.backend.forget_snapshot(&self.0);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn ckpt_dir<'a>(e: &'a VmEnv, name: &str) -> Dir<'a> {
    let d = e.work.join("checkpoints").join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.parent().expect("parent")).expect("checkpoints dir");
    Dir(d, e)
}

fn config_like(e: &VmEnv, like: &VmConfig, id: &str) -> VmConfig {
    let run_dir = e.run_dir(id);
    let _ = std::fs::remove_dir_all(&run_dir);
    VmConfig {
        id: id.to_string(),
        run_dir,
        ..like.clone()
    }
}

/// Restores one VM per id from `dir`, all at once, each on a thread of
/// its own. The threads stay until the VMs are destroyed: the direct
/// launcher's VMMs die with the thread that started them (PDEATHSIG; the
/// daemon's spawner has no such tie).
struct Parallel {
    vms: Vec<Running>,
    _release: std::sync::mpsc::Sender<()>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Drop for Parallel {
    fn drop(&mut self) {
        self.vms.clear();
        let (tx, _) = std::sync::mpsc::channel();
        self._release = tx;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl std::ops::Deref for Parallel {
    type Target = Vec<Running>;
    fn deref(&self) -> &Vec<Running> {
        &self.vms
    }
}

impl std::ops::DerefMut for Parallel {
    fn deref_mut(&mut self) -> &mut Vec<Running> {
        &mut self.vms
    }
}

fn parallel_restores(e: &'static VmEnv, like: &VmConfig, dir: &Path, ids: &[&str]) -> Parallel {
    let (release, hold) = std::sync::mpsc::channel::<()>();
    let hold = std::sync::Arc::new(std::sync::Mutex::new(hold));
    let (tx, rx) = std::sync::mpsc::channel();
    let threads = ids
        .iter()
        .map(|id| {
            let (like, dir, id) = (like.clone(), dir.to_path_buf(), id.to_string());
            let (tx, hold) = (tx.clone(), hold.clone());
            std::thread::spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    restore_from(e, &like, &dir, &id)
                }));
                let failed = r.is_err();
                let _ = tx.send(r.map_err(|_| id));
                if !failed {
                    // Until the sender is dropped (recv fails).
                    let _ = hold.lock().map(|h| h.recv());
                }
            })
        })
        .collect();
    drop(tx);
    let mut p = Parallel {
        vms: Vec::new(),
        _release: release,
        threads,
    };
    for _ in ids {
        match rx.recv() {
            Ok(Ok(r)) => p.vms.push(r),
            Ok(Err(id)) => panic!("parallel restore of {id} failed"),
            Err(_) => panic!("a restore thread vanished"),
        }
    }
    p
}

fn restore_from(e: &VmEnv, like: &VmConfig, dir: &Path, id: &str) -> Running {
    let cfg = config_like(e, like, id);
    let mut v = e
        .backend
        .restore(&cfg, dir)
        .unwrap_or_else(|err| panic!("restore {id} from {}: {err}", dir.display()));
    let c = connect_agent(v.as_mut(), true, AGENT_TIMEOUT)
        .unwrap_or_else(|err| panic!("agent of {id} after restore: {err}"));
    Running { vm: v, c: Some(c) }
}

/// Files in /workspace and /usr/local, and a shell counting in memory
/// into /tmp/count.
fn set_up_state(c: &AgentClient, tag: &str) {
    let out = sh(
        c,
        &format!(
            "mkdir -p /workspace && echo {tag} > /workspace/f && echo {tag} > /usr/local/f && \
             (i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; \
              sleep 0.1; done) >/dev/null 2>&1 & echo started"
        ),
    );
    assert_eq!(stdout(&out), "started", "{out:?}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while count(c) < 3 {
        assert!(Instant::now() < deadline, "the counter does not count");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn count(c: &AgentClient) -> u64 {
    c.read_file("/tmp/count", 64)
        .ok()
        .and_then(|b| String::from_utf8_lossy(&b).trim().parse().ok())
        .unwrap_or(0)
}

fn files(c: &AgentClient) -> String {
    stdout(&sh(c, "cat /workspace/f /usr/local/f | tr '\\n' ' '"))
}

/// The counter goes on from (at least) `from`.
fn assert_counting(c: &AgentClient, from: u64, who: &str) {
    let first = count(c);
    assert!(first >= from, "{who}: counter at {first}, was {from}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while count(c) <= first {
        assert!(
            Instant::now() < deadline,
            "{who}: the counter stopped at {first}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Files of the read-only root not read before (not in the page cache)
/// come from the disk.
fn assert_reads_disk(c: &AgentClient, who: &str) {
    let out = sh(
        c,
        "find /usr -type f -size -64k | tail -n 300 | xargs cat | wc -c",
    );
    assert_eq!(out.status.code, Some(0), "{who}: {out:?}");
    assert!(
        stdout(&out).parse::<u64>().unwrap_or(0) > 0,
        "{who}: {out:?}"
    );
}

fn checkpoint(r: &mut Running, dir: &Path, what: &str) -> CheckpointStats {
    let t = Instant::now();
    let s =
        r.vm.checkpoint(dir)
            .unwrap_or_else(|err| panic!("checkpoint of {what}: {err}"));
    let total = t.elapsed();
    println!(
        "FIGURE checkpoint_paused_{what} {:.1} ms",
        s.paused.as_secs_f64() * 1e3
    );
    println!(
        "FIGURE checkpoint_total_{what} {:.1} ms",
        total.as_secs_f64() * 1e3
    );
    println!(
        "FIGURE checkpoint_bytes_{what} {:.1} MiB",
        s.bytes as f64 / (1 << 20) as f64
    );
    assert!(s.bytes > 0 && s.paused > Duration::ZERO, "{s:?}");
    assert!(dir.join(snapshot::MANIFEST_FILE).is_file());
    s
}

/// `Pss` and `Private_Dirty` of a process, KiB.
fn pss_of(pid: i32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_else(|err| panic!("smaps_rollup of {pid}: {err}"));
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    (field("Pss:"), field("Private_Dirty:"))
}

fn ls(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// A small tmpfs, unmounted (and its mount point removed) on drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: PathBuf, size: &str) -> Tmpfs {
        std::fs::create_dir_all(&at).expect("mount point");
        let st = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&at)
            .status()
            .expect("run mount");
        assert!(st.success(), "mount tmpfs on {}", at.display());
        Tmpfs(at)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A session-like VM (restored from the base template's snapshot) is
/// checkpointed while it runs; two copies restored from the checkpoint in
/// parallel have its state; the source keeps its later changes; a copy's
/// own checkpoint restores too. Disk full and bad calls fail cleanly.
#[test]
fn restored_vm_checkpoint_restores_in_parallel_and_again() {
    let Some(e) = env() else { return };
    let _g = serial();
    let info = e.registry.ensure_snapshot("base").expect("base snapshot");
    let like = info.vm_config("ck-src", e.run_dir("ck-src"), vm::VM_UID, vm::VM_GID);
    let mut src = restore_from(e, &like, &info.dir, "ck-src");
    set_up_state(src.c(), "v1");

    let dir = ckpt_dir(e, "ck1");
    let at = count(src.c());
    checkpoint(&mut src, &dir.0, &format!("restored_{}mib", like.mem_mib));
    assert_eq!(
        ls(&dir.0),
        ["manifest.json", "memory", "state"],
        "{}",
        dir.0.display()
    );
    // The source runs on (its disk too: a migration deactivates block
    // devices, `cont` takes them back) and changes.
    assert_counting(src.c(), at, "source");
    assert_reads_disk(src.c(), "source");
    sh(src.c(), "echo v2 > /workspace/f; echo v2 > /usr/local/f");

    // Two copies at once.
    let t = Instant::now();
    let copies = parallel_restores(e, &like, &dir.0, &["ck-a", "ck-b"]);
    println!(
        "FIGURE checkpoint_restore_2_parallel {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    for (i, r) in copies.iter().enumerate() {
        assert_eq!(files(r.c()), "v1 v1", "copy {i}");
        assert_counting(r.c(), at, &format!("copy {i}"));
    }
    assert_eq!(files(src.c()), "v2 v2", "source");
    assert_counting(src.c(), at, "source");

    // The copies share the checkpoint's pages: what each holds beyond
    // them is what it dirtied.
    for (i, r) in copies.iter().enumerate() {
        let pid = r.vm.pid().expect("copy pid");
        let (pss, dirty) = pss_of(pid);
        println!(
            "FIGURE checkpoint_copy{i}_pss {:.1} MiB",
            pss as f64 / 1024.0
        );
        println!(
            "FIGURE checkpoint_copy{i}_private_dirty {:.1} MiB",
            dirty as f64 / 1024.0
        );
        println!(
            "FIGURE checkpoint_copy{i}_pss_beyond_dirty {:.1} MiB",
            pss.saturating_sub(dirty) as f64 / 1024.0
        );
    }

    // A checkpoint of a copy (a restore of a checkpoint) restores too.
    let mut copies = copies;
    let dir2 = ckpt_dir(e, "ck2");
    sh(copies[0].c(), "echo v3 > /workspace/f");
    let at2 = count(copies[0].c());
    checkpoint(&mut copies[0], &dir2.0, "of_a_checkpoint_copy");
    drop(copies);
    let again = restore_from(e, &like, &dir2.0, "ck-c");
    assert_eq!(
        files(again.c()),
        "v3 v1",
        "restore of the copy's checkpoint"
    );
    assert_counting(again.c(), at2, "restore of the copy's checkpoint");
    drop(again);

    // Disk full: an error naming the path, nothing left, the VM runs on.
    let full = Tmpfs::mount(e.work.join("checkpoints").join("full"), "16m");
    let target = full.0.join("ck");
    let err = src
        .vm
        .checkpoint(&target)
        .expect_err("a checkpoint into 16 MiB");
    let msg = err.to_string();
    println!("disk full: {msg}");
    assert!(msg.contains(&full.0.display().to_string()), "{msg}");
    assert!(ls(&full.0).is_empty(), "left behind: {:?}", ls(&full.0));
    assert_counting(src.c(), at, "source after a failed checkpoint");
    assert_eq!(files(src.c()), "v2 v2");
    // Into a directory that holds a checkpoint already: refused, untouched.
    let before = ls(&dir.0);
    let err = src.vm.checkpoint(&dir.0).expect_err("over a checkpoint");
    assert!(err.to_string().contains("already holds"), "{err}");
    assert_eq!(ls(&dir.0), before);
    // The failed checkpoint left a source that checkpoints fine.
    let dir3 = ckpt_dir(e, "ck3");
    checkpoint(&mut src, &dir3.0, "after_a_failure");
    drop(full);

    // Destroyed: a clear error.
    src.c = None;
    src.vm.destroy().expect("destroy");
    let err = src.vm.checkpoint(&dir3.0).expect_err("destroyed");
    assert!(err.to_string().contains("not running"), "{err}");
}

/// A booted VM (its RAM the daemon's memfd) checkpoints, runs on and
/// restores; the restore's own checkpoint (a 256 MiB guest) too. A VM
/// saved into a snapshot cannot be checkpointed.
#[test]
fn booted_vm_checkpoint_and_a_256_mib_restore() {
    let Some(e) = env() else { return };
    let _g = serial();
    let cfg = e.cold_config("ck-boot", "base", 256);
    let v = e.backend.boot(&cfg).expect("boot");
    let mut booted = Running { vm: v, c: None };
    booted.c = Some(connect_agent(booted.vm.as_mut(), false, AGENT_TIMEOUT).expect("agent"));
    set_up_state(booted.c(), "b1");
    let dir = ckpt_dir(e, "ck-boot");
    let at = count(booted.c());
    checkpoint(&mut booted, &dir.0, "booted_256mib");
    assert_counting(booted.c(), at, "booted source");
    assert_reads_disk(booted.c(), "booted source");
    sh(booted.c(), "echo b2 > /workspace/f");

    let mut r = restore_from(e, &cfg, &dir.0, "ck-boot-r");
    assert_eq!(files(r.c()), "b1 b1");
    assert_counting(r.c(), at, "restore of the booted VM's checkpoint");
    assert_eq!(files(booted.c()), "b2 b1");

    // A fresh 256 MiB restore: the figure the issue's target names.
    let dir2 = ckpt_dir(e, "ck-boot-r");
    let at2 = count(r.c());
    let s = checkpoint(&mut r, &dir2.0, "restored_256mib");
    println!(
        "256 MiB restored guest paused {:?} (target < 150 ms)",
        s.paused
    );
    let dir3 = ckpt_dir(e, "ck-boot-r-again");
    checkpoint(&mut r, &dir3.0, "restored_256mib_again");
    drop(r);
    let r2 = restore_from(e, &cfg, &dir2.0, "ck-boot-r2");
    assert_eq!(files(r2.c()), "b1 b1");
    assert_counting(r2.c(), at2, "second generation");
    drop(r2);

    // Saved into a snapshot: its RAM belongs to it.
    let snap = ckpt_dir(e, "ck-boot-snap");
    booted.c = None;
    booted.vm.snapshot(&snap.0).expect("snapshot");
    let err = booted
        .vm
        .checkpoint(&e.work.join("checkpoints").join("never"))
        .expect_err("checkpoint after snapshot");
    assert!(err.to_string().contains("already saved"), "{err}");
    assert!(!e.work.join("checkpoints").join("never").exists());
}
