//! The VMM of a real session (QEMU/TCG, through the real daemon and its
//! spawner) is jailed like Firecracker under its jailer: its own mount,
//! pid, network and IPC namespaces, a read-only root holding only what it
//! needs, no host loopback (the API) in reach. Sessions, the snapshot they
//! restore from and the standby VMM all work that way.

mod common;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::{stdout_of, Daemon};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn ns(pid: &str, kind: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}"))
        .unwrap_or_else(|e| panic!("ns/{kind} of {pid}: {e}"))
}

fn cmdline(pid: i32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap_or_default()
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

/// The daemon's QEMUs (sessions and standbys).
fn qemus(d: &Daemon) -> Vec<i32> {
    d.sandbox_procs()
        .into_iter()
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.starts_with("qemu"))
        })
        .collect()
}

/// Every non-directory under `dir` (not following symlinks), as paths
/// relative to `dir` with a leading `/`; `skip` entries are not entered.
fn walk(dir: &Path, rel: &Path, skip: &[PathBuf], out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir.join(rel.strip_prefix("/").unwrap_or(rel))) else {
        return;
    };
    for e in rd.flatten() {
        let r = rel.join(e.file_name());
        if skip.contains(&r) {
            continue;
        }
        match e.file_type() {
            Ok(t) if t.is_dir() => walk(dir, &r, skip, out),
            _ => out.push(r),
        }
    }
}

/// A TCP connect to `addr` from inside the network namespace of `pid`.
fn connect_from_netns_of(pid: i32, addr: SocketAddr) -> std::io::Result<TcpStream> {
    let f = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    // A thread of its own: setns changes only the calling thread's
    // network namespace, and this one ends with the answer.
    std::thread::spawn(move || {
        // SAFETY: setns on an fd we opened; this thread ends right after.
        if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        TcpStream::connect_timeout(&addr, Duration::from_secs(2))
    })
    .join()
    .expect("connect thread")
}

