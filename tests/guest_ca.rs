//! `guest_ca_bundle` (issue #25): extra CAs in every guest's trust store
//! and exec environment, fresh and restored sessions alike; a bad bundle
//! fails the daemon's start.
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

/// A test CA (`ca.pem`) and a server certificate it signed for [`NAME`]
/// (`srv.pem`, `srv.key`), in `dir`.
fn make_ca(dir: &Path) -> PathBuf {
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
            "/CN=ca.test",
        ],
    );
    std::fs::write(
        dir.join("srv.ext"),
        format!(
            "subjectAltName=DNS:{NAME}\nbasicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n\
             subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
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
        let ca = make_ca(d);
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
    let host = topo.host_path();
    let prefix = common::daemon::unique_prefix();
    let mut args = vec![
        "--network",
        "on",
        "--uplink",
        "up0",
        "--net-host-netns",
        host.to_str().unwrap(),
        "--dns-upstream",
        "198.51.100.53:53",
        "--net-prefix",
        &prefix,
    ];
    args.extend_from_slice(extra);
    Daemon::start(&args)
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
    let ca = make_ca(dir.path());
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
