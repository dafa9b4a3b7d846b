//! Several hosts behind HAProxy (issue #28): three real daemons (their own
//! state dirs, net prefixes and listen addresses; VMs under the tests'
//! backend), one key file they all read, and a real HAProxy in front with
//! the config `agent-sandbox router config` renders. Everything below goes
//! through HAProxy only: REST, MCP over HTTP (its session header) and the
//! Python SDK. Which host answered is what each daemon reports itself
//! (`X-Asbx-Host` on every reply).

mod common;
#[path = "common/netns.rs"]
mod netns;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::{raw_get, stdout_of, Daemon, Http, Resp};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::router::{Haproxy, BIN};

fn host(r: &Resp) -> String {
    r.header("x-asbx-host").unwrap_or("").to_string()
}

fn tag(id: &str) -> &str {
    id.split('-').nth(1).unwrap_or("")
}

/// `POST /v1/sessions {}` through the router: 201, the id tagged with the
/// host that answered; recorded in `owner`. The host.
fn create(r: &Http, owner: &mut BTreeMap<String, String>, why: &str) -> String {
    let c = r.post("/v1/sessions", &json!({}));
    assert_eq!(c.status, 201, "{why}: {}", c.text());
    let id = c.json()["id"].as_str().expect("id").to_string();
    let h = host(&c);
    assert_eq!(tag(&id), h, "{id} made on {h}");
    owner.insert(id, h.clone());
    h
}

/// Sessions on each host, as each host counts them.
fn counts(ds: &[(&str, &Daemon)]) -> BTreeMap<String, u64> {
    ds.iter()
        .map(|(id, d)| {
            let v = d.http().get("/health").json();
            (id.to_string(), v["sessions"].as_u64().unwrap_or(0))
        })
        .collect()
}

/// A stateful MCP session (protocol 2025-06-18) through the router.
struct Mcp<'a> {
    http: &'a Http,
    sid: String,
    key: String,
}

impl<'a> Mcp<'a> {
    fn post(http: &Http, key: &str, sid: Option<&str>, msg: &Value) -> Resp {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(120)))
            .build()
            .into();
        let mut rb = agent
            .post(format!("{}/mcp", http.base))
            .header("Authorization", &format!("Bearer {key}"))
            .header("Accept", "application/json")
            .header("MCP-Protocol-Version", "2025-06-18")
            .content_type("application/json");
        if let Some(s) = sid {
            rb = rb.header("Mcp-Session-Id", s);
        }
        Http::finish(rb.send(msg.to_string().as_bytes()))
    }

    fn open(http: &'a Http, key: &str) -> (Mcp<'a>, String) {
        let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "router-test", "version": "1"}}});
        let r = Self::post(http, key, None, &init);
        assert_eq!(r.status, 200, "initialize: {}", r.text());
        let sid = r
            .header("mcp-session-id")
            .expect("Mcp-Session-Id")
            .to_string();
        assert_eq!(
            tag(&sid),
            host(&r),
            "MCP session {sid} made on {}",
            host(&r)
        );
        let m = Mcp {
            http,
            sid,
            key: key.to_string(),
        };
        let n = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        let r = Self::post(http, key, Some(&m.sid), &n);
        assert_eq!(r.status, 202, "{}", r.text());
        let h = host(&r);
        (m, h)
    }

    /// A tool call in this MCP session: its structured result and the host
    /// that answered.
    fn call(&self, tool: &str, args: Value) -> (Value, String) {
        let msg = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                         "params": {"name": tool, "arguments": args}});
        let r = Self::post(self.http, &self.key, Some(&self.sid), &msg);
        assert_eq!(r.status, 200, "{tool}: {}", r.text());
        let v = r.json();
        assert!(v["result"]["isError"] != true, "{tool}: {v}");
        (v["result"]["structuredContent"].clone(), host(&r))
    }
}

/// The Python SDK (from sdk/python/src, Debian's httpx) creating `n`
/// sandboxes through `base` and running a command in each; their ids.
fn sdk_sessions(base: &str, key: &str, n: usize) -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("sdk/python/src");
    let script = format!(
        r#"
import json
from agent_sandbox import Client, Sandbox
c = Client()
ids = []
for i in range({n}):
    s = Sandbox.create(client=c)
    r = s.commands.run("echo sdk-%d" % i)
    assert r.exit_code == 0 and r.stdout == "sdk-%d\n" % i, r
    assert s.info().id == s.id
    ids.append(s.id)
print(json.dumps(ids))
"#
    );
    let out = Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(script)
        .env("PYTHONPATH", &src)
        .env("AGENT_SANDBOX_URL", base)
        .env("AGENT_SANDBOX_API_KEY", key)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "SDK script: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.trim()).expect("ids")
}

