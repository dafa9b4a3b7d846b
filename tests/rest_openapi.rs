//! `docs/openapi.yaml` and the router agree: every served route is
//! documented and every documented operation is served.

use agent_sandbox::api::routes::ROUTES;
use std::collections::BTreeSet;

#[test]
fn openapi_matches_routes() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.yaml");
    let text = std::fs::read_to_string(path).expect("read docs/openapi.yaml");
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("parse openapi.yaml");
    assert_eq!(doc["openapi"].as_str(), Some("3.1.0"));
    let mut documented = BTreeSet::new();
    let paths = doc["paths"].as_mapping().expect("paths");
    for (p, item) in paths {
        let p = p.as_str().unwrap().to_string();
        for (m, _) in item.as_mapping().unwrap() {
            let m = m.as_str().unwrap().to_ascii_uppercase();
            if ["GET", "POST", "PUT", "DELETE", "PATCH"].contains(&m.as_str()) {
                documented.insert((m, p.clone()));
            }
        }
    }
    let served: BTreeSet<(String, String)> = ROUTES
        .iter()
        .map(|r| (r.method.to_string(), r.pattern.to_string()))
        .collect();
    let undocumented: Vec<_> = served.difference(&documented).collect();
    let unserved: Vec<_> = documented.difference(&served).collect();
    assert!(
        undocumented.is_empty(),
        "served but not in openapi.yaml: {undocumented:?}"
    );
    assert!(
        unserved.is_empty(),
        "in openapi.yaml but not served: {unserved:?}"
    );
    // Public routes are exactly the ones the spec marks `security: []`.
    for r in ROUTES {
        let op = &doc["paths"][r.pattern][r.method.to_ascii_lowercase().as_str()];
        let public = op["security"].as_sequence().is_some_and(|s| s.is_empty());
        assert_eq!(public, r.scope.is_none(), "{} {}", r.method, r.pattern);
    }
}

/// A path served with other methods answers 405 with the `Allow` header
/// RFC 9110 requires, naming exactly the methods the spec gives that path;
/// the literal `/exec/templates` is never the `{session}` of
/// `DELETE /exec/{session}`.
#[test]
fn method_not_allowed_names_the_paths_methods() {
    use agent_sandbox::api::http::parse_target;
    use agent_sandbox::api::routes::find;
    let allow = |method: &str, url: &str| {
        let t = parse_target(url).expect("target");
        match find(method, &t) {
            Ok((r, _)) => panic!("{method} {url} routed to {} {}", r.method, r.pattern),
            Err(e) => {
                assert_eq!((e.status, e.code), (405, "method_not_allowed"), "{e}");
                e.allow.expect("Allow on a 405")
            }
        }
    };
    assert_eq!(allow("TRACE", "/health"), "GET, HEAD");
    assert_eq!(allow("DELETE", "/exec/templates"), "GET, HEAD");
    assert_eq!(allow("OPTIONS", "/exec/templates"), "GET, HEAD");
    assert_eq!(allow("PUT", "/v1/sessions"), "GET, POST, HEAD");
    assert_eq!(
        allow("PATCH", "/v1/sessions/s/files/content"),
        "GET, PUT, HEAD"
    );
    // The literal route still wins for its own method, the parameter
    // route for the others' paths.
    let t = parse_target("/exec/templates").unwrap();
    assert_eq!(
        find("GET", &t).map(|(r, _)| r.pattern).ok(),
        Some("/exec/templates")
    );
    let t = parse_target("/exec/s1").unwrap();
    let (r, p) = find("DELETE", &t).map_err(|e| e.to_string()).unwrap();
    assert_eq!((r.pattern, p.get("session")), ("/exec/{session}", "s1"));
    // No such path at all: 404, no Allow.
    let t = parse_target("/nope").unwrap();
    let e = find("GET", &t).err().expect("404");
    assert_eq!((e.status, e.allow), (404, None));
}

/// The spec's fork/create `count` bound is the operations layer's, and
/// its snapshot id pattern is what the edge accepts.
#[test]
fn openapi_spells_the_stateful_limits() {
    use agent_sandbox::ops::validate;
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.yaml");
    let text = std::fs::read_to_string(path).expect("read docs/openapi.yaml");
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("parse openapi.yaml");
    let count = &doc["components"]["schemas"]["Count"];
    assert_eq!(count["minimum"].as_u64(), Some(1));
    assert_eq!(
        count["maximum"].as_u64(),
        Some(u64::from(agent_sandbox::ops::state::MAX_FORK))
    );
    let pattern = doc["components"]["parameters"]["Snapshot"]["schema"]["pattern"]
        .as_str()
        .expect("Snapshot pattern");
    assert_eq!(pattern, "^snap-([a-z][a-z0-9]{0,15}-)?[0-9a-f]{12}$");
    assert!(validate::snapshot_id("snap-00ff00ff00ff", "s").is_ok());
    // Made on a host with an id (behind a router, issue #28).
    assert!(validate::snapshot_id("snap-h2-00ff00ff00ff", "s").is_ok());
    assert!(validate::snapshot_id("snap-00FF00FF00FF", "s").is_err());
    assert!(validate::snapshot_id("snap-H2-00ff00ff00ff", "s").is_err());
}
