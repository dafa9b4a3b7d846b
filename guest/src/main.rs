//! `sandbox-agent`: the guest agent binary. As PID 1 it sets the VM up and
//! listens on vsock / virtio-serial; as an ordinary process (tests) it
//! listens where `--listen` says.

use sandbox_agent::agent::{self, Config, Listen};
use std::path::PathBuf;

/// Template description the image build leaves in every root filesystem.
const TEMPLATE_FILE: &str = "/etc/agent-sandbox/template.json";

const USAGE: &str = "usage: sandbox-agent [--listen unix:PATH|vsock:PORT|serial:NAME]... \
[--workspace DIR] [--env KEY=VALUE]...";

struct Logger;
impl log::Log for Logger {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::max_level()
    }
    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) {
            eprintln!("sandbox-agent[{}]: {}", r.level(), r.args());
        }
    }
    fn flush(&self) {}
}

fn main() {
    // Before any thread exists, so every thread inherits the mask.
    agent::block_signals();
    agent::tune_allocator();
    let _ = log::set_logger(&Logger);
    let level = std::env::var("SANDBOX_AGENT_LOG")
        .ok()
        .and_then(|l| l.parse().ok())
        .unwrap_or(log::LevelFilter::Info);
    log::set_max_level(level);
    let pid1 = std::process::id() == 1;
    let mut listen = Vec::new();
    let mut workspace = None;
    let mut env: Vec<(String, String)> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = |name: &str| {
            args.next().unwrap_or_else(|| {
                eprintln!("{name} needs a value\n{USAGE}");
                std::process::exit(2)
            })
        };
        match a.as_str() {
            "--listen" => match val("--listen").parse::<Listen>() {
                Ok(l) => listen.push(l),
                Err(e) => {
                    eprintln!("{e}\n{USAGE}");
                    std::process::exit(2)
                }
            },
            "--workspace" => workspace = Some(PathBuf::from(val("--workspace"))),
            "--env" => {
                let kv = val("--env");
                match kv.split_once('=') {
                    Some((k, v)) => env.push((k.into(), v.into())),
                    None => {
                        eprintln!("--env wants KEY=VALUE\n{USAGE}");
                        std::process::exit(2)
                    }
                }
            }
            "--version" => {
                println!("sandbox-agent {}", env!("CARGO_PKG_VERSION"));
                return;
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return;
            }
            // The kernel passes unknown command-line words to init.
            other if pid1 => log::debug!("ignoring argument {other:?}"),
            other => {
                eprintln!("unknown argument {other:?}\n{USAGE}");
                std::process::exit(2)
            }
        }
    }
    let mut base_env: Vec<(String, String)> = if pid1 {
        let cmd = agent::init::setup();
        if let Some(l) = cmd.get("listen").and_then(|l| l.parse().ok()) {
            listen.push(l);
        }
        if workspace.is_none() {
            workspace = cmd.get("workspace").map(PathBuf::from);
        }
        vec![
            ("PATH".into(), agent::DEFAULT_PATH.into()),
            ("HOME".into(), "/root".into()),
            ("LANG".into(), "C.UTF-8".into()),
            ("USER".into(), "root".into()),
            ("SHELL".into(), "/bin/bash".into()),
        ]
    } else {
        std::env::vars().collect()
    };
    // The template's environment, baked into the image by images/build-rootfs.sh
    // (or by `template build`, with an image's `WorkingDir` and `User`).
    let mut default_user = None;
    if let Ok(text) = std::fs::read(TEMPLATE_FILE) {
        match serde_json::from_slice::<serde_json::Value>(&text) {
            Ok(v) => {
                if workspace.is_none() {
                    workspace = v.get("workdir").and_then(|w| w.as_str()).map(PathBuf::from);
                }
                let id = |k: &str| {
                    v.get(k)
                        .and_then(|n| n.as_u64())
                        .and_then(|n| u32::try_from(n).ok())
                };
                if let (Some(u), g) = (id("uid"), id("gid")) {
                    default_user = Some((u, g.unwrap_or(u)));
                }
                if let Some(obj) = v.get("env").and_then(|e| e.as_object()) {
                    for (k, v) in obj {
                        if let Some(v) = v.as_str() {
                            base_env.retain(|(ek, _)| ek != k);
                            base_env.push((k.clone(), v.to_string()));
                        }
                    }
                }
            }
            Err(e) => log::warn!("{TEMPLATE_FILE}: {e}"),
        }
    }
    for (k, v) in env {
        base_env.retain(|(ek, _)| *ek != k);
        base_env.push((k, v));
    }
    // Exactly one host transport: the virtio-serial port where the VMM
    // gives one (QEMU), else vsock (Firecracker). /dev/vsock exists in
    // every guest, so a vsock listener beside the serial port would be a
    // second door that only guest processes can reach.
    if listen.is_empty() && pid1 {
        if agent::find_serial_port(sandbox_agent::proto::SERIAL_PORT_NAME).is_some() {
            listen.push(Listen::Serial(
                sandbox_agent::proto::SERIAL_PORT_NAME.into(),
            ));
        } else if std::path::Path::new("/dev/vsock").exists() {
            listen.push(Listen::Vsock(sandbox_agent::proto::DEFAULT_VSOCK_PORT));
        }
    }
    if listen.is_empty() {
        eprintln!("nothing to listen on\n{USAGE}");
        if !pid1 {
            std::process::exit(2);
        }
    }
    let cfg = Config {
        listen,
        workspace: workspace.unwrap_or_else(|| PathBuf::from("/workspace")),
        pid1,
        env: base_env,
        default_user,
    };
    if let Err(e) = agent::run(cfg) {
        eprintln!("sandbox-agent: {e}");
        if pid1 {
            // Init must not exit (kernel panic); keep the console readable.
            loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
        }
        std::process::exit(1);
    }
}
