//! The daemon's config file: parsing, unknown keys named, flags over the
//! file, artifact paths reaching the registry and backends, the effective
//! config of `config check`, a daemon run from a file, and every config the
//! Nix code renders (module, `nix run` host) accepted by `config check`.

mod common;
#[path = "common/skip.rs"]
mod skip;

use agent_sandbox::config::{Config, FileConfig};
use agent_sandbox::sandbox::wiring;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"));
    // The environment fallbacks must not leak into what is compared.
    for k in [
        "AGENT_SANDBOX_TEMPLATES",
        "AGENT_SANDBOX_CACHE",
        "AGENT_SANDBOX_SNAPSHOT_STATE",
        "AGENT_SANDBOX_FIRECRACKER",
        "AGENT_SANDBOX_JAILER",
    ] {
        c.env_remove(k);
    }
    for k in agent_sandbox::config::seed_env::VARS {
        c.env_remove(k);
    }
    c
}

fn write(dir: &Path, name: &str, v: &Value) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, serde_json::to_vec_pretty(v).unwrap()).unwrap();
    p
}

fn run(cmd: &mut Command) -> (i32, Value, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = cmd.output().expect("run agent-sandbox");
    let out = serde_json::from_slice(&stdout).unwrap_or(Value::Null);
    (
        status.code().unwrap_or(-1),
        out,
        String::from_utf8_lossy(&stderr).into_owned(),
    )
}

fn check(file: &Path) -> (i32, Value, String) {
    run(bin().args(["config", "check"]).arg(file))
}

#[test]
fn unknown_keys_are_rejected_by_name() {
    let e = FileConfig::parse(r#"{"listen": "127.0.0.1:1", "max_sesions": 3}"#).unwrap_err();
    assert!(e.contains("max_sesions"), "{e}");
    assert!(e.contains("line 1"), "{e}");
    // Nested: the error names the whole path.
    let e = FileConfig::parse(r#"{"network": {"uplink": "eth0"}}"#).unwrap_err();
    assert!(e.contains("network.uplink"), "{e}");
    let e = FileConfig::parse("{\n\"egress\": {\"mode\": \"sometimes\"}}").unwrap_err();
    assert!(e.starts_with("egress.mode"), "{e}");
    assert!(e.contains("line 2"), "{e}");
    let e = FileConfig::parse(r#"{"idle_timeout_secs": "30m"}"#).unwrap_err();
    assert!(e.starts_with("idle_timeout_secs"), "{e}");
    // Relative paths would depend on the service manager's cwd.
    let e = FileConfig::parse(r#"{"images": {"base": "rootfs.erofs"}}"#).unwrap_err();
    assert!(e.starts_with("images.base"), "{e}");
    // A bare QEMU command name is looked up in PATH: allowed.
    FileConfig::parse(r#"{"qemu": "qemu-system-x86_64"}"#).unwrap();

    // The binary: file and key named on stderr, exit 2.
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "bad.json",
        &json!({"listen": "127.0.0.1:1", "nope": 1}),
    );
    let (code, out, err) = check(&f);
    assert_eq!(code, 2, "{err}");
    assert_eq!(out, Value::Null);
    assert!(
        err.contains(&f.display().to_string()) && err.contains("nope"),
        "{err}"
    );
}

#[test]
fn file_values_and_semantic_checks() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "c.json",
        &json!({
            "listen": "127.0.0.1:3999",
            "backend": "firecracker",
            "state_dir": "/srv/sbx",
            "max_sessions": 7,
            "idle_timeout_secs": 90,
            "mcp_http": false,
            "egress": {"mode": "allowlist", "rules": ["203.0.113.0/24:443/tcp"], "domains": ["*.pypi.org"]},
            "network": {"uplink_if": "eth1", "dns_upstreams": ["9.9.9.9:53"]},
        }),
    );
    let (code, out, err) = check(&f);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out["listen"], "127.0.0.1:3999");
    assert_eq!(out["backend"], "firecracker");
    // keys_file follows state_dir when not named.
    assert_eq!(out["keys_file"], "/srv/sbx/keys.json");
    assert_eq!(out["max_sessions"], 7);
    assert_eq!(out["idle_timeout_secs"], 90);
    assert_eq!(out["mcp_http"], false);
    assert_eq!(out["egress"]["domains"], json!(["*.pypi.org"]));
    assert_eq!(out["network"]["uplink_if"], "eth1");
    // Defaults are filled in (the network section's too).
    assert_eq!(out["network"]["prefix"], "asbx");
    assert_eq!(out["max_lifetime_secs"], 86400);
    // The effective config is itself a valid config file, and a fixed point.
    let again = write(dir.path(), "again.json", &out);
    let (code, out2, err) = check(&again);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, out2);

    // `network: null` is no networking, as absent.
    let f = write(dir.path(), "nonet.json", &json!({"network": null}));
    let (code, out, err) = check(&f);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out["network"], Value::Null);

    // Semantic errors name the key.
    for (v, key) in [
        (json!({"backend": "vmware"}), "backend"),
        (json!({"auth": false, "listen": "0.0.0.0:3000"}), "auth"),
        (json!({"max_sessions": 0}), "max_sessions"),
        (json!({"rate_limit": 0}), "rate_limit"),
        (json!({"default_vcpus": 0}), "default_vcpus"),
        (json!({"max_vcpus": 65}), "max_vcpus"),
        (json!({"max_sessions_per_key": 0}), "max_sessions_per_key"),
        (
            json!({"default_mem_mib": 4096, "max_mem_mib": 2048}),
            "exceeds max_mem_mib",
        ),
        (
            json!({"default_vcpus": 4, "max_vcpus_per_key": 2}),
            "exceeds max_vcpus_per_key",
        ),
        (
            json!({"exec_timeout_secs": 100, "max_exec_timeout_secs": 10}),
            "exec_timeout_secs",
        ),
        (
            json!({"egress": {"mode": "allowlist", "rules": ["nonsense"]}}),
            "egress",
        ),
        (json!({"network": {"prefix": "WAYTOOLONG"}}), "network"),
    ] {
        let f = write(dir.path(), "bad.json", &v);
        let (code, _, err) = check(&f);
        assert_eq!(code, 2, "{v} was accepted");
        assert!(err.contains(key), "{v}: {err}");
    }
}

