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
//! come. At most [`MAX_CONNS`] connections at once, [`MAX_PER_PORT`] per
//! port, [`MAX_PER_SESSION`]
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
/// Connections at once to one port of a session.
pub const MAX_PER_PORT: usize = 32;
/// A request body the client declares (`Content-Length`) larger than this
/// is refused (413) before anything reaches the guest.
pub const MAX_BODY: u64 = 256 << 20;
/// The request head must arrive within this, and fit in [`MAX_HEAD`].
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_HEAD: usize = 16 << 10;

type Slot = (String, String, Option<u16>);

struct State {
    ctx: Arc<Ctx>,
    live: AtomicUsize,
    /// Connections open per (owner, session, None) and per (owner,
    /// session, Some(port)).
    per_session: Mutex<HashMap<Slot, usize>>,
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

/// The name of the cookie (and query parameter) that carries a host-form
/// URL's token, and the header a program may send it in instead. All three
/// are removed before the request reaches the guest.
pub const TOKEN_COOKIE: &str = "asbx_token";
const TOKEN_HEADER: &str = "x-asbx-token";

/// Which grant a request names.
#[derive(Debug, PartialEq)]
enum Route {
    /// `/ports/<token>/rest`: the guest gets `/rest`.
    Path { token: String, tail: String },
    /// Host `<port>-<session>.<domain>`: the guest gets the path as it is;
    /// the token comes in the cookie, the header or the query.
    Host {
        port: u16,
        session: String,
        tail: String,
    },
}

fn route(path: &str, host: Option<&str>, domain: Option<&str>) -> Option<Route> {
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
        return Some(Route::Path {
            token: token.to_string(),
            tail,
        });
    }
    let (host, domain) = (host?, domain?);
    let name = host.rsplit_once(':').map_or(host, |(h, p)| {
        if p.bytes().all(|b| b.is_ascii_digit()) {
            h
        } else {
            host
        }
    });
    let label = name
        .to_ascii_lowercase()
        .strip_suffix(&format!(".{domain}"))?
        .to_string();
    let (port, session) = label.split_once('-')?;
    let port = port.parse::<u16>().ok().filter(|p| *p > 0)?;
    if !crate::ops::ports::host_label_session(session) {
        return None;
    }
    Some(Route::Host {
        port,
        session: session.to_string(),
        tail: path.to_string(),
    })
}

/// `parts` (`name=value` pairs) without our token's, and its value.
fn take_token<'a>(parts: impl Iterator<Item = &'a str>) -> (Vec<&'a str>, Option<String>) {
    let mut token = None;
    let kept = parts
        .filter(|kv| {
            match kv
                .strip_prefix(TOKEN_COOKIE)
                .and_then(|r| r.strip_prefix('='))
            {
                Some(v) => {
                    token = Some(v.to_string());
                    false
                }
                None => !kv.is_empty(),
            }
        })
        .collect();
    (kept, token)
}

/// The path with the `asbx_token` query parameter taken out, and its value.
fn take_query_token(path: &str) -> (String, Option<String>) {
    let Some((p, q)) = path.split_once('?') else {
        return (path.to_string(), None);
    };
    let (kept, token) = take_token(q.split('&'));
    if kept.is_empty() {
        (p.to_string(), token)
    } else {
        (format!("{p}?{}", kept.join("&")), token)
    }
}

