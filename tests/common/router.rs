//! HAProxy in front of test daemons, with the config `agent-sandbox
//! router config` renders (issue #28): tests/router.rs, benches/router.rs.
#![allow(dead_code)]

use super::daemon::Daemon;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_agent-sandbox");

/// HAProxy in the foreground on a config file; killed on drop.
pub struct Haproxy {
    child: Child,
    pub base: String,
    pub stats: String,
    pub cfg: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Per-key quotas raised for one key's 60+ VM sessions (each host counts
/// its own), and its request rate for benchmarks.
pub const QUOTA_ARGS: &[&str] = &[
    "--max-sessions-per-key",
    "100",
    "--max-vcpus-per-key",
    "100",
    "--max-mem-mib-per-key",
    "65536",
    "--rate-limit",
    "100000",
    "--rate-burst",
    "100000",
];

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

pub fn addr_of(d: &Daemon) -> String {
    d.base.trim_start_matches("http://").to_string()
}

impl Haproxy {
    /// `agent-sandbox router config` for `hosts` (id, daemon), checked
    /// with `haproxy -c`, then started; waits until every host is up in
    /// the create backend.
    pub fn start(hosts: &[(&str, &Daemon)]) -> Haproxy {
        let hosts: Vec<(&str, &Daemon, Option<u16>)> =
            hosts.iter().map(|(id, d)| (*id, *d, None)).collect();
        Self::start_with(&hosts, None)
    }

    /// [`Haproxy::start`] with a preview frontend on 127.0.0.1:`preview`
    /// in front of each host's preview listener (127.0.0.1 and the port).
    pub fn start_with(hosts: &[(&str, &Daemon, Option<u16>)], preview: Option<u16>) -> Haproxy {
        let dir = tempfile::tempdir().expect("tempdir");
        let (port, stats) = (free_port(), free_port());
        let mut cmd = Command::new(BIN);
        cmd.args(["router", "config", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--stats-listen", &format!("127.0.0.1:{stats}")]);
        if let Some(p) = preview {
            cmd.args(["--preview-listen", &format!("127.0.0.1:{p}")]);
        }
        for (id, d, pv) in hosts {
            let pv = pv
                .map(|p| format!(",preview=127.0.0.1:{p}"))
                .unwrap_or_default();
            cmd.args(["--host", &format!("{id}={}{pv}", addr_of(d))]);
        }
        let out = cmd.output().expect("router config");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let cfg = dir.path().join("haproxy.cfg");
        std::fs::write(&cfg, &out.stdout).expect("write config");
        let check = Command::new("haproxy")
            .arg("-c")
            .arg("-f")
            .arg(&cfg)
            .output()
            .expect("haproxy -c");
        assert!(
            check.status.success(),
            "haproxy -c: {}{}",
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
        let log = std::fs::File::create(dir.path().join("haproxy.log")).expect("log");
        let child = Command::new("haproxy")
            .arg("-db")
            .arg("-f")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start haproxy");
        let h = Haproxy {
            child,
            base: format!("http://127.0.0.1:{port}"),
            stats: format!("http://127.0.0.1:{stats}"),
            cfg,
            _dir: dir,
        };
        let ids: Vec<&str> = hosts.iter().map(|(id, _, _)| *id).collect();
        h.wait_status("place", &ids, "UP");
        h
    }

    /// Until HAProxy's health checks see each of `servers` of `backend`
    /// as `status` (its stats CSV).
    pub fn wait_status(&self, backend: &str, servers: &[&str], status: &str) {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(5)))
            .build()
            .into();
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            // Refused until HAProxy listens.
            let csv = agent
                .get(format!("{}/stats;csv", self.stats))
                .call()
                .ok()
                .and_then(|mut r| r.body_mut().read_to_string().ok())
                .unwrap_or_default();
            let ok = servers.iter().all(|s| {
                csv.lines().any(|l| {
                    let f: Vec<&str> = l.split(',').collect();
                    f.len() > 17 && f[0] == backend && f[1] == *s && f[17].starts_with(status)
                })
            });
            if ok {
                return;
            }
            assert!(
                Instant::now() < end,
                "{backend}/{servers:?} not {status} after 30 s:\n{csv}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