#[test]
fn flags_override_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "c.json",
        &json!({
            "listen": "127.0.0.1:3999",
            "backend": "firecracker",
            "state_dir": "/srv/from-file",
            "max_sessions": 7,
            "idle_timeout_secs": 90,
            "mcp_allowed_origins": ["https://file.example"],
        }),
    );
    let (code, out, err) = run(bin().arg("serve").arg("--config").arg(&f).args([
        "--listen",
        "127.0.0.1:4000",
        "--backend",
        "qemu",
        "--max-sessions",
        "3",
        "--idle-timeout",
        "2m",
        "--state-dir",
        "/srv/from-flag",
        "--mcp-allowed-origin",
        "https://flag.example",
        "--check",
    ]));
    assert_eq!(code, 0, "{err}");
    assert_eq!(out["listen"], "127.0.0.1:4000");
    assert_eq!(out["backend"], "qemu");
    assert_eq!(out["max_sessions"], 3);
    assert_eq!(out["idle_timeout_secs"], 120);
    assert_eq!(out["state_dir"], "/srv/from-flag");
    // The key file follows the state dir unless the file names it.
    assert_eq!(out["keys_file"], "/srv/from-flag/keys.json");
    assert_eq!(out["mcp_allowed_origins"], json!(["https://flag.example"]));

    // Keys the flags leave alone keep the file's values; a named
    // keys_file stays where the file put it.
    let f2 = write(
        dir.path(),
        "c2.json",
        &json!({"keys_file": "/etc/sbx/keys.json", "max_sessions": 7}),
    );
    let (code, out, err) =
        run(bin()
            .arg("up")
            .arg("--config")
            .arg(&f2)
            .args(["--state-dir", "/srv/x", "--check"]));
    assert_eq!(code, 0, "{err}");
    assert_eq!(out["keys_file"], "/etc/sbx/keys.json");
    assert_eq!(out["max_sessions"], 7);

    // A flag that makes the result invalid is reported like a file error.
    let (code, _, err) = run(bin().arg("serve").arg("--config").arg(&f).args([
        "--no-auth",
        "--listen",
        "0.0.0.0:4000",
        "--check",
    ]));
    assert_eq!(code, 2);
    assert!(err.contains("auth"), "{err}");
}

