//! Template builds the daemon runs for admins (`POST /v1/templates`).
//!
//! The hardened daemon can neither exec nor hold the privileges an image
//! build needs (unpacking files of any owner, buildah's runc containers).
//! So, like the spawner, a **builder** process is forked at start, before
//! hardening, and keeps root: it takes one kind of request, a
//! [`BuildSpec`] under a build id, runs `agent-sandbox template build
//! ... --json` for it, and streams the build's [`Event`]s back. It runs
//! nothing else: a compromised daemon can ask for builds (what an admin
//! may), not for commands. `RUN` steps get no network unless the daemon
//! was started allowing it. If the daemon goes, the builder kills its
//! builds and exits.
//!
//! On the daemon side [`Builds`] keeps each build's status (steps, bytes,
//! log tail, the error) for `GET /v1/templates/builds/:id`, and makes the
//! template's snapshot when the image is ready.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::sync::lock;
pub use crate::vm::build::{BuildError, BuildNetwork, BuildSpec, Event};

/// Builds running at once; more are refused until one ends.
pub const MAX_RUNNING: usize = 2;
/// Finished builds kept for their status.
pub const MAX_KEPT: usize = 64;
/// A build still running after this is killed (a registry that never
/// answers, a `RUN` that never ends), with every process it started.
pub const BUILD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3600);
/// Largest Dockerfile accepted from the API.
pub const MAX_DOCKERFILE: usize = 64 * 1024;

/// What the builder is fixed to at fork.
#[derive(Debug, Clone)]
pub struct BuilderConfig {
    /// This program (`/proc/self/exe` at start).
    pub exe: PathBuf,
    pub cache_dir: PathBuf,
    pub templates_dir: PathBuf,
    pub agent: PathBuf,
    pub max_mib: u64,
    /// May a build's `RUN` steps have the host's network.
    pub allow_host_network: bool,
}

#[derive(Serialize, Deserialize)]
struct Req {
    id: String,
    spec: BuildSpec,
}

#[derive(Serialize, Deserialize)]
struct Msg {
    id: String,
    #[serde(default)]
    event: Option<Event>,
    /// The build's process ended (after its last event).
    #[serde(default)]
    exit: Option<String>,
}

/// The daemon's end of the builder.
pub struct BuilderHandle {
    sock: UnixStream,
    pid: i32,
}

impl BuilderHandle {
    pub fn pid(&self) -> i32 {
        self.pid
    }
}

/// Forks the builder. Call while the process is single-threaded, before
/// hardening.
pub fn fork_builder(cfg: BuilderConfig) -> std::io::Result<BuilderHandle> {
    let (ours, theirs) = UnixStream::pair()?;
    // SAFETY: the caller guarantees a single-threaded process, so the
    // child may run arbitrary code after fork.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if pid == 0 {
        drop(ours);
        // SAFETY: prctl with integer arguments and a NUL-terminated name:
        // die with the daemon; a name that tells it apart in `ps`.
        unsafe {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            libc::prctl(libc::PR_SET_NAME, c"asbx-builder".as_ptr(), 0, 0, 0);
        }
        builder_main(cfg, theirs);
        // SAFETY: leave without running the daemon's exit handlers.
        unsafe { libc::_exit(0) };
    }
    drop(theirs);
    Ok(BuilderHandle { sock: ours, pid })
}

/// argv of `template build` for `spec`.
fn argv(cfg: &BuilderConfig, spec: &BuildSpec) -> Vec<String> {
    let mut a = vec![
        cfg.exe.display().to_string(),
        "template".into(),
        "build".into(),
        spec.name.clone(),
        "--json".into(),
        "--no-snapshot".into(),
        "--agent".into(),
        cfg.agent.display().to_string(),
        "--max-mib".into(),
        cfg.max_mib.to_string(),
    ];
    let mut opt = |k: &str, v: Option<String>| {
        if let Some(v) = v {
            a.push(format!("--{k}={v}"));
        }
    };
    opt("from", spec.from.clone());
    opt(
        "dockerfile",
        spec.dockerfile.as_ref().map(|p| p.display().to_string()),
    );
    opt(
        "context",
        spec.context.as_ref().map(|p| p.display().to_string()),
    );
    opt("display-name", spec.display_name.clone());
    opt("description", spec.description.clone());
    opt("tools", spec.tools.as_ref().map(|t| t.join(",")));
    opt("vcpus", spec.vcpus.map(|v| v.to_string()));
    opt("memory-mib", spec.memory_mib.map(|v| v.to_string()));
    opt("disk-mib", spec.disk_mib.map(|v| v.to_string()));
    let net = match spec.network {
        BuildNetwork::Host if cfg.allow_host_network => "host",
        _ => "none",
    };
    a.push(format!("--network={net}"));
    if spec.insecure_registry {
        a.push("--insecure-registry".into());
    }
    a
}

