//! The real guest agent binary, driven over a Unix socket by the host's
//! protocol client (and, for malformed input, by raw bytes).

mod common;
#[path = "common/skip.rs"]
mod skip;

use agent_sandbox::agent::{ClientError, Inbound};
use agent_sandbox::proto::{
    self, channel, encode_frame, encode_json, ErrorCode, Event, ExecRequest, FileType, FrameReader,
    Hello, Kind, PtySize, Request, Response,
};
use common::{marker, procs_with, sleepers, wait_until, TestAgent};
use std::collections::BTreeMap;
use std::io::Write;
use std::time::{Duration, Instant};

fn sh(cmd: &str) -> ExecRequest {
    ExecRequest {
        shell: Some(cmd.into()),
        ..Default::default()
    }
}

fn argv(a: &[&str]) -> ExecRequest {
    ExecRequest {
        argv: a.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

const MAX: usize = 256 << 20;

#[test]
fn exec_basics_env_cwd_stderr_and_exit_codes() {
    let a = TestAgent::start();
    let c = a.client();
    assert_eq!(c.hello.version, proto::PROTOCOL_VERSION);
    assert!(c.hello.capabilities.iter().any(|s| s == "exec"));

    let mut r = argv(&["echo", "hello", "world"]);
    r.notify_start = true;
    let out = c.exec(r, MAX).unwrap();
    assert_eq!(out.stdout, b"hello world\n");
    assert_eq!(out.status.code, Some(0));
    assert!(out.pid > 0, "notify_start delivers the pid");
    // Without notify_start, no event: the answer is all there is.
    let out = c.exec(argv(&["true"]), MAX).unwrap();
    assert_eq!((out.pid, out.status.code), (0, Some(0)));

    let mut r = sh("echo out; echo err >&2; exit 3");
    r.env = BTreeMap::from([("FOO".into(), "bar".into())]);
    let out = c.exec(r, MAX).unwrap();
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
    assert_eq!(out.status.code, Some(3));

    let mut r = sh("printf %s \"$FOO\"; pwd");
    r.env = BTreeMap::from([("FOO".into(), "bar".into())]);
    let out = c.exec(r, MAX).unwrap();
    let ws = a.workspace.canonicalize().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("bar{}\n", ws.display())
    );

    // cwd relative to the workspace.
    std::fs::create_dir_all(a.workspace.join("sub")).unwrap();
    let mut r = argv(&["pwd"]);
    r.cwd = Some("sub".into());
    let out = c.exec(r, MAX).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        ws.join("sub").display().to_string()
    );

    // Killed by a signal.
    let out = c.exec(sh("kill -TERM $$"), MAX).unwrap();
    assert_eq!(out.status.signal, Some(libc::SIGTERM));
    assert_eq!(out.status.code, None);

    // Errors are typed.
    match c.exec(argv(&["definitely-not-a-command-xyz"]), MAX) {
        Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::SpawnFailed),
        other => panic!("expected spawn_failed, got {other:?}"),
    }
    // execve itself failing (found no file, or one it may not run) is
    // reported by the child of the vfork spawn, which is then reaped.
    std::fs::write(a.workspace.join("not-executable"), "#!/bin/sh\n").unwrap();
    for prog in ["/definitely/not/here", "./not-executable"] {
        match c.exec(argv(&[prog]), MAX) {
            Err(ClientError::Agent(e)) => {
                assert_eq!(e.code, ErrorCode::SpawnFailed, "{prog}: {e}")
            }
            other => panic!("{prog}: expected spawn_failed, got {other:?}"),
        }
    }
    // The same through the identity-changing path (a vfork-style clone3).
    let mut r = argv(&["/definitely/not/here"]);
    r.uid = Some(65534);
    match c.exec(r, MAX) {
        Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::SpawnFailed, "{e}"),
        other => panic!("expected spawn_failed, got {other:?}"),
    }
    let zombies = zombie_children(a.pid());
    assert!(
        zombies.is_empty(),
        "zombies after failed spawns: {zombies:?}"
    );
    // uid/gid: the child takes them with raw syscalls (it shares the
    // agent's memory until it execs).
    // SAFETY: plain getter.
    if unsafe { libc::geteuid() } == 0 {
        let mut r = argv(&["sh", "-c", "echo $(id -u) $(id -g) $(id -G)"]);
        r.uid = Some(65534);
        r.gid = Some(65533);
        let out = c.exec(r, MAX).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "65534 65533 65533"
        );
        // And the agent itself kept its identity.
        let out = c.exec(argv(&["id", "-u"]), MAX).unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0");
    }
    let mut r = argv(&["true"]);
    r.cwd = Some("/nonexistent-dir".into());
    match c.exec(r, MAX) {
        Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::NotFound),
        other => panic!("expected not_found, got {other:?}"),
    }
    match c.exec(ExecRequest::default(), MAX) {
        Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::Invalid),
        other => panic!("expected invalid, got {other:?}"),
    }
    // The connection still works after all of that.
    c.ping(Duration::from_secs(5)).unwrap();
}

#[test]
fn hundred_concurrent_execs() {
    let a = TestAgent::start();
    let c = a.client();
    let mut calls = Vec::new();
    for i in 0..100 {
        let call = c
            .call(&Request::Exec(sh(&format!("sleep 1; echo {i}"))))
            .unwrap();
        calls.push((i, call));
    }
    let t = Instant::now();
    for (i, mut call) in calls {
        let mut stdout = Vec::new();
        loop {
            match call.recv().unwrap() {
                Inbound::Data { channel: 1, bytes } => stdout.extend(bytes),
                Inbound::Response(Response::Exited(st)) => {
                    assert_eq!(st.code, Some(0));
                    break;
                }
                Inbound::Error(e) => panic!("exec {i}: {e}"),
                _ => {}
            }
        }
        assert_eq!(String::from_utf8(stdout).unwrap(), format!("{i}\n"));
    }
    // 100 x 1 s run concurrently, not one after another (100 s) nor a few
    // at a time: the bound is far above a loaded host's ~1-2 s.
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t.elapsed()
    );
}

fn seq_bytes(n: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(110 << 20);
    for i in 1..=n {
        writeln!(v, "{i}").unwrap();
    }
    v
}

#[test]
fn hundred_mib_stdout_arrives_complete_and_in_order() {
    let a = TestAgent::start();
    let c = a.client();
    let n = 13_000_000u64; // ~105 MB of text
    let expected = seq_bytes(n);
    assert!(expected.len() > 100 << 20);
    let out = c.exec(argv(&["seq", "1", &n.to_string()]), MAX).unwrap();
    assert_eq!(out.status.code, Some(0));
    assert_eq!(out.stdout.len(), expected.len());
    assert!(out.stdout == expected, "stream differs from seq output");
}