fn drain_cmd(d: &Daemon, key: &str, args: &[&str]) -> String {
    let out = Command::new(BIN)
        .args(["drain", "--url", &d.base])
        .args(args)
        .env("AGENT_SANDBOX_API_KEY", key)
        .output()
        .expect("agent-sandbox drain");
    assert!(
        out.status.success(),
        "drain {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn sixty_sessions_over_three_hosts_behind_haproxy_stay_on_their_host() {
    if Command::new("haproxy").arg("-v").output().is_err() {
        skip!("haproxy is needed (Debian: apt install haproxy; images/install-deps.sh)");
    }
    if !Path::new("/usr/bin/python3").exists()
        || !Command::new("/usr/bin/python3")
            .args(["-c", "import httpx"])
            .status()
            .is_ok_and(|s| s.success())
    {
        skip!("Debian's python3 with httpx is needed for the SDK (apt install python3-httpx)");
    }
    // h1 is small, so creates fill it and must skip it later; all three
    // read the key file h1 made (keys valid on every host).
    let common_args = common::router::QUOTA_ARGS;
    let d1 = Daemon::start(
        &[
            &["--host-id", "h1", "--max-sessions", "26"][..],
            common_args,
        ]
        .concat(),
    );
    let keys = d1.state_dir().join("keys.json");
    let keys = keys.to_str().expect("path");
    let key = d1.key.clone();
    let more = |id: &'static str| {
        Daemon::start(
            &[
                &["--host-id", id, "--max-sessions", "60", "--key-file", keys][..],
                common_args,
            ]
            .concat(),
        )
    };
    let (d2, mut d3) = (more("h2"), more("h3"));
    let hosts = [("h1", &d1), ("h2", &d2), ("h3", &d3)];
    let router = Haproxy::start(&hosts);
    let r = Http::new(&router.base, Some(&key));

    // The router's config passes the doctor: haproxy -c, host ids, templates.
    let doc = Command::new(BIN)
        .args(["doctor", "--router"])
        .arg(&router.cfg)
        .env("AGENT_SANDBOX_API_KEY", &key)
        .output()
        .expect("doctor --router");
    let doc_out = String::from_utf8_lossy(&doc.stdout);
    assert!(
        doc.status.success(),
        "doctor --router:\n{doc_out}{}",
        String::from_utf8_lossy(&doc.stderr)
    );
    for h in ["h1", "h2", "h3"] {
        assert!(doc_out.contains(&format!("host id {h}")), "{doc_out}");
    }
    assert!(
        doc_out.contains("templates: the same on every host"),
        "{doc_out}"
    );
    let rd = r.get("/ready");
    assert_eq!(rd.status, 200, "{}", rd.text());
    assert_eq!(rd.json()["router"], true);

    // 60 sessions: 30 over REST, 15 in three MCP sessions, 15 by the SDK.
    let mut owner: BTreeMap<String, String> = BTreeMap::new();
    for _ in 0..30 {
        create(&r, &mut owner, "REST create");
    }
    let mut mcps = Vec::new();
    let mut mcp_ids = Vec::new();
    for _ in 0..3 {
        let (m, h) = Mcp::open(&r, &key);
        assert_eq!(
            h,
            tag(&m.sid),
            "the MCP session's requests stay on its host"
        );
        for _ in 0..5 {
            let (v, h) = m.call("create_session", json!({}));
            let id = v["sessionId"].as_str().expect("sessionId").to_string();
            assert_eq!(h, tag(&m.sid));
            assert_eq!(tag(&id), h);
            owner.insert(id.clone(), h);
            mcp_ids.push((mcps.len(), id));
        }
        mcps.push(m);
    }
    for id in sdk_sessions(&router.base, &key, 15) {
        owner.insert(id.clone(), tag(&id).to_string());
    }
    assert_eq!(owner.len(), 60);
    let mut spread: BTreeMap<&str, usize> = BTreeMap::new();
    for h in owner.values() {
        *spread.entry(h.as_str()).or_default() += 1;
    }
    let (min, max) = (
        spread.values().min().copied().unwrap_or(0),
        spread.values().max().copied().unwrap_or(0),
    );
    assert!(spread.len() == 3 && max <= 2 * min, "spread {spread:?}");
    eprintln!("FIGURE router spread of 60 sessions {spread:?}");
    assert_eq!(
        counts(&hosts).values().sum::<u64>(),
        60,
        "each host counts what the router sent it"
    );

    // Every request of a session on its host: REST v1, the seed's routes,
    // MCP in its session.
    for (id, h) in &owner {
        let e = r.post(
            &format!("/v1/sessions/{id}/exec"),
            &json!({"command": "echo v1"}),
        );
        assert_eq!(
            (e.status, host(&e).as_str()),
            (200, h.as_str()),
            "{id}: {}",
            e.text()
        );
        assert_eq!(stdout_of(&e.json()), "v1\n");
        let s = r.post(
            &format!("/exec/{id}/execute"),
            &json!({"command": "echo seed"}),
        );
        assert_eq!(
            (s.status, host(&s).as_str()),
            (200, h.as_str()),
            "{id}: {}",
            s.text()
        );
        let g = r.get(&format!("/v1/sessions/{id}"));
        assert_eq!((g.status, host(&g).as_str()), (200, h.as_str()), "{id}");
    }
    for (m, id) in &mcp_ids {
        let (v, h) = mcps[*m].call("execute", json!({"sessionId": id, "command": "echo mcp"}));
        assert_eq!(v["stdout"], "mcp\n");
        assert_eq!(&h, &owner[id]);
    }
    // Stateless MCP (2026-07-28): a call naming a session goes to its host
    // (the router reads `sessionId` from the body), one naming none to a
    // host that takes sessions.
    for h in ["h1", "h2", "h3"] {
        let id = owner
            .iter()
            .find(|(_, o)| *o == h)
            .map(|(id, _)| id.clone())
            .expect("a session");
        let (st, _, v) = common::daemon::mcp_rpc_at(
            &router.base,
            &key,
            "tools/call",
            Some("execute"),
            json!({"name": "execute", "arguments": {"sessionId": id, "command": "echo stateless"}}),
        );
        assert_eq!(st, 200, "{v}");
        assert_eq!(
            v["result"]["structuredContent"]["stdout"], "stateless\n",
            "{id}: {v}"
        );
    }
    let (st, _, v) = common::daemon::mcp_rpc_at(
        &router.base,
        &key,
        "tools/call",
        Some("create_session"),
        json!({"name": "create_session", "arguments": {}}),
    );
    assert_eq!(st, 200, "{v}");
    let made = v["result"]["structuredContent"]["sessionId"]
        .as_str()
        .expect("sessionId")
        .to_string();
    let g = r.get(&format!("/v1/sessions/{made}"));
    assert_eq!(
        (g.status, host(&g)),
        (200, tag(&made).to_string()),
        "{made}"
    );
    owner.insert(made.clone(), tag(&made).to_string());

    // Names a client chose (the seed creates on first use) hash to one host
    // and stay there.
    for i in 0..3 {
        let name = format!("box-{i}");
        let first = r.post(
            &format!("/exec/{name}/execute"),
            &json!({"command": "echo x"}),
        );
        assert_eq!(first.status, 200, "{}", first.text());
        for _ in 0..3 {
            let again = r.get(&format!("/v1/sessions/{name}"));
            assert_eq!((again.status, host(&again)), (200, host(&first)), "{name}");
        }
        owner.insert(name, host(&first));
    }

    // State stays on its host: a checkpoint, a session from it, a fork, a
    // pause and the resume by the next exec (VM backends only).
    if common::daemon::vm_backend() {
        stateful_on_its_host(&r, &mut owner);
    } else {
        skip::not_checked("checkpoints, forks and pauses behind the router need a VM backend");
    }
    let both = r.post(
        "/v1/sessions",
        &json!({"fromSnapshot": "snap-h2-0123456789ab", "id": "mine"}),
    );
    assert_eq!(both.status, 400, "{}", both.text());
    // What would land on one host only is refused at the router.
    let k = r.post("/admin/keys", &json!({"name": "x"}));
    assert_eq!(k.status, 501, "{}", k.text());
    assert_eq!(k.json()["code"], "not_supported");
    assert_eq!(r.post("/v1/admin/drain", &json!({})).status, 501);

    // A full host is skipped for creates: fill h1, then create more. The
    // first of those reach h1 before its health check sees it full: its
    // 503 at_capacity makes HAProxy retry them on another host.
    let mut made = 0;
    while counts(&hosts)["h1"] < 26 {
        create(&r, &mut owner, "a create while h1 fills");
        made += 1;
        assert!(made < 100, "h1 never filled: {:?}", counts(&hosts));
    }
    for _ in 0..6 {
        assert_ne!(create(&r, &mut owner, "a create while h1 is full"), "h1");
    }
    assert_eq!(
        counts(&hosts)["h1"],
        26,
        "h1 took sessions up to its maximum, no more"
    );
    router.wait_status("place", &["h1"], "DOWN");
    for _ in 0..3 {
        assert_ne!(create(&r, &mut owner, "h1 seen full"), "h1");
    }
    // ... never for an existing session's requests: a name that hashes to
    // the full h1 is answered by h1 itself.
    let mut refused = false;
    for i in 0..60 {
        let name = format!("full-{i}");
        let s = r.post(
            &format!("/exec/{name}/execute"),
            &json!({"command": "true"}),
        );
        if s.status == 503 {
            assert_eq!(host(&s), "h1", "{}", s.text());
            assert_eq!(s.json()["code"], "at_capacity", "{}", s.text());
            refused = true;
            break;
        }
        assert_eq!(s.status, 200, "{}", s.text());
        assert_ne!(host(&s), "h1");
        owner.insert(name, host(&s));
    }
    assert!(refused, "no name hashed to h1 in 60 tries");

    // Drain h2: no new sessions there, its own still served until they end.
    let out = drain_cmd(&d2, &key, &[]);
    assert!(out.contains("h2: draining"), "{out}");
    let direct = Http::new(&d2.base, Some(&key)).post("/v1/sessions", &json!({}));
    assert_eq!(direct.status, 503, "{}", direct.text());
    assert_eq!(direct.json()["error"]["code"], "draining");
    router.wait_status("place", &["h2"], "DOWN");
    for _ in 0..3 {
        let h = create(&r, &mut owner, "h2 drains");
        assert_eq!(h, "h3", "h1 is full, h2 drains");
    }
    let on_h2: Vec<String> = owner
        .iter()
        .filter(|(_, h)| *h == "h2")
        .map(|(id, _)| id.clone())
        .collect();
    assert!(!on_h2.is_empty());
    for id in &on_h2 {
        let e = r.post(
            &format!("/v1/sessions/{id}/exec"),
            &json!({"command": "echo still"}),
        );
        assert_eq!(
            (e.status, host(&e).as_str()),
            (200, "h2"),
            "{id}: {}",
            e.text()
        );
    }
    let st = drain_cmd(&d2, &key, &["--status", "--json"]);
    let v: Value = serde_json::from_str(st.trim()).expect("drain json");
    assert_eq!(v["state"], "draining");
    assert_eq!(v["sessions"].as_u64(), Some(on_h2.len() as u64));
    let ready = d2.http().get("/ready");
    assert_eq!(ready.status, 503);
    assert_eq!(ready.json()["checks"]["serving"], false);
    for id in &on_h2 {
        let del = r.delete(&format!("/v1/sessions/{id}"));
        assert_eq!(
            (del.status, host(&del).as_str()),
            (200, "h2"),
            "{id}: {}",
            del.text()
        );
        owner.remove(id);
    }
    let out = drain_cmd(&d2, &key, &["--wait", "60s"]);
    assert!(out.contains("h2: drained (0 session(s))"), "{out}");
    assert_eq!(d2.http().get("/health").json()["drain"], "drained");
    // SIGUSR1 drains too; `drain --cancel` serves again.
    // SAFETY: our own child process.
    unsafe { libc::kill(d3.pid(), libc::SIGUSR1) };
    let end = Instant::now() + Duration::from_secs(10);
    while d3.http().get("/health").json()["drain"] != "draining" {
        assert!(Instant::now() < end, "SIGUSR1 did not drain h3");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(drain_cmd(&d3, &key, &["--cancel"]).contains("h3: serving"));
    assert!(drain_cmd(&d2, &key, &["--cancel"]).contains("h2: serving"));
    router.wait_status("place", &["h2"], "UP");

    // A host dies: its sessions get 503 host_unavailable (never a session of
    // the same name elsewhere), every other session is fine.
    let on_h3: Vec<String> = owner
        .iter()
        .filter(|(_, h)| *h == "h3")
        .map(|(id, _)| id.clone())
        .collect();
    assert!(!on_h3.is_empty());
    d3.terminate(libc::SIGKILL);
    let check_dead = |when: &str| {
        for id in &on_h3 {
            let g = r.post(
                &format!("/v1/sessions/{id}/exec"),
                &json!({"command": "true"}),
            );
            assert_eq!(g.status, 503, "{when}: {id}: {}", g.text());
            assert_eq!(
                g.json()["error"]["code"],
                "host_unavailable",
                "{when}: {}",
                g.text()
            );
            let s = r.post(&format!("/exec/{id}/execute"), &json!({"command": "true"}));
            assert_eq!(s.status, 503, "{when}: {id}");
            assert_eq!(
                s.json()["code"],
                "host_unavailable",
                "{when}: seed shape: {}",
                s.text()
            );
        }
    };
    check_dead("at once");
    router.wait_status("any", &["h3"], "DOWN");
    check_dead("once the checks see it down");
    for (id, h) in owner.iter().filter(|(_, h)| *h != "h3") {
        let e = r.post(
            &format!("/v1/sessions/{id}/exec"),
            &json!({"command": "echo alive"}),
        );
        assert_eq!(
            (e.status, host(&e).as_str()),
            (200, h.as_str()),
            "{id}: {}",
            e.text()
        );
    }
    let c = r.post("/v1/sessions", &json!({}));
    assert_eq!((c.status, host(&c).as_str()), (201, "h2"), "{}", c.text());
    drop(mcps);
}

/// A checkpoint of a session on h2, a session from it, a fork, a pause and
/// the resume by the next exec: all on h2, their ids tagged h2.
fn stateful_on_its_host(r: &Http, owner: &mut BTreeMap<String, String>) {
    let src = owner
        .iter()
        .find(|(id, h)| *h == "h2" && id.starts_with("s-"))
        .map(|(id, _)| id.clone())
        .expect("a session on h2");
    let cp = r.post(
        &format!("/v1/sessions/{src}/snapshots"),
        &json!({"name": "cp"}),
    );
    assert_eq!(cp.status, 201, "{}", cp.text());
    let snap = cp.json()["id"].as_str().expect("snapshot id").to_string();
    assert_eq!(tag(&snap), "h2", "{snap}");
    let g = r.get(&format!("/v1/snapshots/{snap}"));
    assert_eq!((g.status, host(&g).as_str()), (200, "h2"));
    let from = r.post("/v1/sessions", &json!({"fromSnapshot": snap}));
    assert_eq!(
        (from.status, host(&from).as_str()),
        (201, "h2"),
        "{}",
        from.text()
    );
    let from_id = from.json()["id"].as_str().expect("id").to_string();
    assert_eq!(tag(&from_id), "h2");
    owner.insert(from_id, "h2".into());
    let fork = r.post(&format!("/v1/sessions/{src}/fork"), &json!({"count": 1}));
    assert_eq!(
        (fork.status, host(&fork).as_str()),
        (201, "h2"),
        "{}",
        fork.text()
    );
    let forked: Vec<String> = fork.json()["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_string())
        .collect();
    assert_eq!(forked.len(), 1);
    for f in &forked {
        assert_eq!(tag(f), "h2");
        let e = r.post(
            &format!("/v1/sessions/{f}/exec"),
            &json!({"command": "echo fork"}),
        );
        assert_eq!((e.status, host(&e).as_str()), (200, "h2"));
        owner.insert(f.clone(), "h2".into());
    }
    let p = r.post(&format!("/v1/sessions/{src}/pause"), &json!({}));
    assert_eq!((p.status, host(&p).as_str()), (200, "h2"), "{}", p.text());
    let e = r.post(
        &format!("/v1/sessions/{src}/exec"),
        &json!({"command": "echo back"}),
    );
    assert_eq!((e.status, host(&e).as_str()), (200, "h2"), "{}", e.text());
    assert_eq!(stdout_of(&e.json()), "back\n");
}

/// Preview URLs through the router's preview frontend: two hosts with
/// per-session networking (a test uplink namespace, a net prefix each) and
/// preview listeners; each host's guest web server is reached by the path
/// form (`/ports/p-<host>-<token>/`) and the host form
/// (`8000-s-<host>-....preview.test`), always on the guest of its host.
#[test]
fn preview_urls_through_the_router_reach_their_hosts_guest() {
    if !netns::is_root() || !common::daemon::vm_backend() {
        skip!("needs root and the QEMU backend (guest images)");
    }
    if Command::new("haproxy").arg("-v").output().is_err() {
        skip!("haproxy is needed (Debian: apt install haproxy; images/install-deps.sh)");
    }
    let topo = netns::Topology::new("rtp");
    let rp = common::router::free_port();
    let daemon = |id: &str, pv: u16, keys: Option<&str>| {
        let mut args = common::daemon::net_args(&topo.host_path(), None);
        args.extend(
            [
                "--host-id",
                id,
                "--preview-listen",
                &format!("127.0.0.1:{pv}"),
                "--preview-domain",
                "preview.test",
                "--preview-url",
                &format!("http://127.0.0.1:{rp}"),
            ]
            .map(String::from),
        );
        if let Some(k) = keys {
            args.extend(["--key-file".to_string(), k.to_string()]);
        }
        Daemon::start(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let (p1, p2) = (common::router::free_port(), common::router::free_port());
    let d1 = daemon("h1", p1, None);
    let keys = d1.state_dir().join("keys.json").display().to_string();
    let d2 = daemon("h2", p2, Some(&keys));
    let router = Haproxy::start_with(&[("h1", &d1, Some(p1)), ("h2", &d2, Some(p2))], Some(rp));
    let r = Http::new(&router.base, Some(&d1.key));
    let raddr = format!("127.0.0.1:{rp}");
    let mut seen = std::collections::BTreeSet::new();
    // Round robin: two creates land on both hosts.
    for _ in 0..2 {
        let c = r.post("/v1/sessions", &json!({"template": "dev"}));
        assert_eq!(c.status, 201, "{}", c.text());
        let id = c.json()["id"].as_str().expect("id").to_string();
        let h = host(&c);
        seen.insert(h.clone());
        let sh = |cmd: &str, bg: bool| {
            let e = r.post(
                &format!("/v1/sessions/{id}/exec"),
                &json!({"argv": ["sh", "-c", cmd], "background": bg, "timeout": 60_000}),
            );
            assert_eq!(host(&e), h, "{id}");
            e
        };
        sh(&format!("echo served-by-{h} > /workspace/who.txt"), false);
        let e = sh("cd /workspace && exec python3 -m http.server 8000", true);
        assert_eq!(e.status, 202, "{}", e.text());
        let probe = sh(
            "for i in $(seq 100); do python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8000), 1)' \
             2>/dev/null && exit 0; sleep 0.1; done; exit 1",
            false,
        );
        assert_eq!(probe.json()["exitCode"], 0, "{}", probe.text());
        let p = r.post(
            &format!("/v1/sessions/{id}/ports"),
            &json!({"port": 8000, "public": true}),
        );
        assert_eq!(
            (p.status, host(&p).as_str()),
            (201, h.as_str()),
            "{}",
            p.text()
        );
        let v = p.json();
        let url = v["url"].as_str().expect("url").to_string();
        let prefix = format!("http://{raddr}/ports/p-{h}-");
        assert!(url.starts_with(&prefix), "{url}");
        let path = url
            .trim_start_matches(&format!("http://{raddr}"))
            .to_string();
        let (st, body) = raw_get(&raddr, &format!("{path}who.txt"), &raddr, "");
        assert_eq!(
            (st, body.as_str()),
            (200, format!("served-by-{h}\n").as_str()),
            "path form {url}"
        );
        // The host form: the session in the name, the token in a header.
        let host_url = v["hostUrl"].as_str().expect("hostUrl").to_string();
        let token = host_url
            .rsplit("asbx_token=")
            .next()
            .expect("token")
            .to_string();
        let name = format!("8000-{id}.preview.test:{rp}");
        assert!(
            host_url.starts_with(&format!("http://{name}/")),
            "{host_url}"
        );
        let (st, body) = raw_get(
            &raddr,
            "/who.txt",
            &name,
            &format!("X-Asbx-Token: {token}\r\n"),
        );
        assert_eq!(
            (st, body.as_str()),
            (200, format!("served-by-{h}\n").as_str()),
            "host form {host_url}"
        );
        // A token no host made, with this session's name, reaches nothing.
        let wrong = format!("8000-{id}.preview.test:{rp}");
        let (st, _) = raw_get(
            &raddr,
            "/who.txt",
            &wrong,
            "X-Asbx-Token: p-h9-00000000000000000000000000000000\r\n",
        );
        assert!(st == 404 || st == 401, "{st}");
    }
    assert_eq!(seen.len(), 2, "both hosts served a session: {seen:?}");
}