/// A `Cookie` header's value without our cookie, and that cookie's value.
fn take_cookie_token(cookie: &str) -> (String, Option<String>) {
    let (kept, token) = take_token(cookie.split(';').map(str::trim));
    (kept.join("; "), token)
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
    let Some(r) = route(path, header("host"), domain) else {
        return answer(
            c,
            404,
            "not_found",
            "no preview here: /ports/<token>/... or <port>-<session>.<preview domain>",
        );
    };
    let ops = &st.ctx.ops;
    let (token, tail, host_form) = match r {
        Route::Path { token, tail } => (token, tail, None),
        Route::Host {
            port,
            session,
            tail,
        } => {
            let (clean, from_query) = take_query_token(&tail);
            let token = from_query.clone().or_else(|| {
                header(TOKEN_HEADER)
                    .map(str::to_string)
                    .or_else(|| header("cookie").and_then(|c| take_cookie_token(c).1))
            });
            let Some(token) = token else {
                return answer(
                    c,
                    401,
                    "unauthorized",
                    "this preview URL needs its token: open the URL the API gave \
                     (its ?asbx_token= sets a cookie) or send X-Asbx-Token",
                );
            };
            if from_query.is_some() {
                // A browser opened the URL the API gave: keep the token in a
                // cookie of this host only and come back without it, so the
                // app never sees it in its URLs.
                return match ops.preview_target(&token) {
                    Some((s, g)) if g.port == port && s.id.eq_ignore_ascii_case(&session) => {
                        redirect(c, &clean, &token, st)
                    }
                    _ => answer(c, 404, "not_found", "no open port has this token"),
                };
            }
            (token, tail, Some((port, session)))
        }
    };
    let target = ops.preview_target(&token).filter(|(s, g)| {
        host_form
            .as_ref()
            .is_none_or(|(port, sid)| g.port == *port && s.id.eq_ignore_ascii_case(sid))
    });
    let Some((session, grant)) = target else {
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
    if let Some(n) = header("content-length").and_then(|v| v.trim().parse::<u64>().ok()) {
        if n > MAX_BODY {
            return answer(
                c,
                413,
                "payload_too_large",
                &format!("a preview request body is at most {MAX_BODY} bytes"),
            );
        }
    }
    let whole = (session.owner.clone(), session.id.clone(), None);
    let one = (session.owner.clone(), session.id.clone(), Some(grant.port));
    {
        let mut m = crate::sync::lock(&st.per_session);
        let (a, b) = (
            m.get(&whole).copied().unwrap_or(0),
            m.get(&one).copied().unwrap_or(0),
        );
        if a >= MAX_PER_SESSION || b >= MAX_PER_PORT {
            drop(m);
            return answer(
                c,
                503,
                "busy",
                "too many preview connections to this session or port",
            );
        }
        *m.entry(whole.clone()).or_insert(0) += 1;
        *m.entry(one.clone()).or_insert(0) += 1;
    }
    let _release = Release(st, [whole, one]);
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
            || n.to_ascii_lowercase().starts_with("x-forwarded-")
            || n.eq_ignore_ascii_case(TOKEN_HEADER);
        if drop_it {
            continue;
        }
        if n.eq_ignore_ascii_case("cookie") {
            // Our cookie is the daemon's, not the app's.
            let (rest, _) = take_cookie_token(&String::from_utf8_lossy(h.value));
            if !rest.is_empty() {
                head.push_str(&format!("Cookie: {rest}\r\n"));
            }
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

/// Sends a browser that brought the token in the query back to `clean`
/// with the token in a host-only cookie.
fn redirect(mut c: TcpStream, clean: &str, token: &str, st: &State) {
    let secure = st
        .ctx
        .cfg
        .preview_url
        .as_deref()
        .is_some_and(|u| u.starts_with("https://"));
    let _ = c.set_write_timeout(Some(Duration::from_secs(5)));
    let _ = write!(
        c,
        "HTTP/1.1 307 Temporary Redirect\r\nLocation: {clean}\r\n\
         Set-Cookie: {TOKEN_COOKIE}={token}; Path=/; HttpOnly; SameSite=Lax{}\r\n\
         Cache-Control: no-store\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        if secure { "; Secure" } else { "" }
    );
    let _ = c.shutdown(std::net::Shutdown::Both);
}

/// Counts a connection's end as use of its session too.
struct Touch<'a>(&'a crate::ops::Session);

impl Drop for Touch<'_> {
    fn drop(&mut self) {
        self.0.touch();
    }
}

/// Gives a connection's session and port slots back.
struct Release<'a>(&'a State, [Slot; 2]);

impl Drop for Release<'_> {
    fn drop(&mut self) {
        let mut m = crate::sync::lock(&self.0.per_session);
        for k in &self.1 {
            if let Some(n) = m.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    m.remove(k);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{route, take_cookie_token, take_query_token, Route};

    #[test]
    fn routes_by_path_and_by_host() {
        let t = "0123456789abcdef0123456789abcdef";
        let r = |p: &str, h: Option<&str>| route(p, h, Some("preview.test"));
        let path = |token: &str, tail: &str| {
            Some(Route::Path {
                token: token.into(),
                tail: tail.into(),
            })
        };
        assert_eq!(r(&format!("/ports/{t}"), None), path(t, "/"));
        assert_eq!(r(&format!("/ports/{t}/a/b?x=1"), None), path(t, "/a/b?x=1"));
        assert_eq!(r(&format!("/ports/{t}?x=1"), None), path(t, "/?x=1"));
        assert_eq!(
            r("/app.js", Some("8000-s-0123abcd.Preview.Test:8080")),
            Some(Route::Host {
                port: 8000,
                session: "s-0123abcd".into(),
                tail: "/app.js".into()
            })
        );
        assert_eq!(r("/app.js", Some("other.test")), None);
        assert_eq!(r("/app.js", Some(&format!("{t}.preview.test"))), None);
        assert_eq!(r("/", Some("0-a.preview.test")), None);
        assert_eq!(r("/", Some("70000-a.preview.test")), None);
        assert_eq!(r("/", Some("8000-a_b.preview.test")), None);
        assert_eq!(r("/", Some("8000-.preview.test")), None);
        assert_eq!(route("/app.js", Some("8000-a.preview.test"), None), None);
    }

    #[test]
    fn the_token_is_taken_out_of_query_and_cookie() {
        assert_eq!(
            take_query_token("/a?asbx_token=abc"),
            ("/a".into(), Some("abc".into()))
        );
        assert_eq!(
            take_query_token("/a?x=1&asbx_token=abc&y=2"),
            ("/a?x=1&y=2".into(), Some("abc".into()))
        );
        assert_eq!(
            take_query_token("/a?asbx_tokenx=1"),
            ("/a?asbx_tokenx=1".into(), None)
        );
        assert_eq!(
            take_cookie_token("a=1; asbx_token=abc;b=2"),
            ("a=1; b=2".into(), Some("abc".into()))
        );
        assert_eq!(
            take_cookie_token("asbx_token=abc"),
            (String::new(), Some("abc".into()))
        );
    }
}
