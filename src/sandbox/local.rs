//! The guest agent run as a plain host process, one per sandbox, on a Unix
//! socket. NO ISOLATION: commands run on the host as the daemon's user. For
//! development and for testing the daemon without VMs; `serve` only uses it
//! with an explicit `--backend local-process`.

use super::{Result, Sandbox, SandboxError, SandboxFactory, SandboxSpec, TemplateInfo, ID_PREFIX};
use crate::agent::AgentClient;
use crate::harden::spawner::{Child as SpawnedChild, SpawnRequest, SpawnerClient};
use std::io::{BufRead, BufReader};
use std::os::fd::{AsFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct LocalProcessFactory {
    agent_bin: PathBuf,
    /// The hardened daemon cannot fork or exec: it asks its spawner.
    spawner: Option<SpawnerClient>,
    /// Parent of every sandbox's directory (socket + workspace).
    run_root: PathBuf,
    templates: Vec<TemplateInfo>,
}

impl LocalProcessFactory {
    pub fn new(agent_bin: PathBuf, run_root: PathBuf) -> Result<Self> {
        if !agent_bin.is_file() {
            return Err(SandboxError::Other(format!(
                "agent binary {} not found (build it with `cargo build -p sandbox-agent` \
                 or pass --agent-bin)",
                agent_bin.display()
            )));
        }
        std::fs::create_dir_all(&run_root).map_err(|e| {
            SandboxError::Other(format!("create run dir {}: {e}", run_root.display()))
        })?;
        Ok(LocalProcessFactory {
            agent_bin,
            spawner: None,
            run_root,
            templates: vec![TemplateInfo {
                name: "default".into(),
                display_name: "Local process".into(),
                version: env!("CARGO_PKG_VERSION").into(),
                description:
                    "host process running the guest agent (no isolation; development only)".into(),
                tools: Vec::new(),
                vcpus: 1,
                mem_mib: 256,
                is_default: true,
                builtin: true,
                source: None,
            }],
        })
    }

    /// Start agents through the daemon's spawner (which must allow
    /// `agent_bin` to run as the daemon's own uid: there is no isolation
    /// in this backend anyway).
    pub fn with_spawner(mut self, s: SpawnerClient) -> Self {
        self.spawner = Some(s);
        self
    }

    /// `sandbox-agent` next to the running executable (cargo puts both in
    /// the same target directory).
    pub fn default_agent_bin() -> PathBuf {
        std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(|d| d.join("sandbox-agent")))
            .unwrap_or_else(|| PathBuf::from("sandbox-agent"))
    }
}

impl SandboxFactory for LocalProcessFactory {
    fn backend(&self) -> &'static str {
        crate::vm::BackendKind::LocalProcess.as_str()
    }

    fn templates(&self) -> Vec<TemplateInfo> {
        self.templates.clone()
    }

    fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>> {
        if !self.templates.iter().any(|t| t.name == spec.template) {
            return Err(SandboxError::UnknownTemplate(spec.template.clone()));
        }
        let fail = |what: &'static str, msg: String| SandboxError::Failed {
            id: spec.id.clone(),
            what,
            msg,
        };
        let dir = self.run_root.join(&spec.id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| fail("create dir", format!("{}: {e}", dir.display())))?;
        let sock = dir.join("agent.sock");
        let mut args: Vec<String> = vec![
            "--listen".into(),
            format!("unix:{}", sock.display()),
            "--workspace".into(),
            dir.join("workspace").display().to_string(),
        ];
        for (k, v) in &spec.env {
            args.push("--env".into());
            args.push(format!("{k}={v}"));
        }
        let (child, out) = match &self.spawner {
            None => {
                let mut cmd = Command::new(&self.agent_bin);
                cmd.args(&args)
                    .env("SANDBOX_AGENT_LOG", "warn")
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::inherit());
                let mut child = cmd.spawn().map_err(|e| {
                    fail("spawn agent", format!("{}: {e}", self.agent_bin.display()))
                })?;
                let out = child
                    .stdout
                    .take()
                    .map(|o| std::fs::File::from(std::os::fd::OwnedFd::from(o)));
                (LocalChild::Direct(child), out)
            }
            Some(sp) => {
                let (rd, wr) = cloexec_pipe().map_err(|e| fail("pipe", e.to_string()))?;
                let mut argv = vec![self.agent_bin.display().to_string()];
                argv.extend(args);
                // The same environment a direct start would inherit.
                let mut env: Vec<(String, String)> = std::env::vars()
                    .filter(|(k, _)| k != "SANDBOX_AGENT_LOG")
                    .collect();
                env.push(("SANDBOX_AGENT_LOG".into(), "warn".into()));
                // SAFETY: geteuid/getegid have no preconditions.
                let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
                let req = SpawnRequest {
                    argv,
                    env,
                    cwd: Some(dir.display().to_string()),
                    uid,
                    gid,
                    fds: vec![1, 2],
                    new_process_group: false,
                    ..SpawnRequest::default()
                };
                let stderr = std::io::stderr();
                let child = sp.spawn(&req, &[wr.as_fd(), stderr.as_fd()]).map_err(|e| {
                    fail("spawn agent", format!("{}: {e}", self.agent_bin.display()))
                })?;
                drop(wr);
                (LocalChild::Spawned(child), Some(rd))
            }
        };
        let mut sb = LocalSandbox {
            id: spec.id.clone(),
            dir,
            child: Some(child),
            agent: None,
        };
        let mut line = String::new();
        if let Some(out) = out {
            let _ = BufReader::new(out).read_line(&mut line);
        }
        if !line.starts_with(crate::proto::READY_LINE) {
            let _ = sb.destroy();
            return Err(fail("start agent", format!("agent printed {line:?}")));
        }
        let stream = UnixStream::connect(&sock)
            .map_err(|e| fail("connect", format!("{}: {e}", sock.display())));
        let client = stream.and_then(|s| {
            AgentClient::connect(s, Duration::from_secs(10))
                .map_err(|e| fail("agent hello", e.to_string()))
        });
        match client {
            Ok(c) => {
                sb.agent = Some(c);
                Ok(Box::new(sb))
            }
            Err(e) => {
                let _ = sb.destroy();
                Err(e)
            }
        }
    }

    fn sweep_orphans(&self) -> Result<usize> {
        // An agent whose command line names a sandbox dir under our run root
        // belongs to a daemon that died without cleaning up.
        let marker = format!("{}/{ID_PREFIX}", self.run_root.display());
        let mut n = 0;
        for pid in procs_with(&marker) {
            // SAFETY: kill with a pid read from /proc; a pid reused in the
            // meantime would have to carry our marker too.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            n += 1;
        }
        if let Ok(rd) = std::fs::read_dir(&self.run_root) {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().starts_with(ID_PREFIX) {
                    let _ = std::fs::remove_dir_all(e.path());
                    n += 1;
                }
            }
        }
        Ok(n)
    }
}

