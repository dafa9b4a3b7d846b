//! `guest_ca_bundle` (issue #25): extra CAs in every guest's trust store
//! and exec environment, fresh and restored sessions alike; a bad bundle
//! fails the daemon's start. And credential injection, whose per-session
//! CA reaches the guest the same way.
//!
//! The CA and the HTTPS server's certificate are made here with the host's
//! `openssl`; the server runs in the test "internet" namespace
//! (`tests/common/netns.rs`), so no guest packet leaves this machine.

mod common;
#[path = "common/netns.rs"]
mod netns;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::{stdout_of, Daemon};
use netns::{add_internet_addr, in_ns, is_root, DnsServer, Rr, Topology, INTERNET};
use serde_json::json;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const RESOLVER: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 53);
const HTTPS_PORT: u16 = 8443;
const NAME: &str = "ca.test";
const BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
const ENV_VARS: [&str; 6] = [
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "PIP_CERT",
    "GIT_SSL_CAINFO",
];

fn vm_backend() -> bool {
    common::test_backend() != "local-process"
}

fn have_openssl() -> bool {
    Command::new("openssl")
        .arg("version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A test CA (`ca.pem`) and a server certificate it signed for `names`
/// (`srv.pem`, `srv.key`), in `dir`.
fn make_ca(dir: &Path, names: &[&str]) -> PathBuf {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=agent-sandbox test CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "srv.key",
            "-out",
            "srv.csr",
            "-subj",
            &format!("/CN={}", names[0]),
        ],
    );
    std::fs::write(
        dir.join("srv.ext"),
        format!(
            "subjectAltName={}\nbasicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n\
             subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n",
            names
                .iter()
                .map(|n| format!("DNS:{n}"))
                .collect::<Vec<_>>()
                .join(",")
        ),
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "srv.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "srv.pem",
            "-days",
            "2",
            "-extfile",
            "srv.ext",
        ],
    );
    dir.join("ca.pem")
}

