//! The route table: one list, used by the router and checked against
//! `docs/openapi.yaml` by the tests.

use super::auth::{Principal, Scope};
use super::errors::{ApiError, ApiResult};
use super::http::{Params, Reply, Target};
use super::{rest, v1, ws, Ctx};
use std::collections::HashMap;
use std::sync::Arc;

pub type Handler =
    fn(&Arc<Ctx>, &mut super::httpd::Request, &Principal, &Params) -> ApiResult<Reply>;

pub struct Route {
    pub method: &'static str,
    /// `{name}` matches one path segment.
    pub pattern: &'static str,
    /// Scope required; `None` = no authentication.
    pub scope: Option<Scope>,
    pub handler: Handler,
}

macro_rules! r {
    ($m:literal, $p:literal, $s:expr, $h:expr) => {
        Route {
            method: $m,
            pattern: $p,
            scope: $s,
            handler: $h,
        }
    };
}

const EXEC: Option<Scope> = Some(Scope::Exec);
const ADMIN: Option<Scope> = Some(Scope::Admin);

pub static ROUTES: &[Route] = &[
    r!("GET", "/health", None, rest::health),
    r!("GET", "/ready", None, rest::ready),
    r!("GET", "/metrics", Some(Scope::Metrics), rest::metrics),
    // Seed-compatible API.
    r!("GET", "/exec", EXEC, rest::list_sessions),
    r!("GET", "/exec/templates", EXEC, rest::templates),
    r!("POST", "/exec/{session}/execute", EXEC, rest::execute),
    r!("POST", "/exec/{session}/write", EXEC, rest::write),
    r!("GET", "/exec/{session}/read", EXEC, rest::read),
    r!("GET", "/exec/{session}/files", EXEC, rest::files),
    r!("DELETE", "/exec/{session}", EXEC, rest::delete_session),
    r!("GET", "/admin/keys", ADMIN, rest::list_keys),
    r!("POST", "/admin/keys", ADMIN, rest::create_key),
    r!("POST", "/admin/keys/{key}/revoke", ADMIN, rest::revoke_key),
    r!("POST", "/admin/keys/{key}/rotate", ADMIN, rest::rotate_key),
    r!("DELETE", "/admin/keys/{key}", ADMIN, rest::delete_key),
    // v1.
    r!("GET", "/v1/templates", EXEC, rest::templates),
    r!("POST", "/v1/templates", ADMIN, v1::create_template),
    r!(
        "GET",
        "/v1/templates/builds/{build}",
        ADMIN,
        v1::get_template_build
    ),
    r!(
        "DELETE",
        "/v1/templates/{template}",
        ADMIN,
        v1::delete_template
    ),
    // Draining this host (issue #28).
    r!("GET", "/v1/admin/drain", ADMIN, v1::get_drain),
    r!("POST", "/v1/admin/drain", ADMIN, v1::start_drain),
    r!("DELETE", "/v1/admin/drain", ADMIN, v1::end_drain),
    r!("POST", "/v1/run", EXEC, v1::run),
    r!("GET", "/v1/sessions", EXEC, v1::list_sessions),
    r!("POST", "/v1/sessions", EXEC, v1::create_session),
    r!("GET", "/v1/sessions/{session}", EXEC, v1::get_session),
    r!("DELETE", "/v1/sessions/{session}", EXEC, v1::delete_session),
    r!(
        "POST",
        "/v1/sessions/{session}/keepalive",
        EXEC,
        v1::keepalive
    ),
    r!(
        "GET",
        "/v1/sessions/{session}/network",
        EXEC,
        v1::get_network
    ),
    r!(
        "PUT",
        "/v1/sessions/{session}/network",
        EXEC,
        v1::set_network
    ),
    r!(
        "POST",
        "/v1/sessions/{session}/ports",
        EXEC,
        v1::expose_port
    ),
    r!("GET", "/v1/sessions/{session}/ports", EXEC, v1::list_ports),
    r!(
        "DELETE",
        "/v1/sessions/{session}/ports/{port}",
        EXEC,
        v1::close_port
    ),
    r!(
        "GET",
        "/v1/sessions/{session}/secrets",
        EXEC,
        v1::get_secrets
    ),
    r!(
        "PUT",
        "/v1/sessions/{session}/secrets",
        EXEC,
        v1::set_secrets
    ),
    r!("POST", "/v1/sessions/{session}/exec", EXEC, v1::exec),
    r!("GET", "/v1/sessions/{session}/audit", EXEC, v1::audit),
    r!(
        "GET",
        "/v1/sessions/{session}/processes",
        EXEC,
        v1::list_procs
    ),
    r!(
        "DELETE",
        "/v1/sessions/{session}/processes",
        EXEC,
        v1::kill_all
    ),
    r!(
        "GET",
        "/v1/sessions/{session}/processes/{proc}",
        EXEC,
        v1::get_proc
    ),
    r!(
        "GET",
        "/v1/sessions/{session}/processes/{proc}/ws",
        EXEC,
        ws::attach
    ),
    r!("GET", "/v1/sessions/{session}/pty/ws", EXEC, ws::pty),
    r!("POST", "/v1/sessions/{session}/ws-token", EXEC, ws::token),
    r!(
        "GET",
        "/v1/sessions/{session}/processes/{proc}/output",
        EXEC,
        v1::attach
    ),
    r!(
        "POST",
        "/v1/sessions/{session}/processes/{proc}/stdin",
        EXEC,
        v1::stdin
    ),
    r!(
        "POST",
        "/v1/sessions/{session}/processes/{proc}/signal",
        EXEC,
        v1::signal
    ),
    r!(
        "POST",
        "/v1/sessions/{session}/processes/{proc}/resize",
        EXEC,
        v1::resize
    ),
    r!(
        "GET",
        "/v1/sessions/{session}/files/content",
        EXEC,
        v1::download
    ),
    r!(
        "PUT",
        "/v1/sessions/{session}/files/content",
        EXEC,
        v1::upload
    ),
    r!("GET", "/v1/sessions/{session}/files/stat", EXEC, v1::stat),
    r!(
        "GET",
        "/v1/sessions/{session}/files/list",
        EXEC,
        v1::list_files
    ),
    r!(
        "POST",
        "/v1/sessions/{session}/files/mkdir",
        EXEC,
        v1::mkdir
    ),
    r!(
        "POST",
        "/v1/sessions/{session}/files/remove",
        EXEC,
        v1::remove
    ),
    r!(
        "POST",
        "/v1/sessions/{session}/files/rename",
        EXEC,
        v1::rename
    ),
    // Stateful sessions (issue #21).
    r!(
        "POST",
        "/v1/sessions/{session}/snapshots",
        EXEC,
        v1::checkpoint
    ),
    r!("POST", "/v1/sessions/{session}/fork", EXEC, v1::fork),
    r!("POST", "/v1/sessions/{session}/pause", EXEC, v1::pause),
    r!("POST", "/v1/sessions/{session}/resume", EXEC, v1::resume),
    r!("GET", "/v1/snapshots", EXEC, v1::list_snapshots),
    r!("GET", "/v1/snapshots/{snapshot}", EXEC, v1::get_snapshot),
    r!(
        "DELETE",
        "/v1/snapshots/{snapshot}",
        EXEC,
        v1::delete_snapshot
    ),
];

