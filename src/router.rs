//! Several hosts behind one HAProxy (issue #28, docs/operations.md
//! "Several hosts"). Each host runs the daemon as it is; HAProxy sends
//! every request that names a session (or a snapshot, an MCP session, a
//! port token) to the host that owns it. This module holds the two halves
//! of that contract, so they cannot drift apart:
//!
//! - **ids**: a daemon with a host id tags the ids it makes with it:
//!   sessions `s-<host>-<12 hex>`, snapshots `snap-<host>-<12 hex>`, MCP
//!   sessions `m-<host>-<32 hex>`, port tokens `p-<host>-<32 hex>`
//!   ([`tagged`], [`host_of`]);
//! - **the router's config** ([`render`]): an id with a known host's tag
//!   goes to that host (`use-server`); any other name (one a client chose,
//!   as the seed's `/exec/:id/...` routes do) goes where `balance hash` with
//!   `hash-type consistent` puts it, on a ring of servers that are never
//!   health-checked out, so a name maps to one host for as long as the
//!   host list stays the same. Creates that name nothing (`POST
//!   /v1/sessions`, `/v1/run`, MCP `initialize` and session-less calls) go
//!   to the hosts whose `/ready` passes, round robin, and a `503` (full,
//!   draining) makes HAProxy try the next host; a request for an existing
//!   session is never retried elsewhere. A host that is down answers
//!   `503 host_unavailable` for its sessions.
//!
//! Why tags and not an id the router makes and hashes on: a create that a
//! full host refused is retried on another host, and a hash of the id
//! would still point at the first one; the host that takes the session
//! names it, so the id routes there whatever happened on the way.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::OnceLock;

/// Longest host id.
pub const MAX_HOST_ID: usize = 16;

/// The response header every reply of a daemon with a host id carries.
pub const HOST_HEADER: &str = "X-Asbx-Host";

/// The id prefixes a host tags, one per kind of id.
pub const SESSION: &str = "s";
pub const SNAPSHOT: &str = "snap";
pub const MCP_SESSION: &str = "m";
pub const PORT_TOKEN: &str = "p";

/// A host id: 1-16 lower-case letters and digits, a letter first (no
/// `-`: it separates the parts of a tagged id; a DNS label, so it also
/// stands in preview host names).
pub fn valid_host_id(h: &str) -> bool {
    (1..=MAX_HOST_ID).contains(&h.len())
        && h.as_bytes()[0].is_ascii_lowercase()
        && h.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

static HOST: OnceLock<Option<String>> = OnceLock::new();

/// This daemon's host id (set once at start from the config; before that,
/// and in tools that serve nothing, none).
pub fn set_host(id: Option<String>) {
    let _ = HOST.set(id.filter(|h| valid_host_id(h)));
}

pub fn host() -> Option<&'static str> {
    HOST.get().and_then(|h| h.as_deref())
}

/// The [`HOST_HEADER`] line of every reply head (empty without a host
/// id), so a client (and the tests) see which host answered.
pub fn host_header_line() -> &'static str {
    static LINE: OnceLock<String> = OnceLock::new();
    LINE.get_or_init(|| {
        host()
            .map(|h| format!("{HOST_HEADER}: {h}\r\n"))
            .unwrap_or_default()
    })
}

/// `<kind>-<host>-<rand>` on a host with an id, else `<kind>-<rand>`.
pub fn tagged(kind: &str, rand: &str) -> String {
    match host() {
        Some(h) => format!("{kind}-{h}-{rand}"),
        None => format!("{kind}-{rand}"),
    }
}

/// `<kind>-<host>-<rand>` on a host with an id, else `rand` as it is
/// (MCP session ids and port tokens kept their old shape on one host).
pub fn tagged_or_bare(kind: &str, rand: String) -> String {
    match host() {
        Some(h) => format!("{kind}-{h}-{rand}"),
        None => rand,
    }
}

/// The host an id was made on: the middle of `<kind>-<host>-<hex>`, when
/// the id has that shape (`kind` letters, `hex` lower-case hex digits).
pub fn host_of(id: &str) -> Option<&str> {
    let mut parts = id.splitn(3, '-');
    let kind = parts.next()?;
    let host = parts.next()?;
    let rand = parts.next()?;
    let hex = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    (!kind.is_empty()
        && kind.bytes().all(|b| b.is_ascii_lowercase())
        && valid_host_id(host)
        && hex(rand))
    .then_some(host)
}