/// `agent-sandbox serve ARGS` run to its end (at most 60 s): exit code,
/// stdout, stderr.
fn serve(dir: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .arg("serve")
        .args(["--listen", "127.0.0.1:0", "--state-dir"])
        .arg(dir.join("state"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn agent-sandbox serve");
    let t0 = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("serve {args:?} still running after 60 s: it should have refused to start");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("output");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_guest_ca_bundles_fail_the_daemon_start() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let missing = d.join("missing.pem");
    let text = d.join("notes.txt");
    std::fs::write(&text, "not a certificate\n").unwrap();
    let key_only = d.join("key.pem");
    std::fs::write(
        &key_only,
        "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    let big = d.join("big.pem");
    std::fs::write(&big, vec![b'x'; (1 << 20) + 1]).unwrap();
    let base = ["--backend", "qemu", "--network", "off"];
    for (file, why) in [
        (&missing, "No such file"),
        (&text, "no PEM CERTIFICATE block"),
        (&key_only, "no PEM CERTIFICATE block"),
        (&big, "bytes"),
    ] {
        let f = file.to_str().unwrap();
        // The real start, not only the check: it must not come up.
        for check in [false, true] {
            let mut args: Vec<&str> = base.to_vec();
            args.extend(["--guest-ca-bundle", f]);
            if check {
                args.push("--check");
            }
            let (code, _, err) = serve(d, &args);
            assert_ne!(code, Some(0), "{args:?} started: {err}");
            assert!(
                err.contains(&format!("guest_ca_bundle {f}")) && err.contains(why),
                "{args:?}: the error names the key, the file and why ({why}): {err}"
            );
        }
    }
    // A config file must name an absolute path (or `host`).
    let cfg = d.join("config.json");
    std::fs::write(&cfg, r#"{"guest_ca_bundle": "relative/ca.pem"}"#).unwrap();
    let (code, _, err) = serve(d, &["--config", cfg.to_str().unwrap(), "--check"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("guest_ca_bundle: relative/ca.pem is not an absolute path"),
        "{err}"
    );
    // `host`: the host's own bundle, shown as given.
    if Path::new(BUNDLE).is_file() {
        let (code, out, err) = serve(
            d,
            &[&base[..], &["--guest-ca-bundle", "host", "--check"]].concat(),
        );
        assert_eq!(code, Some(0), "{err}");
        assert!(out.contains(r#""guest_ca_bundle": "host""#), "{out}");
    }
    // The local-process backend's agent runs on this host: refused.
    if have_openssl() {
        let ca = make_ca(d, &[NAME]);
        let ca = ca.to_str().unwrap();
        let (code, _, err) = serve(
            d,
            &[
                "--backend",
                "local-process",
                "--guest-ca-bundle",
                ca,
                "--check",
            ],
        );
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("not with backend local-process"), "{err}");
        // A good bundle passes the check, which shows it.
        let (code, out, err) = serve(
            d,
            &[&base[..], &["--guest-ca-bundle", ca, "--check"]].concat(),
        );
        assert_eq!(code, Some(0), "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).expect("--check prints JSON");
        assert_eq!(v["guest_ca_bundle"], ca, "{out}");
    } else {
        skip::not_checked("no openssl on this host to make a test CA");
    }
}

/// A child process killed (and reaped) on drop.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

const SERVER: &str = r#"
import http.server, ssl, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        b = b"hello over tls\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def log_message(self, *a):
        pass
s = http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), H)
c = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
c.load_cert_chain(sys.argv[3], sys.argv[4])
s.socket = c.wrap_socket(s.socket, server_side=True)
s.serve_forever()
"#;

/// An HTTPS server for [`NAME`] on `addr`:[`HTTPS_PORT`] in the test
/// internet namespace, once it accepts connections.
fn https_server(topo: &Topology, addr: Ipv4Addr, dir: &Path) -> Child {
    let c = Child(
        Command::new("ip")
            .args(["netns", "exec", &topo.internet, "python3", "-c", SERVER])
            .arg(addr.to_string())
            .arg(HTTPS_PORT.to_string())
            .arg(dir.join("srv.pem"))
            .arg(dir.join("srv.key"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the test HTTPS server"),
    );
    assert!(
        common::wait_until(Duration::from_secs(10), || {
            in_ns(&topo.internet, || {
                std::net::TcpStream::connect((addr, HTTPS_PORT)).is_ok()
            })
        }),
        "test HTTPS server on {addr}:{HTTPS_PORT} did not start"
    );
    c
}

fn daemon(topo: &Topology, extra: &[&str]) -> Daemon {
    let mut args = common::daemon::net_args(&topo.host_path(), Some("198.51.100.53:53"));
    args.extend(extra.iter().map(|s| s.to_string()));
    Daemon::start(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

fn create(d: &Daemon, id: &str) {
    let r = d.http().post(
        "/v1/sessions",
        &json!({"id": id, "template": "dev",
                "egress": {"mode": "allowlist", "domains": [NAME]}}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
}

/// `command` in session `s`: exit code, stdout, stderr.
fn exec(d: &Daemon, s: &str, command: &str, env: serde_json::Value) -> (i64, String, String) {
    let r = d.http().post(
        &format!("/v1/sessions/{s}/exec"),
        &json!({"command": command, "env": env, "timeout": 120000}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let err: String = v["output"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|e| e["stream"] == "stderr")
                .filter_map(|e| e["data"].as_str())
                .collect()
        })
        .unwrap_or_default();
    (v["exitCode"].as_i64().unwrap_or(-1), stdout_of(&v), err)
}

fn curl(d: &Daemon, s: &str) -> (i64, String, String) {
    exec(
        d,
        s,
        &format!("curl -sS --max-time 30 https://{NAME}:{HTTPS_PORT}/"),
        json!({}),
    )
}

fn python(d: &Daemon, s: &str) -> (i64, String, String) {
    exec(
        d,
        s,
        &format!(
            "python3 -c 'import urllib.request; \
             print(urllib.request.urlopen(\"https://{NAME}:{HTTPS_PORT}/\", timeout=30).read().decode(), end=\"\")'"
        ),
        json!({}),
    )
}

/// What a session that trusts the test CA shows: both clients verify the
/// server, the variables name the bundle, the CA is in it once and in its
/// own file.
fn trusts(d: &Daemon, s: &str, ca_pem: &str) {
    let (code, out, err) = curl(d, s);
    assert_eq!(
        (code, out.as_str()),
        (0, "hello over tls\n"),
        "{s}: curl: {err}"
    );
    let (code, out, err) = python(d, s);
    assert_eq!(
        (code, out.as_str()),
        (0, "hello over tls\n"),
        "{s}: python: {err}"
    );
    let (_, env, _) = exec(d, s, "env", json!({}));
    for v in ENV_VARS {
        assert!(
            env.lines().any(|l| l == format!("{v}={BUNDLE}")),
            "{s}: {v} not set to {BUNDLE}: {env}"
        );
    }
    // The CA's base64 lines appear once in the bundle: no double append.
    let first = ca_pem
        .lines()
        .nth(1)
        .expect("a PEM line after BEGIN")
        .to_string();
    let (_, n, err) = exec(
        d,
        s,
        &format!(
            "grep -cF -- '{first}' {BUNDLE}; grep -c 'agent-sandbox extra CAs begin' {BUNDLE}; \
             grep -cF -- '{first}' /usr/local/share/ca-certificates/agent-sandbox.crt"
        ),
        json!({}),
    );
    assert_eq!(n, "1\n1\n1\n", "{s}: CA, block, own file: {err}");
}

#[test]
fn guests_trust_the_guest_ca_bundle() {
    if !is_root() || !vm_backend() {
        skip!("needs root and the QEMU backend (guest images)");
    }
    if !have_openssl() {
        skip!("needs the host's openssl to make a test CA");
    }
    let dir = tempfile::tempdir().unwrap();
    let ca = make_ca(dir.path(), &[NAME]);
    // The PEM as the daemon normalizes it is what openssl writes.
    let ca_pem = std::fs::read_to_string(&ca).unwrap();
    let topo = Topology::new("gca");
    add_internet_addr(&topo, RESOLVER);
    let _dns = DnsServer::start(&topo.internet, RESOLVER, &[(NAME, Rr::A(INTERNET, 60))]);
    let _https = https_server(&topo, INTERNET, dir.path());

    // Without the bundle: both clients refuse the server's certificate.
    {
        let d = daemon(&topo, &["--standby-vmms", "0"]);
        create(&d, "plain");
        let (code, _, err) = curl(&d, "plain");
        assert_eq!(code, 60, "curl without the CA: {err}");
        assert!(err.contains("certificate"), "{err}");
        let (code, _, err) = python(&d, "plain");
        assert_ne!(code, 0);
        assert!(err.contains("CERTIFICATE_VERIFY_FAILED"), "{err}");
        let (_, env, _) = exec(&d, "plain", "env", json!({}));
        assert!(!env.contains("REQUESTS_CA_BUNDLE="), "{env}");
    }

    let d = daemon(&topo, &["--guest-ca-bundle", ca.to_str().unwrap()]);
    create(&d, "ca");
    trusts(&d, "ca", &ca_pem);
    // Node reads NODE_EXTRA_CA_CERTS (it has its own roots otherwise).
    let (code, out, err) = exec(
        &d,
        "ca",
        &format!(
            "node -e 'require(\"https\").get(\"https://{NAME}:{HTTPS_PORT}/\", r => r.pipe(process.stdout))\
             .on(\"error\", e => {{ console.error(e.message); process.exit(1); }})'"
        ),
        json!({}),
    );
    assert_eq!((code, out.as_str()), (0, "hello over tls\n"), "node: {err}");
    // A user's own value wins, the others stay.
    let (_, out, _) = exec(
        &d,
        "ca",
        "echo $SSL_CERT_FILE $PIP_CERT",
        json!({"SSL_CERT_FILE": "/mine.pem"}),
    );
    assert_eq!(out, format!("/mine.pem {BUNDLE}\n"));

    // A fork's copy is restored from a checkpoint whose disk has the CA.
    let r = d.http().post("/v1/sessions/ca/fork", &json!({"count": 1}));
    assert_eq!(r.status, 201, "{}", r.text());
    let copy = r.json()["sessions"][0]["id"]
        .as_str()
        .expect("fork's session id")
        .to_string();
    trusts(&d, &copy, &ca_pem);

    // Paused and resumed: restored once more, still once.
    let r = d.http().post("/v1/sessions/ca/pause", &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    let r = d.http().post("/v1/sessions/ca/resume", &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    trusts(&d, "ca", &ca_pem);
}

/// Records every request it gets (`host`, `authorization`, `x-api-key`,
/// path) a line each; `/echo` answers with the Authorization it got.
const RECORDER: &str = r#"
import http.server, ssl, sys, threading
addr, logf, cert, key = sys.argv[1:5]
log = open(logf, "a", buffering=1)
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        h = self.headers
        log.write("host=%s auth=%s key=%s path=%s\n" % (h.get("Host"), h.get("Authorization"), h.get("X-Api-Key"), self.path))
        b = (("auth: %s\n" % h.get("Authorization")) if self.path == "/echo" else "ok\n").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def log_message(self, *a):
        pass
plain = http.server.ThreadingHTTPServer((addr, 80), H)
tls = http.server.ThreadingHTTPServer((addr, 443), H)
c = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
c.load_cert_chain(cert, key)
tls.socket = c.wrap_socket(tls.socket, server_side=True)
threading.Thread(target=plain.serve_forever, daemon=True).start()
tls.serve_forever()
"#;

/// Credential injection (issue #25): the guest holds placeholders; the
/// egress proxy puts each value into requests to its own hosts only
/// (TLS terminated with the session's CA, re-originated to the real host,
/// verified against the test CA given as `--proxy-upstream-ca`). The
/// value is never in the guest: not in its environment, files, process
/// list or a checkpoint of its memory; output that shows it is masked; a
/// placeholder towards another host is refused, not forwarded.
#[test]
fn injected_secrets_reach_only_their_hosts() {
    if !is_root() || !vm_backend() {
        skip!("needs root and the QEMU backend (guest images)");
    }
    if !have_openssl() {
        skip!("needs the host's openssl to make a test CA");
    }
    let dir = tempfile::tempdir().unwrap();
    let ca = make_ca(dir.path(), &["api.test", "other.test"]);
    let topo = Topology::new("inj");
    add_internet_addr(&topo, RESOLVER);
    let _dns = DnsServer::start(
        &topo.internet,
        RESOLVER,
        &[
            ("api.test", Rr::A(INTERNET, 60)),
            ("other.test", Rr::A(INTERNET, 60)),
        ],
    );
    let seen = dir.path().join("seen.log");
    std::fs::write(&seen, "").unwrap();
    let _srv = Child(
        Command::new("ip")
            .args(["netns", "exec", &topo.internet, "python3", "-c", RECORDER])
            .arg(INTERNET.to_string())
            .arg(&seen)
            .arg(dir.path().join("srv.pem"))
            .arg(dir.path().join("srv.key"))
            .stdout(Stdio::null())
            .spawn()
            .expect("start the recording server"),
    );
    assert!(
        common::wait_until(Duration::from_secs(10), || in_ns(&topo.internet, || {
            [80, 443]
                .iter()
                .all(|p| std::net::TcpStream::connect((INTERNET, *p)).is_ok())
        })),
        "recording server did not start"
    );
    // Random, so no image or earlier run can hold them.
    let rand = format!(
        "{:016x}",
        (std::process::id() as u64 ^ now_nanos()).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    );
    let value = format!("sk-live-{rand}");
    let other_value = format!("ok-other-{rand}");
    let d = daemon(&topo, &["--proxy-upstream-ca", ca.to_str().unwrap()]);
    let r = d.http().post(
        "/v1/sessions",
        &json!({"id": "inj", "template": "dev",
                "secrets": [
                    {"name": "API_KEY", "value": value, "hosts": ["api.test"],
                     "format": "Bearer {value}"},
                    {"name": "OTHER_KEY", "value": other_value, "hosts": ["other.test"],
                     "header": "X-Api-Key"}]}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    assert!(
        !r.text().contains(&value),
        "the create answer shows the value"
    );
    let info = d.http().get("/v1/sessions/inj/secrets");
    assert_eq!(info.status, 200, "{}", info.text());
    assert!(!info.text().contains(&value) && !info.text().contains(&other_value));
    let placeholder = info.json()["secrets"][0]["placeholder"]
        .as_str()
        .expect("a placeholder")
        .to_string();
    assert!(placeholder.starts_with("asbx-secret-"), "{placeholder}");
    assert!(!d.http().get("/v1/sessions/inj").text().contains(&value));
    let sh = |c: &str| exec(&d, "inj", c, json!({}));
    let curl = |args: &str| sh(&format!("curl -sS --max-time 30 {args}"));

    // 1. The guest sends its placeholder; api.test gets the value.
    let (code, out, err) = curl("-H \"Authorization: Bearer $API_KEY\" https://api.test/");
    assert_eq!((code, out.as_str()), (0, "ok\n"), "curl to api.test: {err}");
    // Python trusts the session's CA through the same bundle.
    let (code, out, err) = sh(
        "python3 -c 'import os, urllib.request as u; \
         r = u.Request(\"https://other.test/\", headers={\"X-Api-Key\": os.environ[\"OTHER_KEY\"]}); \
         print(u.urlopen(r, timeout=30).read().decode(), end=\"\")'",
    );
    assert_eq!(
        (code, out.as_str()),
        (0, "ok\n"),
        "python to other.test: {err}"
    );
    // 2. A placeholder towards a host it is not bound to: refused there.
    let (code, out, _) = curl(
        "-o /dev/null -w '%{http_code}' -H \"Authorization: Bearer $API_KEY\" https://other.test/",
    );
    assert_eq!(
        (code, out.as_str()),
        (0, "403"),
        "API_KEY's placeholder to other.test"
    );
    let (code, out, _) = curl(
        "-o /dev/null -w '%{http_code}' -H \"Authorization: Bearer $API_KEY\" http://api.test/",
    );
    assert_eq!(
        (code, out.as_str()),
        (0, "403"),
        "a placeholder over plain HTTP"
    );
    let log = std::fs::read_to_string(&seen).unwrap();
    assert!(
        log.contains(&format!(
            "host=api.test auth=Bearer {value} key=None path=/\n"
        )),
        "api.test did not get the value:\n{log}"
    );
    assert!(
        log.contains(&format!(
            "host=other.test auth=None key={other_value} path=/\n"
        )),
        "other.test did not get its value:\n{log}"
    );
    assert!(
        !log.lines()
            .any(|l| l.starts_with("host=other.test") && l.contains(&value)),
        "other.test saw API_KEY's value:\n{log}"
    );
    assert!(
        !log.contains(&placeholder),
        "a placeholder left the proxy:\n{log}"
    );

    // 3. Not in a checkpoint of the guest's memory and disk (taken before
    //    the test itself puts the value in: the check below builds it in a
    //    shell, whose freed pages keep it).
    let r = d
        .http()
        .post("/v1/sessions/inj/snapshots", &json!({"name": "look"}));
    assert_eq!(r.status, 201, "{}", r.text());
    let sid = r.json()["id"].as_str().expect("snapshot id").to_string();
    let snaps = d.state_dir().join("checkpoints");
    let grep = Command::new("grep")
        .args(["-rlaF", &value])
        .arg(&snaps)
        .output()
        .expect("grep");
    assert_eq!(
        String::from_utf8_lossy(&grep.stdout),
        "",
        "checkpoint {sid} holds the value"
    );
    let du = Command::new("du")
        .args(["-sb"])
        .arg(&snaps)
        .output()
        .unwrap();
    let bytes: u64 = String::from_utf8_lossy(&du.stdout)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(bytes > 1 << 20, "checkpoint too small to be one: {bytes}");

    // ... nor in its environment, files, processes: environment, files, processes. The value
    //    is put together in the shell and reaches grep on a descriptor
    //    (`-f`), so no command line or environment holds it.
    let (a, b) = value.split_at(6);
    let (_, n, err) = sh(&format!(
        "V=$(printf %s '{a}' '{b}')\n\
         g() {{ grep \"$@\" -F -f /proc/self/fd/3 3<<E\n$V\nE\n}}\n\
         env | g -c; \
         g -rls /proc/[0-9]*/environ /proc/[0-9]*/cmdline /etc /root /tmp /workspace /run | wc -l; \
         ps auxww | g -c; env | grep -c '^API_KEY=asbx-secret-'"
    ));
    assert_eq!(n, "0\n0\n0\n1\n", "the value inside the guest: {err}");
    // 4. Output that shows a value is masked before it leaves.
    let (code, out, err) = curl("-H \"Authorization: Bearer $API_KEY\" https://api.test/echo");
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "auth: Bearer ****\n");

    // 5. Counters.
    let g = d.http().get("/v1/sessions/inj/network").json();
    let n = |k: &str| {
        g["proxy"][k]
            .as_u64()
            .unwrap_or_else(|| panic!("{k} in {g}"))
    };
    assert!(n("intercepted") >= 4, "{g}");
    assert!(n("injected") >= 3, "{g}");
    assert!(n("refusedPlaceholder") >= 2, "{g}");

    // 6. A fork's copy keeps the placeholders under a CA of its own; a
    //    paused and resumed session gets its secrets back.
    let r = d.http().post("/v1/sessions/inj/fork", &json!({"count": 1}));
    assert_eq!(r.status, 201, "{}", r.text());
    let copy = r.json()["sessions"][0]["id"]
        .as_str()
        .expect("fork's session id")
        .to_string();
    let (code, _, err) = exec(
        &d,
        &copy,
        "curl -sS --max-time 30 -H \"Authorization: Bearer $API_KEY\" https://api.test/copy",
        json!({}),
    );
    assert_eq!(code, 0, "copy: {err}");
    let pem = |s: &str| {
        exec(
            &d,
            s,
            "sed -n '/extra CAs begin: egress-proxy/,/extra CAs end: egress-proxy/p' \
             /etc/ssl/certs/ca-certificates.crt",
            json!({}),
        )
        .1
    };
    let (mine, theirs) = (pem("inj"), pem(&copy));
    assert!(mine.contains("BEGIN CERTIFICATE"), "{mine}");
    assert_ne!(mine, theirs, "the copy trusts the source's CA");
    let r = d.http().post("/v1/sessions/inj/pause", &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    let (code, _, err) = curl("-H \"Authorization: Bearer $API_KEY\" https://api.test/resumed");
    assert_eq!(code, 0, "after resume: {err}");
    let log = std::fs::read_to_string(&seen).unwrap();
    for path in ["/copy", "/resumed"] {
        assert!(
            log.contains(&format!("auth=Bearer {value} key=None path={path}\n")),
            "{path}:\n{log}"
        );
    }

    // 7. Live: a new value under the same placeholder, then none at all.
    let new_value = format!("sk-rotated-{rand}");
    let r = d.http().put(
        "/v1/sessions/inj/secrets",
        &json!({"secrets": [{"name": "API_KEY", "value": new_value, "hosts": ["api.test"],
                             "format": "Bearer {value}"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["secrets"][0]["placeholder"], placeholder.as_str());
    let (code, _, err) = curl("-H \"Authorization: Bearer $API_KEY\" https://api.test/");
    assert_eq!(code, 0, "{err}");
    let log = std::fs::read_to_string(&seen).unwrap();
    assert!(log.contains(&format!("auth=Bearer {new_value} ")), "{log}");
    let r = d
        .http()
        .put("/v1/sessions/inj/secrets", &json!({"secrets": []}));
    assert_eq!(r.status, 200, "{}", r.text());
    let g = d.http().get("/v1/sessions/inj/network").json();
    assert!(
        g.get("proxy").is_none(),
        "no proxy without secrets in internet mode: {g}"
    );
    let (_, out, _) = sh("echo ${API_KEY:-gone}");
    assert_eq!(out, "gone\n");

    // Bad secrets: 400 naming the secret, never echoing a value.
    for (bad, want) in [
        (
            json!([{"name": "K", "value": "abc", "hosts": ["a.test"]}]),
            "at least 4",
        ),
        (
            json!([{"name": "K", "value": "abcd-1", "hosts": []}]),
            "hosts",
        ),
        (
            json!([{"name": "K", "value": "abcd-1", "hosts": ["a.test"], "header": "Host"}]),
            "header",
        ),
    ] {
        let r = d
            .http()
            .put("/v1/sessions/inj/secrets", &json!({"secrets": bad}));
        assert_eq!(r.status, 400, "{}", r.text());
        assert!(r.text().contains(want), "{}", r.text());
        assert!(!r.text().contains("abcd-1"), "{}", r.text());
    }
}

fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
