//! A sandbox factory that makes nothing: fuzz inputs reach every layer
//! above the sandbox (parsing, routing, auth, validation, the session
//! registry, MCP tools) and never run a command on this host.

use agent_sandbox::config::Config;
use agent_sandbox::sandbox::{
    Result, Sandbox, SandboxError, SandboxFactory, SandboxSpec, TemplateInfo,
};
use std::path::PathBuf;
use std::time::Duration;

pub struct NoSandboxes;

impl SandboxFactory for NoSandboxes {
    fn backend(&self) -> &'static str {
        "fuzz"
    }

    fn create(&self, spec: &SandboxSpec) -> Result<Box<dyn Sandbox>> {
        Err(SandboxError::Failed {
            id: spec.id.clone(),
            what: "create",
            msg: "fuzzing: no sandboxes are made".into(),
        })
    }

    fn templates(&self) -> Vec<TemplateInfo> {
        vec![TemplateInfo {
            name: "default".into(),
            description: "fuzz".into(),
            vcpus: 1,
            mem_mib: 256,
            is_default: true,
            ..Default::default()
        }]
    }
}

/// A private state dir and a config with limits that let the fuzzer in
/// (no rate limiting) but keep work per input small.
pub fn config() -> Config {
    // `.ci/fuzz` points this at a directory it removes afterwards.
    let dir = std::env::var_os("ASBX_FUZZ_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(format!("/tmp/asbx-fuzz-{}", std::process::id())));
    let _ = std::fs::create_dir_all(&dir);
    Config {
        listen: "127.0.0.1:0".parse().expect("loopback address"),
        key_file: dir.join("keys.json"),
        state_dir: dir,
        max_connections: 64,
        max_connections_per_ip: 64,
        max_sessions: 8,
        rate_per_sec: 1e9,
        rate_burst: 1e9,
        default_exec_timeout: Duration::from_secs(2),
        create_timeout: Duration::from_secs(2),
        write_timeout: Duration::from_secs(2),
        ..Config::default()
    }
}
