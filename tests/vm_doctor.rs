//! `doctor` on this host: structured checks agree with what the QEMU
//! backend found, every non-ok item carries a fix, images are reported.

#[path = "common/skip.rs"]
mod skip;
#[path = "common/vm.rs"]
mod vm;

use agent_sandbox::vm::doctor::{self, Status};
use agent_sandbox::vm::qemu::Accel;

#[test]
fn doctor_reports_this_host_with_fixes() {
    let Some(e) = vm::env() else { return };
    let _g = vm::serial();
    e.registry
        .ensure_snapshot("base")
        .expect("snapshot of base");
    let report = doctor::run(&doctor::Options::default(), Some(&e.registry));
    let text = report.to_string();
    eprintln!("{text}");
    for c in &report.checks {
        if c.status != Status::Ok {
            assert!(
                c.fix.is_some(),
                "{} is {:?} without a fix",
                c.name,
                c.status
            );
        }
    }
    assert_eq!(report.get("qemu").expect("qemu check").status, Status::Ok);
    // The doctor's KVM verdict is the backend's.
    let accel = e.backend.resolve_accel(Some(&e.kernel)).expect("accel");
    let kvm = report.get("kvm").expect("kvm check");
    assert_eq!(
        kvm.status == Status::Ok,
        accel == Accel::Kvm,
        "{kvm:?} vs {accel:?}"
    );
    let base = report.get("template base").expect("base template check");
    assert_eq!(base.status, Status::Ok, "{base:?}");
    assert!(report.get("image: kernel").is_some());
    assert!(text.contains("fix:") || report.checks.iter().all(|c| c.status == Status::Ok));
    let json = serde_json::to_value(&report).expect("serialize");
    assert!(json["checks"].as_array().is_some_and(|a| !a.is_empty()));
}