fn matches(pattern: &str, segs: &[String]) -> Option<HashMap<&'static str, String>> {
    // Patterns are 'static; re-borrow names from the static table.
    let pat: Vec<&str> = pattern.split('/').skip(1).collect();
    if pat.len() != segs.len() {
        return None;
    }
    let mut out = HashMap::new();
    for (p, s) in pat.iter().zip(segs) {
        if let Some(name) = p.strip_prefix('{').and_then(|n| n.strip_suffix('}')) {
            out.insert(static_name(name), s.clone());
        } else if p != s {
            return None;
        }
    }
    Some(out)
}

fn static_name(name: &str) -> &'static str {
    match name {
        "session" => "session",
        "key" => "key",
        "proc" => "proc",
        "snapshot" => "snapshot",
        "port" => "port",
        "build" => "build",
        "template" => "template",
        _ => "param",
    }
}

/// The route for `method` + target; 404 when no path matches, 405 (with
/// the path's methods for `Allow`) when the path exists with other methods.
/// The most literal pattern owns a path for every method: `/exec/templates`
/// is never `/exec/{session}` (DELETE there is 405, not a session delete).
pub fn find(method: &str, t: &Target) -> Result<(&'static Route, Params), ApiError> {
    let matching: Vec<(&'static Route, HashMap<&'static str, String>)> = ROUTES
        .iter()
        .filter_map(|r| matches(r.pattern, &t.segments).map(|p| (r, p)))
        .collect();
    let Some(fewest) = matching.iter().map(|(r, _)| params_in(r)).min() else {
        return Err(ApiError::new(
            404,
            "route_not_found",
            format!("no route {method} {}", t.path),
        ));
    };
    let mut allowed = Vec::new();
    for (r, path) in matching.into_iter().filter(|(r, _)| params_in(r) == fewest) {
        if r.method == method || (method == "HEAD" && r.method == "GET") {
            return Ok((
                r,
                Params {
                    path,
                    query: t.query.clone(),
                },
            ));
        }
        allowed.push(r.method);
    }
    // A GET route also answers HEAD.
    if allowed.contains(&"GET") {
        allowed.push("HEAD");
    }
    let allow = allowed.join(", ");
    let mut e = ApiError::new(
        405,
        "method_not_allowed",
        format!("{method} is not allowed on {}; try {allow}", t.path),
    );
    e.allow = Some(allow);
    Err(e)
}

fn params_in(r: &Route) -> usize {
    r.pattern.matches('{').count()
}