fn check_jailed(d: &Daemon, pid: i32, api: SocketAddr) {
    let p = pid.to_string();
    let args = cmdline(pid);
    let what = format!(
        "QEMU pid {pid} (VM {})",
        common::daemon::vm_id_of(pid).unwrap_or_default()
    );
    for kind in ["net", "mnt", "pid", "ipc"] {
        assert_ne!(
            ns(&p, kind),
            ns("self", kind),
            "{what}: host {kind} namespace"
        );
        assert_ne!(
            ns(&p, kind),
            ns(&d.pid().to_string(), kind),
            "{what}: the daemon's {kind} namespace"
        );
    }
    // Pid 1 of its own pid namespace.
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let nspid = status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .expect("NSpid");
    assert_eq!(
        nspid.split_whitespace().last(),
        Some("1"),
        "{what}: NSpid {nspid}"
    );
    // Its network namespace is empty: loopback only (the TAP is an fd).
    let dev = std::fs::read_to_string(format!("/proc/{pid}/net/dev")).expect("net/dev");
    let ifaces: Vec<&str> = dev
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next().map(str::trim))
        .collect();
    assert_eq!(ifaces, ["lo"], "{what}: interfaces");
    // The API on the host's loopback is out of reach from there.
    match connect_from_netns_of(pid, api) {
        Ok(_) => panic!("{what}: reached the API at {api} from its network namespace"),
        Err(e) => eprintln!("{what}: connect to the API from its netns: {e} (as it should)"),
    }

    // Its root: read-only, and only QEMU's own files.
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    assert!(
        !root.join("etc/passwd").exists(),
        "{what}: the host's /etc/passwd is visible"
    );
    for gone in ["home", "root", "sys", "var/lib", "boot", "run/netns"] {
        assert!(!root.join(gone).exists(), "{what}: /{gone} is visible");
    }
    let e = std::fs::write(root.join("planted"), b"x").expect_err("root is writable");
    assert_eq!(
        e.raw_os_error(),
        Some(libc::EROFS),
        "{what}: write to /: {e}"
    );
    // Its /proc shows its own pid namespace only, and no /proc/sys.
    let procs: Vec<String> = std::fs::read_dir(root.join("proc"))
        .expect("its /proc")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.parse::<u32>().is_ok())
        .collect();
    assert_eq!(procs, ["1"], "{what}: processes in its /proc");
    assert!(!root.join("proc/sys").exists(), "{what}: /proc/sys visible");
    let mut dev: Vec<String> = std::fs::read_dir(root.join("dev"))
        .expect("its /dev")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    dev.sort();
    assert_eq!(dev, ["null", "random", "urandom", "zero"], "{what}: /dev");

    let run_dir = args
        .iter()
        .find_map(|a| a.strip_prefix("socket,id=agent,path="))
        .and_then(|s| {
            Path::new(s.split(',').next()?)
                .parent()
                .map(Path::to_path_buf)
        })
        .expect("run dir from the agent socket path");
    // On the host the jail's mount point is an empty directory.
    let mount_point = run_dir.join("jail");
    assert!(
        std::fs::read_dir(&mount_point)
            .unwrap_or_else(|e| panic!("{what}: {}: {e}", mount_point.display()))
            .next()
            .is_none(),
        "{what}: the jail's root shows on the host"
    );
    let mut files = Vec::new();
    walk(
        &root,
        Path::new("/"),
        &[PathBuf::from("/proc"), run_dir.clone()],
        &mut files,
    );
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).expect("exe");
    let allowed = |f: &Path| {
        let name = f
            .file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default();
        let arg = f.display().to_string();
        f == exe
            || name.contains(".so")
            || f.starts_with("/dev")
            || f.starts_with("/usr/share/qemu")
            || f.starts_with("/usr/share/seabios")
            || f.starts_with("/usr/lib/ipxe")
            || f == Path::new("/etc/ld.so.cache")
            // its kernel and root file system
            || args.iter().any(|a| a.contains(&arg))
    };
    let odd: Vec<&PathBuf> = files.iter().filter(|f| !allowed(f)).collect();
    assert!(
        odd.is_empty(),
        "{what}: unexpected files in its root: {odd:?}"
    );
    let mut etc: Vec<String> = std::fs::read_dir(root.join("etc"))
        .map(|r| {
            r.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    etc.sort();
    assert!(etc.len() <= 1, "{what}: /etc holds {etc:?}");
    eprintln!(
        "{what}: jailed; {} files in its root besides its run dir and /proc",
        files.len()
    );
}

#[test]
fn every_vmm_runs_in_namespaces_of_its_own_with_a_minimal_root() {
    if !is_root() || !common::daemon::vm_backend() {
        skip!("needs root and guest images (a VM backend)");
    }
    let d = Daemon::start(&[]);
    let h = d.http();
    let api: SocketAddr = d
        .base
        .trim_start_matches("http://")
        .parse()
        .expect("API address");
    // Control: the API is reachable from the host's network namespace.
    TcpStream::connect_timeout(&api, Duration::from_secs(2)).expect("API from the host");

    assert_eq!(stdout_of(&h.exec("jail", "echo in-guest")), "in-guest\n");
    // The session's VMM and the standby made for the next session (a
    // QEMU waiting for a snapshot's state): both jailed.
    assert!(
        common::wait_until(Duration::from_secs(120), || {
            qemus(&d)
                .iter()
                .any(|p| cmdline(*p).iter().any(|a| a == "-incoming"))
                && qemus(&d).len() >= 2
        }),
        "no session and standby QEMUs: {:?}\n{}",
        qemus(&d),
        d.log()
    );
    let all = qemus(&d);
    for pid in &all {
        check_jailed(&d, *pid, api);
    }
    assert!(
        d.log().contains("VMMs run jailed"),
        "no jail line in the log:\n{}",
        d.log()
    );
    // The session still works, and a second one (restored into the
    // standby) too.
    assert_eq!(stdout_of(&h.exec("jail", "echo still")), "still\n");
    assert_eq!(stdout_of(&h.exec("jail2", "echo two")), "two\n");

    // A shape larger than the snapshot's cold-boots (kernel and all), jailed too, and
    // its teardown leaves no run dir (the jail's mount point with it).
    let r = h.post("/v1/sessions", &serde_json::json!({ "memoryMib": 640 }));
    assert!(
        (200..300).contains(&r.status),
        "create: {} {}",
        r.status,
        r.text()
    );
    let id = r.json()["id"].as_str().expect("session id").to_string();
    let r = h.post(
        &format!("/v1/sessions/{id}/exec"),
        &serde_json::json!({ "command": "echo cold" }),
    );
    assert_eq!(r.status, 200, "exec: {}", r.text());
    let cold: Vec<i32> = qemus(&d)
        .into_iter()
        .filter(|p| cmdline(*p).iter().any(|a| a == "640M"))
        .collect();
    assert_eq!(cold.len(), 1, "the cold-booted QEMU: {cold:?}");
    assert!(cmdline(cold[0]).iter().any(|a| a == "-kernel"));
    check_jailed(&d, cold[0], api);
    let runs = || {
        std::fs::read_dir(d.state_dir().join("run"))
            .map(|r| r.count())
            .unwrap_or(0)
    };
    let before = runs();
    let r = h.delete(&format!("/v1/sessions/{id}"));
    assert!(
        (200..300).contains(&r.status),
        "delete: {} {}",
        r.status,
        r.text()
    );
    assert!(
        common::wait_until(Duration::from_secs(10), || runs() == before - 1),
        "run dir of the deleted session left"
    );
    eprintln!("checked {} jailed QEMUs: {all:?} and {cold:?}", all.len());
}
