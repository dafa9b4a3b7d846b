//! Runs the real `agent-sandbox serve` binary on 127.0.0.1 with an
//! ephemeral port and a private state dir, and talks to it over HTTP.
//!
//! The backend defaults to `local-process` (the real guest agent as a host
//! process). Set `AGENT_SANDBOX_TEST_BACKEND=qemu` (plus any extra flags in
//! `AGENT_SANDBOX_TEST_ARGS`) to run the same tests through real VMs.
#![allow(dead_code)]

use super::agent_bin;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The first API key and the listening URL a starting `serve` prints on
/// stdout (empty if it exits first); stdout is drained from then on so the
/// daemon never blocks on it.
pub fn read_banner(child: &mut Child) -> (String, String) {
    read_banner_from(child.stdout.take().expect("stdout"))
}

/// [`read_banner`] on a stdout already taken from its child.
pub fn read_banner_from(out: std::process::ChildStdout) -> (String, String) {
    let mut lines = BufReader::new(out).lines();
    let (mut key, mut base) = (String::new(), String::new());
    for line in lines.by_ref() {
        let line = line.expect("read daemon stdout");
        if let Some(k) = line.split("API key: ").nth(1) {
            key = k.trim().to_string();
        }
        if let Some(u) = line.split("listening on ").nth(1) {
            base = u.trim().to_string();
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    (key, base)
}

/// `serve` flags for per-session networking through a test topology
/// (`tests/common/netns.rs`) whose host namespace is at `host`, with a
/// prefix of its own and, when given, `dns` as the upstream resolver.
pub fn net_args(host: &std::path::Path, dns: Option<&str>) -> Vec<String> {
    let mut v: Vec<String> = ["--network", "on", "--uplink", "up0", "--net-host-netns"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.push(host.display().to_string());
    v.push("--net-prefix".into());
    v.push(unique_prefix());
    if let Some(d) = dns {
        v.push("--dns-upstream".into());
        v.push(d.into());
    }
    v
}

/// `t` + 5 hex digits, unique per test process and call.
pub fn unique_prefix() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!(
        "t{:05x}",
        (std::process::id().wrapping_mul(64) + n) & 0xfffff
    )
}

thread_local! {
    /// A command `serve` is started through (`start_in_cgroups`).
    static WRAP: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

pub struct Daemon {
    pub child: Option<Child>,
    /// `--net-prefix` of a VM daemon: what its namespaces are named by.
    pub net_prefix: Option<String>,
    pub base: String,
    /// The first admin+exec+metrics key the daemon printed.
    pub key: String,
    pub dir: tempfile::TempDir,
}

impl Daemon {
    pub fn start(extra: &[&str]) -> Daemon {
        let dir = tempfile::Builder::new()
            .prefix("sbx-daemon-test")
            .tempdir()
            .expect("tempdir");
        Self::start_in(dir, extra)
    }

    /// A daemon on the `local-process` backend whatever the tests' backend
    /// (for API-level checks that need no VM).
    pub fn start_local(extra: &[&str]) -> Daemon {
        Self::start_local_agent(&agent_bin(), extra)
    }

    /// A `local-process` daemon whose sandboxes run `agent` (a stand-in
    /// for the guest agent, such as a hostile one), whatever the test
    /// backend is.
    pub fn start_local_agent(agent: &std::path::Path, extra: &[&str]) -> Daemon {
        let dir = tempfile::Builder::new()
            .prefix("sbx-daemon-test")
            .tempdir()
            .expect("tempdir");
        Self::start_with(dir, "local-process", agent, extra)
    }

    pub fn start_in(dir: tempfile::TempDir, extra: &[&str]) -> Daemon {
        Self::start_with(dir, &super::test_backend(), &agent_bin(), extra)
    }

    /// A daemon started inside the cgroups whose `cgroup.procs` files are
    /// `procs` (a shell moves itself there, then execs `serve`), the way
    /// systemd starts a unit in its own cgroup.
    pub fn start_in_cgroups(
        dir: tempfile::TempDir,
        procs: &[std::path::PathBuf],
        extra: &[&str],
    ) -> Daemon {
        let mut script = String::new();
        for p in procs {
            script.push_str(&format!("echo $$ > '{}' && ", p.display()));
        }
        script.push_str("exec \"$@\"");
        WRAP.with(|w| *w.borrow_mut() = vec!["sh".into(), "-c".into(), script, "sh".into()]);
        // `--backend X` in `extra` picks the backend (else the tests' one).
        let at = extra.iter().position(|a| *a == "--backend");
        let backend = at
            .and_then(|i| extra.get(i + 1))
            .map_or_else(super::test_backend, |b| b.to_string());
        let rest: Vec<&str> = match at {
            Some(i) => extra[..i]
                .iter()
                .chain(extra.iter().skip(i + 2))
                .copied()
                .collect(),
            None => extra.to_vec(),
        };
        let d = Self::start_with(dir, &backend, &agent_bin(), &rest);
        WRAP.with(|w| w.borrow_mut().clear());
        d
    }

    fn start_with(
        dir: tempfile::TempDir,
        backend: &str,
        agent: &std::path::Path,
        extra: &[&str],
    ) -> Daemon {
        let backend = backend.to_string();
        let mut net_prefix = extra
            .iter()
            .position(|a| *a == "--net-prefix")
            .and_then(|i| extra.get(i + 1))
            .map(|p| p.to_string());
        let wrap = WRAP.with(|w| w.borrow().clone());
        let mut cmd = match wrap.split_first() {
            Some((prog, args)) => {
                let mut c = Command::new(prog);
                c.args(args).arg(env!("CARGO_BIN_EXE_agent-sandbox"));
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_agent-sandbox")),
        };
        cmd.arg("serve")
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--state-dir")
            .arg(dir.path())
            .arg("--backend")
            .arg(&backend);
        if backend == "local-process" {
            cmd.arg("--agent-bin").arg(agent);
        }
        if backend != "local-process" {
            // VMs of test daemons have no network unless a test builds its
            // own topology (and says so); each daemon gets its own name
            // prefix, so its start-up sweep leaves other daemons' alone.
            if !extra.contains(&"--network") {
                cmd.args(["--network", "off"]);
            }
            if net_prefix.is_none() {
                let p = unique_prefix();
                cmd.args(["--net-prefix", &p]);
                net_prefix = Some(p);
            }
        }
        cmd.args(super::default_template_args(&backend, extra));
        if let Ok(a) = std::env::var("AGENT_SANDBOX_TEST_ARGS") {
            cmd.args(a.split_whitespace());
        }
        let log = std::fs::File::create(dir.path().join("daemon.log")).expect("log file");
        let mut child = cmd
            .args(extra)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("spawn agent-sandbox serve");
        let (key, base) = read_banner(&mut child);
        assert!(
            !base.is_empty(),
            "daemon did not start; log:\n{}",
            std::fs::read_to_string(dir.path().join("daemon.log")).unwrap_or_default()
        );
        Daemon {
            child: Some(child),
            net_prefix,
            base,
            key,
            dir,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    pub fn http(&self) -> Http {
        Http::new(&self.base, Some(&self.key))
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }

    /// Processes (other than the daemon) whose command line names our
    /// state dir: the sandboxes we started.
    pub fn sandbox_procs(&self) -> Vec<i32> {
        let me = self.pid();
        let daemon_exe = std::fs::canonicalize(env!("CARGO_BIN_EXE_agent-sandbox")).ok();
        super::procs_with(&self.dir.path().display().to_string())
            .into_iter()
            .filter(|&p| p != me)
            // The daemon's spawner is a fork of the daemon (same command
            // line), not a sandbox.
            .filter(|&p| std::fs::read_link(format!("/proc/{p}/exe")).ok() != daemon_exe)
            .collect()
    }

    /// [`Daemon::sandbox_procs`] of sessions: without the standby VMMs
    /// (started ahead for the next session, no guest in them). A VMM
    /// counts once its VM id (`-name agent-sandbox-<id>`) has served a
    /// session (`ready as <id>` in the log).
    pub fn session_procs(&self) -> Vec<i32> {
        of_sessions(self.sandbox_procs(), &self.log())
    }

    /// Sessions restored into a standby VMM so far (all templates), from
    /// `/metrics`.
    pub fn standby_used(&self) -> u64 {
        self.http()
            .get("/metrics")
            .text()
            .lines()
            .filter(|l| l.starts_with("agent_sandbox_standby_vmm_used_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }

    /// The pid of the VMM that serves `session` (its VM id from the
    /// daemon's `ready as <id>` log line), if one runs.
    pub fn vmm_of(&self, session: &str) -> Option<i32> {
        let log = self.log();
        let tag = format!("/{session}: ready as ");
        let id = log
            .lines()
            .rev()
            .find_map(|l| l.split(&tag).nth(1)?.split_whitespace().next())?
            .to_string();
        self.sandbox_procs()
            .into_iter()
            .find(|p| vm_id_of(*p).as_deref() == Some(id.as_str()))
    }

    /// [`super::leftovers`] of this daemon's state dir and net prefix.
    pub fn leftovers(&self) -> Vec<String> {
        super::leftovers(self.dir.path(), self.net_prefix.as_deref())
    }

    /// SIGTERM and wait (bounded) for the exit status.
    pub fn terminate(&mut self, sig: i32) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        // SAFETY: our own child process.
        unsafe { libc::kill(child.id() as i32, sig) };
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(st)) = child.try_wait() {
                return Some(st);
            }
            if Instant::now() > end {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    /// Stop the daemon (if still running) and hand back its state dir, to
    /// start another daemon on it (`start_in`).
    pub fn into_dir(mut self) -> tempfile::TempDir {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let placeholder = tempfile::tempdir().expect("tempdir");
        std::mem::replace(&mut self.dir, placeholder)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // A clean shutdown first (it removes its sessions' VMs, namespaces
        // and links), then force.
        if self.child.is_some() {
            self.terminate(libc::SIGTERM);
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // Whatever a killed daemon left under its network prefix.
        if let Some(p) = &self.net_prefix {
            super::remove_netns_prefixed(p);
        }
        // Leave no sandbox behind even if a test failed half-way.
        for pid in super::procs_with(&self.dir.path().display().to_string()) {
            // SAFETY: processes carrying our private temp dir in their argv.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        super::remove_daemon_cgroups(self.dir.path());
    }
}

pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "status {} body is not JSON ({e}): {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    /// The code of an error answer, in either shape: v1's
    /// `{"error": {code, message}}` or the seed routes' `{"error":
    /// message, code}` (docs/api.md).
    pub fn code(&self) -> String {
        let v = self.json();
        v["error"]["code"]
            .as_str()
            .or(v["code"].as_str())
            .unwrap_or("")
            .to_string()
    }

    /// The message of an error answer, in either shape (see [`Resp::code`]).
    pub fn message(&self) -> String {
        let v = self.json();
        v["error"]["message"]
            .as_str()
            .or(v["error"].as_str())
            .unwrap_or("")
            .to_string()
    }
}

#[derive(Clone)]
pub struct Http {
    agent: ureq::Agent,
    pub base: String,
    pub key: Option<String>,
}

impl Http {
    pub fn new(base: &str, key: Option<&str>) -> Http {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(120)))
            .build()
            .into();
        Http {
            agent,
            base: base.to_string(),
            key: key.map(str::to_string),
        }
    }

    pub fn with_key(&self, key: &str) -> Http {
        let mut h = self.clone();
        h.key = Some(key.to_string());
        h
    }

    pub fn anonymous(&self) -> Http {
        let mut h = self.clone();
        h.key = None;
        h
    }

    /// A response as a [`Resp`] (panics if the request failed).
    pub fn finish(r: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Resp {
        let r = r.expect("HTTP request failed");
        let status = r.status().as_u16();
        let headers = r
            .headers()
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string()))
            .collect();
        let mut body = Vec::new();
        r.into_body()
            .into_reader()
            .read_to_end(&mut body)
            .expect("read body");
        Resp {
            status,
            headers,
            body,
        }
    }

    pub fn get(&self, path: &str) -> Resp {
        let mut rb = self.agent.get(format!("{}{path}", self.base));
        if let Some(k) = &self.key {
            rb = rb.header("Authorization", format!("Bearer {k}"));
        }
        Self::finish(rb.call())
    }

    pub fn delete(&self, path: &str) -> Resp {
        let mut rb = self.agent.delete(format!("{}{path}", self.base));
        if let Some(k) = &self.key {
            rb = rb.header("X-API-Key", k);
        }
        Self::finish(rb.call())
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> Resp {
        self.post_raw(path, body.to_string().as_bytes(), "application/json")
    }

    pub fn post_raw(&self, path: &str, body: &[u8], ct: &str) -> Resp {
        let mut rb = self
            .agent
            .post(format!("{}{path}", self.base))
            .content_type(ct);
        if let Some(k) = &self.key {
            rb = rb.header("X-API-Key", k);
        }
        Self::finish(rb.send(body))
    }

    pub fn put(&self, path: &str, body: &serde_json::Value) -> Resp {
        let mut rb = self
            .agent
            .put(format!("{}{path}", self.base))
            .content_type("application/json");
        if let Some(k) = &self.key {
            rb = rb.header("X-API-Key", k);
        }
        Self::finish(rb.send(body.to_string().as_bytes()))
    }

    pub fn put_raw(&self, path: &str, body: &[u8]) -> Resp {
        let mut rb = self
            .agent
            .put(format!("{}{path}", self.base))
            .content_type("application/octet-stream");
        if let Some(k) = &self.key {
            rb = rb.header("X-API-Key", k);
        }
        Self::finish(rb.send(body))
    }

    /// Starts a POST and returns the live body reader (for streams).
    pub fn post_stream(
        &self,
        path: &str,
        body: &serde_json::Value,
        accept: &str,
    ) -> (u16, Box<dyn BufRead + Send>) {
        let mut rb = self
            .agent
            .post(format!("{}{path}", self.base))
            .content_type("application/json")
            .header("Accept", accept);
        if let Some(k) = &self.key {
            rb = rb.header("X-API-Key", k);
        }
        let r = rb.send(body.to_string()).expect("HTTP request failed");
        let status = r.status().as_u16();
        (
            status,
            Box::new(BufReader::new(r.into_body().into_reader())),
        )
    }

    /// Starts a GET and returns the live body reader (for streams).
    pub fn get_stream(&self, path: &str) -> (u16, Box<dyn BufRead + Send>) {
        let mut rb = self
            .agent
            .get(format!("{}{path}", self.base))
            .header("Accept", "application/x-ndjson");
        if let Some(k) = &self.key {
            rb = rb.header("X-API-Key", k);
        }
        let r = rb.call().expect("HTTP request failed");
        let status = r.status().as_u16();
        (
            status,
            Box::new(BufReader::new(r.into_body().into_reader())),
        )
    }

    /// Runs a command through the seed endpoint and returns the JSON answer.
    pub fn exec(&self, session: &str, command: &str) -> serde_json::Value {
        let r = self.post(
            &format!("/exec/{session}/execute"),
            &serde_json::json!({ "command": command }),
        );
        assert_eq!(r.status, 200, "exec {command:?}: {}", r.text());
        r.json()
    }
}

impl Http {
    /// `sleep <marker>` processes in `session`'s sandbox, counted from
    /// inside it ([`super::count_sleepers_cmd`]) by another exec.
    pub fn sleepers_in(&self, session: &str, marker: &str) -> usize {
        let v = self.exec(session, &super::count_sleepers_cmd(marker));
        let out = stdout_of(&v);
        out.trim()
            .parse()
            .unwrap_or_else(|e| panic!("counting sleepers in {session}: {e}: {v}"))
    }
}

/// All stdout text of a seed/v1 buffered exec answer.
pub fn stdout_of(v: &serde_json::Value) -> String {
    v["output"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|e| e["stream"] == "stdout")
                .filter_map(|e| e["data"].as_str())
                .collect::<String>()
        })
        .unwrap_or_default()
}

/// Whether the tests run against a VM backend (`AGENT_SANDBOX_TEST_BACKEND`).
pub fn vm_backend() -> bool {
    super::test_backend() != "local-process"
}

/// Those of `procs` that are not standby VMMs, going by the daemon's
/// `log` (see [`Daemon::session_procs`]).
pub fn of_sessions(procs: Vec<i32>, log: &str) -> Vec<i32> {
    let served: Vec<&str> = log
        .lines()
        .filter_map(|l| l.split(": ready as ").nth(1))
        .filter_map(|r| r.split_whitespace().next())
        .collect();
    procs
        .into_iter()
        .filter(|p| vm_id_of(*p).is_none_or(|id| served.contains(&id.as_str())))
        .collect()
}

/// The VM id a VMM process runs (`-name agent-sandbox-<id>`), if it is one.
pub fn vm_id_of(pid: i32) -> Option<String> {
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<String> = cmd
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let i = args.iter().position(|a| a == "-name")?;
    Some(args.get(i + 1)?.strip_prefix("agent-sandbox-")?.to_string())
}

/// One stateless (2026-07-28) MCP `tools/call` over the daemon's `/mcp`:
/// (HTTP status, Retry-After header, JSON-RPC answer or Null).
pub fn mcp_call(
    d: &Daemon,
    key: &str,
    tool: &str,
    args: serde_json::Value,
) -> (u16, Option<String>, serde_json::Value) {
    let params = serde_json::json!({"name": tool, "arguments": args});
    mcp_rpc(d, key, "tools/call", Some(tool), params)
}

/// One stateless (2026-07-28) MCP request `method` over `/mcp` (`name`:
/// the `Mcp-Name` header of a tools/call), as [`mcp_call`].
pub fn mcp_rpc(
    d: &Daemon,
    key: &str,
    method: &str,
    name: Option<&str>,
    params: serde_json::Value,
) -> (u16, Option<String>, serde_json::Value) {
    mcp_rpc_at(&d.base, key, method, name, params)
}

/// [`mcp_rpc`] to the `/mcp` of `base` (a daemon, or a router in front).
pub fn mcp_rpc_at(
    base: &str,
    key: &str,
    method: &str,
    name: Option<&str>,
    mut params: serde_json::Value,
) -> (u16, Option<String>, serde_json::Value) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(std::time::Duration::from_secs(120)))
        .build()
        .into();
    let v = "2026-07-28";
    params["_meta"] = serde_json::json!({"io.modelcontextprotocol/protocolVersion": v,
                  "io.modelcontextprotocol/clientCapabilities": {},
                  "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"}});
    let call = serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    let mut req = agent
        .post(format!("{base}/mcp"))
        .header("Authorization", &format!("Bearer {key}"))
        .header("Accept", "application/json, text/event-stream")
        .header("MCP-Protocol-Version", v)
        .header("Mcp-Method", method);
    if let Some(n) = name {
        req = req.header("Mcp-Name", n);
    }
    let mut resp = req
        .content_type("application/json")
        .send(call.to_string().as_bytes())
        .expect("POST /mcp");
    let status = resp.status().as_u16();
    let retry = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    let data = text
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("data:"))
        .unwrap_or(&text)
        .trim();
    (
        status,
        retry,
        serde_json::from_str(data).unwrap_or(serde_json::Value::Null),
    )
}

/// One GET over a fresh connection to `addr` with `host` as its Host and
/// `extra` header lines: the status and the whole answer (head and body).
pub fn raw_get_whole(addr: &str, path: &str, host: &str, extra: &str) -> (u16, String) {
    use std::io::Write;
    let mut c = std::net::TcpStream::connect(addr).expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    write!(
        c,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n"
    )
    .expect("write request");
    let mut out = Vec::new();
    let _ = c.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}

/// [`raw_get_whole`]: the status and the body only.
pub fn raw_get(addr: &str, path: &str, host: &str, extra: &str) -> (u16, String) {
    let (status, text) = raw_get_whole(addr, path, host, extra);
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}