fn builder_main(cfg: BuilderConfig, sock: UnixStream) {
    let Ok(out) = sock.try_clone() else { return };
    let out = Arc::new(Mutex::new(out));
    let send = {
        let out = out.clone();
        move |m: &Msg| {
            if let Ok(mut l) = serde_json::to_vec(m) {
                l.push(b'\n');
                let _ = lock(&out).write_all(&l);
            }
        }
    };
    let children: Arc<Mutex<Vec<u32>>> = Arc::default();
    for line in BufReader::new(sock).lines() {
        let Ok(line) = line else { break };
        let Ok(req) = serde_json::from_str::<Req>(&line) else {
            continue;
        };
        let argv = argv(&cfg, &req.spec);
        let cfg = cfg.clone();
        let send = send.clone();
        let children = children.clone();
        std::thread::spawn(move || {
            let fail = |m: String| Msg {
                id: req.id.clone(),
                event: Some(Event::Failed(BuildError {
                    step: "start".into(),
                    at: None,
                    message: m,
                    log_tail: Vec::new(),
                })),
                exit: Some("not started".into()),
            };
            let (r, w) = match crate::vm::build::pipe() {
                Ok(p) => p,
                Err(e) => return send(&fail(format!("pipe: {e}"))),
            };
            let w2 = match w.try_clone() {
                Ok(w2) => w2,
                Err(e) => return send(&fail(format!("pipe: {e}"))),
            };
            let mut cmd = Command::new(&argv[0]);
            cmd.args(&argv[1..])
                .env_clear()
                .env(
                    "PATH",
                    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                )
                .env("HOME", "/root")
                .env("AGENT_SANDBOX_CACHE", &cfg.cache_dir)
                .env("AGENT_SANDBOX_TEMPLATES", &cfg.templates_dir)
                .env("RUST_LOG", "warn")
                .current_dir("/")
                .process_group(0)
                .stdin(Stdio::null())
                .stdout(Stdio::from(w))
                .stderr(Stdio::from(w2));
            let mut child = match cmd.spawn() {
                Ok(c) => c,
                Err(e) => return send(&fail(format!("start {}: {e}", argv[0]))),
            };
            cmd.stdout(Stdio::null()).stderr(Stdio::null());
            lock(&children).push(child.id());
            {
                // Its own process group: the timeout takes skopeo, buildah
                // and RUN steps with it.
                let (pid, kids) = (child.id(), children.clone());
                std::thread::spawn(move || {
                    std::thread::sleep(BUILD_TIMEOUT);
                    if lock(&kids).contains(&pid) {
                        // SAFETY: kill with integer arguments; our child's group.
                        unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
                    }
                });
            }
            for l in BufReader::new(r).lines() {
                let Ok(l) = l else { break };
                let event = serde_json::from_str::<Event>(&l).unwrap_or(Event::Log { line: l });
                send(&Msg {
                    id: req.id.clone(),
                    event: Some(event),
                    exit: None,
                });
            }
            let st = child
                .wait()
                .map(|s| s.to_string())
                .unwrap_or_else(|e| e.to_string());
            lock(&children).retain(|p| *p != child.id());
            send(&Msg {
                id: req.id.clone(),
                event: None,
                exit: Some(st),
            });
        });
    }
    // The daemon is gone: so are its builds.
    for pid in lock(&children).iter() {
        // SAFETY: kill with integer arguments; our own children's groups.
        unsafe { libc::kill(-(*pid as i32), libc::SIGKILL) };
    }
}

/// One step as a build's status shows it.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StepView {
    pub name: String,
    /// `pending`, `running`, `done`, `failed`.
    pub status: &'static str,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Bytes {
    pub done: u64,
    pub total: u64,
}

/// `GET /v1/templates/builds/:id`.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BuildView {
    pub build_id: String,
    pub template: String,
    /// `building`, `ready`, `failed`.
    pub status: &'static str,
    /// The step running (or that failed).
    pub step: Option<String>,
    pub steps: Vec<StepView>,
    pub bytes: Bytes,
    pub log_tail: Vec<String>,
    pub error: Option<BuildError>,
    pub started_at: u64,
    pub finished_at: Option<u64>,
    pub digest: Option<String>,
    pub image_bytes: Option<u64>,
    pub cached: Option<bool>,
    #[serde(skip)]
    owner_dir: Option<PathBuf>,
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl BuildView {
    fn set_step(&mut self, name: &str, status: &'static str) {
        for s in &mut self.steps {
            if s.name == name {
                s.status = status;
            } else if status == "running" && s.status == "running" {
                s.status = "done";
            }
        }
        self.step = Some(name.into());
    }

    fn log(&mut self, l: String) {
        if self.log_tail.len() == crate::vm::build::LOG_TAIL {
            self.log_tail.remove(0);
        }
        self.log_tail.push(l);
    }

    fn fail(&mut self, e: BuildError) {
        let step = e.step.clone();
        if self.steps.iter().any(|s| s.name == step) {
            self.set_step(&step, "failed");
        } else {
            self.step = Some(step);
        }
        self.status = "failed";
        self.error = Some(e);
        self.finished_at = Some(now());
    }
}