#[test]
fn slow_reader_applies_backpressure_not_memory() {
    // A reader that stops consuming must stall the producer: the agent
    // may not buffer more than the window.
    let a = TestAgent::start();
    let c = a.client();
    let m = marker();
    let mut call = c
        .call(&Request::Exec(sh(&format!(
            "exec yes {m}-backpressure-line-padding-padding-padding"
        ))))
        .unwrap();
    // Read nothing for a while.
    std::thread::sleep(Duration::from_millis(700));
    let agent_rss = rss_kib(a.pid());
    // Credit is 1 MiB, the pipe 1 MiB: the agent holds at most a chunk.
    assert!(agent_rss < 64 * 1024, "agent RSS grew to {agent_rss} KiB");
    let (received, _) = c.traffic();
    assert!(
        received < 4 << 20,
        "{received} bytes arrived although nobody granted credit"
    );
    // Now consume some and cancel.
    let mut got = 0usize;
    while got < 8 << 20 {
        if let Inbound::Data { bytes, .. } = call.recv().unwrap() {
            got += bytes.len();
        }
    }
    call.cancel().unwrap();
    loop {
        match call.recv().unwrap() {
            Inbound::Error(e) => {
                assert_eq!(e.code, ErrorCode::Cancelled);
                break;
            }
            Inbound::Response(r) => panic!("expected cancel, got {r:?}"),
            _ => {}
        }
    }
    assert!(wait_until(Duration::from_secs(5), || procs_with(&m).is_empty()));
}

fn rss_kib(pid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[test]
fn stdin_round_trip() {
    let a = TestAgent::start();
    let c = a.client();
    let mut r = argv(&["cat"]);
    r.stdin = true;
    let mut call = c.call(&Request::Exec(r)).unwrap();
    // More than the window, so credit must flow back.
    let data: Vec<u8> = (0..(3u32 << 20)).map(|i| (i * 7 % 251) as u8).collect();
    let sender = {
        let data = data.clone();
        let tx = call.sender();
        std::thread::spawn(move || {
            tx.send_all(&data).unwrap();
            tx.send_eof().unwrap();
        })
    };
    let mut out = Vec::new();
    loop {
        match call.recv().unwrap() {
            Inbound::Data { bytes, .. } => out.extend(bytes),
            Inbound::Response(Response::Exited(st)) => {
                assert_eq!(st.code, Some(0));
                break;
            }
            Inbound::Error(e) => panic!("{e}"),
            _ => {}
        }
    }
    sender.join().unwrap();
    assert_eq!(out.len(), data.len());
    assert!(out == data);
}

#[test]
fn timeout_and_cancel_kill_the_whole_group() {
    let a = TestAgent::start();
    let c = a.client();
    let m = marker();
    // A child and a grandchild, both sleeping.
    let mut r = sh(&format!("sleep {m} & sh -c 'sleep {m}' ; wait"));
    r.timeout_ms = Some(500);
    let t = Instant::now();
    let out = c.exec(r, MAX).unwrap();
    assert!(out.status.timed_out);
    assert_eq!(out.status.signal, Some(libc::SIGKILL));
    // Killed at its 0.5 s timeout, not run for its ~10^5 s: generous.
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    assert!(
        wait_until(Duration::from_secs(5), || procs_with(&m).is_empty()),
        "processes left behind: {:?}",
        procs_with(&m)
    );

    // Cancel.
    let m2 = marker();
    let mut call = c
        .call(&Request::Exec(sh(&format!(
            "sleep {m2} & sleep {m2}; wait"
        ))))
        .unwrap();
    assert!(wait_until(Duration::from_secs(5), || sleepers(&m2) == 2));
    call.cancel().unwrap();
    match call.finish() {
        Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::Cancelled),
        other => panic!("expected cancelled, got {other:?}"),
    }
    assert!(wait_until(Duration::from_secs(5), || procs_with(&m2).is_empty()));

    // Dropping a connection kills its foreground processes too.
    let m3 = marker();
    let c2 = a.client();
    let _call = c2.call(&Request::Exec(sh(&format!("sleep {m3}")))).unwrap();
    assert!(wait_until(Duration::from_secs(5), || sleepers(&m3) == 1));
    c2.close();
    assert!(wait_until(Duration::from_secs(5), || procs_with(&m3).is_empty()));
    // And the agent reaps everything: no zombies of ours. (The last sleep
    // is already gone from procs_with once it is a zombie; its reap by the
    // pump or the reaper thread may come a moment later.)
    assert!(
        wait_until(Duration::from_secs(5), || zombie_children(a.pid())
            .is_empty()),
        "zombies: {:?}",
        zombie_children(a.pid())
    );
}

/// A process that is SIGKILLed but slow to die (here: held by a tracer at
/// its exit; in a guest: thousands of fork-bomb processes in memory
/// reclaim) does not hold its exec's answer: the answer comes a short
/// grace after the kill, and the process is reaped once it is gone.
#[test]
fn killed_process_slow_to_die_is_answered_then_reaped() {
    const PTRACE_SEIZE: libc::c_uint = 0x4206;
    const PTRACE_O_TRACEEXIT: libc::c_ulong = 0x40;
    let a = TestAgent::start();
    let c = a.client();
    let m = marker();
    let mut r = argv(&["sleep", &m]);
    r.timeout_ms = Some(1000);
    r.notify_start = true;
    let t = Instant::now();
    let mut call = c.call(&Request::Exec(r)).unwrap();
    let pid = match call.recv().unwrap() {
        Inbound::Event(Event::Started { pid, .. }) => pid,
        other => panic!("expected started, got {other:?}"),
    };
    // SAFETY: ptrace with integer arguments on a process we may trace.
    let seized = unsafe {
        libc::ptrace(
            PTRACE_SEIZE,
            pid,
            std::ptr::null_mut::<libc::c_void>(),
            PTRACE_O_TRACEEXIT,
        )
    };
    if seized < 0 {
        skip!(
            "cannot trace the agent's child: {}",
            std::io::Error::last_os_error()
        );
    }
    let st = match call.finish().unwrap() {
        Response::Exited(st) => st,
        other => panic!("expected exited, got {other:?}"),
    };
    let took = t.elapsed();
    assert!(st.timed_out, "{st:?}");
    assert_eq!(st.signal, Some(libc::SIGKILL), "{st:?}");
    // Timeout (1 s) + the agent's grace (2 s) for the reap: the answer
    // waited that long, and then came although the process is still
    // there (held until the detach below; without the grace, never).
    assert!(
        took >= Duration::from_millis(2900) && took < Duration::from_secs(30),
        "answered after {took:?}"
    );
    // Still held at its exit: answered before it was gone.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat
        .rsplit_once(')')
        .map(|(_, r)| r.trim_start().chars().next());
    assert_eq!(state, Some(Some('t')), "{stat}");
    // SAFETY: as above; the tracee is in its exit stop.
    let detached = unsafe {
        libc::ptrace(
            libc::PTRACE_DETACH,
            pid,
            std::ptr::null_mut::<libc::c_void>(),
            0,
        )
    };
    assert_eq!(detached, 0, "{}", std::io::Error::last_os_error());
    assert!(
        wait_until(Duration::from_secs(5), || !std::path::Path::new(&format!(
            "/proc/{pid}"
        ))
        .exists()),
        "pid {pid} not reaped after it died"
    );
    let out = c.exec(argv(&["echo", "still here"]), MAX).unwrap();
    assert_eq!(out.stdout, b"still here\n");
}

