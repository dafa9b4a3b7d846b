//! Session layer behaviour with an in-process server and a wrapped factory:
//! slow sandbox creation blocks nobody else, failed creation is reported
//! and cleaned up, the warm pool serves new sessions.

mod common;
#[path = "common/skip.rs"]
mod skip;

use agent_sandbox::api::Server;
use agent_sandbox::config::Config;
use agent_sandbox::sandbox::local::LocalProcessFactory;
use agent_sandbox::sandbox::{
    Result as SbResult, Sandbox, SandboxError, SandboxFactory, SandboxSpec, TemplateInfo,
};
use common::daemon::{stdout_of, Http};
use common::wait_until;
use serde_json::json;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The local-process factory plus three extra templates: `slow` takes 3 s
/// to create, `broken` always fails, `stalling` fails after 4 s (a boot
/// that times out). While `hold` is set, `slow` and `stalling` do not
/// start their wait (up to a minute): a test orders events with it instead
/// of racing the clock.
struct Wrapped {
    inner: LocalProcessFactory,
    created: AtomicUsize,
    stalled: AtomicUsize,
    slow_made: AtomicUsize,
    hold: AtomicBool,
}

impl Wrapped {
    fn held(&self) {
        let t = Instant::now();
        while self.hold.load(Ordering::SeqCst) && t.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl SandboxFactory for Wrapped {
    fn backend(&self) -> &'static str {
        "test"
    }
    fn templates(&self) -> Vec<TemplateInfo> {
        let mut t = self.inner.templates();
        for name in ["slow", "broken", "stalling"] {
            let mut x = t[0].clone();
            x.name = name.into();
            x.is_default = false;
            t.push(x);
        }
        t
    }
    fn create(&self, spec: &SandboxSpec) -> SbResult<Box<dyn Sandbox>> {
        self.created.fetch_add(1, Ordering::SeqCst);
        let mut s = spec.clone();
        match spec.template.as_str() {
            "broken" => {
                return Err(SandboxError::Other(
                    "template broken: kernel missing".into(),
                ))
            }
            "slow" => {
                self.held();
                std::thread::sleep(Duration::from_secs(3));
                self.slow_made.fetch_add(1, Ordering::SeqCst);
            }
            "stalling" => {
                self.held();
                std::thread::sleep(Duration::from_secs(4));
                self.stalled.fetch_add(1, Ordering::SeqCst);
                return Err(SandboxError::Other(
                    "template stalling: timed out waiting for the agent".into(),
                ));
            }
            _ => {}
        }
        s.template = "default".into();
        self.inner.create(&s)
    }
}

/// The server, shut down when dropped: a failing test leaves no agent
/// processes behind either.
struct Running(Option<Server>);

impl Running {
    fn addr(&self) -> std::net::SocketAddr {
        self.0.as_ref().map(Server::addr).expect("server running")
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

fn start(pool: usize) -> (Running, Arc<Wrapped>, tempfile::TempDir) {
    start_held(pool, false)
}

fn start_held(pool: usize, hold: bool) -> (Running, Arc<Wrapped>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let factory = Arc::new(Wrapped {
        inner: LocalProcessFactory::new(common::agent_bin(), dir.path().join("run")).unwrap(),
        created: AtomicUsize::new(0),
        stalled: AtomicUsize::new(0),
        slow_made: AtomicUsize::new(0),
        hold: AtomicBool::new(hold),
    });
    let cfg = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        state_dir: dir.path().into(),
        key_file: dir.path().join("keys.json"),
        auth: false,
        pool_size: pool,
        ..Config::default()
    };
    let server = Server::start(cfg, factory.clone()).unwrap();
    (Running(Some(server)), factory, dir)
}

#[test]
fn slow_creation_blocks_no_one_and_failures_are_clean() {
    let (server, f, _dir) = start_held(0, true);
    let h = Http::new(&format!("http://{}", server.addr()), None);
    let h2 = h.clone();
    let slow = std::thread::spawn(move || {
        let t = Instant::now();
        let r = h2.post(
            "/exec/tortoise/execute",
            &json!({"template": "slow", "command": "echo slow"}),
        );
        (r.status, stdout_of(&r.json()), t.elapsed())
    });
    assert!(wait_until(Duration::from_secs(10), || f
        .created
        .load(Ordering::SeqCst)
        >= 1));
    // Answered while the tortoise's sandbox is still being made (held
    // until we let go): a creation that blocked others would hold these.
    let v = h.exec("hare", "echo fast");
    assert_eq!(stdout_of(&v), "fast\n");
    assert_eq!(h.get("/exec").status, 200);
    assert_eq!(f.slow_made.load(Ordering::SeqCst), 0, "hare waited");
    f.hold.store(false, Ordering::SeqCst);
    let (st, out, took) = slow.join().unwrap();
    assert_eq!((st, out.as_str()), (200, "slow\n"));
    assert!(took >= Duration::from_secs(3));

    // A sandbox that cannot be made: a clear 503, and no session left.
    let r = h.post(
        "/exec/doomed/execute",
        &json!({"template": "broken", "command": "true"}),
    );
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.code(), "session_failed");
    assert!(r.text().contains("kernel missing"));
    let ids: Vec<String> = h.get("/exec").json()["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect();
    assert!(!ids.contains(&"doomed".to_string()), "{ids:?}");
    let r = h.post(
        "/v1/sessions",
        &json!({"id": "doomed2", "template": "broken"}),
    );
    assert_eq!(r.status, 503);
    assert_eq!(h.get("/v1/sessions/doomed2").status, 404);
    let m = h.get("/metrics").text();
    assert!(m.contains("kind=\"sandbox_create\""), "{m}");
    server.shutdown();
}

#[test]
fn warm_pool_serves_new_sessions() {
    let (server, f, dir) = start(1);
    let h = Http::new(&format!("http://{}", server.addr()), None);
    // One warm sandbox per template (`broken` and `stalling` keep failing).
    assert!(wait_until(Duration::from_secs(10), || {
        h.get("/metrics")
            .text()
            .contains("agent_sandbox_pool_size{template=\"default\"} 1")
    }));
    // `slow` fills too (after 3 s): from then on the pooled sandboxes'
    // processes are all there is.
    assert!(wait_until(Duration::from_secs(20), || {
        h.get("/metrics")
            .text()
            .contains("agent_sandbox_pool_size{template=\"slow\"} 1")
    }));
    let marker = dir.path().display().to_string();
    let warm = common::procs_with(&marker);
    assert!(!warm.is_empty(), "no warm sandbox process");
    let before = f.created.load(Ordering::SeqCst);
    let v = h.exec("warm", "echo warm");
    assert_eq!(stdout_of(&v), "warm\n");
    // The pool refills in the background.
    assert!(wait_until(Duration::from_secs(10), || {
        h.get("/metrics")
            .text()
            .contains("agent_sandbox_pool_size{template=\"default\"} 1")
            && f.created.load(Ordering::SeqCst) > before
    }));
    // The session had a pooled sandbox: deleting it ends one of the pooled
    // processes (a sandbox of its own would leave them all running).
    assert!(warm.iter().all(|p| common::procs_with(&marker).contains(p)));
    assert_eq!(h.delete("/exec/warm").status, 200);
    assert!(
        wait_until(Duration::from_secs(10), || warm
            .iter()
            .any(|p| !common::procs_with(&marker).contains(p))),
        "every pooled sandbox {warm:?} outlived the session"
    );
    // A session with another shape does not use the pool.
    let r = h.post("/v1/sessions", &json!({"id": "big", "vcpus": 2}));
    assert_eq!(r.status, 201);
    server.shutdown();
    // Shutdown destroyed the sessions and the warm sandboxes.
    assert!(wait_until(Duration::from_secs(5), || common::procs_with(
        &marker
    )
    .is_empty()));
}

/// A template whose sandboxes fail only after a long wait (a boot timing
/// out) holds up no other template's refill: each template has its own
/// filler, and a failing one backs off. Taken warm sandboxes come back at
/// once, both during its first (hanging) attempt and after it failed.
#[test]
fn a_failing_template_does_not_hold_up_the_pool() {
    // `stalling` is held in its first attempt until the first round is done.
    let (server, f, _dir) = start_held(1, true);
    let h = Http::new(&format!("http://{}", server.addr()), None);
    let pooled = |h: &Http| {
        h.get("/metrics")
            .text()
            .contains("agent_sandbox_pool_size{template=\"default\"} 1")
    };
    // The refill must not wait for `stalling`: each round checks it came
    // while `stalling` was still in the same attempt (or backoff).
    let take_and_refill = |round: &str| {
        let stalled = f.stalled.load(Ordering::SeqCst);
        let v = h.exec(&format!("warm-{round}"), "echo warm");
        assert_eq!(stdout_of(&v), "warm\n");
        assert!(
            wait_until(Duration::from_secs(20), || pooled(&h)),
            "{round}: no refill"
        );
        assert_eq!(
            f.stalled.load(Ordering::SeqCst),
            stalled,
            "{round}: the refill waited for `stalling`"
        );
    };
    assert!(wait_until(Duration::from_secs(10), || pooled(&h)));
    // `stalling` is held inside its first attempt (`slow` too).
    assert_eq!(f.stalled.load(Ordering::SeqCst), 0);
    take_and_refill("during");
    f.hold.store(false, Ordering::SeqCst);
    assert!(wait_until(Duration::from_secs(10), || f
        .stalled
        .load(Ordering::SeqCst)
        >= 1));
    take_and_refill("after");
    // One failure, then the 5 s backoff: no second attempt finished yet.
    assert_eq!(f.stalled.load(Ordering::SeqCst), 1);
    server.shutdown();
}