#[test]
fn artifact_paths_reach_the_registry_and_backends() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // An image cache whose current.json names other artifacts: the
    // config's explicit ones win, templates it does not name keep theirs.
    let cache = d.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    std::fs::write(
        cache.join("current.json"),
        json!({"kernel": "/cache/vmlinux-old", "rootfs": {"base": "/cache/base-old.erofs", "python": "/cache/python.erofs"}})
            .to_string(),
    )
    .unwrap();
    let text = json!({
        "state_dir": d.join("state"),
        "kernel": "/nix/store/k/vmlinux",
        "images": {"base": "/nix/store/b/rootfs.erofs"},
        "templates_dir": "/nix/store/t-templates",
        "cache_dir": cache,
        "snapshot_dir": d.join("snaps"),
        "qemu": "/nix/store/q/bin/qemu-system-x86_64",
        "firecracker": "/nix/store/f/bin/firecracker",
        "jailer": "/nix/store/f/bin/jailer",
        "default_vcpus": 2,
        "default_mem_mib": 768,
    })
    .to_string();
    let mut cfg = Config::default();
    FileConfig::parse(&text).unwrap().apply(&mut cfg);
    cfg.validate().unwrap();

    let rc = wiring::registry_config(&cfg);
    assert_eq!(
        rc.pinned_kernel,
        Some(PathBuf::from("/nix/store/k/vmlinux"))
    );
    assert_eq!(
        rc.pinned_rootfs.get("base"),
        Some(&PathBuf::from("/nix/store/b/rootfs.erofs"))
    );
    assert_eq!(
        rc.pinned_rootfs.get("python"),
        Some(&PathBuf::from("/cache/python.erofs"))
    );
    assert_eq!(rc.templates_dir, PathBuf::from("/nix/store/t-templates"));
    assert_eq!(rc.cache_dir, cache);
    // Snapshots go to <snapshot_dir>/snapshots/<backend>/<template>.
    assert_eq!(rc.state_dir, d.join("snaps"));
    assert_eq!((rc.default_vcpus, rc.default_mem_mib), (2, 768));

    let qc = wiring::qemu_config(&cfg);
    assert_eq!(
        qc.binary,
        PathBuf::from("/nix/store/q/bin/qemu-system-x86_64")
    );
    assert_eq!(qc.accel_cache, Some(d.join("snaps/qemu-accel")));
    let jc = wiring::jailer_config(&cfg);
    assert_eq!(
        jc.firecracker_bin,
        PathBuf::from("/nix/store/f/bin/firecracker")
    );
    assert_eq!(jc.jailer_bin, PathBuf::from("/nix/store/f/bin/jailer"));
    assert_eq!(jc.chroot_base, d.join("state/jail"));

    // The registry really uses them.
    let be = wiring::backend("qemu", &cfg).unwrap();
    let reg = agent_sandbox::vm::templates::Registry::new(rc, be);
    assert_eq!(reg.kernel().unwrap(), PathBuf::from("/nix/store/k/vmlinux"));
    assert_eq!(
        reg.rootfs("base").unwrap(),
        PathBuf::from("/nix/store/b/rootfs.erofs")
    );
}

#[test]
fn environment_is_a_fallback_under_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "c.json",
        &json!({"templates_dir": "/from/file/templates"}),
    );
    let (code, out, err) = run(bin()
        .args(["config", "check"])
        .arg(&f)
        .env("AGENT_SANDBOX_TEMPLATES", "/from/env/templates")
        .env("AGENT_SANDBOX_JAILER", "/from/env/jailer"));
    assert_eq!(code, 0, "{err}");
    assert_eq!(out["templates_dir"], "/from/file/templates");
    assert_eq!(out["jailer"], "/from/env/jailer");
    assert_eq!(out["firecracker"], Value::Null);
}

