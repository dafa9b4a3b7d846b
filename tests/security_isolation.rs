//! From inside a real guest (QEMU/TCG, through the real daemon): the host's
//! files, processes, devices and kernel are not visible. (What the guest
//! cannot reach over the network is `tests/net_guest.rs`.)

mod common;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::{stdout_of, Daemon};
use std::os::unix::process::CommandExt;

/// A process group, killed whole when dropped (also when a test fails).
struct Group(std::process::Child);

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: signalling the process group this test made.
        unsafe { libc::kill(-(self.0.id() as i32), libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

#[test]
fn a_guest_sees_neither_host_files_nor_host_processes() {
    if common::test_backend() == "local-process" {
        skip!("the local-process backend has no isolation to test");
    }
    // Something unmistakable on the host: a file, and a process whose
    // command line carries a marker.
    let marker = format!("asbx-host-marker-{}", std::process::id());
    let file = std::env::temp_dir().join(&marker);
    std::fs::write(&file, "host secret").unwrap();
    // (`; true` keeps the shell, and with it the marker, alive.)
    // Its own process group, killed whole below: killing only the shell
    // left `sleep` running for 5 minutes with the test's stdout, which
    // held up whoever reads that (CI's `tee`).
    let sleeper = std::process::Command::new("sh")
        .args(["-c", "sleep 300; true"])
        .arg(&marker)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .expect("spawn sleep");
    let sleeper = Group(sleeper);
    // Control: on the host, the marker is in the sleeper's command line.
    // (Right after spawn the child may not have exec'd yet.)
    let cmdline = format!("/proc/{}/cmdline", sleeper.0.id());
    assert!(common::wait_until(
        std::time::Duration::from_secs(5),
        || String::from_utf8_lossy(&std::fs::read(&cmdline).unwrap_or_default()).contains(&marker)
    ));
    let d = Daemon::start(&[]);
    let h = d.http();
    // The marker is split in the script so that no process in the guest
    // (this shell, grep, ...) carries it by accident.
    let (m1, m2) = marker.split_at(9);
    let script = format!(
        "m1={m1}; m2={m2}; \
         test -e /tmp/$m1$m2 && echo FILE-VISIBLE; \
         test -e {dir}/$m1$m2 && echo FILE-VISIBLE; \
         for f in /proc/[0-9]*/cmdline; do \
           case \"$(tr '\\0' ' ' < $f 2>/dev/null)\" in *$m1$m2*) echo PROC-VISIBLE $f;; esac; \
         done; \
         echo PID1=$(tr '\\0' ' ' < /proc/1/cmdline); \
         echo PROCS=$(ls -d /proc/[0-9]* | wc -l); \
         echo KERNEL=$(uname -r); \
         ls /dev/kvm /dev/sda /dev/nvme0n1 2>/dev/null | sed 's/^/DEV /'; \
         echo HOSTNAME=$(hostname)",
        dir = std::env::temp_dir().display()
    );
    let v = h.exec("iso", &script);
    let out = stdout_of(&v);
    drop(sleeper);
    let _ = std::fs::remove_file(&file);
    assert!(!out.contains("FILE-VISIBLE"), "{out}");
    assert!(!out.contains("PROC-VISIBLE"), "{out}");
    // PID 1 is our agent, and the guest runs only a handful of processes.
    assert!(out.contains("PID1=/sbin/sandbox-agent"), "{out}");
    let procs: usize = out
        .lines()
        .find_map(|l| l.strip_prefix("PROCS="))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(usize::MAX);
    assert!(procs < 50, "{procs} processes visible in the guest:\n{out}");
    // Its own kernel, not the host's, and no host device nodes but its
    // own read-only disk.
    let host_kernel = String::from_utf8(
        std::process::Command::new("uname")
            .arg("-r")
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let guest_kernel = out
        .lines()
        .find_map(|l| l.strip_prefix("KERNEL="))
        .unwrap_or("");
    assert_ne!(guest_kernel.trim(), host_kernel.trim(), "{out}");
    assert!(!out.contains("DEV /dev/kvm"), "{out}");
    assert!(
        !out.contains("/dev/sda") && !out.contains("/dev/nvme0n1"),
        "{out}"
    );
}

/// Inside the guest, as uid 65534, the agent is out of reach over vsock:
/// connecting to port 5000 at the loopback CID (1), CID 3 and the guest's
/// own CID fails, or is closed at once without a byte (the agent takes
/// only the host, CID 2). Before, such a connection ran commands as root
/// whatever uid the API asked for. Exec through the API keeps working.
#[test]
fn a_guest_user_cannot_reach_the_agent_over_vsock() {
    if common::test_backend() == "local-process" {
        skip!("the local-process backend has no guest kernel or vsock");
    }
    let d = Daemon::start(&[]);
    let h = d.http();
    let r = h.post(
        "/v1/sessions",
        &serde_json::json!({"id": "vs", "template": "python"}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    // The probe opens /dev/vsock (root only) for the own CID, then drops
    // to nobody before it connects. The host speaks first on a protocol
    // connection, so a live agent leaves recv() waiting: a timeout there
    // means it was reached.
    let probe = r#"
import errno, fcntl, json, os, socket, struct
out = {}
try:
    with open("/dev/vsock", "rb") as f:
        raw = fcntl.ioctl(f, socket.IOCTL_VM_SOCKETS_GET_LOCAL_CID, b"\0" * 4)
    own = struct.unpack("I", raw)[0]
except OSError as e:
    own = None
out["own_cid"] = own
os.setgroups([]); os.setgid(65534); os.setuid(65534)
out["uid"] = os.getuid()
cids = {1, 3}
if own is not None and own not in (0xFFFFFFFF, 2):
    cids.add(own)
for cid in sorted(cids):
    s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect((cid, 5000))
    except OSError as e:
        out[str(cid)] = errno.errorcode.get(e.errno, "timeout") if e.errno else "timeout"
        continue
    try:
        out[str(cid)] = "closed" if s.recv(1) == b"" else "answered"
    except OSError:
        out[str(cid)] = "reached"
print(json.dumps(out))
"#;
    let v = h.exec("vs", &format!("python3 -c '{probe}'"));
    let out = stdout_of(&v);
    eprintln!("vsock probe as nobody: {out}");
    assert_eq!(v["exitCode"], 0, "{v}");
    let got: serde_json::Value = serde_json::from_str(out.trim()).expect("probe JSON");
    assert_eq!(got["uid"], 65534, "{got}");
    for cid in ["1", "3"] {
        let r = got[cid].as_str().unwrap_or("missing");
        assert!(
            r != "reached" && r != "answered" && r != "missing",
            "CID {cid} port 5000 reached as uid 65534: {got}"
        );
    }
    // The kernel layer: without CONFIG_VSOCKETS_LOOPBACK there is no
    // transport for CID 1 at all (with it: a reset, or the agent).
    assert_eq!(
        got["1"], "ENODEV",
        "the guest kernel still has vsock loopback: {got}"
    );
    if let Some(own) = got["own_cid"]
        .as_u64()
        .filter(|c| *c != 2 && *c != 0xFFFF_FFFF)
    {
        let r = got[own.to_string()].as_str().unwrap_or("missing");
        assert!(r != "reached" && r != "answered", "own CID reached: {got}");
    }
    // The API's own path still works (as root, as before).
    let v = h.exec("vs", "id -u");
    assert_eq!(stdout_of(&v).trim(), "0", "{v}");
}
