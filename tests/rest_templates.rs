//! Templates as a session sees them: listed in the seed's shape
//! (`GET /exec/templates`, `/v1/templates`, MCP `list_templates`), the
//! default one (a session naming none) is the developer image `dev`, and a
//! session's commands get their template's `env` under their own.

mod common;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::{mcp_call, stdout_of, vm_backend, Daemon, Http};
use serde_json::{json, Value};
use std::path::Path;
use std::time::Instant;

/// `images/templates/NAME.json` as written (no `extends` applied).
fn template_file(name: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("images/templates/{name}.json"));
    let text = std::fs::read(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
    serde_json::from_slice(&text).unwrap_or_else(|e| panic!("parse {}: {e}", p.display()))
}

/// Every entry has the seed's fields with the seed's types, and ours.
fn assert_seed_shape(list: &Value, route: &str) -> Vec<Value> {
    let all = list["templates"]
        .as_array()
        .unwrap_or_else(|| panic!("{route}: no templates array: {list}"))
        .clone();
    assert!(!all.is_empty(), "{route}: no templates");
    for t in &all {
        for f in ["name", "displayName", "version", "description"] {
            assert!(t[f].is_string(), "{route}: {f} of {t}");
        }
        assert!(!t["displayName"].as_str().unwrap_or("").is_empty(), "{t}");
        let tools = t["tools"].as_array().unwrap_or_else(|| panic!("tools {t}"));
        assert!(tools.iter().all(Value::is_string), "{route}: tools {t}");
        let r = &t["resources"];
        assert!(r["memSizeMib"].as_u64().unwrap_or(0) >= 64, "{route}: {t}");
        assert!(r["vcpuCount"].as_u64().unwrap_or(0) >= 1, "{route}: {t}");
        assert_eq!(r["memSizeMib"], t["memoryMib"], "{route}: {t}");
        assert_eq!(r["vcpuCount"], t["vcpus"], "{route}: {t}");
        assert!(t["default"].is_boolean(), "{route}: {t}");
    }
    all
}

fn default_of(all: &[Value]) -> Vec<String> {
    all.iter()
        .filter(|t| t["default"] == true)
        .filter_map(|t| t["name"].as_str().map(str::to_string))
        .collect()
}

/// The listing on all three routes; the name of the one marked default.
fn listings(d: &Daemon) -> (Vec<Value>, String) {
    let h = d.http();
    let seed = h.get("/exec/templates");
    assert_eq!(seed.status, 200, "{}", seed.text());
    let v1 = h.get("/v1/templates");
    assert_eq!(v1.status, 200, "{}", v1.text());
    let (_, _, m) = mcp_call(d, &d.key, "list_templates", json!({}));
    let mcp = &m["result"]["structuredContent"];
    let all = assert_seed_shape(&seed.json(), "/exec/templates");
    assert_eq!(assert_seed_shape(&v1.json(), "/v1/templates"), all);
    assert_eq!(assert_seed_shape(mcp, "MCP list_templates"), all);
    let defaults = default_of(&all);
    assert_eq!(defaults.len(), 1, "exactly one default: {all:?}");
    (all, defaults[0].clone())
}

#[test]
fn templates_are_listed_in_the_seed_shape_with_the_default_marked() {
    let d = Daemon::start(&["--default-template", "default"]);
    let (all, default) = listings(&d);
    if !vm_backend() {
        // The local-process backend has its one stand-in template.
        assert_eq!(default, "default");
        return;
    }
    assert_eq!(default, "dev", "a session naming no template gets dev");
    for t in &all {
        let name = t["name"].as_str().unwrap_or_default();
        let file = template_file(name);
        assert_eq!(t["displayName"], file["display_name"], "{name}");
        assert_eq!(t["version"], file["version"], "{name}");
        assert_eq!(t["tools"], file["tools"], "{name}");
        assert_eq!(t["description"], file["description"], "{name}");
    }
    let names: Vec<&str> = all.iter().filter_map(|t| t["name"].as_str()).collect();
    for want in ["base", "dev"] {
        assert!(names.contains(&want), "{want} not listed: {names:?}");
    }
    let dev = all.iter().find(|t| t["name"] == "dev").expect("dev listed");
    let tools: Vec<&str> = dev["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    for want in [
        "python3", "pip", "node", "npm", "gcc", "make", "git", "curl", "jq",
    ] {
        assert!(tools.contains(&want), "dev lacks {want}: {tools:?}");
    }
    assert_eq!(dev["resources"]["memSizeMib"], 1024, "{dev}");

    // The configured default is the one marked, whatever it is.
    let d = Daemon::start(&["--default-template", "base"]);
    assert_eq!(listings(&d).1, "base");
}

/// Runs `command` in `session` (`/v1`), with `env` for this command alone.
fn run(h: &Http, session: &str, command: &str, env: Value) -> (i64, String, String) {
    let r = h.post(
        &format!("/v1/sessions/{session}/exec"),
        &json!({"command": command, "env": env, "timeout": 120000}),
    );
    assert_eq!(r.status, 200, "{command}: {}", r.text());
    let v = r.json();
    let stderr: String = v["output"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["stream"] == "stderr")
        .filter_map(|e| e["data"].as_str())
        .collect();
    (v["exitCode"].as_i64().unwrap_or(-1), stdout_of(&v), stderr)
}