/// A seed host's environment is a layer under the config file: `config
/// check` shows it applied, the file wins where both name a thing, a value
/// that cannot be honoured names its variable, and a daemon started from
/// the environment alone listens on `PORT` without auth and gives sessions
/// the egress policy the variables describe.
#[test]
fn a_seed_env_configures_the_daemon_under_the_file() {
    let dir = tempfile::Builder::new()
        .prefix("sbx-seed-env")
        .tempdir()
        .unwrap();
    let f = write(dir.path(), "c.json", &json!({"default_vcpus": 1}));
    let seed = [
        ("VM_VCPU_COUNT", "2"),
        ("VM_MEM_SIZE_MIB", "512"),
        ("VM_CPU_QUOTA_US", "150000"),
        ("VM_NOFILE_LIMIT", "4096"),
        ("FIRECRACKER_JAIL_BASE", "/srv/seed-jail"),
        ("VM_DEST_MODE", "deny"),
        ("VM_DEST_RULES", "198.51.100.0/24:443/tcp"),
        ("VM_DNS_MODE", "deny"),
        ("VM_DNS_DOMAINS", "evil.example"),
        ("VM_BW_ENABLED", "1"),
        ("VM_BW_RATE_KBIT", "4000"),
        ("VM_BW_BURST_KBIT", "400"),
    ];
    let (code, out, err) = run(bin().args(["config", "check"]).arg(&f).envs(seed));
    assert_eq!(code, 0, "{err}");
    assert_eq!(out["default_vcpus"], 1, "the file wins: {out}");
    assert_eq!(out["default_mem_mib"], 512);
    assert_eq!(
        out["vm_cpu_max"],
        json!({"quota_us": 150000, "period_us": 100000})
    );
    assert_eq!(out["vm_nofile_limit"], 4096);
    assert_eq!(out["jail_dir"], "/srv/seed-jail");
    let e = &out["egress"];
    assert_eq!(e["mode"], "denylist", "{e}");
    assert_eq!(e["rules"], json!(["198.51.100.0/24:443/tcp"]));
    assert_eq!(e["deniedDomains"], json!(["evil.example"]));
    assert_eq!(
        (e["bandwidthKbps"].clone(), e["bandwidthBurstKbit"].clone()),
        (json!(4000), json!(400))
    );

    let (code, _, err) = run(bin()
        .args(["config", "check"])
        .arg(&f)
        .env("VM_DNS_MODE", "sometimes"));
    assert_eq!(code, 2);
    assert!(err.contains("VM_DNS_MODE"), "{err}");
    // A config-level check names the variable behind the key too.
    let (code, _, err) = run(bin()
        .args(["config", "check"])
        .arg(&f)
        .env("VM_VCPU_COUNT", "64")
        .env("VM_MEM_SIZE_MIB", "300000"));
    assert_eq!(code, 2);
    assert!(err.contains("VM_MEM_SIZE_MIB"), "{err}");

    // Keys made from the environment: its key file, its prefix.
    let seed_keys = dir.path().join("seed-keys.json");
    let out = bin()
        .args(["keys", "create", "--name", "seed"])
        .env("AUTH_KEYS_PATH", &seed_keys)
        .env("AUTH_KEY_PREFIX", "sk_seed_")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("sk_seed_k"), "{text}");
    assert!(std::fs::read_to_string(&seed_keys)
        .unwrap()
        .contains("sk_seed_"));

    // A daemon from the environment alone.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let log = std::fs::File::create(dir.path().join("daemon.log")).unwrap();
    let mut child = bin()
        .arg("serve")
        .args(["--backend", "local-process", "--network", "off"])
        .arg("--agent-bin")
        .arg(common::agent_bin())
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env("PORT", port.to_string())
        .env("AUTH_ENABLED", "false")
        .env("AUTH_KEYS_PATH", dir.path().join("seed-keys.json"))
        .env("VM_DEST_MODE", "allow")
        .env("VM_DEST_RULES", "198.51.100.7/32")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(log)
        .spawn()
        .expect("spawn agent-sandbox serve");
    let stdout = child.stdout.take().unwrap();
    let _guard = Running(child);
    let (_, base) = common::daemon::read_banner_from(stdout);
    assert_eq!(
        base,
        format!("http://127.0.0.1:{port}"),
        "{}",
        std::fs::read_to_string(dir.path().join("daemon.log")).unwrap_or_default()
    );
    let h = common::daemon::Http::new(&base, None);
    let r = h.post("/v1/sessions", &json!({"id": "seed-env"}));
    assert_eq!(r.status, 201, "no key needed: {}", r.text());
    let s = h.get("/v1/sessions/seed-env").json();
    assert_eq!(s["egress"]["mode"], "allowlist", "{s}");
    assert_eq!(s["egress"]["rules"], json!(["198.51.100.7/32"]));
}

