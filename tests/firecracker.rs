//! The Firecracker backend against a fake Firecracker: a real Unix-socket
//! HTTP server that checks every request against Firecracker's published
//! v1.16.1 API spec (tests/data/firecracker-v1.16.1-swagger.yaml) and answers
//! with the status codes the spec lists. A fake spawner plays the jailer:
//! it builds the jail layout, starts a stand-in VMM process (a copy of
//! `sleep` named `firecracker`) and the fake API server.
//!
//! Runs as any user; as root the VM user is 4242, otherwise the caller.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[path = "common/process.rs"]
mod process;
use process::process_gone;

use agent_sandbox::vm::firecracker::{FirecrackerBackend, Timeouts, DEFAULT_CMDLINE};
use agent_sandbox::vm::jailer::{JailerConfig, DOCUMENTED_JAILER_FLAGS};
use agent_sandbox::vm::launch::{Output, Spawner};
use agent_sandbox::vm::snapshot::Manifest;
use agent_sandbox::vm::{Backend, NetAttachment, VmConfig, VmError};
use serde_json::{json, Value as Json};
use serde_yaml_ng::Value as Yaml;

// ---------------------------------------------------------------- spec ----

/// Validator for the subset of Swagger 2.0 the Firecracker spec uses:
/// paths with `{param}` templates, body parameters, `$ref` to definitions,
/// object/string/integer/boolean/array types, `required`, `enum`,
/// `minimum`/`maximum`. Unknown properties are rejected unless the schema
/// says `additionalProperties: true`: Firecracker deserializes request
/// bodies with `deny_unknown_fields`, so an extra field is a 400 there.
struct Spec {
    root: Yaml,
}

impl Spec {
    fn load() -> Spec {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/firecracker-v1.16.1-swagger.yaml");
        let text = fs::read_to_string(&p).unwrap();
        let root: Yaml = serde_yaml_ng::from_str(&text).unwrap();
        assert_eq!(root.get("swagger").and_then(Yaml::as_str), Some("2.0"));
        Spec { root }
    }

    fn version(&self) -> &str {
        self.root["info"]["version"].as_str().unwrap_or("?")
    }

    /// The operation object for `method path`, and the path parameters.
    fn operation(
        &self,
        method: &str,
        path: &str,
    ) -> Result<(&Yaml, HashMap<String, String>), String> {
        let paths = self.root["paths"].as_mapping().ok_or("spec has no paths")?;
        let segs: Vec<&str> = path.split('/').collect();
        for (tmpl, item) in paths {
            let Some(tmpl) = tmpl.as_str() else { continue };
            let tsegs: Vec<&str> = tmpl.split('/').collect();
            if tsegs.len() != segs.len() {
                continue;
            }
            let mut params = HashMap::new();
            let matched = tsegs.iter().zip(&segs).all(|(t, s)| {
                if t.starts_with('{') && t.ends_with('}') {
                    params.insert(t[1..t.len() - 1].to_string(), s.to_string());
                    !s.is_empty()
                } else {
                    t == s
                }
            });
            if matched {
                return match item.get(method.to_ascii_lowercase().as_str()) {
                    Some(op) => Ok((op, params)),
                    None => Err(format!("{method} is not an operation on {tmpl}")),
                };
            }
        }
        Err(format!("no path {path} in the spec"))
    }