/// Whether `id` is `<kind>-<hex>` or `<kind>-<host>-<hex>` with `n` hex
/// digits: the shape of an id of `kind` made by some host.
pub fn is_made_id(id: &str, kind: &str, n: usize) -> bool {
    let Some(rest) = id.strip_prefix(kind).and_then(|r| r.strip_prefix('-')) else {
        return false;
    };
    let hex = match rest.split_once('-') {
        Some((h, hex)) if valid_host_id(h) => hex,
        Some(_) => return false,
        None => rest,
    };
    hex.len() == n
        && hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// One host behind the router.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterHost {
    /// Its `host_id` (the daemon's `--host-id`), also the server's name.
    pub id: String,
    /// Its API listen address.
    pub api: SocketAddr,
    /// Its preview listener, when the router serves preview URLs.
    pub preview: Option<SocketAddr>,
}

impl std::str::FromStr for RouterHost {
    type Err = String;
    /// `ID=ADDR` or `ID=ADDR,preview=ADDR`.
    fn from_str(s: &str) -> Result<RouterHost, String> {
        let (id, rest) = s
            .split_once('=')
            .ok_or_else(|| format!("host {s:?}: ID=ADDR[,preview=ADDR]"))?;
        let mut parts = rest.split(',');
        let addr = |a: &str| {
            a.parse::<SocketAddr>()
                .map_err(|e| format!("host {id:?}: address {a:?}: {e} (IP:PORT)"))
        };
        let api = addr(parts.next().unwrap_or_default())?;
        let mut preview = None;
        for p in parts {
            match p.split_once('=') {
                Some(("preview", a)) => preview = Some(addr(a)?),
                _ => return Err(format!("host {id:?}: unknown part {p:?} (preview=ADDR)")),
            }
        }
        Ok(RouterHost {
            id: id.to_string(),
            api,
            preview,
        })
    }
}

/// What the router's config is made from.
#[derive(Debug, Clone)]
pub struct RouterSpec {
    /// Where clients reach the API (REST, MCP over HTTP).
    pub listen: SocketAddr,
    /// Where clients reach preview URLs (every host's `preview_url`
    /// names it); `None`: no preview frontend.
    pub preview_listen: Option<SocketAddr>,
    pub hosts: Vec<RouterHost>,
    /// The hosts read one key file on shared storage: key changes
    /// through the router reach all of them. Otherwise the router refuses
    /// them (a change would land on one host only).
    pub shared_keys: bool,
    /// HAProxy's stats page (`/stats`, read-only) on this address.
    pub stats_listen: Option<SocketAddr>,
}

impl RouterSpec {
    /// Host ids valid and unique, addresses unique, preview listeners
    /// named for every host or none.
    pub fn validate(&self) -> Result<(), String> {
        if self.hosts.is_empty() {
            return Err("a router needs at least one host".into());
        }
        let mut seen = std::collections::HashSet::new();
        for h in &self.hosts {
            if !valid_host_id(&h.id) {
                return Err(format!(
                    "host id {:?}: 1-{MAX_HOST_ID} lower-case letters and digits, a letter first",
                    h.id
                ));
            }
            if !seen.insert(h.id.clone()) {
                return Err(format!("host id {:?} named twice", h.id));
            }
            if self.preview_listen.is_some() && h.preview.is_none() {
                return Err(format!(
                    "host {:?} has no preview address (ID=ADDR,preview=ADDR) but the router serves previews",
                    h.id
                ));
            }
        }
        let ids: std::collections::HashSet<u32> =
            self.hosts.iter().map(|h| server_id(&h.id)).collect();
        if ids.len() != self.hosts.len() {
            return Err("two host ids hash to the same HAProxy server id: rename one".into());
        }
        Ok(())
    }
}

/// A server's HAProxy `id`: from its name alone (FNV-1a, 1..2^31), so the
/// hash ring stays the same whatever order the hosts are listed in.
pub fn server_id(name: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    (h & 0x7fff_fffe) + 1
}

