//! Stateful sessions (issue #21) at the API edge, on the local-process
//! backend (no checkpoints there): every new REST route and MCP tool is
//! reachable with its scope and only for the owner, bad input is a 400 that
//! names the field, the backend's refusal is 501 `not_supported`, and the
//! snapshot list is empty. The real-VM behaviour is tested elsewhere.

mod common;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::{mcp_call, mcp_rpc, Daemon, Http};
use serde_json::{json, Value};

const UNKNOWN: &str = "snap-0123456789ab";

/// Creates a key through the admin API; its token.
fn make_key(admin: &Http, scopes: Value) -> String {
    let r = admin.post("/admin/keys", &json!({"name": "t", "scopes": scopes}));
    assert_eq!(r.status, 201, "create key: {}", r.text());
    r.json()["key"].as_str().unwrap_or_default().to_string()
}

/// `status` and error `code`, and the message contains `says`.
#[track_caller]
fn refused(r: &common::daemon::Resp, status: u16, code: &str, says: &str) {
    assert_eq!(
        (r.status, r.code().as_str()),
        (status, code),
        "{}",
        r.text()
    );
    assert!(
        r.message().contains(says),
        "{:?} lacks {says:?}",
        r.message()
    );
}

#[test]
fn stateful_routes_answer_on_local_process() {
    let d = Daemon::start_local(&[]);
    let admin = d.http();
    let owner = admin.with_key(&make_key(&admin, json!(["exec"])));
    let other = admin.with_key(&make_key(&admin, json!(["exec"])));
    let metrics = admin.with_key(&make_key(&admin, json!(["metrics"])));

    // The new create fields are taken and shown.
    let r = owner.post(
        "/v1/sessions",
        &json!({"id": "src", "onIdle": "pause", "pausedTtl": "30m"}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    assert_eq!(
        (v["onIdle"].as_str(), v["pausedTtlMs"].as_u64()),
        (Some("pause"), Some(30 * 60 * 1000)),
        "{v}"
    );
    assert!(v.get("snapshotBytes").is_none(), "not paused: {v}");
    let r = owner.post("/v1/sessions", &json!({"id": "plain"}));
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["onIdle"], "destroy");

    // The backend cannot checkpoint: 501 not_supported, the session runs on.
    for (path, body) in [
        ("/v1/sessions/src/snapshots", json!({"name": "before"})),
        ("/v1/sessions/src/snapshots", json!({})),
        ("/v1/sessions/src/fork", json!({"count": 2})),
        ("/v1/sessions/src/pause", json!({})),
    ] {
        let r = owner.post(path, &body);
        assert_eq!(
            (r.status, r.code().as_str()),
            (501, "not_supported"),
            "{path}: {}",
            r.text()
        );
    }
    // Resuming a running session is nothing to do: 200, as it is.
    let r = owner.post("/v1/sessions/src/resume", &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["state"], "ready", "{}", r.text());
    let r = owner.get("/v1/sessions/src");
    assert_eq!((r.status, &r.json()["state"]), (200, &json!("ready")));
    assert_eq!(
        common::daemon::stdout_of(&owner.exec("src", "echo alive")),
        "alive\n"
    );

    // Snapshots: none, and an unknown one is 404 for get and delete.
    let r = owner.get("/v1/snapshots");
    assert_eq!((r.status, r.json()), (200, json!({"snapshots": []})));
    let r = admin.get("/v1/snapshots");
    assert_eq!((r.status, r.json()), (200, json!({"snapshots": []})));
    for r in [
        owner.get(&format!("/v1/snapshots/{UNKNOWN}")),
        owner.delete(&format!("/v1/snapshots/{UNKNOWN}")),
    ] {
        refused(&r, 404, "snapshot_not_found", UNKNOWN);
    }
    // A snapshot id of the wrong shape is refused at the edge.
    for bad in ["junk", "snap-0123456789AB", "snap-0123", "s-0123456789ab"] {
        for r in [
            owner.get(&format!("/v1/snapshots/{bad}")),
            owner.delete(&format!("/v1/snapshots/{bad}")),
        ] {
            refused(&r, 400, "bad_request", "snapshot");
        }
    }

    // Another key's session is not there for it; the session's owner
    // still has it.
    for path in [
        "/v1/sessions/src/snapshots",
        "/v1/sessions/src/pause",
        "/v1/sessions/src/resume",
    ] {
        refused(
            &other.post(path, &json!({})),
            404,
            "session_not_found",
            "src",
        );
    }
    refused(
        &other.post("/v1/sessions/src/fork", &json!({"count": 1})),
        404,
        "session_not_found",
        "src",
    );
    // Without the exec scope: 403 on every new route.
    for r in [
        metrics.post("/v1/sessions/src/snapshots", &json!({})),
        metrics.post("/v1/sessions/src/fork", &json!({"count": 1})),
        metrics.post("/v1/sessions/src/pause", &json!({})),
        metrics.post("/v1/sessions/src/resume", &json!({})),
        metrics.get("/v1/snapshots"),
        metrics.get(&format!("/v1/snapshots/{UNKNOWN}")),
        metrics.delete(&format!("/v1/snapshots/{UNKNOWN}")),
    ] {
        assert_eq!(r.status, 403, "{}", r.text());
    }
    // Unknown session: 404 before anything else is tried.
    refused(
        &owner.post("/v1/sessions/nope/pause", &json!({})),
        404,
        "session_not_found",
        "nope",
    );
}

#[test]
fn stateful_bad_bodies_are_400_naming_the_field() {
    let d = Daemon::start_local(&[]);
    let h = d.http();
    assert_eq!(h.post("/v1/sessions", &json!({"id": "s"})).status, 201);
    let max = agent_sandbox::ops::state::MAX_FORK;
    let over = i64::from(max) + 1;
    let long = "x".repeat(65);
    let over_says = format!("count {over} outside 1..={max}");
    let cases: Vec<(&str, Value, &str)> = vec![
        ("/v1/sessions/s/fork", json!({}), "count is required"),
        (
            "/v1/sessions/s/fork",
            json!({"count": null}),
            "count is required",
        ),
        (
            "/v1/sessions/s/fork",
            json!({"count": 0}),
            "count 0 outside",
        ),
        (
            "/v1/sessions/s/fork",
            json!({"count": -3}),
            "count -3 outside",
        ),
        ("/v1/sessions/s/fork", json!({ "count": over }), &over_says),
        ("/v1/sessions/s/fork", json!({"count": 2.5}), "integer"),
        ("/v1/sessions/s/fork", json!({"count": "2"}), "invalid"),
        (
            "/v1/sessions/s/fork",
            json!({"count": 1, "n": 1}),
            "unknown field `n`",
        ),
        (
            "/v1/sessions/s/snapshots",
            json!({"name": long}),
            "name must be 1-64",
        ),
        (
            "/v1/sessions/s/snapshots",
            json!({"name": ""}),
            "name must be 1-64",
        ),
        (
            "/v1/sessions/s/snapshots",
            json!({"label": "x"}),
            "unknown field `label`",
        ),
        (
            "/v1/sessions",
            json!({"onIdle": "sleep"}),
            "onIdle \"sleep\"",
        ),
        ("/v1/sessions", json!({"onIdle": 1}), "invalid type"),
        ("/v1/sessions", json!({"pausedTtl": 0}), "pausedTtl"),
        ("/v1/sessions", json!({"pausedTtl": "soon"}), "soon"),
        (
            "/v1/sessions",
            json!({"fromSnapshot": "junk"}),
            "fromSnapshot \"junk\"",
        ),
        (
            "/v1/sessions",
            json!({"fromSnapshot": UNKNOWN, "count": 0}),
            "count 0 outside",
        ),
        (
            "/v1/sessions",
            json!({"fromSnapshot": UNKNOWN, "count": over}),
            "count",
        ),
        (
            "/v1/sessions",
            json!({"fromSnapshots": UNKNOWN}),
            "unknown field",
        ),
    ];
    for (path, body, says) in &cases {
        let r = h.post(path, body);
        assert_eq!(r.status, 400, "{path} {body}: {}", r.text());
        assert!(
            r.message().contains(says),
            "{path} {body}: {:?} lacks {says:?}",
            r.message()
        );
    }
    // A valid create from a snapshot this daemon does not have: 404, and
    // no session is left behind.
    for body in [
        json!({ "fromSnapshot": UNKNOWN }),
        json!({"fromSnapshot": UNKNOWN, "count": 2}),
    ] {
        let r = h.post("/v1/sessions", &body);
        assert_eq!(
            (r.status, r.code().as_str()),
            (404, "snapshot_not_found"),
            "{body}: {}",
            r.text()
        );
    }
    let r = h.get("/v1/sessions");
    let ids: Vec<String> = r.json()["sessions"]
        .as_array()
        .map(|l| l.iter().map(|s| s["id"].to_string()).collect())
        .unwrap_or_default();
    assert_eq!(ids, ["\"s\""], "{}", r.text());
}

/// Text of a tool error, or panics if the call succeeded.
fn tool_error(d: &Daemon, tool: &str, args: Value) -> String {
    let (status, _, v) = mcp_call(d, &d.key, tool, args.clone());
    assert_eq!(status, 200, "{tool} {args}: {v}");
    assert_eq!(v["result"]["isError"], true, "{tool} {args}: {v}");
    v["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn mcp_stateful_tools_on_local_process() {
    let d = Daemon::start_local(&[]);
    // Listed, in order after the others, with object schemas that refuse
    // unknown arguments.
    let (status, _, v) = mcp_rpc(&d, &d.key, "tools/list", None, json!({}));
    assert_eq!(status, 200, "{v}");
    let tools = v["result"]["tools"].as_array().cloned().unwrap_or_default();
    let names: Vec<&str> = tools.iter().filter_map(|t| t["name"].as_str()).collect();
    let new = [
        "pause_session",
        "resume_session",
        "checkpoint_session",
        "fork_session",
        "list_snapshots",
        "delete_snapshot",
    ];
    assert!(names.windows(new.len()).any(|w| w == new), "{names:?}");
    for t in &tools {
        let name = t["name"].as_str().unwrap_or_default();
        for s in ["inputSchema", "outputSchema"] {
            assert_eq!(t[s]["type"], "object", "{name} {s}");
        }
        assert_eq!(t["inputSchema"]["additionalProperties"], false, "{name}");
    }
    let create = tools
        .iter()
        .find(|t| t["name"] == "create_session")
        .expect("create_session");
    for arg in ["fromSnapshot", "count", "onIdle", "pausedTtl"] {
        assert!(
            create["inputSchema"]["properties"].get(arg).is_some(),
            "{arg}"
        );
    }
    let max = agent_sandbox::ops::state::MAX_FORK;
    let fork = tools.iter().find(|t| t["name"] == "fork_session");
    assert_eq!(
        fork.map(|t| &t["inputSchema"]["properties"]["count"]["maximum"]),
        Some(&json!(max))
    );

    let (_, _, v) = mcp_call(
        &d,
        &d.key,
        "create_session",
        json!({"sessionId": "m", "onIdle": "pause"}),
    );
    assert_eq!(v["result"]["isError"], false, "{v}");
    // The backend cannot checkpoint: the operation's message.
    for (tool, args) in [
        ("pause_session", json!({"sessionId": "m"})),
        ("checkpoint_session", json!({"sessionId": "m", "name": "n"})),
        ("fork_session", json!({"sessionId": "m", "count": 2})),
    ] {
        let e = tool_error(&d, tool, args);
        assert!(e.contains("not"), "{tool}: {e}");
    }
    let (_, _, v) = mcp_call(&d, &d.key, "list_snapshots", json!({}));
    assert_eq!(
        v["result"]["structuredContent"],
        json!({"snapshots": []}),
        "{v}"
    );

    // Bad arguments, each named.
    let long = "x".repeat(65);
    for (tool, args, says) in [
        (
            "fork_session",
            json!({"sessionId": "m"}),
            "count is required",
        ),
        (
            "fork_session",
            json!({"sessionId": "m", "count": 0}),
            "count 0 outside",
        ),
        (
            "fork_session",
            json!({"sessionId": "m", "count": max + 1}),
            "outside",
        ),
        (
            "fork_session",
            json!({"sessionId": "m", "count": -1}),
            "count",
        ),
        (
            "fork_session",
            json!({"sessionId": "nope", "count": 1}),
            "no session \"nope\"",
        ),
        (
            "checkpoint_session",
            json!({"sessionId": "m", "name": long}),
            "name must be 1-64",
        ),
        (
            "checkpoint_session",
            json!({"sessionId": "m", "x": 1}),
            "unknown argument \"x\"",
        ),
        ("pause_session", json!({}), "sessionId is required"),
        ("resume_session", json!({"sessionId": "no such"}), "invalid"),
        (
            "delete_snapshot",
            json!({"snapshotId": "junk"}),
            "snapshotId \"junk\"",
        ),
        ("delete_snapshot", json!({"snapshotId": UNKNOWN}), UNKNOWN),
        ("list_snapshots", json!({"all": true}), "unknown argument"),
        ("create_session", json!({"onIdle": "nap"}), "onIdle \"nap\""),
        ("create_session", json!({"pausedTtl": [1]}), "pausedTtl"),
        (
            "create_session",
            json!({"fromSnapshot": "snap-x"}),
            "fromSnapshot",
        ),
        (
            "create_session",
            json!({"fromSnapshot": UNKNOWN, "count": 0}),
            "count 0",
        ),
    ] {
        let e = tool_error(&d, tool, args.clone());
        assert!(e.contains(says), "{tool} {args}: {e:?} lacks {says:?}");
    }
}
