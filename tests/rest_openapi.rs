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
