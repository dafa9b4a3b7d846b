//! The inspection proxy (src/net/proxy.rs) against direct NAT, same run:
//! two sessions on one `Net` in a throwaway test topology, one `internet`
//! (NAT only), one `allowlist` with `domains` (every TCP connection to
//! port 80 through the proxy); a namespace on each TAP plays the guest and
//! talks to one HTTP server in the test internet namespace. Prints the
//! time from connect to the last byte of a small answer (p50/p99) and
//! the rate of a large download, both ways. Run as root:
//! `cargo bench --bench proxy` (N from ASBX_BENCH_N, default 200).
//!
//! Then credential injection (src/net/inject.rs), same run: HTTPS to a
//! TLS server in the internet namespace, direct (an `internet` session,
//! its TLS end to end) against a session with a secret bound to the
//! server's name (the proxy terminates TLS with the session's CA, puts the
//! value in, re-originates TLS verified against the test CA).
//!
//! The "guest" reaches its TAP through a userspace frame relay
//! (tests/common/netns.rs `Guest`), the same for both sessions: it bounds
//! the download rate of both, so compare the two, not the absolute rate.

#[path = "common/mod.rs"]
mod bench;
#[path = "../tests/common/netns.rs"]
mod netns;
#[path = "../tests/common/skip.rs"]
mod skip;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agent_sandbox::net::inject::{Ca, Injection, SecretSpec};
use agent_sandbox::net::{Net, NetConfig, NetPolicy, SessionNet};
use netns::{in_ns, is_root, DnsServer, Guest, Rr, SweepGuard, Topology, WebServer, INTERNET};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};

/// The `p` quantile in milliseconds.
fn pct(v: &mut [Duration], p: f64) -> f64 {
    bench::pct(v, p).as_secs_f64() * 1e3
}

/// One `GET path` with Connection: close; the bytes received.
fn get(ns: &str, path: &str) -> usize {
    let req = format!("GET {path} HTTP/1.1\r\nHost: pypi.test\r\nConnection: close\r\n\r\n");
    in_ns(ns, move || {
        let mut c = TcpStream::connect_timeout(&(INTERNET, 80).into(), Duration::from_secs(5))
            .expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        c.write_all(req.as_bytes()).unwrap();
        let mut buf = vec![0u8; 256 << 10];
        let mut n = 0;
        loop {
            match c.read(&mut buf) {
                Ok(0) | Err(_) => return n,
                Ok(k) => n += k,
            }
        }
    })
}

