//! Audited execs in real guests (issue #26): the process tree from the
//! kernel's process events connector and the file changes from the
//! overlay's upper dir, as the agent reports them in the exit status.
//! QEMU under TCG: slow, one VM at a time.

mod common;
#[path = "common/skip.rs"]
mod skip;
#[path = "common/vm.rs"]
mod vm;

use agent_sandbox::agent::{AgentClient, ExecOutput};
use agent_sandbox::proto::audit::limits;
use agent_sandbox::proto::{
    ExecAudit, ExecRequest, FileChange, FileChangeKind, FileType, ProcEvent, ProcEventKind,
};
use agent_sandbox::vm::{connect_agent, Backend, Vm};
use std::time::{Duration, Instant};
use vm::{env, serial, sh, stdout, VmEnv};

const AGENT_TIMEOUT: Duration = Duration::from_secs(60);

fn restore(e: &VmEnv, template: &str, id: &str) -> (Box<dyn Vm>, AgentClient) {
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

fn audited(c: &AgentClient, cmd: &str, uid: Option<u32>) -> (ExecOutput, ExecAudit) {
    let t = Instant::now();
    let out = c
        .exec(
            ExecRequest {
                shell: Some(cmd.to_string()),
                timeout_ms: Some(300_000),
                uid,
                audit: true,
                ..Default::default()
            },
            1 << 20,
        )
        .unwrap_or_else(|e| panic!("exec {cmd:?}: {e}"));
    assert_eq!(
        out.status.code,
        Some(0),
        "{cmd:?}: stderr {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let a = out
        .status
        .audit
        .clone()
        .unwrap_or_else(|| panic!("{cmd:?}: no audit in {:?}", out.status));
    eprintln!(
        "audited {cmd:?}: {:?}, {} events (+{} dropped), {} files (+{} dropped), notes {:?}",
        t.elapsed(),
        a.procs.len(),
        a.procs_dropped,
        a.files.len(),
        a.files_dropped,
        a.notes
    );
    (out, a)
}

fn argv_of(e: &ProcEvent) -> Vec<&str> {
    e.argv
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(String::as_str)
        .collect()
}

fn find(a: &ExecAudit, kind: ProcEventKind, pid: i32) -> &ProcEvent {
    a.procs
        .iter()
        .find(|e| e.kind == kind && e.pid == pid)
        .unwrap_or_else(|| panic!("no {kind:?} event of pid {pid} in {:#?}", a.procs))
}

#[test]
fn audited_exec_reports_its_process_tree_and_a_flood_is_bounded() {
    let Some(e) = env() else { return };
    let _g = serial();
    let (mut v, c) = restore(e, "python", "audit-procs");
    assert!(
        c.hello.capabilities.iter().any(|s| s == "exec.audit"),
        "capabilities {:?}",
        c.hello.capabilities
    );

    // Not asked: nothing comes back.
    let plain = sh(&c, "true");
    assert_eq!(plain.status.audit, None);

    let script = "(sleep 0.1; true) & ls / >/dev/null; \
                  python3 -c 'import os; print(os.getpid(), flush=True); p = os.fork(); os._exit(3) if p == 0 else print(p, os.waitpid(p, 0)[1] >> 8)'; \
                  wait; echo root $$";
    let (out, a) = audited(&c, script, None);
    assert!(a.procs_tracked, "notes: {:?}", a.notes);
    assert_eq!(a.procs_dropped, 0);
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    let py: i32 = lines[0].parse().expect("python pid");
    let (child, child_code) = lines[1].split_once(' ').expect("child line");
    let child: i32 = child.parse().expect("child pid");
    assert_eq!(child_code, "3");
    let root: i32 = lines[2]
        .strip_prefix("root ")
        .and_then(|s| s.parse().ok())
        .expect("root pid");

    // The root: forked by the agent (PID 1), runs sh -c, exits 0.
    let f = find(&a, ProcEventKind::Fork, root);
    assert_eq!(f.ppid, 1);
    assert_eq!(a.procs[0], *f, "the root's fork comes first");
    let x = find(&a, ProcEventKind::Exec, root);
    let xa = argv_of(x);
    assert_eq!(xa[..2], ["/bin/sh", "-c"]);
    let cut = &script[..script.len().min(limits::MAX_ARG_BYTES)];
    assert_eq!(xa[2], cut);
    assert_eq!(x.argv_truncated, script.len() > limits::MAX_ARG_BYTES);
    assert_eq!(x.uid, Some(0));
    let end = find(&a, ProcEventKind::Exit, root);
    assert_eq!(end.exit_code, Some(0));
    // ls: a child of the root.
    let ls = a
        .procs
        .iter()
        .find(|e| e.kind == ProcEventKind::Exec && argv_of(e) == ["ls", "/"])
        .unwrap_or_else(|| panic!("no exec of ls / in {:#?}", a.procs));
    assert_eq!(ls.ppid, root);
    assert_eq!(find(&a, ProcEventKind::Fork, ls.pid).ppid, root);
    // sleep: in a subshell the root forked.
    let sl = a
        .procs
        .iter()
        .find(|e| e.kind == ProcEventKind::Exec && argv_of(e) == ["sleep", "0.1"])
        .unwrap_or_else(|| panic!("no exec of sleep in {:#?}", a.procs));
    let sub = find(&a, ProcEventKind::Fork, sl.pid).ppid;
    assert_eq!(find(&a, ProcEventKind::Fork, sub).ppid, root);
    // python3, its fork and the child's exit code.
    let pe = find(&a, ProcEventKind::Exec, py);
    assert_eq!(pe.ppid, root);
    assert!(argv_of(pe)[0].starts_with("python3"), "{pe:?}");
    assert_eq!(find(&a, ProcEventKind::Fork, child).ppid, py);
    let ce = find(&a, ProcEventKind::Exit, child);
    assert_eq!((ce.exit_code, ce.signal, ce.ppid), (Some(3), None, py));
    // Times run from the exec's start, in order.
    assert!(a.procs.windows(2).all(|w| w[0].t_ms <= w[1].t_ms));
    assert!(end.t_ms < 60_000);

    // Another uid: the process's uid change and its exec show it.
    let (_, a) = audited(&c, "id -u", Some(1000));
    let x = a
        .procs
        .iter()
        .find(|e| e.kind == ProcEventKind::Exec && argv_of(e).first() == Some(&"/bin/sh"))
        .expect("exec of the root");
    assert_eq!(x.uid, Some(1000));
    assert!(
        a.procs
            .iter()
            .any(|e| e.kind == ProcEventKind::Uid && e.uid == Some(1000)),
        "{:#?}",
        a.procs
    );
    let id = a
        .procs
        .iter()
        .find(|e| e.kind == ProcEventKind::Exec && argv_of(e) == ["id", "-u"])
        .expect("exec of id");
    assert_eq!(id.uid, Some(1000));

    // What auditing costs: the same commands without the flag.
    let flood = "i=0; while [ $i -lt 5000 ]; do (exit 0); i=$((i+1)); done";
    let t = Instant::now();
    let o = sh(&c, flood);
    assert_eq!((o.status.code, &o.status.audit), (Some(0), &None));
    eprintln!("unaudited flood: {:?}", t.elapsed());
    let t = Instant::now();
    for _ in 0..10 {
        sh(&c, "true");
    }
    eprintln!("unaudited true: {:?} each", t.elapsed() / 10);
    let t = Instant::now();
    for _ in 0..10 {
        audited(&c, "true", None);
    }
    eprintln!("audited true: {:?} each", t.elapsed() / 10);

    // A flood: 5000 processes give a bounded list and a count.
    let (_, a) = audited(
        &c,
        "i=0; while [ $i -lt 5000 ]; do (exit 0); i=$((i+1)); done",
        None,
    );
    assert_eq!(a.procs.len(), limits::MAX_PROC_EVENTS);
    let overrun = a.notes.iter().any(|n| n.contains("overrun"));
    assert!(
        a.procs_dropped as usize + a.procs.len() >= 2 * 5000 || overrun,
        "dropped {} with notes {:?}",
        a.procs_dropped,
        a.notes
    );
    assert!(a.procs_dropped >= 5000, "dropped {}", a.procs_dropped);
    let bytes = serde_json::to_vec(&a).unwrap().len();
    assert!(bytes <= limits::MAX_BYTES, "{bytes} bytes");

    // After the flood, an unaudited exec still reports nothing and a small
    // audited one only its own processes.
    assert_eq!(sh(&c, "true").status.audit, None);
    let (_, a) = audited(&c, "true", None);
    assert!(a.procs.len() <= 3, "{:#?}", a.procs);
    v.destroy().expect("destroy");
}

fn change<'a>(a: &'a ExecAudit, path: &str) -> &'a FileChange {
    a.files
        .iter()
        .find(|f| f.path == path)
        .unwrap_or_else(|| panic!("no change of {path} in {:#?}", a.files))
}

