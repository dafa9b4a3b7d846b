//! The preview listener: guests' exposed ports from outside (issue #26,
//! `ops::ports`). Its own address (`preview_listen`), its own threads
//! (`preview-accept`, one per connection) under the `Preview` seccomp
//! filter, which may accept and relay but open no socket or file: the
//! connection to the guest is made by the session's connector in the
//! session namespace (`net::connect`).
//!
//! Per connection: the request head (≤ 16 KiB within 10 s) names the
//! grant by path (`/ports/<token>/rest`, the prefix dropped on the way)
//! or by host (`<token>.<preview_domain>`). A token that is not open now
//! gets 404, a port that is not public without the owner's key 401,
//! before anything reaches the guest. The head goes to the guest with
//! `Connection: close` (unless it asks for an Upgrade: WebSocket), the
//! key's `Authorization` header dropped, `X-Forwarded-*` added; then bytes
//! both ways until both sides close or 300 s pass without one, so
//! chunked bodies, server-sent events and WebSocket frames pass as they
//! come. At most [`MAX_CONNS`] connections at once, [`MAX_PER_SESSION`]
//! per session.

use super::Ctx;
use crate::ops::ports::{self, DialError};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Connections at once over all sessions, and per session.
pub const MAX_CONNS: usize = 1024;
pub const MAX_PER_SESSION: usize = 64;
/// The request head must arrive within this, and fit in [`MAX_HEAD`].
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_HEAD: usize = 16 << 10;

struct State {
    ctx: Arc<Ctx>,
    live: AtomicUsize,
    per_session: Mutex<HashMap<(String, String), usize>>,
}

/// Binds `addr` and serves it from its own thread; the bound address.
pub fn start(ctx: Arc<Ctx>, addr: SocketAddr) -> Result<SocketAddr, String> {
    let l = TcpListener::bind(addr).map_err(|e| format!("preview_listen {addr}: {e}"))?;
    let bound = l
        .local_addr()
        .map_err(|e| format!("preview_listen {addr}: {e}"))?;
    let base = ctx
        .cfg
        .preview_url
        .clone()
        .unwrap_or_else(|| format!("http://{bound}"));
    ctx.ops.set_preview_base(base.clone());
    let st = Arc::new(State {
        ctx,
        live: AtomicUsize::new(0),
        per_session: Mutex::new(HashMap::new()),
    });
    crate::harden::thread::spawn(
        crate::harden::ThreadKind::Preview,
        std::thread::Builder::new().name("preview-accept".into()),
        move || accept_loop(&st, &l),
    )
    .map_err(|e| format!("start the preview listener: {e}"))?;
    log::info!("preview listener on {bound} ({base})");
    Ok(bound)
}

