//! The session layer's stateful-session machinery (issue #21) with an
//! in-process server over a factory whose sandboxes "checkpoint" (a file
//! written into the checkpoint directory) and "restore" (a new agent
//! process, after checking that file): pause and resume, resume on the
//! first request, the idle pause, `pausedTtl`, quotas, fork and creates
//! from a checkpoint, paused sessions across a restart, and that every
//! checkpoint's files go with their last user. What the VM really keeps is
//! `tests/rest_state.rs`'s.

mod common;
#[path = "common/skip.rs"]
mod skip;

use agent_sandbox::agent::AgentClient;
use agent_sandbox::api::Server;
use agent_sandbox::config::Config;
use agent_sandbox::sandbox::local::LocalProcessFactory;
use agent_sandbox::sandbox::{
    CheckpointStats, Result as SbResult, Sandbox, SandboxError, SandboxFactory, SandboxSpec,
    TemplateInfo,
};
use common::daemon::Http;
use common::wait_until;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

struct Ckpt {
    inner: LocalProcessFactory,
    restores: AtomicUsize,
}

struct CkptSandbox(Box<dyn Sandbox>);

const MARK: &str = "memory";

impl Sandbox for CkptSandbox {
    fn id(&self) -> &str {
        self.0.id()
    }
    fn agent(&self) -> &AgentClient {
        self.0.agent()
    }
    fn destroy(&mut self) -> SbResult<()> {
        self.0.destroy()
    }
    fn pids(&self) -> Vec<i32> {
        self.0.pids()
    }
    fn checkpoint(&mut self, dir: &Path) -> SbResult<CheckpointStats> {
        std::fs::write(dir.join(MARK), vec![7u8; 64 << 10])
            .map_err(|e| SandboxError::Other(format!("write {}: {e}", dir.display())))?;
        Ok(CheckpointStats {
            paused: Duration::from_millis(3),
            bytes: 64 << 10,
        })
    }
}

impl SandboxFactory for Ckpt {
    fn backend(&self) -> &'static str {
        "test"
    }
    fn templates(&self) -> Vec<TemplateInfo> {
        self.inner.templates()
    }
    fn create(&self, spec: &SandboxSpec) -> SbResult<Box<dyn Sandbox>> {
        Ok(Box::new(CkptSandbox(self.inner.create(spec)?)))
    }
    fn restore(&self, spec: &SandboxSpec, dir: &Path) -> SbResult<Box<dyn Sandbox>> {
        self.check_restorable(spec, dir)?;
        self.restores.fetch_add(1, Ordering::SeqCst);
        self.create(spec)
    }
    fn check_restorable(&self, _: &SandboxSpec, dir: &Path) -> SbResult<()> {
        if dir.join(MARK).is_file() {
            Ok(())
        } else {
            Err(SandboxError::Unrestorable(format!(
                "{} has no {MARK}",
                dir.display()
            )))
        }
    }
}

struct Running(Option<Server>, Arc<Ckpt>);

impl Running {
    fn http(&self) -> Http {
        let addr = self.0.as_ref().map(Server::addr).expect("server");
        Http::new(&format!("http://{addr}"), None)
    }
    fn shutdown(mut self) {
        if let Some(s) = self.0.take() {
            s.shutdown();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            s.shutdown();
        }
    }
}

fn start(state: &Path, tweak: impl FnOnce(&mut Config)) -> Running {
    let factory = Arc::new(Ckpt {
        inner: LocalProcessFactory::new(common::agent_bin(), state.join("run")).expect("factory"),
        restores: AtomicUsize::new(0),
    });
    let mut cfg = Config {
        listen: "127.0.0.1:0".parse().expect("addr"),
        state_dir: state.into(),
        key_file: state.join("keys.json"),
        auth: false,
        pool_size: 0,
        ..Config::default()
    };
    tweak(&mut cfg);
    let server = Server::start(cfg, factory.clone()).expect("server");
    Running(Some(server), factory)
}