fn zombie_children(ppid: i32) -> Vec<i32> {
    let mut z = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        if let Some((_, rest)) = stat.rsplit_once(')') {
            let f: Vec<&str> = rest.split_whitespace().collect();
            if f.first() == Some(&"Z") && f.get(1).and_then(|p| p.parse().ok()) == Some(ppid) {
                z.push(pid);
            }
        }
    }
    z
}

#[test]
fn background_process_lifecycle() {
    let a = TestAgent::start();
    let c = a.client();
    let m = marker();
    let mut r = sh(&format!(
        "echo started; while read l; do echo \"got $l\"; done; echo bye; sleep {m}"
    ));
    r.background = true;
    r.stdin = true;
    r.tag = Some("worker".into());
    let (proc, pid) = match c.simple(&Request::Exec(r), Duration::from_secs(5)).unwrap() {
        Response::Started { proc, pid } => (proc, pid),
        other => panic!("{other:?}"),
    };
    assert!(pid > 0);
    // It outlives the request, and is listed.
    let procs = match c
        .simple(&Request::ListProcs, Duration::from_secs(5))
        .unwrap()
    {
        Response::Procs { procs } => procs,
        other => panic!("{other:?}"),
    };
    let me = procs.iter().find(|p| p.proc == proc).expect("listed");
    assert!(me.background && me.exit.is_none());
    assert_eq!(me.tag.as_deref(), Some("worker"));

    // Write to its stdin from a second connection (no output attach).
    let c2 = a.client();
    let w = c2
        .call(&Request::Attach {
            proc,
            stdin: true,
            replay: false,
        })
        .unwrap();
    w.send_all(b"one\ntwo\n").unwrap();
    // Re-attach with replay on the first connection: earlier output first.
    let mut att = c
        .call(&Request::Attach {
            proc,
            stdin: false,
            replay: true,
        })
        .unwrap();
    let mut seen = String::new();
    while !seen.contains("got two") {
        match att.recv_timeout(Duration::from_secs(10)).unwrap() {
            Some(Inbound::Data { bytes, .. }) => seen.push_str(&String::from_utf8_lossy(&bytes)),
            Some(other) => panic!("unexpected {other:?}"),
            None => panic!("no output; so far {seen:?}"),
        }
    }
    assert!(seen.starts_with("started\n"), "{seen:?}");
    // Close stdin: the loop ends and the process sleeps.
    assert!(matches!(
        c.simple(&Request::CloseStdin { proc }, Duration::from_secs(5)),
        Ok(Response::Ok)
    ));
    assert!(wait_until(Duration::from_secs(5), || sleepers(&m) == 1));
    // Kill it with a chosen signal; the attach sees the exit.
    assert!(matches!(
        c.simple(
            &Request::Signal {
                proc,
                signal: libc::SIGTERM
            },
            Duration::from_secs(5)
        ),
        Ok(Response::Ok)
    ));
    let st = loop {
        match att.recv_timeout(Duration::from_secs(10)).unwrap() {
            Some(Inbound::Response(Response::Exited(st))) => break st,
            Some(Inbound::Data { bytes, .. }) => seen.push_str(&String::from_utf8_lossy(&bytes)),
            other => panic!("unexpected {other:?}"),
        }
    };
    assert!(seen.contains("bye"));
    assert_eq!(st.signal, Some(libc::SIGTERM));
    assert!(wait_until(Duration::from_secs(5), || procs_with(&m).is_empty()));
    drop(w);
    // Still listed, with its exit status; signalling it now is an error.
    let procs = match c
        .simple(&Request::ListProcs, Duration::from_secs(5))
        .unwrap()
    {
        Response::Procs { procs } => procs,
        other => panic!("{other:?}"),
    };
    let me = procs.iter().find(|p| p.proc == proc).expect("still listed");
    assert_eq!(me.exit.as_ref().and_then(|e| e.signal), Some(libc::SIGTERM));
    match c.simple(&Request::Signal { proc, signal: 9 }, Duration::from_secs(5)) {
        Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::NotFound),
        other => panic!("{other:?}"),
    }
    // A late attach replays the buffer and the exit.
    let mut late = c
        .call(&Request::Attach {
            proc,
            stdin: false,
            replay: true,
        })
        .unwrap();
    let mut all = Vec::new();
    loop {
        match late.recv().unwrap() {
            Inbound::Data { bytes, .. } => all.extend(bytes),
            Inbound::Response(Response::Exited(_)) => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(
        String::from_utf8_lossy(&all),
        "started\ngot one\ngot two\nbye\n"
    );
}

#[test]
fn background_output_buffer_is_bounded() {
    let a = TestAgent::start();
    let c = a.client();
    let mut r = sh("head -c 20000000 /dev/zero; echo; echo tail-marker");
    r.background = true;
    let proc = match c.simple(&Request::Exec(r), Duration::from_secs(5)).unwrap() {
        Response::Started { proc, .. } => proc,
        other => panic!("{other:?}"),
    };
    // Let it finish unobserved: only the bounded buffer can remain.
    assert!(wait_until(Duration::from_secs(20), || {
        match c.simple(&Request::ListProcs, Duration::from_secs(5)) {
            Ok(Response::Procs { procs }) => {
                procs.iter().any(|p| p.proc == proc && p.exit.is_some())
            }
            _ => false,
        }
    }));
    let mut call = c
        .call(&Request::Attach {
            proc,
            stdin: false,
            replay: true,
        })
        .unwrap();
    let mut dropped = 0;
    let mut data = Vec::new();
    loop {
        match call.recv().unwrap() {
            Inbound::Event(Event::Dropped { bytes }) => dropped += bytes,
            Inbound::Data { bytes, .. } => data.extend(bytes),
            Inbound::Response(Response::Exited(st)) => {
                assert_eq!(st.code, Some(0));
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(data.ends_with(b"tail-marker\n"));
    assert_eq!(dropped + data.len() as u64, 20_000_000 + 1 + 12);
    assert!(dropped > 0);
    assert!(data.len() <= proto::limits::BACKGROUND_BUFFER);
    assert!(rss_kib(a.pid()) < 64 * 1024);
}

#[test]
fn pty_exec_with_resize() {
    let a = TestAgent::start();
    let c = a.client();
    let mut r = sh("stty size; read x; stty size; echo \"tty:$x\"");
    r.pty = Some(PtySize { rows: 24, cols: 80 });
    r.stdin = true;
    let mut call = c.call(&Request::Exec(r)).unwrap();
    let mut out = String::new();
    let mut proc = 0;
    while !out.contains("24 80") {
        match call.recv_timeout(Duration::from_secs(10)).unwrap() {
            Some(Inbound::Event(Event::Started { proc: p, .. })) => proc = p,
            Some(Inbound::Data { channel, bytes }) => {
                assert_eq!(channel, channel::STDOUT, "pty output is all on channel 1");
                out.push_str(&String::from_utf8_lossy(&bytes));
            }
            other => panic!("unexpected {other:?} after {out:?}"),
        }
    }
    assert!(matches!(
        c.simple(
            &Request::Resize {
                proc,
                rows: 50,
                cols: 132
            },
            Duration::from_secs(5)
        ),
        Ok(Response::Ok)
    ));
    call.send_all(b"hi\n").unwrap();
    loop {
        match call.recv_timeout(Duration::from_secs(10)).unwrap() {
            Some(Inbound::Data { bytes, .. }) => out.push_str(&String::from_utf8_lossy(&bytes)),
            Some(Inbound::Response(Response::Exited(st))) => {
                assert_eq!(st.code, Some(0));
                break;
            }
            Some(Inbound::Eof { .. }) | Some(Inbound::Event(_)) => {}
            other => panic!("unexpected {other:?} after {out:?}"),
        }
    }
    assert!(out.contains("50 132"), "{out:?}");
    assert!(out.contains("tty:hi"), "{out:?}");
}

#[test]
fn binary_file_round_trips() {
    let a = TestAgent::start();
    let c = a.client();
    let big: Vec<u8> = {
        // Deterministic, incompressible-looking bytes (xorshift).
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        (0..(100usize << 20))
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    };
    for (name, data) in [
        ("empty.bin", Vec::new()),
        ("one.bin", vec![0xFFu8]),
        ("nested/dir/big.bin", big),
    ] {
        let n = c.write_file(name, &data, Some(0o600)).unwrap();
        assert_eq!(n, data.len() as u64);
        let on_disk = std::fs::read(a.workspace.join(name)).unwrap();
        assert!(on_disk == data, "{name} differs on disk");
        let back = c.read_file(name, 200 << 20).unwrap();
        assert_eq!(back.len(), data.len());
        assert!(back == data, "{name} differs after read");
        let st = c.stat(name).unwrap();
        assert_eq!(st.size, data.len() as u64);
        assert_eq!(st.mode, 0o600);
        assert_eq!(st.file_type, FileType::File);
    }
    // No temporary files left next to them.
    let leftovers: Vec<_> = std::fs::read_dir(a.workspace.join("nested/dir"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(leftovers.len(), 1, "{leftovers:?}");
}

#[test]
fn file_operations() {
    let a = TestAgent::start();
    let c = a.client();
    c.write_file("a/b/c.txt", b"0123456789", None).unwrap();
    // Range read.
    let mut call = c
        .call(&Request::ReadFile {
            path: "a/b/c.txt".into(),
            offset: 3,
            len: Some(4),
        })
        .unwrap();
    let mut got = Vec::new();
    loop {
        match call.recv().unwrap() {
            Inbound::Data { bytes, .. } => got.extend(bytes),
            Inbound::Response(Response::Read { bytes, size }) => {
                assert_eq!((bytes, size), (4, 10));
                break;
            }
            Inbound::Eof { .. } => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(got, b"3456");
    // Atomic replace keeps readers from seeing half files; mode kept.
    std::fs::set_permissions(
        a.workspace.join("a/b/c.txt"),
        std::os::unix::fs::PermissionsExt::from_mode(0o751),
    )
    .unwrap();
    c.write_file("a/b/c.txt", b"new", None).unwrap();
    assert_eq!(c.stat("a/b/c.txt").unwrap().mode, 0o751);
    // Absolute paths work too.
    let abs = a.workspace.join("a/b/c.txt");
    assert_eq!(c.read_file(abs.to_str().unwrap(), 100).unwrap(), b"new");

    let ok = |r: Request| c.simple(&r, Duration::from_secs(5));
    assert!(matches!(
        ok(Request::Mkdir {
            path: "x/y/z".into(),
            parents: true,
            mode: None
        }),
        Ok(Response::Ok)
    ));
    c.write_file("x/y/z/f", b"f", None).unwrap();
    let (entries, truncated) = c.list("", true, 1000).unwrap();
    assert!(!truncated);
    let paths: Vec<&str> = entries.iter().map(|e| e.path.as_str()).collect();
    for p in ["a", "a/b", "a/b/c.txt", "x", "x/y/z", "x/y/z/f"] {
        assert!(paths.contains(&p), "{p} missing from {paths:?}");
    }
    let (_, truncated) = c.list("", true, 2).unwrap();
    assert!(truncated);
    let (top, _) = c.list("", false, 1000).unwrap();
    assert_eq!(top.len(), 2);

    // Rename without overwrite refuses an existing target.
    match ok(Request::Rename {
        from: "x/y/z/f".into(),
        to: "a/b/c.txt".into(),
        overwrite: false,
    }) {
        Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::AlreadyExists),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        ok(Request::Rename {
            from: "x/y/z/f".into(),
            to: "moved".into(),
            overwrite: false
        }),
        Ok(Response::Ok)
    ));
    // Non-recursive remove of a non-empty dir fails; recursive works.
    match ok(Request::Remove {
        path: "a".into(),
        recursive: false,
    }) {
        Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::DirectoryNotEmpty),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        ok(Request::Remove {
            path: "a".into(),
            recursive: true
        }),
        Ok(Response::Ok)
    ));
    assert!(!a.workspace.join("a").exists());
    match c.stat("a") {
        Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::NotFound),
        other => panic!("{other:?}"),
    }
    match c.read_file("x", 100) {
        Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::IsADirectory),
        other => panic!("{other:?}"),
    }
}

// ---------------------------------------------------------------------------
// Malformed input, sent as raw bytes.
// ---------------------------------------------------------------------------

struct Raw {
    s: std::os::unix::net::UnixStream,
    r: FrameReader<std::os::unix::net::UnixStream>,
}

impl Raw {
    fn new(a: &TestAgent) -> Raw {
        let s = a.stream();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut raw = Raw {
            r: FrameReader::new(s.try_clone().unwrap()),
            s,
        };
        raw.send(&encode_json(
            Kind::Hello,
            0,
            &Hello {
                version: proto::PROTOCOL_VERSION,
                min_version: 1,
                nonce: 7,
                software: "test".into(),
                capabilities: vec![],
                max_payload: 1 << 20,
                restored: None,
            },
        ));
        let f = raw.next().expect("hello reply");
        assert_eq!(f.kind(), Some(Kind::Hello));
        raw
    }
    fn send(&mut self, b: &[u8]) {
        self.s.write_all(b).unwrap();
    }
    fn next(&mut self) -> Option<proto::Frame> {
        self.r.read_frame().ok().flatten()
    }
    fn next_error(&mut self) -> (u64, proto::ErrorBody) {
        loop {
            let f = self.next().expect("a frame");
            if f.kind() == Some(Kind::Error) {
                return (f.header.id, serde_json::from_slice(&f.payload).unwrap());
            }
        }
    }
}

#[test]
fn malformed_frames_get_errors_without_harming_other_requests() {
    let a = TestAgent::start();
    let mut raw = Raw::new(&a);
    // A long-running request in flight on the same connection.
    raw.send(&encode_json(
        Kind::Request,
        1,
        &Request::Exec(sh("sleep 1; echo survivor")),
    ));

    // Unknown kind.
    raw.send(
        &encode_frame(Kind::Data, 5, 0, b"x")
            .iter()
            .enumerate()
            .map(|(i, b)| if i == 1 { 200 } else { *b })
            .collect::<Vec<u8>>(),
    );
    let (id, e) = raw.next_error();
    assert_eq!((id, e.code, e.id), (0, ErrorCode::UnknownKind, Some(5)));

    // Not JSON / wrong shape / unknown op.
    for (rid, body) in [
        (10u64, &b"{not json"[..]),
        (11, br#"{"op":"exec","argv":"notalist"}"#),
        (12, br#"{"op":"launch_missiles"}"#),
    ] {
        raw.send(&encode_frame(Kind::Request, rid, 0, body));
        let (id, e) = raw.next_error();
        assert_eq!((id, e.code), (rid, ErrorCode::Protocol), "{}", e.message);
    }
    // Invalid UTF-8 inside a path string.
    let mut bad = br#"{"op":"stat","path":"a"#.to_vec();
    bad.extend_from_slice(&[0xff, 0xfe]);
    bad.extend_from_slice(br#""}"#);
    raw.send(&encode_frame(Kind::Request, 13, 0, &bad));
    let (id, e) = raw.next_error();
    assert_eq!((id, e.code), (13, ErrorCode::Protocol));
    // NUL in a path.
    raw.send(&encode_json(
        Kind::Request,
        14,
        &Request::Stat {
            path: "a\0b".into(),
        },
    ));
    let (id, e) = raw.next_error();
    assert_eq!((id, e.code), (14, ErrorCode::Invalid));
    // Id 0 and a reused id.
    raw.send(&encode_json(Kind::Request, 0, &Request::Ping));
    let (id, e) = raw.next_error();
    assert_eq!((id, e.code), (0, ErrorCode::Invalid));
    raw.send(&encode_json(Kind::Request, 1, &Request::Ping));
    let (id, e) = raw.next_error();
    assert_eq!((id, e.code, e.id), (0, ErrorCode::DuplicateId, Some(1)));
    // Frames for unknown ids are ignored; a window with a bad payload is reported.
    raw.send(&encode_frame(Kind::Data, 999, 0, b"stray"));
    raw.send(&encode_frame(Kind::Window, 1, 1, b"abc"));
    let (id, e) = raw.next_error();
    assert_eq!((id, e.code), (0, ErrorCode::Protocol));
    // Sent-by-agent kinds are refused.
    raw.send(&encode_frame(Kind::Response, 1, 0, b"{}"));
    let (_, e) = raw.next_error();
    assert_eq!(e.code, ErrorCode::Protocol);

    // The first request still completes normally.
    let mut stdout = Vec::new();
    loop {
        let f = raw.next().expect("frame");
        if f.header.id != 1 {
            continue;
        }
        match f.kind() {
            Some(Kind::Data) => stdout.extend(f.payload),
            Some(Kind::Response) => {
                let r: Response = serde_json::from_slice(&f.payload).unwrap();
                assert!(
                    matches!(r, Response::Exited(ref s) if s.code == Some(0)),
                    "{r:?}"
                );
                break;
            }
            Some(Kind::Error) => panic!("{}", String::from_utf8_lossy(&f.payload)),
            _ => {}
        }
    }
    assert_eq!(stdout, b"survivor\n");
}

#[test]
fn fatal_frames_close_only_their_connection() {
    let a = TestAgent::start();
    let good = a.client();
    let m = marker();
    let mut long = good
        .call(&Request::Exec(sh(&format!("sleep 1.{m}; echo fine"))))
        .unwrap();

    // Oversized frame: error, then close.
    let mut raw = Raw::new(&a);
    let mut h = encode_frame(Kind::Request, 1, 0, b"");
    h[4..8].copy_from_slice(&((proto::MAX_PAYLOAD as u32) + 1).to_le_bytes());
    raw.send(&h);
    let (_, e) = raw.next_error();
    assert_eq!(e.code, ErrorCode::Protocol);
    assert!(raw.next().is_none(), "connection should close");

    // Random bytes (bad magic).
    let mut raw = Raw::new(&a);
    let junk: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8 | 1)
        .collect();
    let _ = raw.s.write_all(&junk);
    let (_, e) = raw.next_error();
    assert_eq!(e.code, ErrorCode::Protocol);
    assert!(raw.next().is_none());

    // Truncated frame, then hang-up.
    let mut raw = Raw::new(&a);
    let f = encode_json(Kind::Request, 3, &Request::Ping);
    raw.send(&f[..f.len() - 3]);
    raw.s.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(raw.next().is_none());

    // Garbage before any hello.
    let mut s = a.stream();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut r = FrameReader::new(s);
    let f = r.read_frame().unwrap().expect("error frame");
    assert_eq!(f.kind(), Some(Kind::Error));

    // Version with no overlap.
    let mut s = a.stream();
    s.write_all(&encode_json(
        Kind::Hello,
        0,
        &Hello {
            version: 99,
            min_version: 50,
            nonce: 1,
            software: "future".into(),
            capabilities: vec![],
            max_payload: 1024,
            restored: None,
        },
    ))
    .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let f = FrameReader::new(s)
        .read_frame()
        .unwrap()
        .expect("error frame");
    assert_eq!(f.kind(), Some(Kind::Error));

    // The well-behaved connection was not disturbed.
    let mut out = Vec::new();
    loop {
        match long.recv().unwrap() {
            Inbound::Data { bytes, .. } => out.extend(bytes),
            Inbound::Response(Response::Exited(st)) => {
                assert_eq!(st.code, Some(0));
                break;
            }
            Inbound::Error(e) => panic!("{e}"),
            _ => {}
        }
    }
    assert_eq!(out, b"fine\n");
    good.ping(Duration::from_secs(5)).unwrap();
}

#[test]
fn host_finds_its_hello_after_stale_bytes() {
    // virtio-serial hands a new client whatever the guest wrote for the
    // previous one; the client must skip it. Simulate with a socket pair:
    // the fake "agent" writes junk, then a hello with another nonce, then
    // the real answer.
    use std::io::Read;
    let (host, mut guest) = std::os::unix::net::UnixStream::pair().unwrap();
    let t = std::thread::spawn(move || {
        let mut r = FrameReader::new(guest.try_clone().unwrap());
        let f = r.read_frame().unwrap().unwrap();
        let h: Hello = serde_json::from_slice(&f.payload).unwrap();
        let mut stale = encode_frame(Kind::Data, 4, 1, b"old output");
        stale.truncate(20); // half a frame
        guest.write_all(&stale).unwrap();
        guest.write_all(b"\xa5\x01garbage").unwrap();
        let other = Hello {
            nonce: h.nonce ^ 1,
            ..h.clone()
        };
        guest
            .write_all(&encode_json(Kind::Hello, 0, &other))
            .unwrap();
        guest.write_all(&encode_json(Kind::Hello, 0, &h)).unwrap();
        let mut b = [0u8; 1];
        let _ = guest.read(&mut b);
    });
    let c = agent_sandbox::agent::AgentClient::connect(host, Duration::from_secs(5)).unwrap();
    assert_eq!(c.hello.version, proto::PROTOCOL_VERSION);
    c.close();
    t.join().unwrap();
}

#[test]
fn frames_right_behind_the_hello_belong_to_the_connection() {
    // An agent may write its next frames before the host reads its hello:
    // they arrive in the same read and are neither refused nor dropped.
    // Proof they are read: a bad frame right behind the hello closes the
    // connection; a good one (a connection-level error report) does not.
    use std::io::Read;
    for bad in [false, true] {
        let (host, mut guest) = std::os::unix::net::UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || {
            let mut r = FrameReader::new(guest.try_clone().unwrap());
            let f = r.read_frame().unwrap().unwrap();
            let h: Hello = serde_json::from_slice(&f.payload).unwrap();
            let mut out = encode_json(Kind::Hello, 0, &h);
            if bad {
                out.extend_from_slice(b"\x00\x00not a frame header at all");
            } else {
                out.extend_from_slice(&encode_json(
                    Kind::Error,
                    0,
                    &proto::ErrorBody {
                        code: ErrorCode::Io,
                        message: "early".into(),
                        id: None,
                    },
                ));
            }
            guest.write_all(&out).unwrap();
            let mut b = [0u8; 1];
            let _ = guest.read(&mut b);
        });
        let c = agent_sandbox::agent::AgentClient::connect(host, Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("bad={bad}: connect refused: {e}"));
        let closed = wait_until(Duration::from_secs(3), || c.is_closed());
        assert_eq!(closed, bad, "bad={bad}: closed={closed}");
        c.close();
        t.join().unwrap();
    }
}

fn hello(nonce: u64) -> Vec<u8> {
    encode_json(
        Kind::Hello,
        0,
        &Hello {
            version: proto::PROTOCOL_VERSION,
            min_version: 1,
            nonce,
            software: "test".into(),
            max_payload: 1 << 20,
            ..Default::default()
        },
    )
}

#[test]
fn hello_mid_connection_starts_a_new_connection() {
    // virtio-serial cannot tell the guest a new host attached (a restored
    // guest still holds the snapshot's connection): the hello is the reset.
    let a = TestAgent::start();
    let mut raw = Raw::new(&a);
    let m = marker();
    raw.send(&encode_json(
        Kind::Request,
        1,
        &Request::Exec(sh(&format!("sleep {m}; echo too-late"))),
    ));
    assert!(wait_until(Duration::from_secs(5), || sleepers(&m) == 1));
    raw.send(&hello(8));
    // Nothing of the old connection follows the new hello reply.
    let f = loop {
        let f = raw.next().expect("hello reply");
        if f.kind() == Some(Kind::Hello) {
            break f;
        }
        assert_eq!(f.header.id, 1, "unexpected frame {f:?}");
    };
    let h: Hello = serde_json::from_slice(&f.payload).unwrap();
    assert_eq!((h.nonce, h.version), (8, proto::PROTOCOL_VERSION));
    // The old connection's foreground process dies with it.
    assert!(wait_until(Duration::from_secs(5), || procs_with(&m).is_empty()));
    // Ids start afresh: 1 is free again.
    raw.send(&encode_json(Kind::Request, 1, &Request::Ping));
    let f = raw.next().expect("pong");
    assert_eq!((f.kind(), f.header.id), (Some(Kind::Response), 1));
    let r: Response = serde_json::from_slice(&f.payload).unwrap();
    assert!(matches!(r, Response::Pong { .. }), "{r:?}");
    // A hello that fails (no common version) ends the stream.
    raw.send(&encode_json(
        Kind::Hello,
        0,
        &Hello {
            version: 99,
            min_version: 50,
            ..Default::default()
        },
    ));
    let (id, e) = raw.next_error();
    assert_eq!((id, e.code), (0, ErrorCode::Protocol));
    assert!(raw.next().is_none(), "connection should close");
}

#[test]
fn restore_fixup_in_hello_is_applied_before_the_answer() {
    // A valid fixup would set the clock of the host running this test, so
    // only the validation is exercised here: a bad fixup is refused with a
    // connection error instead of a hello (tests/vm_qemu.rs checks the
    // guest clock after a real restore).
    let a = TestAgent::start();
    let mut s = a.stream();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(&encode_json(
        Kind::Hello,
        0,
        &Hello {
            version: proto::PROTOCOL_VERSION,
            min_version: 1,
            nonce: 3,
            restored: Some(proto::RestoreFixup {
                unix_time_ns: 1,
                entropy_hex: "not hex".into(),
                warm_up: false,
            }),
            ..Default::default()
        },
    ))
    .unwrap();
    let mut r = FrameReader::new(s);
    let f = r.read_frame().unwrap().expect("error frame");
    assert_eq!(f.kind(), Some(Kind::Error));
    let e: proto::ErrorBody = serde_json::from_slice(&f.payload).unwrap();
    assert_eq!(e.code, ErrorCode::Invalid);
    assert!(e.message.contains("restore fixup"), "{}", e.message);
    assert!(r.read_frame().unwrap().is_none(), "connection should close");
    // The host clock was not touched by the refused fixup.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    assert!(now.as_secs() > 1_000_000_000);
}

/// The host client reads the socket from whichever caller is waiting (one
/// leads, the others wait on their channels) or from its background reader
/// when none is. Losing the agent must fail every waiting call, whoever
/// reads, and an idle connection must notice too.
#[test]
fn losing_the_agent_fails_every_waiting_call_and_idle_clients_notice() {
    let mut a = TestAgent::start();
    let c = a.client();
    let idle = a.client();
    let m = marker();
    let waiters: Vec<_> = (0..4)
        .map(|i| {
            let c = c.clone();
            let m = m.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                let r = if i % 2 == 0 {
                    c.exec(argv(&["sleep", &m]), MAX).map(|_| ())
                } else {
                    let mut call = c.call(&Request::Exec(argv(&["sleep", &m]))).unwrap();
                    // Connection loss arrives as an `unavailable` error.
                    match call.recv_deadline(Instant::now() + Duration::from_secs(60)) {
                        Ok(Inbound::Error(e)) => Err(ClientError::Agent(e)),
                        Ok(m) => panic!("unexpected {m:?}"),
                        Err(e) => Err(e),
                    }
                };
                (r, t.elapsed())
            })
        })
        .collect();
    assert!(wait_until(Duration::from_secs(10), || sleepers(&m) == 4));
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    for w in waiters {
        let (r, took) = w.join().unwrap();
        assert!(r.is_err(), "a call survived the agent: {r:?}");
        assert!(took < Duration::from_secs(20), "took {took:?}");
    }
    assert!(wait_until(Duration::from_secs(5), || c.is_closed() && idle.is_closed()));
    // The agent was killed, not shut down: its sleepers are orphans now.
    for pid in procs_with(&m) {
        // SAFETY: signalling a test-owned process.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// Timeouts hold while another caller leads the reading, and a call that
/// timed out leaves the connection usable.
#[test]
fn recv_deadlines_hold_while_another_caller_reads() {
    let a = TestAgent::start();
    let c = a.client();
    let m = marker();
    let mut long = c.call(&Request::Exec(argv(&["sleep", &m]))).unwrap();
    let c2 = c.clone();
    // Leads the reading until we kill its sleep, while the other call
    // times out: a timeout that waited for the leader would never end.
    let m2 = marker();
    let m2c = m2.clone();
    let slow = std::thread::spawn(move || c2.exec(argv(&["sleep", &m2c]), MAX));
    assert!(wait_until(Duration::from_secs(10), || sleepers(&m2) == 1));
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    let got = long.recv_timeout(Duration::from_millis(300)).unwrap();
    assert!(got.is_none(), "unexpected message {got:?}");
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(290) && took < Duration::from_secs(20),
        "took {took:?}"
    );
    assert_eq!(sleepers(&m2), 1, "the leader's exec ended first");
    // A timeout says how long the call has gone unanswered since it was
    // sent (the daemon's 504 quotes it), not how long the last wait was.
    match long.recv_deadline(Instant::now() + Duration::from_millis(50)) {
        Err(ClientError::Timeout(d)) => assert!(d >= Duration::from_millis(540), "{d:?}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    for pid in procs_with(&m2) {
        // SAFETY: signalling a test-owned process.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let out = slow.join().unwrap().unwrap();
    assert_eq!(out.status.signal, Some(libc::SIGKILL), "{:?}", out.status);
    long.cancel().unwrap();
    match long.finish() {
        Err(ClientError::Agent(e)) => assert_eq!(e.code, ErrorCode::Cancelled),
        other => panic!("expected cancelled, got {other:?}"),
    }
    let out = c.exec(argv(&["echo", "still here"]), MAX).unwrap();
    assert_eq!(out.stdout, b"still here\n");
    assert!(wait_until(Duration::from_secs(5), || procs_with(&m).is_empty()));
}

#[test]
fn kill_all_outside_a_vm_kills_the_process_groups_of_execs() {
    // Not the VM's init: no sandbox cgroup, so the agent kills what it
    // started (each exec's process group); in a VM it is `cgroup.kill`
    // (tests/rest.rs).
    let a = TestAgent::start();
    let c = a.client();
    let m = marker();
    let mut r = sh(&format!("sleep {m} & sleep {m}"));
    r.background = true;
    assert!(matches!(
        c.simple(&Request::Exec(r), Duration::from_secs(5)),
        Ok(Response::Started { .. })
    ));
    let fg = c.call(&Request::Exec(sh(&format!("sleep {m}")))).unwrap();
    assert!(wait_until(Duration::from_secs(10), || sleepers(&m) >= 3));
    match c.simple(&Request::KillAll, Duration::from_secs(10)) {
        Ok(Response::Killed {
            processes,
            remaining,
        }) => assert_eq!((processes, remaining), (2, 0)),
        other => panic!("{other:?}"),
    }
    let mut fg = fg;
    let st = fg.finish().expect("foreground exec answered");
    match st {
        Response::Exited(st) => assert_eq!(st.signal, Some(libc::SIGKILL)),
        other => panic!("{other:?}"),
    }
    assert!(wait_until(Duration::from_secs(5), || sleepers(&m) == 0));
}

/// A fake agent's side of the handshake on `guest`: reads the host's
/// hello, answers as `software` with `caps`; the reader for what follows.
fn fake_hello(
    guest: &std::os::unix::net::UnixStream,
    software: &str,
    caps: &[&str],
) -> FrameReader<std::os::unix::net::UnixStream> {
    let mut r = FrameReader::new(guest.try_clone().unwrap());
    let f = r.read_frame().unwrap().expect("the host's hello");
    let h: Hello = serde_json::from_slice(&f.payload).unwrap();
    let reply = Hello {
        version: h.version,
        min_version: 1,
        nonce: h.nonce,
        software: software.into(),
        capabilities: caps.iter().map(|c| c.to_string()).collect(),
        max_payload: 1 << 20,
        restored: None,
    };
    let mut g = guest;
    g.write_all(&encode_json(Kind::Hello, 0, &reply)).unwrap();
    r
}

/// A host never sends per-exec limits to an agent that does not announce
/// `exec.limits`: an older agent would ignore them and run the command
/// unlimited. The real agent (as a plain process, no per-exec cgroups)
/// refuses a limited exec itself, and reports its usage from rusage.
#[test]
fn exec_limits_are_never_dropped_silently() {
    use agent_sandbox::agent::AgentClient;
    let (host, guest) = std::os::unix::net::UnixStream::pair().unwrap();
    let old_agent = std::thread::spawn(move || {
        let mut r = fake_hello(&guest, "old-agent/0", &["exec"]);
        // Nothing else may arrive (the refused exec is never sent).
        guest
            .set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let next = r.read_frame().ok().flatten();
        assert!(next.is_none(), "the host sent {next:?}");
    });
    let c = AgentClient::connect(host, Duration::from_secs(10)).expect("hello");
    let limited = ExecRequest {
        argv: vec!["true".into()],
        memory_max: Some(64 << 20),
        ..Default::default()
    };
    match c.call(&Request::Exec(limited)) {
        Err(ClientError::Agent(e)) => {
            assert_eq!(e.code, ErrorCode::Invalid);
            assert!(e.message.contains("exec.limits"), "{e}");
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a limited exec went to an agent without exec.limits"),
    }
    old_agent.join().unwrap();
    drop(c);

    let a = TestAgent::start();
    let c = a.client();
    let limited = ExecRequest {
        argv: vec!["true".into()],
        cpu_max_us: Some(50_000),
        ..Default::default()
    };
    match c.exec(limited, 1 << 20) {
        Err(ClientError::Agent(e)) => {
            assert_eq!(e.code, ErrorCode::SpawnFailed);
            assert!(e.message.contains("cgroup per exec"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    let out = c.exec(sh("true"), 1 << 20).expect("exec");
    let u = out.status.usage.expect("usage");
    assert_eq!(u.source, proto::UsageSource::Rusage);
    assert!(u.memory_peak_bytes > 0, "{u:?}");
}

/// Audited execs with the agent as a plain process: the workspace is the
/// scanned root, and the process tree comes from the host kernel's
/// connector (the VM tests in `tests/vm_audit.rs` cover the guest's).
#[test]
fn audited_exec_reports_workspace_changes_and_its_processes() {
    use proto::{FileChangeKind, ProcEventKind};
    let a = TestAgent::start();
    let c = a.client();
    assert!(c.hello.capabilities.iter().any(|s| s == "exec.audit"));
    let plain = c.exec(sh("echo x > plain.txt"), MAX).unwrap();
    assert_eq!(plain.status.audit, None, "no flag, no record");
    std::fs::write(a.workspace.join("old.txt"), "one\ntwo\n").unwrap();
    let mut req = sh("echo hi > new.txt; echo three >> old.txt; rm plain.txt; ls / > /dev/null");
    req.audit = true;
    let out = c.exec(req, MAX).unwrap();
    assert_eq!(out.status.code, Some(0));
    let au = out.status.audit.expect("audit record");
    assert!(au.files_tracked);
    let ws = a
        .workspace
        .to_string_lossy()
        .trim_end_matches('/')
        .to_string();
    let f = |name: &str| {
        au.files
            .iter()
            .find(|f| f.path == format!("{ws}/{name}"))
            .unwrap_or_else(|| panic!("no {name} in {:#?}", au.files))
    };
    let n = f("new.txt");
    assert_eq!((n.change, n.size), (FileChangeKind::Created, Some(3)));
    use sha2::Digest;
    let want: String = sha2::Sha256::digest(b"hi\n")
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(n.sha256.as_deref(), Some(want.as_str()));
    assert!(n.diff.as_deref().unwrap().contains("+hi"));
    let o = f("old.txt");
    assert_eq!(o.change, FileChangeKind::Modified);
    assert!(o.diff_unavailable, "written outside any audited exec");
    assert_eq!(f("plain.txt").change, FileChangeKind::Deleted);
    // Its next change has a diff: the agent kept the text.
    let mut req = sh("echo four >> old.txt");
    req.audit = true;
    let au2 = c.exec(req, MAX).unwrap().status.audit.unwrap();
    let d = au2.files[0].diff.as_deref().expect("diff from the cache");
    assert!(d.contains(" three") && d.contains("+four"), "{d}");

    let mut bg = sh("true");
    bg.audit = true;
    bg.background = true;
    assert!(
        c.exec(bg, MAX).is_err(),
        "audit of a background exec is refused"
    );

    if !au.procs_tracked {
        skip::not_checked(&format!("process events: {:?}", au.notes));
        return;
    }
    let root = au
        .procs
        .iter()
        .find(|e| e.kind == ProcEventKind::Fork && e.ppid == a.pid())
        .unwrap_or_else(|| panic!("no fork by the agent in {:#?}", au.procs));
    assert!(au.procs.iter().any(|e| e.kind == ProcEventKind::Exec
        && e.pid == root.pid
        && e.argv
            .as_deref()
            .unwrap_or_default()
            .first()
            .map(String::as_str)
            == Some("/bin/sh")));
    let ls = au
        .procs
        .iter()
        .find(|e| {
            e.kind == ProcEventKind::Exec
                && e.argv.as_deref().unwrap_or_default() == ["ls".to_string(), "/".to_string()]
        })
        .unwrap_or_else(|| panic!("no exec of ls in {:#?}", au.procs));
    assert_eq!(ls.ppid, root.pid);
    assert!(au
        .procs
        .iter()
        .any(|e| e.kind == ProcEventKind::Exit && e.pid == root.pid && e.exit_code == Some(0)));
}

/// The host holds a guest's audit record to the documented limits, whatever
/// the agent sent (a hostile agent ignoring them within one frame).
#[test]
fn the_host_bounds_an_audit_record_from_the_guest() {
    use agent_sandbox::agent::AgentClient;
    use proto::audit::limits;
    use proto::{ExecAudit, ExitStatus, FileChange, FileChangeKind, ProcEvent, ProcEventKind};
    let (host, guest) = std::os::unix::net::UnixStream::pair().unwrap();
    let hostile = std::thread::spawn(move || {
        let mut r = fake_hello(&guest, "hostile/0", &["exec", "exec.audit"]);
        let req = r.read_frame().unwrap().expect("the exec");
        let ev = ProcEvent {
            kind: ProcEventKind::Exec,
            pid: 2,
            ppid: 1,
            t_ms: 0,
            argv: Some(vec!["a".repeat(300); 20]),
            argv_truncated: false,
            uid: Some(0),
            euid: None,
            exit_code: None,
            signal: None,
        };
        let file = FileChange {
            path: "/p".repeat(600),
            path_truncated: false,
            change: FileChangeKind::Modified,
            file_type: FileType::File,
            size: Some(1),
            sha256: Some("zz".into()),
            diff: Some("+line\n".repeat(3000)),
            diff_truncated: false,
            diff_unavailable: false,
        };
        // Big strings in the first of each only: all of it in one frame.
        let mut small_ev = ev.clone();
        small_ev.argv = Some(vec!["x".into()]);
        let mut procs = vec![small_ev; limits::MAX_PROC_EVENTS + 50];
        procs[0] = ev;
        let mut small_file = file.clone();
        (small_file.path, small_file.diff) = ("/q".into(), None);
        let mut files = vec![small_file; limits::MAX_FILES + 10];
        files[0] = file;
        let audit = ExecAudit {
            procs,
            procs_tracked: true,
            files,
            files_tracked: true,
            notes: vec!["n".repeat(1000); 30],
            ..ExecAudit::default()
        };
        let st = ExitStatus {
            code: Some(0),
            audit: Some(audit),
            ..Default::default()
        };
        let frame = encode_json(Kind::Response, req.header.id, &Response::Exited(st));
        assert!(frame.len() <= proto::MAX_PAYLOAD, "{} bytes", frame.len());
        (&guest).write_all(&frame).unwrap();
    });
    let c = AgentClient::connect(host, Duration::from_secs(10)).expect("hello");
    let mut req = argv(&["true"]);
    req.audit = true;
    let out = c.exec(req, MAX).expect("exec");
    hostile.join().unwrap();
    let a = out.status.audit.expect("audit");
    assert_eq!(a.procs.len(), limits::MAX_PROC_EVENTS);
    assert_eq!(a.procs_dropped, 50);
    let argv = a.procs[0].argv.as_ref().unwrap();
    assert_eq!(argv.len(), limits::MAX_ARGV);
    assert!(argv.iter().all(|s| s.len() <= limits::MAX_ARG_BYTES));
    assert!(a.procs[0].argv_truncated);
    assert_eq!((a.files.len(), a.files_dropped), (limits::MAX_FILES, 10));
    let f = &a.files[0];
    assert!(f.path.len() <= limits::MAX_PATH_BYTES && f.path_truncated);
    assert!(f.diff.as_ref().unwrap().len() <= limits::MAX_DIFF_BYTES && f.diff_truncated);
    assert_eq!(f.sha256, None, "not a sha256");
    assert_eq!(a.notes.len(), limits::MAX_NOTES);
    assert!(a.notes.iter().all(|n| n.len() <= limits::MAX_NOTE_BYTES));
}