/// The JSON error body HAProxy answers with itself, in the route's shape
/// (`seed`: the seed's `{error, code}`; else `{error: {code, message}}`),
/// quoted for the config.
fn body(seed: bool, code: &str, message: &str) -> String {
    let v = if seed {
        serde_json::json!({"error": message, "code": code})
    } else {
        serde_json::json!({"error": {"code": code, "message": message}})
    };
    // Single-quoted in HAProxy's config: no single quote inside.
    format!("'{}'", v.to_string().replace('\'', "\u{2019}"))
}

const UNAVAILABLE: &str = "its sessions are unreachable until it is back (others are not affected)";

/// The HAProxy (2.6 or newer) config for `spec`. Checked with `haproxy
/// -c` by `agent-sandbox doctor --router` and the tests.
pub fn render(spec: &RouterSpec) -> Result<String, String> {
    spec.validate()?;
    let mut c = String::new();
    let w = &mut c;
    let hosts = &spec.hosts;
    let names: Vec<&str> = hosts.iter().map(|h| h.id.as_str()).collect();
    let _ = writeln!(
        w,
        "# agent-sandbox router: made by `agent-sandbox router config` (docs/operations.md,\n\
         # \"Several hosts\"). Hosts: {}.\n\
         global\n    # maxconn: HAProxy's default, from the open-file limit.\n\n\
         defaults\n    mode http\n    timeout connect 2s\n    timeout client 1h\n    \
         timeout server 1h\n    timeout tunnel 1h\n    timeout http-request 15s\n    \
         timeout queue 5s\n    timeout check 2s\n    retries 1\n",
        names.join(", ")
    );
    // The API frontend.
    let _ = writeln!(w, "frontend api\n    bind {}", spec.listen);
    w.push_str(
        "    acl post method POST\n    acl create path /v1/sessions\n    acl mcp path /mcp\n    \
         acl fork path_reg ^/v1/sessions/[^/]+/fork$\n    acl seed path_beg /exec /admin /health /ready\n",
    );
    // No host answers at all.
    let _ = writeln!(
        w,
        "    http-request return status 503 content-type application/json string {} if {{ nbsrv(any) eq 0 }} seed\n    \
         http-request return status 503 content-type application/json string {} if {{ nbsrv(any) eq 0 }}",
        body(true, "unavailable", "no host answers"),
        body(false, "unavailable", "no host answers")
    );
    // The router's own readiness: some host takes new sessions.
    let ready = |ok: bool| {
        let mut v = serde_json::json!({"status": if ok { "ready" } else { "not_ready" }, "ready": ok, "router": true});
        if !ok {
            v["reason"] = "no host takes new sessions".into();
        }
        format!("'{v}'")
    };
    let _ = writeln!(
        w,
        "    http-request return status 200 content-type application/json string {} if {{ path /ready }} {{ nbsrv(place) gt 0 }}\n    \
         http-request return status 503 content-type application/json string {} if {{ path /ready }}",
        ready(true),
        ready(false)
    );
    // What a change on one host would break elsewhere.
    let _ = writeln!(
        w,
        "    http-request return status 501 content-type application/json string {} if {{ path_beg /v1/templates }} !METH_GET\n    \
         http-request return status 501 content-type application/json string {} if {{ path_beg /v1/templates/builds }}\n    \
         http-request return status 501 content-type application/json string {} if {{ path_beg /v1/admin/ }}",
        body(
            false,
            "not_supported",
            "behind the router, build or remove templates on every host (agent-sandbox template build, or each host's own address)"
        ),
        body(
            false,
            "not_supported",
            "behind the router, ask the host that runs the build at its own address"
        ),
        body(
            false,
            "not_supported",
            "behind the router, drain or inspect a host at its own address (agent-sandbox drain --url)"
        ),
    );
    if !spec.shared_keys {
        let _ = writeln!(
            w,
            "    http-request return status 501 content-type application/json string {} if {{ path_beg /admin/keys }} !METH_GET",
            body(
                true,
                "not_supported",
                "behind the router, keys live in one key file deployed to every host: change it with agent-sandbox keys and deploy it (or put it on shared storage and render the router with --shared-keys)"
            )
        );
    }
    // Bodies that name where a request goes (bounded by HAProxy's buffer).
    w.push_str(
        "    http-request wait-for-body time 2s if post create || post fork || post mcp\n    \
         http-request set-var(txn.bid) req.body,json_query('$.id') if post create\n    \
         http-request set-var(txn.snap) req.body,json_query('$.fromSnapshot') if post create\n",
    );
    let _ = writeln!(
        w,
        "    http-request return status 400 content-type application/json string {} if {{ var(txn.bid) -m found }} {{ var(txn.snap) -m found }}",
        body(
            false,
            "bad_request",
            "behind the router, a session from a snapshot takes the id its host makes: leave out id"
        )
    );
    // The session (or snapshot, MCP session, token) a request names.
    w.push_str(
        "    http-request set-var(txn.sid) path,field(3,/) if { path_reg ^/exec/[^/]+ } !{ path_reg ^/exec/templates/?$ }\n    \
         http-request set-var(txn.sid) path,field(4,/) if { path_reg ^/v1/(sessions|snapshots)/[^/]+ }\n    \
         http-request set-var(txn.sid) var(txn.snap) if { var(txn.snap) -m found }\n    \
         http-request set-var(txn.sid) var(txn.bid) if { var(txn.bid) -m found }\n    \
         http-request set-var(txn.sid) req.hdr(mcp-session-id) if mcp { req.hdr(mcp-session-id) -m found }\n    \
         http-request set-var(txn.sid) req.body,json_query('$.params.arguments.sessionId') if post mcp !{ var(txn.sid) -m found }\n    \
         http-request set-var(txn.sid) req.body,json_query('$.params.arguments.snapshotId') if post mcp !{ var(txn.sid) -m found }\n    \
         http-request set-var(txn.sid) req.body,json_query('$.params.arguments.fromSnapshot') if post mcp !{ var(txn.sid) -m found }\n    \
         http-request set-var(txn.sid) req.body,json_query('$.params.arguments.id') if post mcp !{ var(txn.sid) -m found } { req.body,json_query('$.params.name') -m str create_session }\n",
    );
    tags(w, hosts, "any");
    w.push_str(
        "    use_backend seed_sessions if { var(txn.sid) -m found } { path_beg /exec/ }\n    \
         use_backend sessions if { var(txn.sid) -m found }\n    \
         use_backend place if post create { nbsrv(place) gt 0 } || post mcp { nbsrv(place) gt 0 } || { path /v1/run } { nbsrv(place) gt 0 }\n    \
         default_backend any\n\n",
    );
    // Session routes: the tag's host, else the hash ring. No checks: a
    // down host stays on the ring, so its names are never sent elsewhere.
    session_backend(w, "sessions", false, hosts, |h| Some(h.api));
    session_backend(w, "seed_sessions", true, hosts, |h| Some(h.api));
    // Creates: hosts whose /ready passes; a 503 tries the next one.
    let _ = writeln!(
        w,
        "backend place\n    balance roundrobin\n    option httpchk GET /ready\n    \
         http-check expect status 200\n    retry-on 503 conn-failure empty-response\n    \
         retries {}\n    option redispatch 1\n    \
         default-server check inter 1s fastinter 500ms downinter 1s rise 1 fall 1",
        hosts.len().saturating_sub(1).max(1)
    );
    servers(w, hosts, |h| Some(h.api), true);
    w.push('\n');
    // Everything else (lists, templates, health): any live host.
    let _ = writeln!(
        w,
        "backend any\n    balance roundrobin\n    option httpchk GET /health\n    \
         http-check expect status 200\n    option redispatch 1\n    \
         default-server check inter 1s fastinter 500ms downinter 1s rise 1 fall 2"
    );
    servers(w, hosts, |h| Some(h.api), true);
    w.push('\n');
    if let Some(p) = spec.preview_listen {
        let _ = writeln!(w, "frontend preview\n    bind {p}");
        w.push_str(
            "    http-request set-var(txn.sid) path,field(3,/) if { path_reg ^/ports/[^/]+ }\n    \
             http-request set-var(txn.sid) req.hdr(host),field(1,.),regsub(^[0-9]+-,) if !{ path_beg /ports/ }\n",
        );
        tags(w, hosts, "any");
        w.push_str("    default_backend preview_sessions\n\n");
        session_backend(w, "preview_sessions", false, hosts, |h| h.preview);
    }
    if let Some(s) = spec.stats_listen {
        let _ = writeln!(
            w,
            "frontend stats\n    bind {s}\n    stats enable\n    stats uri /stats\n    stats refresh 5s\n"
        );
    }
    Ok(c)
}

