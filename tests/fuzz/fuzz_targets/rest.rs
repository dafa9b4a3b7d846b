//! REST request handling: raw bytes as one HTTP request on a loopback
//! connection to an in-process server (HTTP parsing, routing, auth,
//! JSON bodies, validation, the MCP HTTP endpoint), over a factory that
//! makes no sandboxes. `TOKEN` in an input is replaced by a valid API key,
//! so seeds can reach authenticated handlers. A panic in any server thread
//! aborts the process (libfuzzer's panic hook): a crash.

#![no_main]

#[path = "fake.rs"]
mod fake;

use agent_sandbox::api::Server;
use agent_sandbox::start_daemon;
use libfuzzer_sys::fuzz_target;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

struct Target {
    addr: SocketAddr,
    token: String,
    _server: Server,
}

fn target() -> &'static Target {
    static T: OnceLock<Target> = OnceLock::new();
    T.get_or_init(|| {
        let server = start_daemon(fake::config(), Arc::new(fake::NoSandboxes))
            .expect("start the server");
        let (_, token) = server
            .ctx
            .auth
            .keys
            .create(
                "fuzz",
                vec!["admin".into(), "exec".into(), "metrics".into()],
                None,
                None,
                None,
            )
            .expect("create a key");
        Target {
            addr: server.addr(),
            token,
            _server: server,
        }
    })
}

fn replace_token(data: &[u8], token: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + token.len());
    let mut i = 0;
    while i < data.len() {
        if data[i..].starts_with(b"TOKEN") {
            out.extend_from_slice(token.as_bytes());
            i += 5;
        } else {
            out.push(data[i]);
            i += 1;
        }
    }
    out
}

fuzz_target!(|data: &[u8]| {
    if data.len() > 64 * 1024 {
        return;
    }
    let t = target();
    let req = replace_token(data, &t.token);
    let Ok(mut c) = TcpStream::connect_timeout(&t.addr, Duration::from_secs(5)) else {
        panic!("the server stopped accepting connections");
    };
    let _ = c.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = c.set_write_timeout(Some(Duration::from_secs(5)));
    let _ = c.write_all(&req);
    let _ = c.shutdown(Shutdown::Write);
    let mut resp = Vec::new();
    let _ = c.take(4 << 20).read_to_end(&mut resp);
    // Whatever came back is a status line or nothing (a request the server
    // could not parse is dropped).
    if !resp.is_empty() {
        assert!(
            resp.starts_with(b"HTTP/"),
            "not an HTTP response: {:?}",
            String::from_utf8_lossy(&resp[..resp.len().min(200)])
        );
    }
});