fn main() {
    if !is_root() {
        println!("SKIP bench proxy: needs root (network namespaces, netlink, nftables)");
        return;
    }
    let n: usize = std::env::var("ASBX_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let mut topo = Topology::new("bproxy");
    let upstream = upstream();
    let cfg = NetConfig {
        host_netns: Some(topo.host_path()),
        uplink_if: "up0".into(),
        prefix: "asbxy".into(),
        dns_upstreams: vec![(INTERNET, 53).into()],
        proxy_upstream_ca: upstream.ca_file.path().to_path_buf(),
        ..NetConfig::default()
    };
    let _sweep = SweepGuard(cfg.clone());
    let _ = Net::sweep(&cfg);
    let _web = WebServer::start(&topo.internet, INTERNET);
    let _dns = DnsServer::start(
        &topo.internet,
        INTERNET,
        &[
            ("pypi.test", Rr::A(INTERNET, 300)),
            ("api.test", Rr::A(INTERNET, 300)),
        ],
    );
    let net = Net::new(cfg).expect("net init");
    let p = |j: &str| serde_json::from_str::<NetPolicy>(j).expect("policy");
    let direct = net
        .create_session(p(r#"{"mode":"internet"}"#))
        .expect("session");
    let proxied = net
        .create_session(p(r#"{"mode":"allowlist","domains":["pypi.test"]}"#))
        .expect("session");
    let gd = Guest::attach(&mut topo, direct.netns(), "tap0", 1);
    let gp = Guest::attach(&mut topo, proxied.netns(), "tap0", 2);
    // Warm-up (ARP, the proxy's first lookup through the forwarder).
    for g in [&gd, &gp] {
        assert!(get(&g.ns, "/bytes/1") > 0);
    }
    println!("small answer (connect .. last byte of GET /bytes/1), n={n}, interleaved:");
    let (mut td, mut tp) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        for (g, v) in [(&gd, &mut td), (&gp, &mut tp)] {
            let t = Instant::now();
            let got = get(&g.ns, "/bytes/1");
            v.push(t.elapsed());
            assert!(got > 0);
        }
    }
    let (d50, d99, p50, p99) = (
        pct(&mut td, 0.5),
        pct(&mut td, 0.99),
        pct(&mut tp, 0.5),
        pct(&mut tp, 0.99),
    );
    println!("  direct NAT   p50 {d50:>8.3} ms   p99 {d99:>8.3} ms");
    println!("  via proxy    p50 {p50:>8.3} ms   p99 {p99:>8.3} ms");
    println!("  added by the proxy: p50 {:+.3} ms", p50 - d50);
    const BIG: usize = 32 << 20;
    println!("download of {} MiB, best of 3:", BIG >> 20);
    for (name, g) in [("direct NAT", &gd), ("via proxy", &gp)] {
        let mut best = 0f64;
        for _ in 0..3 {
            let t = Instant::now();
            let got = get(&g.ns, &format!("/bytes/{BIG}"));
            assert!(got >= BIG, "{name}: {got} bytes");
            best = best.max(got as f64 * 8.0 / t.elapsed().as_secs_f64() / 1e6);
        }
        println!("  {name:<12} {best:>8.1} Mbit/s");
    }
    if let Some(s) = proxied.proxy_stats() {
        println!("proxy counters: {s:?}");
    }
    drop(gd);
    drop(gp);
    injection(&net, &mut topo, &upstream, n);
}

/// The test CA's TLS server for `api.test` (443, internet namespace):
/// `GET /bytes/N` answers N bytes; the last Authorization it got is kept.
fn tls_server(ns: &str, cfg: Arc<rustls::ServerConfig>) -> Arc<Mutex<String>> {
    let l = in_ns(ns, || {
        TcpListener::bind((INTERNET, 443)).expect("bind :443")
    });
    let auth = Arc::new(Mutex::new(String::new()));
    let a = auth.clone();
    std::thread::spawn(move || {
        for c in l.incoming().flatten() {
            let (cfg, a) = (cfg.clone(), a.clone());
            std::thread::spawn(move || {
                let Ok(conn) = rustls::ServerConnection::new(cfg) else {
                    return;
                };
                let mut s = rustls::StreamOwned::new(conn, c);
                let mut head = Vec::new();
                let mut b = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut b) {
                        Ok(0) | Err(_) => return,
                        Ok(k) => head.extend_from_slice(&b[..k]),
                    }
                }
                let text = String::from_utf8_lossy(&head).to_string();
                if let Some(v) = text.lines().find_map(|l| l.strip_prefix("Authorization: ")) {
                    *a.lock().unwrap() = v.to_string();
                }
                let n: usize = text
                    .split_whitespace()
                    .nth(1)
                    .and_then(|p| p.strip_prefix("/bytes/"))
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(1);
                let _ = write!(
                    s,
                    "HTTP/1.1 200 OK\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n"
                );
                let chunk = vec![b'x'; 64 << 10];
                let mut left = n;
                while left > 0 {
                    let k = left.min(chunk.len());
                    if s.write_all(&chunk[..k]).is_err() {
                        return;
                    }
                    left -= k;
                }
                s.conn.send_close_notify();
                let _ = s.flush();
            });
        }
    });
    auth
}

/// One HTTPS `GET path` to api.test from `ns`, trusting `roots`; the
/// bytes received.
fn get_tls(ns: &str, roots: &Arc<rustls::ClientConfig>, path: &str, auth: &str) -> usize {
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: api.test\r\nAuthorization: {auth}\r\nConnection: close\r\n\r\n"
    );
    let cfg = roots.clone();
    in_ns(ns, move || {
        let c = TcpStream::connect_timeout(&(INTERNET, 443).into(), Duration::from_secs(5))
            .expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let name = ServerName::try_from("api.test").unwrap();
        let conn = rustls::ClientConnection::new(cfg, name).expect("client");
        let mut s = rustls::StreamOwned::new(conn, c);
        s.write_all(req.as_bytes()).expect("request");
        let mut buf = vec![0u8; 256 << 10];
        let mut n = 0;
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => return n,
                Ok(k) => n += k,
            }
        }
    })
}