/// `txn.tag`: the host a tagged id names, when it is one of ours; such a
/// request to a host the health checks of `checked` see down is answered
/// 503 at once (no connect timeout first).
fn tags(w: &mut String, hosts: &[RouterHost], checked: &str) {
    w.push_str(
        "    http-request set-var(txn.tag) var(txn.sid),field(2,-) if { var(txn.sid) -m reg ^[a-z]+-[a-z][a-z0-9]*-[0-9a-f]+$ }\n",
    );
    for h in hosts {
        let msg = format!("host {} does not answer: {UNAVAILABLE}", h.id);
        // The seed's error shape on its routes, ours elsewhere.
        for (seed, only) in [(true, " { path_beg /exec/ }"), (false, "")] {
            let _ = writeln!(
                w,
                "    http-request return status 503 content-type application/json string {} if {{ var(txn.tag) -m str {id} }} !{{ srv_is_up({checked}/{id}) }}{only}",
                body(seed, "host_unavailable", &msg),
                id = h.id
            );
        }
    }
}

fn session_backend(
    w: &mut String,
    name: &str,
    seed: bool,
    hosts: &[RouterHost],
    addr: impl Fn(&RouterHost) -> Option<SocketAddr>,
) {
    let _ = writeln!(
        w,
        "backend {name}\n    balance hash var(txn.sid)\n    hash-type consistent sdbm avalanche\n    \
         http-error status 503 content-type application/json string {}",
        body(
            seed,
            "host_unavailable",
            &format!("the host that holds this session does not answer: {UNAVAILABLE}")
        )
    );
    for h in hosts {
        let _ = writeln!(
            w,
            "    use-server {id} if {{ var(txn.tag) -m str {id} }}",
            id = h.id
        );
    }
    servers(w, hosts, addr, false);
    w.push('\n');
}