enum LocalChild {
    Direct(Child),
    Spawned(SpawnedChild),
}

impl LocalChild {
    fn pid(&self) -> i32 {
        match self {
            LocalChild::Direct(c) => c.id() as i32,
            LocalChild::Spawned(c) => c.pid(),
        }
    }

    /// SIGTERM (lets the agent kill its children's process groups), then
    /// SIGKILL after a grace period; reaps a direct child.
    fn stop(self) {
        let end = Instant::now() + Duration::from_secs(2);
        match self {
            LocalChild::Direct(mut child) => {
                // SAFETY: our own child, not yet reaped, so the pid is ours.
                unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
                loop {
                    match child.try_wait() {
                        Ok(Some(_)) => break,
                        Ok(None) if Instant::now() < end => {
                            std::thread::sleep(Duration::from_millis(5))
                        }
                        _ => {
                            let _ = child.kill();
                            let _ = child.wait();
                            break;
                        }
                    }
                }
            }
            LocalChild::Spawned(child) => {
                let _ = child.kill(libc::SIGTERM);
                if !matches!(child.wait_until(end), Ok(Some(_))) {
                    let _ = child.kill(libc::SIGKILL);
                    let _ = child.wait_until(Instant::now() + Duration::from_secs(2));
                }
            }
        }
    }
}

fn cloexec_pipe() -> std::io::Result<(std::fs::File, std::fs::File)> {
    let mut p = [0; 2];
    // SAFETY: pipe2 writes two fds into our array.
    if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both fds are new and owned here.
    Ok(unsafe {
        (
            std::fs::File::from_raw_fd(p[0]),
            std::fs::File::from_raw_fd(p[1]),
        )
    })
}

pub struct LocalSandbox {
    id: String,
    dir: PathBuf,
    child: Option<LocalChild>,
    agent: Option<AgentClient>,
}

impl Sandbox for LocalSandbox {
    fn id(&self) -> &str {
        &self.id
    }

    fn agent(&self) -> &AgentClient {
        match &self.agent {
            Some(a) => a,
            // A LocalSandbox is only handed out once its agent is connected.
            None => unreachable!("local sandbox {} without agent", self.id),
        }
    }

    fn destroy(&mut self) -> Result<()> {
        if let Some(a) = &self.agent {
            a.close();
        }
        if let Some(child) = self.child.take() {
            child.stop();
        }
        if self.dir.exists() {
            std::fs::remove_dir_all(&self.dir).map_err(|e| SandboxError::Failed {
                id: self.id.clone(),
                what: "remove dir",
                msg: format!("{}: {e}", self.dir.display()),
            })?;
        }
        Ok(())
    }

    fn pids(&self) -> Vec<i32> {
        self.child.iter().map(LocalChild::pid).collect()
    }
}

impl Drop for LocalSandbox {
    fn drop(&mut self) {
        let _ = self.destroy();
    }
}

/// Pids of live processes whose command line contains `marker`.
pub fn procs_with(marker: &str) -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    let me = std::process::id() as i32;
    for e in rd.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if pid == me {
            continue;
        }
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmd).contains(marker) {
            out.push(pid);
        }
    }
    out
}