fn checkpoint_dirs(state: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(state.join("checkpoints"))
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

fn exec_ok(h: &Http, id: &str) {
    let r = h.post(
        &format!("/v1/sessions/{id}/exec"),
        &json!({"command": "true"}),
    );
    assert_eq!(r.status, 200, "exec in {id}: {}", r.text());
}

#[test]
fn pause_resume_restart_and_the_files_of_each_checkpoint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let srv = start(dir.path(), |_| {});
    let h = srv.http();
    assert_eq!(h.post("/v1/sessions", &json!({"id": "a"})).status, 201);
    let r = h.post("/v1/sessions/a/pause", &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["state"], "paused");
    assert_eq!(v["snapshotBytes"], 64 << 10);
    assert!(
        v["pausedExpiresAt"].as_u64() > v["pausedAt"].as_u64(),
        "{v}"
    );
    assert_eq!(checkpoint_dirs(dir.path()).len(), 1);
    // Pausing again is nothing; a resume restores it, its checkpoint goes.
    assert_eq!(h.post("/v1/sessions/a/pause", &json!({})).status, 200);
    let r = h.post("/v1/sessions/a/resume", &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["state"], "ready");
    assert_eq!(srv.1.restores.load(Ordering::SeqCst), 1);
    assert!(checkpoint_dirs(dir.path()).is_empty());
    // An exec resumes a paused session by itself.
    assert_eq!(h.post("/v1/sessions/a/pause", &json!({})).status, 200);
    exec_ok(&h, "a");
    assert_eq!(srv.1.restores.load(Ordering::SeqCst), 2);
    // Deleting a paused session removes its checkpoint.
    assert_eq!(h.post("/v1/sessions/a/pause", &json!({})).status, 200);
    assert!(h.delete("/v1/sessions/a").status < 300);
    assert!(
        wait_until(Duration::from_secs(5), || checkpoint_dirs(dir.path())
            .is_empty()),
        "{:?}",
        checkpoint_dirs(dir.path())
    );

    // Across a restart: paused kept and listed, running gone.
    assert_eq!(h.post("/v1/sessions", &json!({"id": "b"})).status, 201);
    assert_eq!(h.post("/v1/sessions", &json!({"id": "c"})).status, 201);
    assert_eq!(h.post("/v1/sessions/b/pause", &json!({})).status, 200);
    let r = h.post("/v1/sessions/c/snapshots", &json!({"name": "keep"}));
    assert_eq!(r.status, 201, "{}", r.text());
    let sid = r.json()["id"].as_str().expect("id").to_string();
    // What a crash mid-checkpoint leaves: swept at the next start.
    let torn = dir.path().join("checkpoints/.tmp-snap-0123456789ab");
    std::fs::create_dir_all(&torn).expect("mkdir");
    std::fs::write(torn.join(MARK), b"half").expect("write");
    srv.shutdown();
    let srv = start(dir.path(), |_| {});
    let h = srv.http();
    assert!(!torn.exists(), "torn checkpoint not swept");
    let v = h.get("/v1/sessions/b").json();
    assert_eq!(v["state"], "paused", "{v}");
    assert_eq!(h.get("/v1/sessions/c").status, 404);
    let snaps = h.get("/v1/snapshots").json();
    assert_eq!(snaps["snapshots"][0]["id"], sid.as_str(), "{snaps}");
    assert_eq!(snaps["snapshots"][0]["restorable"], true);
    exec_ok(&h, "b");
    assert_eq!(h.get("/v1/sessions/b").json()["state"], "ready");

    // Sessions from the checkpoint; it stays until deleted.
    let r = h.post("/v1/sessions", &json!({"fromSnapshot": sid, "count": 3}));
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["sessions"].as_array().map(Vec::len), Some(3));
    assert_eq!(checkpoint_dirs(dir.path()).len(), 1);
    assert!(h.delete(&format!("/v1/snapshots/{sid}")).status < 300);
    assert!(wait_until(Duration::from_secs(5), || checkpoint_dirs(
        dir.path()
    )
    .is_empty()));
    // An unrestorable checkpoint is listed as such, and refused.
    let r = h.post("/v1/sessions/b/snapshots", &json!({}));
    assert_eq!(r.status, 201, "{}", r.text());
    let sid2 = r.json()["id"].as_str().expect("id").to_string();
    let d2 = dir.path().join("checkpoints").join(&sid2);
    std::fs::remove_file(d2.join(MARK)).expect("rm");
    let v = h.get(&format!("/v1/snapshots/{sid2}")).json();
    assert_eq!(v["restorable"], false, "{v}");
    assert!(
        v["problem"]
            .as_str()
            .is_some_and(|p| p.contains("no memory")),
        "{v}"
    );
    let r = h.post("/v1/sessions", &json!({"fromSnapshot": sid2}));
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(r.code(), "snapshot_unrestorable");
    srv.shutdown();
}

