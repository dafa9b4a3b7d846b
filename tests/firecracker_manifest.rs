//! Snapshot manifest: staleness rules (backend-neutral, used by Firecracker).

use std::fs;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use agent_sandbox::vm::snapshot::{Inputs, Manifest, MANIFEST_FILE};
use agent_sandbox::vm::VmError;

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[test]
fn staleness_rules() {
    let t = TempDir(std::env::temp_dir().join(format!("fcm-{}", std::process::id())));
    let _ = fs::remove_dir_all(&t.0);
    let snap = t.0.join("snap");
    fs::create_dir_all(&snap).unwrap();
    let kernel = t.0.join("vmlinux");
    let rootfs = t.0.join("rootfs");
    fs::write(&kernel, b"kernel-1").unwrap();
    fs::write(&rootfs, vec![0u8; 10_000]).unwrap();
    fs::write(snap.join("vmstate"), b"s").unwrap();
    fs::write(snap.join("memory"), b"m").unwrap();
    let inputs = Inputs {
        backend: "firecracker",
        vmm_version: "Firecracker v1.16.1",
        kernel: &kernel,
        rootfs: &rootfs,
        vcpus: 2,
        mem_mib: 256,
        devices: agent_sandbox::vm::snapshot::devices_of(Some("06:00:ac:10:00:02"), "sandbox.ip=x"),
    };
    let m = Manifest::create(&inputs, vec!["vmstate".into(), "memory".into()]).unwrap();
    assert_eq!(m.kernel.sha256.len(), 64);
    m.write(&snap).unwrap();
    let m = Manifest::read(&snap).unwrap();
    assert_eq!(m.is_stale(&snap, &inputs), None);

    // A touched but unchanged file is still fresh (hash fallback).
    let f = fs::File::options().write(true).open(&kernel).unwrap();
    f.set_modified(SystemTime::now() + Duration::from_secs(60))
        .unwrap();
    drop(f);
    assert_eq!(m.is_stale(&snap, &inputs), None);
    // A copy elsewhere with the same content is fresh too.
    let copy = t.0.join("vmlinux.copy");
    fs::copy(&kernel, &copy).unwrap();
    assert_eq!(
        m.is_stale(
            &snap,
            &Inputs {
                kernel: &copy,
                ..inputs.clone()
            }
        ),
        None
    );

    let stale = |i: &Inputs| m.is_stale(&snap, i).expect("should be stale");
    assert!(stale(&Inputs {
        vmm_version: "Firecracker v1.17.0",
        ..inputs.clone()
    })
    .contains("v1.17.0"));
    assert!(stale(&Inputs {
        backend: "qemu",
        ..inputs.clone()
    })
    .contains("qemu"));
    assert!(stale(&Inputs {
        devices: agent_sandbox::vm::snapshot::devices_of(None, "sandbox.ip=x"),
        ..inputs.clone()
    })
    .contains("net=none"));
    assert!(stale(&Inputs {
        vcpus: 4,
        ..inputs.clone()
    })
    .contains("4 vCPUs"));
    fs::write(&kernel, b"kernel-2").unwrap();
    assert!(stale(&inputs).contains("kernel") && stale(&inputs).contains("content"));
    fs::write(&kernel, b"kernel-1").unwrap();
    fs::write(&rootfs, vec![0u8; 10_001]).unwrap();
    assert!(stale(&inputs).contains("rootfs") && stale(&inputs).contains("size"));
    fs::write(&rootfs, vec![0u8; 10_000]).unwrap();
    assert_eq!(m.is_stale(&snap, &inputs), None);
    fs::remove_file(snap.join("memory")).unwrap();
    assert!(stale(&inputs).contains("missing"));
    fs::remove_file(&rootfs).unwrap();
    fs::write(snap.join("memory"), b"m").unwrap();
    assert!(stale(&inputs).contains("rootfs"));

    // Corrupt or hostile manifests are clear errors naming the file.
    fs::write(snap.join(MANIFEST_FILE), b"{not json").unwrap();
    let e = Manifest::read(&snap).unwrap_err();
    assert!(
        matches!(&e, VmError::BadFile { path, .. } if path.ends_with(MANIFEST_FILE)),
        "{e}"
    );
    let mut j: serde_json::Value = serde_json::to_value(&m).unwrap();
    j["files"] = serde_json::json!(["../../etc/passwd"]);
    fs::write(snap.join(MANIFEST_FILE), j.to_string()).unwrap();
    assert!(Manifest::read(&snap)
        .unwrap_err()
        .to_string()
        .contains("bad file name"));
    assert!(!snap.join(format!(".{MANIFEST_FILE}.tmp")).exists());
}