fn guest_sha(c: &AgentClient, path: &str) -> String {
    stdout(&sh(c, &format!("sha256sum {path} | cut -d' ' -f1")))
}

#[test]
fn audited_exec_reports_file_changes_with_hashes_and_diffs() {
    let Some(e) = env() else { return };
    let _g = serial();
    let (mut v, c) = restore(e, "base", "audit-files");

    // Before anything audited: a file changed by an unaudited exec, and a
    // secret file as the daemon places one.
    sh(&c, "echo before > /workspace/unaudited.txt");
    c.write_file("/run/secrets/token", b"s3cret-value\n", Some(0o400))
        .expect("secret file");

    let (_, a) = audited(
        &c,
        "echo hello > /workspace/a.txt; echo tmp > /tmp/t.txt; \
         head -c 3000 /dev/urandom > /workspace/bin.dat; mkdir /workspace/d; \
         cat /run/secrets/token > /dev/null; echo extra > /run/secrets/other; \
         ln -s /run/secrets/token /workspace/link",
        None,
    );
    assert!(a.files_tracked, "notes {:?}", a.notes);
    let f = change(&a, "/workspace/a.txt");
    assert_eq!(f.change, FileChangeKind::Created);
    assert_eq!(f.size, Some(6));
    assert_eq!(
        f.sha256.as_deref(),
        Some(guest_sha(&c, "/workspace/a.txt").as_str())
    );
    let d = f.diff.as_deref().expect("diff of a created text file");
    assert!(d.contains("--- /dev/null") && d.contains("+hello"), "{d}");
    let t = change(&a, "/tmp/t.txt");
    assert_eq!(t.change, FileChangeKind::Created);
    assert_eq!(
        t.sha256.as_deref(),
        Some(guest_sha(&c, "/tmp/t.txt").as_str())
    );
    let b = change(&a, "/workspace/bin.dat");
    assert_eq!(b.size, Some(3000));
    assert_eq!(
        b.sha256.as_deref(),
        Some(guest_sha(&c, "/workspace/bin.dat").as_str())
    );
    assert_eq!(b.diff, None, "binary: no diff");
    assert_eq!(change(&a, "/workspace/d").file_type, FileType::Dir);
    let l = change(&a, "/workspace/link");
    assert_eq!(l.file_type, FileType::Symlink);
    assert_eq!(l.sha256, None);
    let json = serde_json::to_string(&a).unwrap();
    assert!(
        !json.contains("s3cret"),
        "secret contents in the record: {json}"
    );
    assert!(
        a.files.iter().all(|f| !f.path.starts_with("/run")),
        "{:#?}",
        a.files
    );

    // Modify an image file, a file of the earlier audited exec, one only
    // an unaudited exec wrote; delete one of the image and one of ours.
    let (_, a) = audited(
        &c,
        "echo more >> /etc/hostname; echo world > /workspace/a.txt; \
         echo after > /workspace/unaudited.txt; rm /etc/agent-sandbox/template.json; \
         rm /workspace/bin.dat; rm /run/secrets/other; cat /run/secrets/token >/dev/null",
        None,
    );
    let h = change(&a, "/etc/hostname");
    assert_eq!(h.change, FileChangeKind::Modified);
    assert_eq!(
        h.sha256.as_deref(),
        Some(guest_sha(&c, "/etc/hostname").as_str())
    );
    let d = h.diff.as_deref().expect("diff against the image's copy");
    assert!(
        d.contains("--- a/etc/hostname") && d.contains(" sandbox") && d.contains("+more"),
        "{d}"
    );
    let w = change(&a, "/workspace/a.txt");
    assert_eq!(w.change, FileChangeKind::Modified);
    let d = w.diff.as_deref().expect("diff against the cached copy");
    assert!(d.contains("-hello") && d.contains("+world"), "{d}");
    let u = change(&a, "/workspace/unaudited.txt");
    assert!(u.diff_unavailable && u.diff.is_none(), "{u:?}");
    assert!(u.sha256.is_some());
    let t = change(&a, "/etc/agent-sandbox/template.json");
    assert_eq!(t.change, FileChangeKind::Deleted);
    assert_eq!(t.file_type, FileType::File);
    let b = change(&a, "/workspace/bin.dat");
    assert_eq!((b.change, b.size), (FileChangeKind::Deleted, None));
    assert!(a.files.iter().all(|f| !f.path.starts_with("/run")));
    assert!(!serde_json::to_string(&a).unwrap().contains("s3cret"));
    // Copy-up parents are not changes of their own.
    assert!(a.files.iter().all(|f| f.path != "/etc"), "{:#?}", a.files);

    // Many paths: a bounded list and a count.
    let (_, a) = audited(
        &c,
        "mkdir /workspace/many && cd /workspace/many && i=0; while [ $i -lt 300 ]; do echo $i > f$i; i=$((i+1)); done",
        None,
    );
    assert_eq!(a.files.len(), limits::MAX_FILES);
    assert_eq!(a.files.len() as u64 + a.files_dropped, 301);

    // Unaudited: nothing.
    assert_eq!(sh(&c, "echo x > /workspace/z").status.audit, None);
    v.destroy().expect("destroy");
}