fn client(ca_pem: &str) -> Arc<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth(),
    )
}

/// The upstream test CA (its PEM file for `proxy_upstream_ca`) and the
/// server config of a leaf for api.test it signed.
struct Upstream {
    ca_file: tempfile::NamedTempFile,
    ca_pem: String,
    server: Arc<rustls::ServerConfig>,
}

fn upstream() -> Upstream {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["api.test".to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let server = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![leaf.der().clone(), ca.der().clone()],
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
    )
    .unwrap();
    let mut ca_file = tempfile::NamedTempFile::new().unwrap();
    ca_file.write_all(ca.pem().as_bytes()).unwrap();
    Upstream {
        ca_file,
        ca_pem: ca.pem(),
        server: Arc::new(server),
    }
}

fn injection(net: &Net, topo: &mut Topology, up: &Upstream, n: usize) {
    let auth = tls_server(&topo.internet, up.server.clone());
    let p = |j: &str| serde_json::from_str::<NetPolicy>(j).expect("policy");
    let direct = net
        .create_session(p(r#"{"mode":"internet"}"#))
        .expect("session");
    let injected: SessionNet = net
        .create_session(p(r#"{"mode":"internet"}"#))
        .expect("session");
    let spec = SecretSpec {
        name: "API_KEY".into(),
        value: "sk-bench-value-1234".into(),
        hosts: vec!["api.test".parse().unwrap()],
        header: None,
        format: Some("Bearer {value}".into()),
    };
    let inj = Injection::new(Arc::new(Ca::new("bench").unwrap()), &[spec], None).unwrap();
    let placeholder = inj.env()["API_KEY"].clone();
    let session_ca = inj.ca().pem().to_string();
    injected
        .set_injection(Some(Arc::new(inj)))
        .expect("set_injection");
    let gd = Guest::attach(topo, direct.netns(), "tap0", 3);
    let gi = Guest::attach(topo, injected.netns(), "tap0", 4);
    let (cd, ci) = (client(&up.ca_pem), client(&session_ca));
    let bearer = format!("Bearer {placeholder}");
    assert!(get_tls(&gd.ns, &cd, "/bytes/1", &bearer) > 0);
    assert!(get_tls(&gi.ns, &ci, "/bytes/1", &bearer) > 0);
    assert_eq!(
        *auth.lock().unwrap(),
        "Bearer sk-bench-value-1234",
        "not injected"
    );
    println!(
        "HTTPS small answer (connect .. last byte, a TLS handshake each), n={n}, interleaved:"
    );
    let (mut td, mut ti) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        for (g, c, v) in [(&gd, &cd, &mut td), (&gi, &ci, &mut ti)] {
            let t = Instant::now();
            assert!(get_tls(&g.ns, c, "/bytes/1", &bearer) > 0);
            v.push(t.elapsed());
        }
    }
    let (d50, d99, i50, i99) = (
        pct(&mut td, 0.5),
        pct(&mut td, 0.99),
        pct(&mut ti, 0.5),
        pct(&mut ti, 0.99),
    );
    println!("  direct TLS       p50 {d50:>8.3} ms   p99 {d99:>8.3} ms");
    println!("  injected         p50 {i50:>8.3} ms   p99 {i99:>8.3} ms");
    println!("  added by interception: p50 {:+.3} ms", i50 - d50);
    const BIG: usize = 32 << 20;
    println!("HTTPS download of {} MiB, best of 3:", BIG >> 20);
    for (name, g, c) in [("direct TLS", &gd, &cd), ("injected", &gi, &ci)] {
        let mut best = 0f64;
        for _ in 0..3 {
            let t = Instant::now();
            let got = get_tls(&g.ns, c, &format!("/bytes/{BIG}"), &bearer);
            assert!(got >= BIG, "{name}: {got} bytes");
            best = best.max(got as f64 * 8.0 / t.elapsed().as_secs_f64() / 1e6);
        }
        println!("  {name:<16} {best:>8.1} Mbit/s");
    }
    if let Some(s) = injected.proxy_stats() {
        println!("proxy counters: {s:?}");
    }
}