#[test]
fn forks_idle_pause_ttl_and_quotas() {
    let dir = tempfile::tempdir().expect("tempdir");
    let srv = start(dir.path(), |c| {
        c.max_paused_per_key = 1;
        c.max_sessions = 6;
        c.reap_interval = Duration::from_secs(1);
    });
    let h = srv.http();
    assert_eq!(h.post("/v1/sessions", &json!({"id": "src"})).status, 201);
    let r = h.post("/v1/sessions/src/fork", &json!({"count": 3}));
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    assert_eq!(v["sourceId"], "src");
    let ids: Vec<String> = v["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_string())
        .collect();
    assert_eq!(ids.len(), 3);
    for id in &ids {
        exec_ok(&h, id);
    }
    // Fork checkpoints are not listed and go once the copies are up.
    assert!(h.get("/v1/snapshots").json()["snapshots"]
        .as_array()
        .is_some_and(Vec::is_empty));
    assert!(wait_until(Duration::from_secs(5), || checkpoint_dirs(
        dir.path()
    )
    .is_empty()));
    // 4 running of 6: a fork of 3 does not fit, and leaves nothing.
    let r = h.post("/v1/sessions/src/fork", &json!({"count": 3}));
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.code(), "at_capacity");
    assert_eq!(
        h.get("/v1/sessions").json()["sessions"]
            .as_array()
            .map(Vec::len),
        Some(4)
    );
    assert!(wait_until(Duration::from_secs(5), || checkpoint_dirs(
        dir.path()
    )
    .is_empty()));
    // One paused session per key here.
    assert_eq!(
        h.post(&format!("/v1/sessions/{}/pause", ids[0]), &json!({}))
            .status,
        200
    );
    let r = h.post(&format!("/v1/sessions/{}/pause", ids[1]), &json!({}));
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.code(), "quota_exceeded");
    assert!(r.message().contains("max_paused_per_key"), "{}", r.text());
    // A paused session frees its capacity: 3 running of 6 now.
    let r = h.post("/v1/sessions", &json!({"id": "extra"}));
    assert_eq!(r.status, 201, "{}", r.text());
    assert!(h.delete(&format!("/v1/sessions/{}", ids[0])).status < 300);

    // onIdle pause: paused by the reaper, then removed after pausedTtl.
    let r = h.post(
        "/v1/sessions",
        &json!({"id": "sleepy", "idleTimeout": 1, "onIdle": "pause", "pausedTtl": 3}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["onIdle"], "pause");
    assert!(
        wait_until(Duration::from_secs(10), || h
            .get("/v1/sessions/sleepy")
            .json()["state"]
            == "paused"),
        "not paused when idle: {}",
        h.get("/v1/sessions/sleepy").text()
    );
    assert!(
        wait_until(Duration::from_secs(15), || h
            .get("/v1/sessions/sleepy")
            .status
            == 404),
        "paused session outlived its pausedTtl"
    );
    assert!(wait_until(Duration::from_secs(5), || checkpoint_dirs(
        dir.path()
    )
    .is_empty()));
    srv.shutdown();
}