/// Makes a template's snapshot once its image is ready.
pub type SnapshotHook = Arc<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// The daemon's builds.
pub struct Builds {
    tx: Mutex<UnixStream>,
    jobs: Arc<Mutex<BTreeMap<String, BuildView>>>,
    dir: PathBuf,
    seq: AtomicU64,
    cache_dir: PathBuf,
}

impl Builds {
    /// Takes over the builder: a thread reads its events into the jobs'
    /// status and, for a ready image, runs `snapshot` (then `ready`).
    pub fn start(
        handle: BuilderHandle,
        state_dir: PathBuf,
        cache_dir: PathBuf,
        snapshot: SnapshotHook,
    ) -> std::io::Result<Arc<Builds>> {
        let rx = handle.sock.try_clone()?;
        let dir = state_dir.join("builds");
        // What a crashed run left; made again by the first Dockerfile.
        let _ = std::fs::remove_dir_all(&dir);
        let jobs: Arc<Mutex<BTreeMap<String, BuildView>>> = Arc::default();
        let b = Arc::new(Builds {
            tx: Mutex::new(handle.sock),
            jobs: jobs.clone(),
            dir,
            seq: AtomicU64::new(0),
            cache_dir: cache_dir.clone(),
        });
        std::thread::Builder::new()
            .name("template-builds".into())
            .spawn(move || {
                for line in BufReader::new(rx).lines() {
                    let Ok(line) = line else { break };
                    let Ok(m) = serde_json::from_str::<Msg>(&line) else {
                        continue;
                    };
                    on_msg(&jobs, &snapshot, &cache_dir, m);
                }
                log::error!("template builder process ended: no more template builds");
                for v in lock(&jobs).values_mut() {
                    if v.status == "building" {
                        v.fail(BuildError {
                            step: v.step.clone().unwrap_or_else(|| "start".into()),
                            at: None,
                            message: "the builder process ended".into(),
                            log_tail: Vec::new(),
                        });
                    }
                }
            })?;
        Ok(b)
    }

    /// Starts a build; `dockerfile_text` (from the API) is written into a
    /// directory of the build's, which is its context unless one is given.
    pub fn start_build(
        &self,
        mut spec: BuildSpec,
        dockerfile_text: Option<String>,
    ) -> Result<BuildView, String> {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        let id = format!("b{}{n}", now() % 100_000_000);
        let mut jobs = lock(&self.jobs);
        if jobs.values().filter(|v| v.status == "building").count() >= MAX_RUNNING {
            return Err(format!(
                "{MAX_RUNNING} builds are running: retry when one has ended"
            ));
        }
        if jobs
            .values()
            .any(|v| v.status == "building" && v.template == spec.name)
        {
            return Err(format!("template {} is being built", spec.name));
        }
        let mut owner_dir = None;
        if let Some(text) = dockerfile_text {
            let d = self.dir.join(&id);
            std::fs::create_dir_all(&d).map_err(|e| format!("{}: {e}", d.display()))?;
            let f = d.join("Dockerfile");
            std::fs::write(&f, text).map_err(|e| format!("{}: {e}", f.display()))?;
            spec.dockerfile = Some(f);
            if spec.context.is_none() {
                spec.context = Some(d.clone());
            }
            owner_dir = Some(d);
        }
        let steps = if spec.dockerfile.is_some() {
            crate::vm::build::STEPS_DOCKERFILE
        } else {
            crate::vm::build::STEPS_IMAGE
        };
        let view = BuildView {
            build_id: id.clone(),
            template: spec.name.clone(),
            status: "building",
            step: None,
            steps: steps
                .iter()
                .chain(["snapshot"].iter())
                .map(|s| StepView {
                    name: s.to_string(),
                    status: "pending",
                })
                .collect(),
            bytes: Bytes::default(),
            log_tail: Vec::new(),
            error: None,
            started_at: now(),
            finished_at: None,
            digest: None,
            image_bytes: None,
            cached: None,
            owner_dir,
        };
        let mut line = serde_json::to_vec(&Req {
            id: id.clone(),
            spec,
        })
        .map_err(|e| e.to_string())?;
        line.push(b'\n');
        lock(&self.tx)
            .write_all(&line)
            .map_err(|e| format!("template builder: {e}"))?;
        // Oldest finished ones go first.
        while jobs.len() >= MAX_KEPT {
            let Some(k) = jobs
                .iter()
                .filter(|(_, v)| v.status != "building")
                .min_by_key(|(_, v)| v.started_at)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            jobs.remove(&k);
        }
        jobs.insert(id, view.clone());
        Ok(view)
    }