fn servers(
    w: &mut String,
    hosts: &[RouterHost],
    addr: impl Fn(&RouterHost) -> Option<SocketAddr>,
    check: bool,
) {
    for h in hosts {
        if let Some(a) = addr(h) {
            let _ = writeln!(
                w,
                "    server {} {a} id {}{}",
                h.id,
                server_id(&h.id),
                if check { " check" } else { "" }
            );
        }
    }
}

/// The hosts a router config names (`server` lines of its `any`
/// backend): what `doctor --router` probes. Also checks the config has
/// the parts routing depends on; each missing one is a finding.
pub fn read_config(text: &str) -> (Vec<(String, String)>, Vec<String>) {
    let mut hosts = Vec::new();
    let mut backend = "";
    let mut findings = Vec::new();
    let saw = |what: &str| text.lines().any(|l| l.trim() == what);
    for (what, why) in [
        (
            "balance hash var(txn.sid)",
            "session routes are not hashed on the session id",
        ),
        (
            "hash-type consistent sdbm avalanche",
            "the hash is not consistent",
        ),
        (
            "option httpchk GET /ready",
            "creates are not health-checked with /ready",
        ),
        (
            "retry-on 503 conn-failure empty-response",
            "a full host's 503 is not retried for creates",
        ),
        ("backend sessions", "no session backend"),
    ] {
        if !saw(what) {
            findings.push(format!("missing `{what}`: {why}"));
        }
    }
    for l in text.lines() {
        let t: Vec<&str> = l.split_whitespace().collect();
        match t.as_slice() {
            ["backend", name, ..] => backend = name,
            ["server", name, addr, ..] if backend == "any" => {
                if !valid_host_id(name) {
                    findings.push(format!("server {name:?}: not a host id"));
                }
                hosts.push((name.to_string(), addr.to_string()));
            }
            _ => {}
        }
    }
    if hosts.is_empty() {
        findings.push("no `server` lines in `backend any`: no hosts".into());
    }
    (hosts, findings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_ids() {
        for ok in ["h1", "a", "host0123456789ab"] {
            assert!(valid_host_id(ok), "{ok}");
        }
        for bad in ["", "1h", "H1", "h-1", "h.1", "host0123456789abc", "h_1"] {
            assert!(!valid_host_id(bad), "{bad}");
        }
    }

    #[test]
    fn tags_are_read_back() {
        assert_eq!(host_of("s-h2-0123456789ab"), Some("h2"));
        assert_eq!(host_of("snap-web3-0123456789ab"), Some("web3"));
        assert_eq!(host_of("m-h1-00ff"), Some("h1"));
        for none in [
            "s-0123456789ab",
            "my-box",
            "s-h2-xyz",
            "S-h2-00",
            "s--00",
            "h2",
            "-h2-00",
        ] {
            assert_eq!(host_of(none), None, "{none}");
        }
        assert!(is_made_id("snap-0123456789ab", "snap", 12));
        assert!(is_made_id("snap-h1-0123456789ab", "snap", 12));
        for bad in [
            "snap-0123456789a",
            "snap-H1-0123456789ab",
            "snap-h1-0123456789aB",
            "snap-",
            "s-0123456789ab",
        ] {
            assert!(!is_made_id(bad, "snap", 12), "{bad}");
        }
    }

    #[test]
    fn hosts_parse_and_validate() {
        let h: RouterHost = "h1=10.0.0.1:8080,preview=10.0.0.1:8081".parse().unwrap();
        assert_eq!(h.id, "h1");
        assert_eq!(h.preview, Some("10.0.0.1:8081".parse().unwrap()));
        assert!("h1".parse::<RouterHost>().is_err());
        assert!("h1=nowhere".parse::<RouterHost>().is_err());
        assert!("h1=10.0.0.1:1,x=1".parse::<RouterHost>().is_err());
        let spec = |hosts: &[&str], preview: bool| RouterSpec {
            listen: "127.0.0.1:8080".parse().unwrap(),
            preview_listen: preview.then(|| "127.0.0.1:8081".parse().unwrap()),
            hosts: hosts.iter().map(|h| h.parse().unwrap()).collect(),
            shared_keys: false,
            stats_listen: None,
        };
        assert!(spec(&[], false).validate().is_err());
        assert!(spec(&["h1=1.2.3.4:1", "h1=1.2.3.5:1"], false)
            .validate()
            .is_err());
        assert!(spec(&["H1=1.2.3.4:1"], false).validate().is_err());
        assert!(spec(&["h1=1.2.3.4:1"], true).validate().is_err());
        let s = spec(&["h1=1.2.3.4:1", "h2=1.2.3.5:1"], false);
        let text = render(&s).unwrap();
        let (hosts, findings) = read_config(&text);
        assert!(findings.is_empty(), "{findings:?}");
        assert_eq!(
            hosts,
            vec![
                ("h1".into(), "1.2.3.4:1".into()),
                ("h2".into(), "1.2.3.5:1".into())
            ]
        );
        // The ring does not depend on the order hosts are listed in.
        assert_ne!(server_id("h1"), server_id("h2"));
        let (_, f) = read_config("frontend x\n");
        assert!(f.len() >= 5, "{f:?}");
    }

    /// docs/router-sample.cfg is what `router config` prints for it.
    #[test]
    fn the_sample_in_the_docs_is_current() {
        let spec = RouterSpec {
            listen: "0.0.0.0:3000".parse().unwrap(),
            preview_listen: None,
            hosts: vec![
                "h1=10.0.0.11:3000".parse().unwrap(),
                "h2=10.0.0.12:3000".parse().unwrap(),
            ],
            shared_keys: false,
            stats_listen: None,
        };
        assert_eq!(
            render(&spec).unwrap(),
            include_str!("../docs/router-sample.cfg"),
            "regenerate: agent-sandbox router config --listen 0.0.0.0:3000 --host h1=10.0.0.11:3000 \
             --host h2=10.0.0.12:3000 > docs/router-sample.cfg"
        );
    }
}