    fn validate_request(
        &self,
        method: &str,
        path: &str,
        body: Option<&Json>,
    ) -> Result<(), String> {
        let (op, params) = self.operation(method, path)?;
        let mut body_schema = None;
        let mut body_required = false;
        for p in op
            .get("parameters")
            .and_then(Yaml::as_sequence)
            .into_iter()
            .flatten()
        {
            match p["in"].as_str() {
                Some("body") => {
                    body_schema = Some(&p["schema"]);
                    body_required = p.get("required").and_then(Yaml::as_bool).unwrap_or(false);
                }
                Some("path") => {
                    let name = p["name"].as_str().unwrap_or_default();
                    if !params.contains_key(name) {
                        return Err(format!("path parameter {name} missing"));
                    }
                }
                _ => {}
            }
        }
        match (body_schema, body) {
            (None, Some(_)) => Err(format!("{method} {path} takes no body")),
            (Some(_), None) if body_required => Err(format!("{method} {path} needs a body")),
            (Some(s), Some(b)) => {
                self.validate(b, s, "body")?;
                // Firecracker also insists the id in the path is the id in the body.
                for (param, field) in [
                    ("drive_id", "drive_id"),
                    ("iface_id", "iface_id"),
                    ("id", "id"),
                ] {
                    if let Some(v) = params.get(param) {
                        if b.get(field).and_then(Json::as_str) != Some(v.as_str()) {
                            return Err(format!(
                                "body.{field} does not match path parameter {v:?}"
                            ));
                        }
                    }
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn resolve<'a>(&'a self, schema: &'a Yaml) -> Result<&'a Yaml, String> {
        match schema.get("$ref").and_then(Yaml::as_str) {
            Some(r) => {
                let name = r
                    .strip_prefix("#/definitions/")
                    .ok_or(format!("unsupported $ref {r}"))?;
                self.root["definitions"]
                    .get(name)
                    .ok_or(format!("dangling $ref {r}"))
            }
            None => Ok(schema),
        }
    }

    fn validate(&self, v: &Json, schema: &Yaml, at: &str) -> Result<(), String> {
        let schema = self.resolve(schema)?;
        if let Some(en) = schema.get("enum").and_then(Yaml::as_sequence) {
            let ok = en.iter().any(|e| match (e, v) {
                (Yaml::String(a), Json::String(b)) => a == b,
                (Yaml::Number(a), Json::Number(b)) => a.as_f64() == b.as_f64(),
                (Yaml::Bool(a), Json::Bool(b)) => a == b,
                _ => false,
            });
            if !ok {
                return Err(format!("{at}: {v} is not one of {en:?}"));
            }
        }
        let ty = schema.get("type").and_then(Yaml::as_str);
        match ty {
            Some("object") | None if schema.get("properties").is_some() || ty.is_some() => {
                let obj = v
                    .as_object()
                    .ok_or(format!("{at}: expected an object, got {v}"))?;
                for r in schema
                    .get("required")
                    .and_then(Yaml::as_sequence)
                    .into_iter()
                    .flatten()
                {
                    let r = r.as_str().unwrap_or_default();
                    if !obj.contains_key(r) {
                        return Err(format!("{at}: required property {r} missing"));
                    }
                }
                let props = schema.get("properties").and_then(Yaml::as_mapping);
                let extra_ok =
                    schema.get("additionalProperties").and_then(Yaml::as_bool) == Some(true);
                for (k, val) in obj {
                    match props.and_then(|p| p.get(k.as_str())) {
                        Some(ps) => self.validate(val, ps, &format!("{at}.{k}"))?,
                        None if extra_ok => {}
                        None => return Err(format!("{at}: unknown property {k}")),
                    }
                }
                Ok(())
            }
            Some("string") => v
                .as_str()
                .map(|_| ())
                .ok_or(format!("{at}: expected a string, got {v}")),
            Some("boolean") => v
                .as_bool()
                .map(|_| ())
                .ok_or(format!("{at}: expected a boolean, got {v}")),
            Some("integer") => {
                let n = match v {
                    Json::Number(n) if n.is_i64() || n.is_u64() => n.as_f64().unwrap_or(f64::NAN),
                    _ => return Err(format!("{at}: expected an integer, got {v}")),
                };
                if let Some(min) = schema.get("minimum").and_then(Yaml::as_f64) {
                    if n < min {
                        return Err(format!("{at}: {n} below minimum {min}"));
                    }
                }
                if let Some(max) = schema.get("maximum").and_then(Yaml::as_f64) {
                    if n > max {
                        return Err(format!("{at}: {n} above maximum {max}"));
                    }
                }
                Ok(())
            }
            Some("array") => {
                let arr = v
                    .as_array()
                    .ok_or(format!("{at}: expected an array, got {v}"))?;
                for (i, item) in arr.iter().enumerate() {
                    self.validate(item, &schema["items"], &format!("{at}[{i}]"))?;
                }
                Ok(())
            }
            Some(other) => Err(format!("{at}: validator does not know type {other}")),
            None => Ok(()),
        }
    }

    /// The success status the spec lists for an operation (204 or 200).
    fn success_status(&self, method: &str, path: &str) -> u16 {
        let (op, _) = self.operation(method, path).unwrap();
        op["responses"]
            .as_mapping()
            .into_iter()
            .flatten()
            .filter_map(|(k, _)| k.as_u64())
            .find(|c| (200..300).contains(c))
            .unwrap_or(204) as u16
    }

    fn lists_status(&self, method: &str, path: &str, status: u16) -> bool {
        let Ok((op, _)) = self.operation(method, path) else {
            return false;
        };
        op["responses"]
            .as_mapping()
            .into_iter()
            .flatten()
            .any(|(k, _)| k.as_u64() == Some(u64::from(status)) || k.as_str() == Some("default"))
    }
}

// ------------------------------------------------------- fake firecracker --

#[derive(Debug, Clone, PartialEq)]
struct Req {
    method: String,
    path: String,
    body: Json,
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    Normal,
    /// The jailer exits 1 with a message.
    JailerFails,
    /// The VMM exits at once; no API socket ever appears.
    VmmDies,
    /// The VMM runs but never creates its API socket.
    NoSocket,
    /// The API accepts connections and never answers.
    Hang,
}

#[derive(Default)]
struct Shared {
    log: Vec<Req>,
    violations: Vec<String>,
    /// (method, path) -> (status, fault_message)
    faults: HashMap<(String, String), (u16, String)>,
    hung: Vec<UnixStream>,
    /// Jail root -> whether that VM is paused.
    paused: HashMap<PathBuf, bool>,
    /// Jail root -> the host ends of its open vsock connections, which a
    /// snapshot resets (Firecracker sends VIRTIO_VSOCK_EVENT_TRANSPORT_RESET).
    vsock_conns: HashMap<PathBuf, Vec<UnixStream>>,
    /// Jail root -> its serial console file (`PUT /serial`).
    serial: HashMap<PathBuf, PathBuf>,
    /// Nothing on the guest's console at InstanceStart.
    no_console: bool,
    /// No agent on the guest's vsock (with `no_console`: a guest that
    /// never boots).
    no_agent: bool,
}

/// Apparent size of the fake's snapshot memory file; only two 4 KiB pages
/// of it are data (at 0 and at `FAKE_MEM_DATA2`), the rest is a hole.
const FAKE_MEM_LEN: u64 = 1 << 20;
const FAKE_MEM_DATA2: u64 = 640 << 10;

struct FakeFc {
    spec: Arc<Spec>,
    mode: Mutex<Mode>,
    shared: Arc<Mutex<Shared>>,
    jailer_argv: Mutex<Vec<Vec<OsString>>>,
    cgroup_root: Mutex<Option<PathBuf>>,
}

impl FakeFc {
    fn new() -> Arc<FakeFc> {
        Arc::new(FakeFc {
            spec: Arc::new(Spec::load()),
            mode: Mutex::new(Mode::Normal),
            shared: Arc::default(),
            jailer_argv: Mutex::default(),
            cgroup_root: Mutex::default(),
        })
    }

    fn set_mode(&self, m: Mode) {
        *self.mode.lock().unwrap() = m;
    }

    fn fail(&self, method: &str, path: &str, status: u16, msg: &str) {
        assert!(
            self.spec.lists_status(method, path, status),
            "spec does not list {status} for {method} {path}"
        );
        self.shared
            .lock()
            .unwrap()
            .faults
            .insert((method.into(), path.into()), (status, msg.into()));
    }

    fn take_log(&self) -> Vec<Req> {
        std::mem::take(&mut self.shared.lock().unwrap().log)
    }

    fn violations(&self) -> Vec<String> {
        self.shared.lock().unwrap().violations.clone()
    }
}

fn arg_value(argv: &[OsString], flag: &str) -> Option<String> {
    argv.iter()
        .position(|a| a == flag)
        .and_then(|i| argv.get(i + 1))
        .map(|v| v.to_string_lossy().into_owned())
}

impl Spawner for FakeFc {
    fn run(&self, argv: &[OsString], _deadline: Instant) -> agent_sandbox::vm::Result<Output> {
        if argv.get(1).is_some_and(|a| a == "--version") {
            return Ok(Output {
                code: Some(0),
                stdout: format!("Firecracker v{}\n", self.spec.version()).into_bytes(),
                stderr: vec![],
            });
        }
        self.jailer_argv.lock().unwrap().push(argv.to_vec());
        // Play the jailer: only documented flags before `--`.
        let sep = argv
            .iter()
            .position(|a| a == "--")
            .expect("no -- in jailer argv");
        for a in &argv[1..sep] {
            let s = a.to_string_lossy();
            if s.starts_with("--") {
                assert!(
                    DOCUMENTED_JAILER_FLAGS.contains(&s.as_ref()),
                    "undocumented jailer flag {s}"
                );
            }
        }
        let mode = *self.mode.lock().unwrap();
        if mode == Mode::JailerFails {
            return Ok(Output {
                code: Some(1),
                stdout: vec![],
                stderr: b"Jailer error: Failed to join network namespace: netns: No such file"
                    .to_vec(),
            });
        }
        let id = arg_value(argv, "--id").unwrap();
        let base = PathBuf::from(arg_value(argv, "--chroot-base-dir").unwrap());
        let exec = PathBuf::from(arg_value(argv, "--exec-file").unwrap());
        let exec_name = exec.file_name().unwrap().to_string_lossy().into_owned();
        let root = base.join(&exec_name).join(&id).join("root");
        fs::create_dir_all(&root).unwrap();
        // The jailer makes <cgroup_root>/<parent>/<id>; so do we, to see it removed.
        if let Some(cg) = self.cgroup_root.lock().unwrap().as_ref() {
            let parent = arg_value(argv, "--parent-cgroup").unwrap();
            fs::create_dir_all(cg.join(parent).join(&id)).unwrap();
        }
        // The stand-in VMM: `sleep` under the exec file's name, so its comm
        // is what the backend checks before trusting the pid file.
        let vmm = root.join(&exec_name);
        fs::copy("/bin/sleep", &vmm).unwrap();
        let secs = if mode == Mode::VmmDies { "0" } else { "60" };
        // Reaped by the backend's teardown (waitpid), like a VMM under a
        // subreaper would be.
        // ETXTBSY: another test thread forked while the copy was open for
        // writing, and its child holds that fd until it execs. Retry.
        #[allow(clippy::zombie_processes)]
        let child = (0..100)
            .find_map(
                |_| match std::process::Command::new(&vmm).arg(secs).spawn() {
                    Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                        std::thread::sleep(std::time::Duration::from_millis(10));
                        None
                    }
                    r => Some(r.unwrap()),
                },
            )
            .expect("stand-in VMM: text file busy for 1 s");
        fs::write(
            root.join(format!("{exec_name}.pid")),
            child.id().to_string(),
        )
        .unwrap();
        let api = arg_value(&argv[sep..], "--api-sock").unwrap();
        if matches!(mode, Mode::Normal | Mode::Hang) {
            let l = UnixListener::bind(root.join(api.trim_start_matches('/'))).unwrap();
            let spec = self.spec.clone();
            let shared = self.shared.clone();
            std::thread::spawn(move || serve(l, root, spec, shared, mode));
        }
        Ok(Output {
            code: Some(0),
            ..Output::default()
        })
    }
}

fn serve(l: UnixListener, root: PathBuf, spec: Arc<Spec>, shared: Arc<Mutex<Shared>>, mode: Mode) {
    for conn in l.incoming() {
        let Ok(conn) = conn else { return };
        let mut reader = BufReader::new(conn);
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                break;
            }
            let mut parts = line.trim_end().split(' ');
            let (method, path) = (
                parts.next().unwrap_or("").to_string(),
                parts.next().unwrap_or("").to_string(),
            );
            let mut len = 0usize;
            let mut bad_headers: Vec<String> = Vec::new();
            loop {
                let mut h = String::new();
                if reader.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                    break;
                }
                if let Some((k, v)) = h.split_once(':') {
                    let (k, v) = (k.to_ascii_lowercase(), v.trim());
                    match k.as_str() {
                        "content-length" => len = v.parse().unwrap_or(0),
                        // Firecracker's micro_http accepts only these media types.
                        "content-type" | "accept" if v != "application/json" => {
                            bad_headers.push(format!("{k}: {v}"))
                        }
                        "content-type" | "accept" | "host" => {}
                        _ => bad_headers.push(format!("unexpected header {k}")),
                    }
                }
            }
            let mut body = vec![0u8; len];
            if reader.read_exact(&mut body).is_err() {
                break;
            }
            if mode == Mode::Hang {
                shared.lock().unwrap().hung.push(reader.into_inner());
                break;
            }
            let json: Option<Json> = if len > 0 {
                serde_json::from_slice(&body).ok()
            } else {
                None
            };
            let mut s = shared.lock().unwrap();
            if !bad_headers.is_empty() {
                s.violations
                    .push(format!("{method} {path}: headers {bad_headers:?}"));
            }
            let (status, reply) = if len > 0 && json.is_none() {
                s.violations
                    .push(format!("{method} {path}: body is not JSON"));
                (400, json!({"fault_message": "body is not JSON"}))
            } else if let Err(e) = spec.validate_request(&method, &path, json.as_ref()) {
                s.violations.push(format!("{method} {path}: {e}"));
                (
                    400,
                    json!({"fault_message": format!("spec violation: {e}")}),
                )
            } else {
                s.log.push(Req {
                    method: method.clone(),
                    path: path.clone(),
                    body: json.clone().unwrap_or(Json::Null),
                });
                if let Some((st, msg)) = s.faults.get(&(method.clone(), path.clone())).cloned() {
                    if path == "/snapshot/create" {
                        // Like a disk that fills up: the vsock reset is
                        // done and the files are torn.
                        let body = json.as_ref().unwrap_or(&Json::Null);
                        reset_vsock(&mut s, &root);
                        for p in ["snapshot_path", "mem_file_path"] {
                            let f =
                                root.join(body[p].as_str().unwrap_or("").trim_start_matches('/'));
                            let _ = fs::write(f, b"torn");
                        }
                    }
                    (st, json!({ "fault_message": msg }))
                } else {
                    match act(
                        &root,
                        &method,
                        &path,
                        json.as_ref().unwrap_or(&Json::Null),
                        &mut s,
                        &shared,
                    ) {
                        Ok(()) => (spec.success_status(&method, &path), Json::Null),
                        Err(m) => (400, json!({ "fault_message": m })),
                    }
                }
            };
            drop(s);
            let body = if reply.is_null() {
                String::new()
            } else {
                reply.to_string()
            };
            let reason = if status < 300 {
                "No Content"
            } else {
                "Bad Request"
            };
            let resp = if body.is_empty() {
                format!("HTTP/1.1 {status} {reason}\r\nServer: Firecracker API\r\nConnection: keep-alive\r\n\r\n")
            } else {
                format!("HTTP/1.1 {status} {reason}\r\nServer: Firecracker API\r\nConnection: keep-alive\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len())
            };
            if reader.get_mut().write_all(resp.as_bytes()).is_err() {
                break;
            }
        }
    }
}

/// What the fake VMM does for a valid request (roughly Firecracker's rules).
fn act(
    root: &Path,
    method: &str,
    path: &str,
    body: &Json,
    s: &mut Shared,
    shared: &Arc<Mutex<Shared>>,
) -> Result<(), String> {
    let jail = |p: &Json| root.join(p.as_str().unwrap_or("").trim_start_matches('/'));
    let paused = s.paused.get(root).copied().unwrap_or(false);
    match (method, path) {
        // A mute guest has no agent either: nothing listens on the vsock.
        ("PUT", "/vsock") if !s.no_agent => start_vsock(jail(&body["uds_path"]), root, shared),
        // A booting kernel's first words on the console `PUT /serial` named.
        ("PUT", "/serial") => {
            s.serial
                .insert(root.to_path_buf(), jail(&body["serial_out_path"]));
        }
        ("PUT", "/actions") if body["action_type"] == "InstanceStart" && !s.no_console => {
            if let Some(p) = s.serial.get(root) {
                let mut f = fs::OpenOptions::new()
                    .append(true)
                    .open(p)
                    .map_err(|e| format!("serial_out_path {}: {e}", p.display()))?;
                f.write_all(b"Linux version 6.1 (fake)\n")
                    .map_err(|e| e.to_string())?;
            }
        }
        ("PATCH", "/vm") => {
            s.paused
                .insert(root.to_path_buf(), body["state"] == "Paused");
        }
        ("PUT", "/snapshot/create") => {
            if !paused {
                return Err("Cannot create snapshot: the microVM is not paused".into());
            }
            reset_vsock(s, root);
            fs::write(jail(&body["snapshot_path"]), b"state").map_err(|e| e.to_string())?;
            let mem = fs::File::create(jail(&body["mem_file_path"])).map_err(|e| e.to_string())?;
            use std::os::unix::fs::FileExt;
            mem.set_len(FAKE_MEM_LEN).map_err(|e| e.to_string())?;
            for at in [0, FAKE_MEM_DATA2] {
                mem.write_all_at(&[7u8; 4096], at)
                    .map_err(|e| e.to_string())?;
            }
        }
        ("PUT", "/snapshot/load") => {
            for p in [&body["snapshot_path"], &body["mem_backend"]["backend_path"]] {
                fs::metadata(jail(p)).map_err(|e| format!("cannot open {p}: {e}"))?;
            }
            s.paused
                .insert(root.to_path_buf(), body["resume_vm"] != true);
            start_vsock(root.join("v.sock"), root, shared);
        }
        _ => {}
    }
    Ok(())
}

/// The snapshot resets the vsock transport: every open connection ends.
fn reset_vsock(s: &mut Shared, root: &Path) {
    for c in s.vsock_conns.remove(root).unwrap_or_default() {
        let _ = c.shutdown(std::net::Shutdown::Both);
    }
}

/// Firecracker's host side of vsock: `CONNECT n\n` -> `OK <port>\n`, then
/// the guest's stream (here an echo).
fn start_vsock(path: PathBuf, root: &Path, shared: &Arc<Mutex<Shared>>) {
    let l = UnixListener::bind(&path).unwrap();
    let (root, shared) = (root.to_path_buf(), shared.clone());
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(c) = c else { return };
            if let Ok(held) = c.try_clone() {
                let mut s = shared.lock().unwrap();
                s.vsock_conns.entry(root.clone()).or_default().push(held);
            }
            std::thread::spawn(move || {
                let mut r = BufReader::new(c);
                let mut line = String::new();
                if r.read_line(&mut line).is_err() || line != "CONNECT 5000\n" {
                    return;
                }
                let mut c = r.into_inner();
                if c.write_all(b"OK 1073741824\n").is_err() {
                    return;
                }
                let mut buf = [0u8; 256];
                while let Ok(n) = c.read(&mut buf) {
                    if n == 0 || c.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
}

// ------------------------------------------------------------ fixtures ---

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        Self::new_in(&std::env::temp_dir(), tag)
    }

    fn new_in(base: &Path, tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = base.join(format!(
            "fct-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

struct Fixture {
    tmp: TempDir,
    fake: Arc<FakeFc>,
    backend: FirecrackerBackend,
    cfg: VmConfig,
}

fn vm_user() -> (u32, u32) {
    // SAFETY: no preconditions.
    unsafe {
        if libc::geteuid() == 0 {
            (4242, 4242)
        } else {
            (libc::getuid(), libc::getgid())
        }
    }
}

fn fixture(tag: &str, id: &str) -> Fixture {
    let tmp = TempDir::new(tag);
    let fake = FakeFc::new();
    let jcfg = JailerConfig {
        chroot_base: tmp.0.join("jail"),
        cgroup_root: tmp.0.join("cgroup"),
        ..JailerConfig::default()
    };
    *fake.cgroup_root.lock().unwrap() = Some(jcfg.cgroup_root.clone());
    let backend = FirecrackerBackend::new(jcfg, fake.clone()).with_timeouts(Timeouts {
        jailer: Duration::from_secs(2),
        api_socket: Duration::from_millis(800),
        request: Duration::from_millis(500),
        snapshot: Duration::from_secs(2),
        teardown: Duration::from_secs(2),
        first_output: Duration::from_secs(2),
    });
    let images = tmp.0.join("images");
    fs::create_dir_all(&images).unwrap();
    fs::write(images.join("vmlinux"), b"\x7fELF kernel").unwrap();
    fs::write(images.join("rootfs.erofs"), vec![1u8; 8192]).unwrap();
    for f in ["vmlinux", "rootfs.erofs"] {
        fs::set_permissions(images.join(f), fs::Permissions::from_mode(0o444)).unwrap();
    }
    let (uid, gid) = vm_user();
    let cfg = VmConfig {
        id: id.into(),
        kernel: images.join("vmlinux"),
        rootfs: images.join("rootfs.erofs"),
        vcpus: 2,
        mem_mib: 256,
        cmdline_extra: "quiet".into(),
        net: Some(NetAttachment {
            netns: "/run/netns/asbx-test".into(),
            tap: "tap0".into(),
            guest_mac: "06:00:ac:10:00:02".into(),
        }),
        uid,
        gid,
        run_dir: tmp.0.join("run").join(id),
    };
    fs::create_dir_all(&cfg.run_dir).unwrap();
    Fixture {
        tmp,
        fake,
        backend,
        cfg,
    }
}

fn jail_dir(f: &Fixture) -> PathBuf {
    f.tmp.0.join("jail/firecracker").join(&f.cfg.id)
}

fn cgroup_dir(f: &Fixture) -> PathBuf {
    f.tmp.0.join("cgroup/agent-sandbox").join(&f.cfg.id)
}

fn calls(log: &[Req]) -> Vec<String> {
    log.iter()
        .map(|r| format!("{} {}", r.method, r.path))
        .collect()
}

// --------------------------------------------------------------- tests ---

#[test]
fn validator_rejects_what_firecracker_would() {
    let s = Spec::load();
    assert!(s
        .validate_request(
            "PUT",
            "/machine-config",
            Some(&json!({"vcpu_count": 2, "mem_size_mib": 256}))
        )
        .is_ok());
    for (m, p, b, why) in [
        (
            "PUT",
            "/machine-config",
            json!({"vcpu_count": 2}),
            "required",
        ),
        (
            "PUT",
            "/machine-config",
            json!({"vcpu_count": "2", "mem_size_mib": 1}),
            "integer",
        ),
        (
            "PUT",
            "/machine-config",
            json!({"vcpu_count": 33, "mem_size_mib": 1}),
            "maximum",
        ),
        (
            "PUT",
            "/machine-config",
            json!({"vcpu_count": 1, "mem_size_mib": 1, "vcpus": 1}),
            "unknown",
        ),
        ("PUT", "/actions", json!({"action_type": "Start"}), "one of"),
        ("PATCH", "/vm", json!({"state": "Stopped"}), "one of"),
        (
            "PUT",
            "/drives/rootfs",
            json!({"drive_id": "other", "is_root_device": true}),
            "does not match",
        ),
        (
            "PUT",
            "/snapshot/load",
            json!({"snapshot_path": "/s", "mem_backend": {"backend_type": "File"}}),
            "required",
        ),
        (
            "PUT",
            "/vsock",
            json!({"guest_cid": 2, "uds_path": "/v"}),
            "minimum",
        ),
        (
            "POST",
            "/actions",
            json!({"action_type": "InstanceStart"}),
            "not an operation",
        ),
        ("PUT", "/nope", json!({}), "no path"),
    ] {
        let e = s
            .validate_request(m, p, Some(&b))
            .expect_err(&format!("{m} {p} {b} should fail"));
        assert!(e.contains(why), "{m} {p}: {e:?} should mention {why:?}");
    }
    assert_eq!(s.success_status("PUT", "/actions"), 204);
    assert_eq!(s.success_status("GET", "/version"), 200);
}

#[test]
fn boot_snapshot_restore_send_exactly_the_spec_valid_requests() {
    let f = fixture("cycle", "vm-cycle-1");
    let mut vm = f.backend.boot(&f.cfg).expect("boot");
    assert_eq!(f.fake.violations(), Vec::<String>::new());
    assert!(cgroup_dir(&f).is_dir());
    let log = f.fake.take_log();
    assert_eq!(
        calls(&log),
        [
            "PUT /logger",
            "PUT /serial",
            "PUT /boot-source",
            "PUT /drives/rootfs",
            "PUT /machine-config",
            "PUT /network-interfaces/eth0",
            "PUT /vsock",
            "PUT /actions",
        ]
    );
    let bodies: Vec<&Json> = log.iter().map(|r| &r.body).collect();
    assert_eq!(
        *bodies[0],
        json!({"log_path": "/firecracker.log", "level": "Warning", "show_level": true})
    );
    // The console goes to a file in the jail, rate-limited (a boot's
    // burst, then 4 KiB/s).
    assert_eq!(
        *bodies[1],
        json!({"serial_out_path": "/serial.log", "rate_limiter":
            {"size": 4096, "one_time_burst": 1048576, "refill_time": 1000}})
    );
    assert_eq!(
        *bodies[2],
        json!({"kernel_image_path": "/vmlinux", "boot_args": format!("{DEFAULT_CMDLINE} quiet")})
    );
    assert_eq!(
        *bodies[3],
        json!({"drive_id": "rootfs", "path_on_host": "/rootfs", "is_root_device": true, "is_read_only": true})
    );
    assert_eq!(
        *bodies[4],
        json!({"vcpu_count": 2, "mem_size_mib": 256, "smt": false})
    );
    assert_eq!(
        *bodies[5],
        json!({"iface_id": "eth0", "host_dev_name": "tap0", "guest_mac": "06:00:ac:10:00:02"})
    );
    assert_eq!(*bodies[6], json!({"guest_cid": 3, "uds_path": "/v.sock"}));
    assert_eq!(*bodies[7], json!({"action_type": "InstanceStart"}));

    // The jail holds the linked kernel and rootfs at the paths sent above.
    let root = jail_dir(&f).join("root");
    assert_eq!(
        fs::read(root.join("vmlinux")).unwrap(),
        fs::read(&f.cfg.kernel).unwrap()
    );
    assert!(root.join("rootfs").is_file() && root.join("firecracker.log").is_file());

    // Agent channel through the vsock bridge.
    let mut s = vm
        .connect_agent(Instant::now() + Duration::from_secs(2))
        .expect("agent");
    s.write_all(b"ping").unwrap();
    let mut buf = [0u8; 4];
    s.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"ping");

    let snap = f.tmp.0.join("snap");
    vm.snapshot(&snap).expect("snapshot");
    let log = f.fake.take_log();
    assert_eq!(calls(&log), ["PATCH /vm", "PUT /snapshot/create"]);
    assert_eq!(log[0].body, json!({"state": "Paused"}));
    assert_eq!(
        log[1].body,
        json!({"snapshot_type": "Full", "snapshot_path": "/new-snapshot.state", "mem_file_path": "/new-snapshot.mem"})
    );
    let m = Manifest::read(&snap).expect("manifest");
    // The version line plus the tag of the fixed machine (command line).
    assert_eq!(m.backend, "firecracker");
    let tag = m
        .vmm_version
        .strip_prefix("Firecracker v1.16.1; machine=")
        .unwrap_or_else(|| panic!("vmm_version {:?}", m.vmm_version));
    assert!(tag.len() == 16 && tag.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!((m.vcpus, m.mem_mib), (2, 256));
    assert_eq!(m.files, ["vmstate", "memory"]);
    assert_eq!(
        fs::metadata(snap.join("memory")).unwrap().len(),
        FAKE_MEM_LEN
    );
    assert_eq!(
        fs::metadata(snap.join("memory"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o444,
        "root's, read-only to every VM uid"
    );

    let pid = vm.pid().expect("pid");
    vm.destroy().expect("destroy");
    assert!(process_gone(pid), "VMM {pid} still running");
    assert!(!jail_dir(&f).exists(), "jail dir left behind");
    assert!(!cgroup_dir(&f).exists(), "cgroup dir left behind");
    assert!(!f.cfg.run_dir.exists(), "run dir left behind");
    vm.destroy().expect("second destroy is a no-op");

    let mut vm = f.backend.restore(&f.cfg, &snap).expect("restore");
    assert_eq!(f.fake.violations(), Vec::<String>::new());
    let log = f.fake.take_log();
    assert_eq!(calls(&log), ["PUT /logger", "PUT /snapshot/load"]);
    assert_eq!(
        log[1].body,
        json!({
            "snapshot_path": "/snapshot.state",
            "mem_backend": {"backend_type": "File", "backend_path": "/snapshot.mem"},
            "resume_vm": true,
            "network_overrides": [{"iface_id": "eth0", "host_dev_name": "tap0"}],
        })
    );
    let s = vm
        .connect_agent(Instant::now() + Duration::from_secs(2))
        .expect("agent after restore");
    drop(s);
    // A restored VM can be snapshotted again without touching its template.
    let snap2 = f.tmp.0.join("snap2");
    vm.snapshot(&snap2).expect("second snapshot");
    assert_eq!(fs::read(snap.join("vmstate")).unwrap(), b"state");
    drop(vm); // Drop tears down too.
    assert!(!jail_dir(&f).exists());
    assert_eq!(f.fake.violations(), Vec::<String>::new());
}

#[test]
fn boot_without_network_sends_no_interface() {
    let mut f = fixture("nonet", "vm-nonet");
    f.cfg.net = None;
    let mut vm = f.backend.boot(&f.cfg).expect("boot");
    assert!(!calls(&f.fake.take_log())
        .iter()
        .any(|c| c.contains("network")));
    let argv = f.fake.jailer_argv.lock().unwrap()[0].clone();
    assert!(!argv.iter().any(|a| a == "--netns"));
    vm.destroy().unwrap();
    assert_eq!(f.fake.violations(), Vec::<String>::new());
}

#[test]
fn api_400_becomes_a_clear_error_and_everything_is_removed() {
    let f = fixture("fault", "vm-fault");
    f.fake
        .fail("PUT", "/machine-config", 400, "Invalid memory size: 256");
    let e = f.backend.boot(&f.cfg).err().expect("boot must fail");
    let msg = e.to_string();
    assert!(matches!(e, VmError::Api { .. }), "{e:?}");
    assert!(
        msg.contains("PUT /machine-config")
            && msg.contains("HTTP 400")
            && msg.contains("Invalid memory size: 256"),
        "{msg}"
    );
    assert!(!jail_dir(&f).exists(), "jail dir left behind");
    assert!(!f.cfg.run_dir.exists());
    assert_eq!(f.fake.violations(), Vec::<String>::new());
}

#[test]
fn snapshot_create_rejected_is_an_error() {
    let f = fixture("snapfault", "vm-snapfault");
    let mut vm = f.backend.boot(&f.cfg).unwrap();
    f.fake.fail(
        "PUT",
        "/snapshot/create",
        400,
        "Cannot save the memory file: No space left on device",
    );
    let snap = f.tmp.0.join("snap");
    let e = vm.snapshot(&snap).unwrap_err().to_string();
    assert!(
        e.contains("/snapshot/create") && e.contains("No space left"),
        "{e}"
    );
    assert!(
        !snap.join("manifest.json").exists(),
        "no manifest for a failed snapshot"
    );
    vm.destroy().unwrap();
}

#[test]
fn jailer_failure_is_reported_with_its_message() {
    let f = fixture("jfail", "vm-jfail");
    f.fake.set_mode(Mode::JailerFails);
    let e = f.backend.boot(&f.cfg).err().unwrap().to_string();
    assert!(
        e.contains("jailer") && e.contains("exit code 1") && e.contains("netns"),
        "{e}"
    );
    assert!(!jail_dir(&f).exists());
}

#[test]
fn vmm_that_dies_at_start_gives_a_bounded_clear_error() {
    let f = fixture("dies", "vm-dies");
    f.fake.set_mode(Mode::VmmDies);
    let t = Instant::now();
    let e = f.backend.boot(&f.cfg).err().unwrap().to_string();
    // Bounded, not hanging (the fixture's timeouts are all <= 2 s); that
    // the death itself was noticed is the message, not the time.
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
    assert!(
        e.contains("exited while starting") || e.contains("VMM pid file"),
        "{e}"
    );
    assert!(!jail_dir(&f).exists());
}

#[test]
fn vmm_without_api_socket_times_out_and_is_killed() {
    let f = fixture("nosock", "vm-nosock");
    f.fake.set_mode(Mode::NoSocket);
    let t = Instant::now();
    let e = f.backend.boot(&f.cfg).err().unwrap();
    // Its timeout (<= 2 s here) fired: without it, this would never end.
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
    assert!(
        matches!(e, VmError::Timeout { .. }) && e.to_string().contains("API socket"),
        "{e}"
    );
    assert!(!jail_dir(&f).exists());
}

#[test]
fn api_that_never_answers_times_out() {
    let f = fixture("hang", "vm-hang");
    f.fake.set_mode(Mode::Hang);
    let t = Instant::now();
    let e = f.backend.boot(&f.cfg).err().unwrap();
    // Its timeout (<= 2 s here) fired: without it, this would never end.
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
    assert!(
        matches!(e, VmError::Timeout { .. }) && e.to_string().contains("PUT /logger"),
        "{e}"
    );
    assert!(!jail_dir(&f).exists());
}

#[test]
fn restore_refuses_stale_or_missing_snapshots() {
    let f = fixture("stale", "vm-stale");
    let missing = f
        .backend
        .restore(&f.cfg, &f.tmp.0.join("nosnap"))
        .err()
        .unwrap();
    assert!(
        matches!(missing, VmError::BadFile { .. })
            && missing.to_string().contains("snapshot create"),
        "{missing}"
    );

    let mut vm = f.backend.boot(&f.cfg).unwrap();
    let snap = f.tmp.0.join("snap");
    vm.snapshot(&snap).unwrap();
    vm.destroy().unwrap();

    let mut other = f.cfg.clone();
    other.mem_mib = 512;
    let e = f.backend.restore(&other, &snap).err().unwrap();
    assert!(
        matches!(e, VmError::StaleSnapshot { .. }) && e.to_string().contains("512 MiB"),
        "{e}"
    );

    // Same size, new content: caught by the hash after the fingerprint moved.
    fs::set_permissions(&f.cfg.rootfs, fs::Permissions::from_mode(0o644)).unwrap();
    fs::write(&f.cfg.rootfs, vec![2u8; 8192]).unwrap();
    let e = f.backend.restore(&f.cfg, &snap).err().unwrap();
    assert!(
        matches!(e, VmError::StaleSnapshot { .. }) && e.to_string().contains("rootfs"),
        "{e}"
    );
    assert!(!jail_dir(&f).exists());
    assert!(f.fake.take_log().iter().all(|r| r.path != "/snapshot/load"));
}

#[test]
fn leftover_jail_is_refused_then_cleaned() {
    let f = fixture("stalejail", "vm-leftover");
    fs::create_dir_all(jail_dir(&f).join("root")).unwrap();
    let e = f.backend.boot(&f.cfg).err().unwrap();
    assert!(matches!(e, VmError::BadFile { .. }), "{e}");
    f.backend.cleanup_stale(&f.cfg.id).unwrap();
    assert!(!jail_dir(&f).exists());
    let mut vm = f.backend.boot(&f.cfg).unwrap();
    vm.destroy().unwrap();
}

#[test]
fn bad_inputs_name_the_file() {
    let mut f = fixture("badin", "vm-badin");
    f.cfg.kernel = f.tmp.0.join("missing-vmlinux");
    let e = f.backend.boot(&f.cfg).err().unwrap();
    assert!(
        matches!(&e, VmError::BadFile { path, .. } if path.ends_with("missing-vmlinux")),
        "{e}"
    );
    let mut f = fixture("badid", "vm_bad_id");
    f.cfg.net = None;
    assert!(f
        .backend
        .boot(&f.cfg)
        .err()
        .unwrap()
        .to_string()
        .contains("invalid VM id"));
}

// ---------------------------------------------------------- checkpoints ---

/// `f.cfg` as another VM: its own id, VM user, network namespace and run
/// dir; the same shape, MAC and command line (what a checkpoint fixes).
fn sibling(f: &Fixture, id: &str, n: u32) -> VmConfig {
    let (uid, gid) = vm_user();
    // SAFETY: no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let mut cfg = f.cfg.clone();
    cfg.id = id.into();
    (cfg.uid, cfg.gid) = if root { (uid + n, gid + n) } else { (uid, gid) };
    if let Some(net) = &mut cfg.net {
        net.netns = format!("/run/netns/asbx-test-{n}").into();
    }
    cfg.run_dir = f.tmp.0.join("run").join(id);
    fs::create_dir_all(&cfg.run_dir).unwrap();
    cfg
}

fn jail_of(f: &Fixture, id: &str) -> PathBuf {
    f.tmp.0.join("jail/firecracker").join(id)
}

fn echo(s: &mut UnixStream, what: &[u8]) {
    s.write_all(what).unwrap();
    let mut buf = vec![0u8; what.len()];
    s.read_exact(&mut buf).unwrap();
    assert_eq!(buf, what);
}

/// The host end of an agent stream a snapshot reset: EOF, not a hang.
fn assert_reset(s: &mut UnixStream) {
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("agent stream not reset by the snapshot: {other:?}"),
    }
}

/// Allocated bytes of the files of a checkpoint, counted here on its own.
fn disk_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    ["vmstate", "memory", "manifest.json"]
        .iter()
        .map(|n| fs::metadata(dir.join(n)).unwrap().blocks() * 512)
        .sum()
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .map(|r| {
            r.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn assert_checkpoint_calls(log: &[Req]) {
    assert_eq!(
        calls(log),
        ["PATCH /vm", "PUT /snapshot/create", "PATCH /vm"],
        "{log:?}"
    );
    assert_eq!(log[0].body, json!({"state": "Paused"}));
    assert_eq!(
        log[1].body,
        json!({"snapshot_type": "Full", "snapshot_path": "/new-snapshot.state", "mem_file_path": "/new-snapshot.mem"})
    );
    assert_eq!(log[2].body, json!({"state": "Resumed"}));
}

#[test]
fn checkpoint_of_a_running_vm_restores_into_a_new_jail_and_again() {
    use std::os::unix::fs::MetadataExt;
    let f = fixture("ckpt", "vm-ckpt-a");
    let mut a = f.backend.boot(&f.cfg).expect("boot");
    f.fake.take_log();
    let mut agent = a
        .connect_agent(Instant::now() + Duration::from_secs(2))
        .expect("agent");
    echo(&mut agent, b"before");

    // 1. A booted VM: paused only for the snapshot, then running again.
    let ck1 = f.tmp.0.join("checkpoints/ck1");
    let st = a.checkpoint(&ck1).expect("checkpoint");
    assert_checkpoint_calls(&f.fake.take_log());
    assert_eq!(f.fake.violations(), Vec::<String>::new());
    let root_a = jail_of(&f, "vm-ckpt-a").join("root");
    assert_eq!(
        f.fake.shared.lock().unwrap().paused.get(&root_a),
        Some(&false)
    );
    assert_eq!(names_in(&ck1), ["manifest.json", "memory", "vmstate"]);
    assert!(
        !root_a.join("new-snapshot.mem").exists() && !root_a.join("new-snapshot.state").exists()
    );
    assert_eq!(st.bytes, disk_bytes(&ck1));
    assert!(
        st.bytes >= 8192 && st.bytes < FAKE_MEM_LEN,
        "allocated bytes, not the sparse file's length: {st:?}"
    );
    assert!(
        st.paused > Duration::ZERO && st.paused < Duration::from_secs(2),
        "{st:?}"
    );
    let m = Manifest::read(&ck1).expect("manifest");
    assert_eq!(m.files, ["vmstate", "memory"]);
    assert_eq!((m.vcpus, m.mem_mib), (2, 256));
    for n in ["vmstate", "memory"] {
        let meta = fs::metadata(ck1.join(n)).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o444, "{n}");
        if vm_user().0 == 4242 {
            assert_eq!((meta.uid(), meta.gid()), (0, 0), "{n}: root's");
        }
    }
    println!(
        "FIGURE fc_checkpoint_fake paused_us={} bytes={}",
        st.paused.as_micros(),
        st.bytes
    );

    // The snapshot reset the source's agent connection; a new one works.
    assert!(a.checkpoint_resets_agent());
    assert_reset(&mut agent);
    let mut agent = a
        .connect_agent(Instant::now() + Duration::from_secs(2))
        .expect("agent after checkpoint");
    echo(&mut agent, b"after");

    // 2. Restored into a new jailed Firecracker: own id, uid, netns.
    let cfg_b = sibling(&f, "vm-ckpt-b", 1);
    f.backend.check_snapshot(&cfg_b, &ck1).expect("restorable");
    let mut b = f
        .backend
        .restore(&cfg_b, &ck1)
        .expect("restore from checkpoint");
    let log = f.fake.take_log();
    assert_eq!(calls(&log), ["PUT /logger", "PUT /snapshot/load"]);
    assert_eq!(
        log[1].body,
        json!({
            "snapshot_path": "/snapshot.state",
            "mem_backend": {"backend_type": "File", "backend_path": "/snapshot.mem"},
            "resume_vm": true,
            "network_overrides": [{"iface_id": "eth0", "host_dev_name": "tap0"}],
        })
    );
    let argv = f.fake.jailer_argv.lock().unwrap().last().unwrap().clone();
    assert_eq!(arg_value(&argv, "--id").as_deref(), Some("vm-ckpt-b"));
    assert_eq!(arg_value(&argv, "--uid"), Some(cfg_b.uid.to_string()));
    assert_eq!(arg_value(&argv, "--gid"), Some(cfg_b.gid.to_string()));
    assert_eq!(
        arg_value(&argv, "--netns").as_deref(),
        Some("/run/netns/asbx-test-1")
    );
    // The checkpoint's files are linked (shared pages), read-only.
    let root_b = jail_of(&f, "vm-ckpt-b").join("root");
    for (in_jail, name) in [("snapshot.state", "vmstate"), ("snapshot.mem", "memory")] {
        let (linked, orig) = (
            fs::metadata(root_b.join(in_jail)).unwrap(),
            fs::metadata(ck1.join(name)).unwrap(),
        );
        assert_eq!(
            (linked.dev(), linked.ino()),
            (orig.dev(), orig.ino()),
            "{in_jail}"
        );
        assert_eq!(linked.permissions().mode() & 0o222, 0, "{in_jail} writable");
    }
    let mut agent_b = b
        .connect_agent(Instant::now() + Duration::from_secs(2))
        .expect("agent of the restored copy");
    echo(&mut agent_b, b"copy");

    // 3. A checkpoint of the restored VM, restored again; its source
    // checkpoint is untouched.
    let ck2 = f.tmp.0.join("checkpoints/ck2");
    b.checkpoint(&ck2).expect("checkpoint of a restored VM");
    assert_checkpoint_calls(&f.fake.take_log());
    assert_reset(&mut agent_b);
    assert_eq!(fs::read(ck1.join("vmstate")).unwrap(), b"state");
    assert_eq!(
        fs::metadata(root_b.join("snapshot.mem")).unwrap().ino(),
        fs::metadata(ck1.join("memory")).unwrap().ino()
    );
    let cfg_c = sibling(&f, "vm-ckpt-c", 2);
    let mut c = f
        .backend
        .restore(&cfg_c, &ck2)
        .expect("restore of a checkpoint of a copy");
    echo(
        &mut c
            .connect_agent(Instant::now() + Duration::from_secs(2))
            .unwrap(),
        b"grandchild",
    );
    assert_eq!(
        calls(&f.fake.take_log()),
        ["PUT /logger", "PUT /snapshot/load"]
    );

    // 4. The source checkpoints again (repeated checkpoints are Full).
    let ck3 = f.tmp.0.join("checkpoints/ck3");
    a.checkpoint(&ck3).expect("second checkpoint of the source");
    assert_checkpoint_calls(&f.fake.take_log());

    // A checkpoint of another shape is reported, not restored.
    let mut big = cfg_b.clone();
    big.mem_mib = 512;
    let e = f.backend.check_snapshot(&big, &ck1).unwrap_err();
    assert!(matches!(e, VmError::StaleSnapshot { .. }), "{e}");

    for vm in [&mut a, &mut b, &mut c] {
        vm.destroy().unwrap();
    }
    for id in ["vm-ckpt-a", "vm-ckpt-b", "vm-ckpt-c"] {
        assert!(!jail_of(&f, id).exists(), "{id}: jail left behind");
    }
    // Checkpoints outlive the VMs that made and used them.
    assert!(Manifest::read(&ck1).is_ok() && Manifest::read(&ck2).is_ok());
    assert_eq!(f.fake.violations(), Vec::<String>::new());
}

#[test]
fn checkpoint_whose_snapshot_fails_resumes_the_vm_and_leaves_nothing() {
    let f = fixture("ckptfail", "vm-ckptfail");
    let mut vm = f.backend.boot(&f.cfg).unwrap();
    f.fake.take_log();
    let root = jail_dir(&f).join("root");
    f.fake.fail(
        "PUT",
        "/snapshot/create",
        400,
        "Cannot save the memory file: No space left on device (os error 28)",
    );
    let dir = f.tmp.0.join("checkpoints/full");
    let e = vm.checkpoint(&dir).unwrap_err();
    assert_checkpoint_calls(&f.fake.take_log());
    assert_eq!(
        f.fake.shared.lock().unwrap().paused.get(&root),
        Some(&false),
        "left paused"
    );
    // A full disk is an I/O error of that kind, naming the files.
    match &e {
        VmError::Io { source, .. } => {
            assert_eq!(source.kind(), std::io::ErrorKind::StorageFull, "{e}")
        }
        other => panic!("not an Io error: {other:?}"),
    }
    let msg = e.to_string();
    assert!(
        msg.contains("vm-ckptfail")
            && msg.contains(&root.join("new-snapshot.mem").display().to_string())
            && msg.contains("No space left"),
        "{msg}"
    );
    assert!(
        !dir.exists(),
        "checkpoint dir left behind: {:?}",
        names_in(&dir)
    );
    assert!(
        !root.join("new-snapshot.mem").exists() && !root.join("new-snapshot.state").exists(),
        "torn files left in the jail"
    );

    // Another fault: an API error, still naming the files.
    f.fake.fail(
        "PUT",
        "/snapshot/create",
        400,
        "Cannot save the microVM state",
    );
    fs::create_dir_all(&dir).unwrap();
    let e = vm.checkpoint(&dir).unwrap_err();
    assert!(matches!(e, VmError::Api { .. }), "{e:?}");
    assert!(e.to_string().contains("new-snapshot.state"), "{e}");
    assert!(
        dir.is_dir() && names_in(&dir).is_empty(),
        "{:?}",
        names_in(&dir)
    );
    f.fake.take_log();

    // The VM runs on and checkpoints once the fault is gone, over what a
    // crash left half-written.
    f.fake.shared.lock().unwrap().faults.clear();
    fs::write(dir.join(".memory.part"), b"torn by a crash").unwrap();
    vm.checkpoint(&dir).expect("checkpoint after the fault");
    assert_checkpoint_calls(&f.fake.take_log());
    assert_eq!(names_in(&dir), ["manifest.json", "memory", "vmstate"]);
    assert_eq!(
        fs::metadata(dir.join("memory")).unwrap().len(),
        FAKE_MEM_LEN
    );
    vm.destroy().unwrap();
    assert_eq!(f.fake.violations(), Vec::<String>::new());
}

#[test]
fn checkpoint_refused_pause_or_bad_dir_sends_no_snapshot() {
    let f = fixture("ckptpause", "vm-ckptpause");
    let mut vm = f.backend.boot(&f.cfg).unwrap();
    f.fake.take_log();

    // Nowhere to write: nothing is asked of the VMM.
    let file = f.tmp.0.join("a-file");
    fs::write(&file, b"x").unwrap();
    let e = vm.checkpoint(&file.join("ck")).unwrap_err();
    assert!(
        e.to_string()
            .contains(&file.join("ck").display().to_string()),
        "{e}"
    );
    assert_eq!(f.fake.take_log(), vec![]);

    // A complete checkpoint is never overwritten.
    let done = f.tmp.0.join("done");
    vm.checkpoint(&done).unwrap();
    f.fake.take_log();
    let e = vm.checkpoint(&done).unwrap_err();
    assert!(matches!(e, VmError::BadFile { .. }), "{e}");
    assert_eq!(f.fake.take_log(), vec![]);
    assert!(Manifest::read(&done).is_ok());

    // Pause refused: no snapshot, a resume to be sure, nothing written.
    f.fake
        .fail("PATCH", "/vm", 400, "Failed to pause the microVM");
    let dir = f.tmp.0.join("never");
    let e = vm.checkpoint(&dir).unwrap_err();
    assert!(e.to_string().contains("PATCH /vm"), "{e}");
    let log = f.fake.take_log();
    assert!(log.iter().all(|r| r.path != "/snapshot/create"), "{log:?}");
    assert!(!dir.exists());
    vm.destroy().unwrap();
    assert_eq!(f.fake.violations(), Vec::<String>::new());
}

#[test]
fn checkpoint_onto_another_filesystem_keeps_the_memory_file_sparse() {
    use std::os::unix::fs::MetadataExt;
    let shm = Path::new("/dev/shm");
    let f = fixture("ckptxfs", "vm-ckptxfs");
    let other_fs =
        shm.is_dir() && fs::metadata(shm).unwrap().dev() != fs::metadata(&f.tmp.0).unwrap().dev();
    if !other_fs {
        // Not a skip: the same-filesystem path (rename) is what the other
        // tests take; say which one ran.
        println!("FIGURE fc_checkpoint_copy path=rename (no second filesystem)");
    }
    let base = if other_fs {
        shm.to_path_buf()
    } else {
        f.tmp.0.clone()
    };
    let holder = TempDir::new_in(&base, "ckptxfs");
    let mut vm = f.backend.boot(&f.cfg).unwrap();
    let dir = holder.0.join("ck");
    let st = vm.checkpoint(&dir).expect("checkpoint across filesystems");
    let mem = fs::metadata(dir.join("memory")).unwrap();
    assert_eq!(mem.len(), FAKE_MEM_LEN);
    assert!(
        mem.blocks() * 512 < FAKE_MEM_LEN / 2,
        "holes filled in: {} bytes allocated",
        mem.blocks() * 512
    );
    let data = fs::read(dir.join("memory")).unwrap();
    for (at, b) in data.iter().enumerate() {
        let at = at as u64;
        let want = if at < 4096 || (FAKE_MEM_DATA2..FAKE_MEM_DATA2 + 4096).contains(&at) {
            7
        } else {
            0
        };
        assert_eq!(*b, want, "byte {at}");
    }
    assert_eq!(st.bytes, disk_bytes(&dir));
    let root = jail_dir(&f).join("root");
    assert!(!root.join("new-snapshot.mem").exists());
    if other_fs {
        println!(
            "FIGURE fc_checkpoint_copy path=sparse-copy bytes={}",
            st.bytes
        );
    }
    // And it restores.
    let cfg_b = sibling(&f, "vm-ckptxfs-b", 1);
    let mut b = f.backend.restore(&cfg_b, &dir).expect("restore");
    b.destroy().unwrap();
    vm.destroy().unwrap();
    assert_eq!(f.fake.violations(), Vec::<String>::new());
}

/// A guest that never prints on its console (a KVM that runs no guest,
/// as on a nested-PVM host) fails `connect_agent` once `first_output`
/// passes, well before the agent timeout, naming the console and KVM.
#[test]
fn a_guest_that_prints_nothing_fails_in_seconds_with_its_evidence() {
    let f = fixture("mute", "vm-mute");
    {
        let mut s = f.fake.shared.lock().unwrap();
        (s.no_console, s.no_agent) = (true, true);
    }
    let mut vm = f.backend.boot(&f.cfg).expect("boot");
    let t = Instant::now();
    let e = vm
        .connect_agent(Instant::now() + Duration::from_secs(60))
        .expect_err("a guest that prints nothing must not connect");
    let took = t.elapsed();
    let msg = e.to_string();
    assert!(matches!(e, VmError::Timeout { .. }), "{e:?}");
    assert!(took < Duration::from_secs(10), "took {took:?}: {msg}");
    for want in ["first console output", "no console output", "kvm: "] {
        assert!(msg.contains(want), "{want:?} missing: {msg}");
    }
    vm.destroy().expect("destroy");
    assert!(!jail_dir(&f).exists());
}

/// A booted guest's console lines come with a VMM's death: the kernel's
/// words, escaped (guest output is untrusted), and the VMM's log tail.
#[test]
fn a_vmm_that_dies_after_boot_reports_console_and_log() {
    let f = fixture("diesboot", "vm-diesboot");
    let mut vm = f.backend.boot(&f.cfg).expect("boot");
    let root = jail_dir(&f).join("root");
    fs::write(
        root.join("firecracker.log"),
        "[Error] vcpu: Unexpected exit reason on vcpu run: InternalError\n",
    )
    .unwrap();
    let mut serial = fs::OpenOptions::new()
        .append(true)
        .open(root.join("serial.log"))
        .unwrap();
    serial
        .write_all(b"Kernel panic - not syncing: \x1b[31mVFS\n")
        .unwrap();
    drop(serial);
    let pid = vm.pid().expect("stand-in VMM pid");
    // SAFETY: kill of the stand-in VMM this test started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let t = Instant::now();
    while !process_gone(pid) && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let e = vm
        .connect_agent(Instant::now() + Duration::from_secs(30))
        .expect_err("a dead VMM must not connect");
    let msg = e.to_string();
    for want in [
        "exited",
        "InternalError",
        "console: ",
        "Kernel panic - not syncing",
        "kvm: ",
    ] {
        assert!(msg.contains(want), "{want:?} missing: {msg}");
    }
    assert!(!msg.contains('\x1b'), "unescaped guest output: {msg:?}");
    vm.destroy().expect("destroy");
}

/// The console is a diagnosis, never a gate: a guest whose agent answers
/// connects though it printed nothing (a Firecracker that writes no
/// serial file, a kernel without a console).
#[test]
fn an_answering_agent_connects_without_console_output() {
    let f = fixture("quiet", "vm-quiet");
    f.fake.shared.lock().unwrap().no_console = true;
    let mut vm = f.backend.boot(&f.cfg).expect("boot");
    let mut s = vm
        .connect_agent(Instant::now() + Duration::from_secs(5))
        .expect("the agent answers");
    echo(&mut s, b"hello");
    vm.destroy().expect("destroy");
}