fn accept_loop(st: &Arc<State>, l: &TcpListener) {
    for c in l.incoming() {
        let c = match c {
            Ok(c) => c,
            Err(e) => {
                log::warn!("preview accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if st.ctx.is_closing() {
            return;
        }
        if st.live.fetch_add(1, Ordering::SeqCst) >= MAX_CONNS {
            st.live.fetch_sub(1, Ordering::SeqCst);
            answer(c, 503, "busy", "too many preview connections at once");
            continue;
        }
        let st2 = st.clone();
        let spawned = std::thread::Builder::new()
            .name("preview-conn".into())
            .spawn(move || {
                serve(&st2, c);
                st2.live.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            st.live.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A JSON error answer, then the connection closes.
fn answer(mut c: TcpStream, status: u16, code: &str, message: &str) {
    let body = serde_json::json!({"error": {"code": code, "message": message}}).to_string();
    let _ = c.set_write_timeout(Some(Duration::from_secs(5)));
    let _ = write!(
        c,
        "HTTP/1.1 {status} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        super::httpd::reason(status),
        body.len()
    );
    let _ = c.shutdown(std::net::Shutdown::Both);
}

/// The head (through its blank line) and the bytes read after it.
fn read_head(c: &mut TcpStream) -> io::Result<Option<(Vec<u8>, usize)>> {
    let _ = c.set_read_timeout(Some(HEAD_TIMEOUT));
    let deadline = Instant::now() + HEAD_TIMEOUT;
    let mut buf = Vec::with_capacity(2048);
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Ok(Some((buf, i + 4)));
        }
        if buf.len() >= MAX_HEAD || Instant::now() >= deadline {
            return Ok(None);
        }
        let n = c.read(&mut chunk)?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Which grant a request names: its token and the path the guest gets.
fn route(path: &str, host: Option<&str>, domain: Option<&str>) -> Option<(String, String)> {
    if let Some(rest) = path.strip_prefix("/ports/") {
        let (token, tail) = match rest.find(['/', '?']) {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let tail = if tail.is_empty() {
            "/".to_string()
        } else if tail.starts_with('?') {
            format!("/{tail}")
        } else {
            tail.to_string()
        };
        return Some((token.to_string(), tail));
    }
    let (host, domain) = (host?, domain?);
    let name = host.rsplit_once(':').map_or(host, |(h, p)| {
        if p.bytes().all(|b| b.is_ascii_digit()) {
            h
        } else {
            host
        }
    });
    let token = name
        .to_ascii_lowercase()
        .strip_suffix(&format!(".{domain}"))?
        .to_string();
    Some((token, path.to_string()))
}

fn serve(st: &State, mut c: TcpStream) {
    let peer = c.peer_addr().ok();
    let Ok(Some((buf, len))) = read_head(&mut c) else {
        return;
    };
    let mut headers = [httparse::EMPTY_HEADER; 96];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(&buf[..len]) {
        Ok(httparse::Status::Complete(_)) => {}
        _ => return answer(c, 400, "bad_request", "not an HTTP/1.1 request head"),
    }
    let (Some(method), Some(path)) = (req.method, req.path) else {
        return answer(c, 400, "bad_request", "not an HTTP/1.1 request head");
    };
    let header = |n: &str| {
        req.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(n))
            .and_then(|h| std::str::from_utf8(h.value).ok())
    };
    let domain = st.ctx.cfg.preview_domain.as_deref();
    let Some((token, tail)) = route(path, header("host"), domain) else {
        return answer(c, 404, "not_found", "no preview here: /ports/<token>/...");
    };
    let ops = &st.ctx.ops;
    let Some((session, grant)) = ops.preview_target(&token) else {
        return answer(
            c,
            404,
            "not_found",
            "no open port has this token (closed, expired or never opened)",
        );
    };
    let mut used_key = false;
    if !grant.public {
        let key = crate::ops::auth::token_from_headers(
            req.headers
                .iter()
                .map(|h| (h.name, std::str::from_utf8(h.value).unwrap_or(""))),
        );
        match st.ctx.auth.authenticate(peer.map(|p| p.ip()), key) {
            Ok(p) if p.id == session.owner || p.is_admin() || !st.ctx.cfg.auth => used_key = true,
            Ok(_) => return answer(c, 404, "not_found", "no open port has this token"),
            Err(e) => {
                return answer(
                    c,
                    401,
                    "unauthorized",
                    &format!(
                        "port {} is not public: send the owner's API key (Authorization: \
                         Bearer ...): {e}",
                        grant.port
                    ),
                )
            }
        }
    }
    let key = (session.owner.clone(), session.id.clone());
    {
        let mut m = crate::sync::lock(&st.per_session);
        let n = m.entry(key.clone()).or_insert(0);
        if *n >= MAX_PER_SESSION {
            drop(m);
            return answer(
                c,
                503,
                "busy",
                "too many preview connections to this session",
            );
        }
        *n += 1;
    }
    let _release = Release(st, key);
    let up = match ops.dial_guest(&session, grant.port) {
        Ok(u) => u,
        Err(DialError::Paused) => {
            return answer(c, 503, "session_paused", "the session is paused: resume it")
        }
        Err(DialError::NoNetwork) => {
            return answer(
                c,
                502,
                "unreachable",
                "this daemon has no per-session networking: guests cannot be reached",
            )
        }
        Err(DialError::Unreachable(e)) => {
            return answer(
                c,
                502,
                "unreachable",
                &format!("nothing answers on port {} in the guest: {e}", grant.port),
            )
        }
        Err(DialError::Gone(e)) => return answer(c, 404, "not_found", &e),
    };
    let upgrade = header("upgrade").is_some();
    let scheme = if st
        .ctx
        .cfg
        .preview_url
        .as_deref()
        .is_some_and(|u| u.starts_with("https://"))
    {
        "https"
    } else {
        "http"
    };
    let mut head = format!("{method} {tail} HTTP/1.1\r\n");
    for h in req.headers.iter() {
        let n = h.name;
        let drop_it = (used_key
            && (n.eq_ignore_ascii_case("authorization") || n.eq_ignore_ascii_case("x-api-key")))
            || (!upgrade
                && (n.eq_ignore_ascii_case("connection") || n.eq_ignore_ascii_case("keep-alive")))
            || n.to_ascii_lowercase().starts_with("x-forwarded-");
        if drop_it {
            continue;
        }
        head.push_str(n);
        head.push_str(": ");
        head.push_str(&String::from_utf8_lossy(h.value));
        head.push_str("\r\n");
    }
    if let Some(p) = peer {
        head.push_str(&format!("X-Forwarded-For: {}\r\n", p.ip()));
    }
    if let Some(h) = header("host") {
        head.push_str(&format!("X-Forwarded-Host: {h}\r\n"));
    }
    head.push_str(&format!("X-Forwarded-Proto: {scheme}\r\n"));
    if !upgrade {
        // One request per connection: a second one on it could not be
        // routed (its path still carries the token).
        head.push_str("Connection: close\r\n");
    }
    head.push_str("\r\n");
    let mut up = up;
    // Use of the session (its idle timer starts again), not a command: a
    // preview connection does not stop a pause or checkpoint.
    session.touch();
    let _touch = Touch(&session);
    if up.write_all(head.as_bytes()).is_err() || up.write_all(&buf[len..]).is_err() {
        return answer(c, 502, "unreachable", "the guest closed the connection");
    }
    let _ = c.set_read_timeout(None);
    ports::splice(c, up);
}

/// Counts a connection's end as use of its session too.
struct Touch<'a>(&'a crate::ops::Session);

impl Drop for Touch<'_> {
    fn drop(&mut self) {
        self.0.touch();
    }
}

/// Gives a session's connection slot back.
struct Release<'a>(&'a State, (String, String));

impl Drop for Release<'_> {
    fn drop(&mut self) {
        let mut m = crate::sync::lock(&self.0.per_session);
        if let Some(n) = m.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::route;

    #[test]
    fn routes_by_path_and_by_host() {
        let t = "0123456789abcdef0123456789abcdef";
        let r = |p: &str, h: Option<&str>| route(p, h, Some("preview.test"));
        assert_eq!(
            r(&format!("/ports/{t}"), None),
            Some((t.into(), "/".into()))
        );
        assert_eq!(
            r(&format!("/ports/{t}/a/b?x=1"), None),
            Some((t.into(), "/a/b?x=1".into()))
        );
        assert_eq!(
            r(&format!("/ports/{t}?x=1"), None),
            Some((t.into(), "/?x=1".into()))
        );
        assert_eq!(
            r("/app.js", Some(&format!("{t}.preview.test:8080"))),
            Some((t.into(), "/app.js".into()))
        );
        assert_eq!(r("/app.js", Some("other.test")), None);
        assert_eq!(
            route("/app.js", Some(&format!("{t}.preview.test")), None),
            None
        );
    }
}