/// Kills the daemon on drop, even when an assertion failed.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        // SAFETY: signalling our own child by pid.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

#[test]
fn a_daemon_runs_from_a_config_file() {
    let dir = tempfile::Builder::new()
        .prefix("sbx-config-test")
        .tempdir()
        .unwrap();
    // Backend, agent and state dir come from the file alone (local-process:
    // this is about configuration, not VMs); --listen overrides the file.
    let f = write(
        dir.path(),
        "config.json",
        &json!({
            "listen": "127.0.0.1:1",
            "backend": "local-process",
            "agent_bin": common::agent_bin(),
            "state_dir": dir.path().join("state"),
            "mcp_http": false,
            "max_sessions": 1,
            "egress": {"mode": "none"},
        }),
    );
    let log = std::fs::File::create(dir.path().join("daemon.log")).unwrap();
    let mut child = bin()
        .arg("serve")
        .arg("--config")
        .arg(&f)
        .args(["--listen", "127.0.0.1:0"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(log)
        .spawn()
        .expect("spawn agent-sandbox serve");
    let stdout = child.stdout.take().unwrap();
    let _guard = Running(child);
    let (key, base) = common::daemon::read_banner_from(stdout);
    assert!(
        !base.is_empty() && !key.is_empty(),
        "daemon did not start: {}",
        std::fs::read_to_string(dir.path().join("daemon.log")).unwrap_or_default()
    );
    assert!(!base.ends_with(":1"), "--listen must override the file");
    assert!(dir.path().join("state/keys.json").exists());
    let h = common::daemon::Http::new(&base, Some(&key));
    // mcp_http: false -> /mcp is not served.
    let r = h.post(
        "/mcp",
        &json!({"jsonrpc": "2.0", "id": 1, "method": "ping"}),
    );
    assert_eq!(r.status, 404, "{}", r.text());
    // The file's default egress reaches a session that names none.
    let r = h.post("/v1/sessions", &json!({"id": "cfg-one"}));
    assert_eq!(r.status, 201, "{}", r.text());
    let s = h.get("/v1/sessions/cfg-one").json();
    assert_eq!(s["egress"]["mode"], "none", "{s}");
    // max_sessions: 1.
    let r = h.post("/v1/sessions", &json!({"id": "cfg-two"}));
    assert_eq!(r.status, 503, "{}", r.text());
}

/// `attr` of nixos-module/ci/eval.nix, as JSON (offline, stub nixpkgs).
fn nix_eval(eval: &Path, root: &Path, attr: &str) -> std::process::Output {
    Command::new("nix-instantiate")
        .args(["--readonly-mode", "--eval", "--strict", "--json", "-E"])
        .arg(format!(
            "(import {} {{ root = {}; }}).{attr}",
            eval.display(),
            root.display()
        ))
        .output()
        .expect("run nix-instantiate")
}

/// The configs the Nix code writes (NixOS module for a few option sets,
/// the `nix run` host), rendered by nixos-module/ci/eval.nix through
/// cli.nix with stub store paths, must pass `config check`: a key the
/// module writes and the daemon does not know fails here.
#[test]
fn nix_rendered_configs_are_accepted() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let eval = root.join("nixos-module/ci/eval.nix");
    let have_nix = Command::new("nix-instantiate")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !have_nix || !eval.exists() || !root.join("images/templates").is_dir() {
        skip!("nix-instantiate (Debian: nix-bin), nixos-module/ci/eval.nix or images/templates missing");
    }
    let out = nix_eval(&eval, root, "configs");
    assert!(
        out.status.success(),
        "nix-instantiate: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let configs: serde_json::Map<String, Value> =
        serde_json::from_slice(&out.stdout).expect("configs JSON");
    assert!(
        ["module-default", "module-keyed", "module-networked", "host"]
            .iter()
            .all(|k| configs.contains_key(*k)),
        "{:?}",
        configs.keys()
    );
    let dir = tempfile::tempdir().unwrap();
    for (name, rendered) in &configs {
        let f = write(dir.path(), &format!("{name}.json"), rendered);
        let (code, eff, err) = check(&f);
        assert_eq!(code, 0, "{name}: {err}\n{rendered:#}");
        // Every value Nix wrote is what the daemon will use.
        for (k, v) in rendered.as_object().unwrap() {
            if k == "egress" || k == "network" {
                // Filled with defaults; compare the keys Nix set.
                for (ik, iv) in v.as_object().into_iter().flatten() {
                    assert_eq!(&eff[k][ik], iv, "{name}: {k}.{ik}");
                }
                continue;
            }
            assert_eq!(&eff[k], v, "{name}: {k}");
        }
    }
    // Spot checks of what the module means.
    let m = &configs["module-default"];
    assert_eq!(m["snapshot_dir"], m["state_dir"]);
    assert!(m["kernel"].as_str().unwrap().ends_with("/vmlinux"));
    assert_eq!(configs["module-networked"]["network"]["uplink_if"], "eth1");
    assert_eq!(configs["host"]["snapshot_dir"], "/var/lib/agent-sandbox");
}

/// The router's HAProxy config as the NixOS module makes it
/// (`services.agent-sandbox.router`, through cli.nix's argv): the real
/// binary accepts that argv and HAProxy accepts what it prints.
#[test]
fn nix_rendered_router_config_is_accepted_by_haproxy() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let eval = root.join("nixos-module/ci/eval.nix");
    let have = |c: &str, a: &str| {
        Command::new(c)
            .arg(a)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !have("nix-instantiate", "--version") || !have("haproxy", "-v") {
        skip!("nix-instantiate (Debian: nix-bin) and haproxy are needed");
    }
    let out = nix_eval(&eval, root, "routerArgv");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let argv: Vec<String> = serde_json::from_slice(&out.stdout).expect("argv JSON");
    assert_eq!(argv[0], "@agent-sandbox@/bin/agent-sandbox");
    let cfg = bin().args(&argv[1..]).output().expect("router config");
    assert!(
        cfg.status.success(),
        "{}",
        String::from_utf8_lossy(&cfg.stderr)
    );
    let text = String::from_utf8_lossy(&cfg.stdout).to_string();
    for want in [
        "server h1 10.0.0.11:3000",
        "server h2 10.0.0.12:3001",
        "bind 127.0.0.1:3001",
        "bind 127.0.0.1:8404",
    ] {
        assert!(text.contains(want), "{want}:\n{text}");
    }
    // --shared-keys: key changes pass.
    assert!(!text.contains("path_beg /admin/keys"), "{text}");
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("router.cfg");
    std::fs::write(&f, &text).unwrap();
    let c = Command::new("haproxy")
        .arg("-c")
        .arg("-f")
        .arg(&f)
        .output()
        .unwrap();
    assert!(
        c.status.success(),
        "haproxy -c: {}{}",
        String::from_utf8_lossy(&c.stdout),
        String::from_utf8_lossy(&c.stderr)
    );
}

/// The admin commands the NixOS module and its test use: `keys --config F
/// create` writes the key file the config names; `mcp --url` takes its key
/// from the file AGENT_SANDBOX_KEY_FILE names.
#[test]
fn admin_commands_read_the_config() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("named-keys.json");
    let f = write(
        dir.path(),
        "c.json",
        &json!({"state_dir": dir.path().join("state"), "keys_file": keys}),
    );
    let out = bin()
        .args(["keys", "--config"])
        .arg(&f)
        .args(["create", "--name", "t", "--scopes", "exec"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let token = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(!token.is_empty() && !token.contains('\n'), "{token:?}");
    assert!(keys.exists(), "key file the config names was not written");
    let listed = bin()
        .args(["keys", "list", "--config"])
        .arg(&f)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&listed.stdout).contains("exec"));

    // An empty key file named by the variable is refused by name, before
    // any connection is tried.
    let empty = dir.path().join("empty-key");
    std::fs::write(&empty, "").unwrap();
    let out = bin()
        .args(["mcp", "--url", "http://127.0.0.1:9"])
        .env_remove("AGENT_SANDBOX_API_KEY")
        .env("AGENT_SANDBOX_KEY_FILE", &empty)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&empty.display().to_string()) && err.contains("empty"),
        "{err}"
    );
}
