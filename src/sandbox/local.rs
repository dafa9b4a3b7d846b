//! The guest agent run as a plain host process, one per sandbox, on a Unix
//! socket. NO ISOLATION: commands run on the host as the daemon's user. For
//! development and for testing the daemon without VMs; `serve` only uses it
//! with an explicit `--backend local-process`.

use super::{Result, Sandbox, SandboxError, SandboxFactory, SandboxSpec, TemplateInfo, ID_PREFIX};
use crate::agent::AgentClient;
use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct LocalProcessFactory {
    agent_bin: PathBuf,
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
            run_root,
            templates: vec![TemplateInfo {
                name: "default".into(),
                description:
                    "host process running the guest agent (no isolation; development only)".into(),
                vcpus: 1,
                mem_mib: 256,
                is_default: true,
            }],
        })
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
        "local-process"
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
        let mut cmd = Command::new(&self.agent_bin);
        cmd.arg("--listen")
            .arg(format!("unix:{}", sock.display()))
            .arg("--workspace")
            .arg(dir.join("workspace"));
        for (k, v) in &spec.env {
            cmd.arg("--env").arg(format!("{k}={v}"));
        }
        cmd.env("SANDBOX_AGENT_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let child = cmd
            .spawn()
            .map_err(|e| fail("spawn agent", format!("{}: {e}", self.agent_bin.display())))?;
        let mut sb = LocalSandbox {
            id: spec.id.clone(),
            dir,
            child: Some(child),
            agent: None,
        };
        let out = sb.child.as_mut().and_then(|c| c.stdout.take());
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

pub struct LocalSandbox {
    id: String,
    dir: PathBuf,
    child: Option<Child>,
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
        if let Some(mut child) = self.child.take() {
            let pid = child.id() as i32;
            // SIGTERM lets the agent kill its children's process groups.
            // SAFETY: our own child, not yet reaped, so the pid is ours.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            let end = Instant::now() + Duration::from_secs(2);
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
        self.child.iter().map(|c| c.id() as i32).collect()
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
