//! `agent-sandbox drain` and `agent-sandbox doctor --router` (issue #28):
//! host tooling around several hosts behind HAProxy.

use crate::router;
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(Duration::from_secs(3)))
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into()
}

/// One JSON request; the status and the body (`null` if not JSON).
fn call(
    a: &ureq::Agent,
    method: &str,
    url: &str,
    key: Option<&str>,
) -> Result<(u16, Value), String> {
    let mut r = ureq::http::Request::builder().method(method).uri(url);
    if let Some(k) = key {
        r = r.header("Authorization", format!("Bearer {k}"));
    }
    let req = r.body(()).map_err(|e| format!("{method} {url}: {e}"))?;
    let mut resp = a.run(req).map_err(|e| format!("{method} {url}: {e}"))?;
    let status = resp.status().as_u16();
    let body = resp
        .body_mut()
        .with_config()
        .limit(1 << 20)
        .read_to_string()
        .unwrap_or_default();
    Ok((status, serde_json::from_str(&body).unwrap_or(Value::Null)))
}

fn error_text(v: &Value) -> String {
    v["error"]["message"]
        .as_str()
        .or_else(|| v["error"].as_str())
        .unwrap_or("no error message")
        .to_string()
}

/// What `drain` does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DrainAction {
    Start,
    Cancel,
    Status,
}

/// `agent-sandbox drain`: starts (or ends, or shows) the drain of the
/// daemon at `base` (its own address, never the router's); `wait`: until
/// it reports `drained` (at most `wait`). Prints the state.
pub fn drain(
    base: &str,
    key: Option<&str>,
    action: DrainAction,
    wait: Option<Duration>,
    json: bool,
) -> Result<(), String> {
    let a = agent();
    let url = format!("{}/v1/admin/drain", base.trim_end_matches('/'));
    let method = match action {
        DrainAction::Start => "POST",
        DrainAction::Cancel => "DELETE",
        DrainAction::Status => "GET",
    };
    let (status, mut v) = call(&a, method, &url, key)?;
    if status != 200 {
        return Err(format!("{method} {url}: {status}: {}", error_text(&v)));
    }
    if let Some(limit) = wait.filter(|_| action == DrainAction::Start) {
        let start = Instant::now();
        let mut last = usize::MAX;
        while v["state"] != "drained" {
            let left = v["sessions"].as_u64().unwrap_or(0) as usize;
            if left != last && !json {
                println!("draining: {left} session(s) left");
                last = left;
            }
            if start.elapsed() >= limit {
                return Err(format!(
                    "still draining after {}s: {left} session(s) left",
                    limit.as_secs()
                ));
            }
            std::thread::sleep(Duration::from_secs(1));
            let (s, nv) = call(&a, "GET", &url, key)?;
            if s != 200 {
                return Err(format!("GET {url}: {s}: {}", error_text(&nv)));
            }
            v = nv;
        }
    }
    if json {
        println!("{v}");
    } else {
        println!(
            "{}: {} ({} session(s))",
            v["host"].as_str().unwrap_or(base),
            v["state"].as_str().unwrap_or("?"),
            v["sessions"]
        );
    }
    Ok(())
}

/// `agent-sandbox doctor --router FILE`: the config has what routing
/// needs and `haproxy -c` accepts it; every host it names answers, reports
/// the host id its server is named by, and (with a key) has the same
/// templates as the others. Prints one line a check; fails on any.
pub fn doctor_router(file: &Path, key: Option<&str>) -> Result<(), String> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| format!("router config {}: {e}", file.display()))?;
    let (hosts, mut bad) = router::read_config(&text);
    let mut ok: Vec<String> = Vec::new();
    match std::process::Command::new("haproxy")
        .args(["-c", "-q", "-f"])
        .arg(file)
        .output()
    {
        Ok(o) if o.status.success() => ok.push("haproxy -c: the config is valid".into()),
        Ok(o) => bad.push(format!(
            "haproxy -c rejects the config: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => bad.push(format!(
            "haproxy -c: cannot run haproxy ({e}); install it (Debian: apt install haproxy, 2.6 or newer)"
        )),
    }
    let a = agent();
    let mut templates: Vec<(String, Vec<String>)> = Vec::new();
    for (name, addr) in &hosts {
        let base = format!("http://{addr}");
        match call(&a, "GET", &format!("{base}/health"), None) {
            Ok((200, v)) => match v["host"].as_str() {
                Some(h) if h == name => {
                    ok.push(format!("host {name} ({addr}): answers, host id {h}, {}", v["drain"].as_str().unwrap_or("?")))
                }
                Some(h) => bad.push(format!(
                    "host {name} ({addr}) reports host id {h:?}: its server must be named {h:?}, or its host_id {name:?}"
                )),
                None => bad.push(format!(
                    "host {name} ({addr}) has no host id: start it with --host-id {name} (config host_id) so its ids route back to it"
                )),
            },
            Ok((s, v)) => bad.push(format!("host {name} ({addr}): /health {s}: {}", error_text(&v))),
            Err(e) => bad.push(format!("host {name} ({addr}) does not answer: {e}")),
        }
        if let Some(k) = key {
            if let Ok((200, v)) = call(&a, "GET", &format!("{base}/v1/templates"), Some(k)) {
                let mut names: Vec<String> = v["templates"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|t| t["name"].as_str().map(str::to_string))
                    .collect();
                names.sort();
                templates.push((name.clone(), names));
            }
        }
    }
    if let Some((first, want)) = templates.first() {
        for (name, have) in &templates[1..] {
            if have != want {
                bad.push(format!(
                    "host {name} has templates {have:?}, host {first} {want:?}: build the same templates on every host"
                ));
            }
        }
        if templates.len() == hosts.len() {
            ok.push(format!(
                "templates: the same on every host ({})",
                want.join(", ")
            ));
        }
    }
    for l in &ok {
        println!("ok    {l}");
    }
    for l in &bad {
        println!("FAIL  {l}");
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!("{} router check(s) failed", bad.len()))
    }
}