/// The python template's `env` (PYTHONUNBUFFERED=1 and the pip settings)
/// reaches a session's commands; the session's `env` overrides it, and a
/// command's own overrides both.
#[test]
fn a_session_gets_its_templates_env_under_its_own() {
    if !vm_backend() {
        skip::not_checked("template env needs a VM backend (the local backend has no templates)");
        return;
    }
    let tpl = template_file("python");
    assert_eq!(tpl["env"]["PYTHONUNBUFFERED"], "1", "python.json changed");
    let d = Daemon::start(&[]);
    let h = d.http();
    let r = h.post(
        "/v1/sessions",
        &json!({"id": "py-env", "template": "python",
                "env": {"PIP_ROOT_USER_ACTION": "from-session", "ONLY_SESSION": "s"}}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let probe = "echo \"$PYTHONUNBUFFERED $PIP_DISABLE_PIP_VERSION_CHECK $PIP_ROOT_USER_ACTION $ONLY_SESSION\"";
    let (code, out, err) = run(&h, "py-env", probe, json!({}));
    assert_eq!((code, out.as_str()), (0, "1 1 from-session s\n"), "{err}");
    // Python itself sees it.
    let (code, out, err) = run(
        &h,
        "py-env",
        "python3 -c 'import os; print(os.environ[\"PYTHONUNBUFFERED\"])'",
        json!({}),
    );
    assert_eq!((code, out.as_str()), (0, "1\n"), "{err}");
    let (code, out, err) = run(
        &h,
        "py-env",
        probe,
        json!({"PYTHONUNBUFFERED": "0", "PIP_ROOT_USER_ACTION": "from-command"}),
    );
    assert_eq!((code, out.as_str()), (0, "0 1 from-command s\n"), "{err}");
    // The base template's env has none of python's.
    let r = h.post(
        "/v1/sessions",
        &json!({"id": "base-env", "template": "base"}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let (code, out, err) = run(&h, "base-env", probe, json!({}));
    assert_eq!((code, out.as_str()), (0, "   \n"), "{err}");
}

/// A session naming no template, on each route that makes one (seed
/// execute, `/v1/sessions`, MCP `create_session`), is a `dev` session: the
/// seed README's first example (`node -e`) works, and python, pip, node,
/// npm, gcc, git and jq are there.
#[test]
fn a_session_naming_no_template_is_a_developer_machine() {
    if !vm_backend() {
        skip::not_checked("the dev template needs a VM backend");
        return;
    }
    let d = Daemon::start(&["--default-template", "default"]);
    let h = d.http();
    let t0 = Instant::now();
    // The seed README's first example, verbatim.
    let r = h.post(
        "/exec/my-session/execute",
        &json!({"command": "node", "args": ["-e", "console.log(1+1)"]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["exitCode"], 0, "{v}");
    assert_eq!(stdout_of(&v), "2\n", "{v}");
    eprintln!(
        "FIGURE dev create+first exec (the seed README's node -e, snapshot made if missing): {} ms",
        t0.elapsed().as_millis()
    );
    let r = h.get("/v1/sessions/my-session");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["template"], "dev", "{}", r.text());

    let r = h.post("/v1/sessions", &json!({"id": "v1-dev"}));
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["template"], "dev", "{}", r.text());
    let checks = [
        ("python3 -c 'print(6*7)'", "42"),
        ("python -c 'import sys; print(sys.version_info[0])'", "3"),
        ("python3 -m pip --version | cut -d' ' -f1", "pip"),
        ("python3 -m venv --without-pip /tmp/v && /tmp/v/bin/python -c 'print(1)'", "1"),
        ("node -e 'console.log(6*7)'", "42"),
        ("npm --version | cut -d. -f1 | grep -qE '^[0-9]+$' && echo npm", "npm"),
        (
            "cd /tmp && printf '#include <stdio.h>\\nint main(void) { printf(\"%%d\\\\n\", 6 * 7); return 0; }\\n' > h.c && gcc -o h h.c && ./h",
            "42",
        ),
        ("git init -q /tmp/r && git -C /tmp/r rev-parse --is-inside-work-tree", "true"),
        ("echo '{\"a\": [1, 2]}' | jq -c '.a | add'", "3"),
    ];
    for (cmd, want) in checks {
        let t = Instant::now();
        let (code, out, err) = run(&h, "v1-dev", cmd, json!({}));
        eprintln!("dev: {cmd:?} in {} ms", t.elapsed().as_millis());
        assert_eq!((code, out.trim()), (0, want), "{cmd}: {err}");
    }

    let (_, _, m) = mcp_call(
        &d,
        &d.key,
        "create_session",
        json!({"sessionId": "mcp-dev"}),
    );
    assert_ne!(m["result"]["isError"], true, "{m}");
    assert_eq!(m["result"]["structuredContent"]["template"], "dev", "{m}");
}