    pub fn get(&self, id: &str) -> Option<BuildView> {
        lock(&self.jobs).get(id).cloned()
    }

    /// Whether a build of `name` is running.
    pub fn building(&self, name: &str) -> bool {
        lock(&self.jobs)
            .values()
            .any(|v| v.status == "building" && v.template == name)
    }

    /// At shutdown: the API's Dockerfiles go (running builds die with the
    /// builder when the daemon exits).
    pub fn close(&self) {
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                log::warn!("{}: {e}", self.dir.display());
            }
        }
    }

    pub fn cache_dir(&self) -> &std::path::Path {
        &self.cache_dir
    }
}

fn on_msg(
    jobs: &Arc<Mutex<BTreeMap<String, BuildView>>>,
    snapshot: &SnapshotHook,
    cache_dir: &std::path::Path,
    m: Msg,
) {
    let mut g = lock(jobs);
    let Some(v) = g.get_mut(&m.id) else { return };
    if v.status != "building" {
        return;
    }
    match m.event {
        Some(Event::Step { name, .. }) => {
            v.set_step(&name, "running");
            v.bytes = Bytes::default();
        }
        Some(Event::Bytes { done, total }) => v.bytes = Bytes { done, total },
        Some(Event::Log { line }) => v.log(line),
        Some(Event::Failed(e)) => v.fail(e),
        Some(Event::Ready(b)) => {
            v.digest = Some(b.digest);
            v.image_bytes = Some(b.image_bytes);
            v.cached = Some(b.cached);
            v.set_step("snapshot", "running");
            let name = v.template.clone();
            let id = m.id.clone();
            let owner = v.owner_dir.clone();
            drop(g);
            // The snapshot boots a VM: not on the reader's thread.
            let jobs = jobs.clone();
            let snapshot = snapshot.clone();
            let cache = cache_dir.to_path_buf();
            let _ = std::thread::Builder::new()
                .name(format!("snapshot-{name}"))
                .spawn(move || {
                    let r = snapshot(&name);
                    if let Some(d) = owner {
                        let _ = std::fs::remove_dir_all(d);
                    }
                    let mut g = lock(&jobs);
                    let Some(v) = g.get_mut(&id) else { return };
                    match r {
                        Ok(()) => {
                            v.set_step("snapshot", "done");
                            v.status = "ready";
                            v.step = None;
                            v.finished_at = Some(now());
                        }
                        Err(e) => {
                            // Not half there: a template that cannot boot goes.
                            let _ = crate::vm::build::remove(&cache, &name);
                            v.fail(BuildError {
                                step: "snapshot".into(),
                                at: None,
                                message: e,
                                log_tail: Vec::new(),
                            });
                        }
                    }
                });
        }
        None => {
            if let Some(exit) = m.exit {
                // Ended without a verdict of its own (killed, crashed).
                if v.error.is_none() && v.digest.is_none() {
                    let step = v.step.clone().unwrap_or_else(|| "start".into());
                    let tail = v.log_tail.clone();
                    let msg = tail.last().cloned().unwrap_or_default();
                    v.fail(BuildError {
                        step,
                        at: None,
                        message: format!("the build ended ({exit}): {msg}"),
                        log_tail: tail,
                    });
                }
                if v.status == "failed" {
                    if let Some(d) = v.owner_dir.take() {
                        let _ = std::fs::remove_dir_all(d);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argv_keeps_the_network_off_unless_allowed() {
        let cfg = BuilderConfig {
            exe: "/bin/agent-sandbox".into(),
            cache_dir: "/c".into(),
            templates_dir: "/t".into(),
            agent: "/a".into(),
            max_mib: 10,
            allow_host_network: false,
        };
        let spec = BuildSpec {
            name: "x".into(),
            from: Some("oci-archive:/f --dockerfile=/etc/passwd".into()),
            network: BuildNetwork::Host,
            ..Default::default()
        };
        let a = argv(&cfg, &spec);
        assert!(a.contains(&"--network=none".to_string()));
        // One argument, whatever it holds: no flag can be smuggled in.
        assert!(a.contains(&"--from=oci-archive:/f --dockerfile=/etc/passwd".to_string()));
        let a = argv(
            &BuilderConfig {
                allow_host_network: true,
                ..cfg
            },
            &spec,
        );
        assert!(a.contains(&"--network=host".to_string()));
    }
}
