//! MCP message handling: each line of the input is one JSON-RPC message
//! for the protocol engine (initialize, discover, tools/list, tools/call
//! with arbitrary arguments, notifications, batches of junk), on one fresh
//! connection per input, over a factory that makes no sandboxes. Every
//! answer must serialize; nothing may panic.

#![no_main]

#[path = "fake.rs"]
mod fake;

use agent_sandbox::metrics::Metrics;
use agent_sandbox::mcp::jsonrpc;
use agent_sandbox::mcp::server::{Conn, Engine, Sink};
use agent_sandbox::mcp::Host;
use agent_sandbox::ops::{Ops, Principal, Scope};
use agent_sandbox::session::Manager;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

struct Discard;

impl Sink for Discard {
    fn send(&self, msg: &Value) -> bool {
        serde_json::to_vec(msg).is_ok()
    }
}

fn engine() -> &'static Arc<Engine> {
    static E: OnceLock<Arc<Engine>> = OnceLock::new();
    E.get_or_init(|| {
        let cfg = Arc::new(fake::config());
        let mgr = Manager::new(
            cfg.clone(),
            Arc::new(fake::NoSandboxes),
            Arc::new(Metrics::new()),
        );
        Engine::new(Host::new(Ops::new(mgr, cfg)))
    })
}

fuzz_target!(|data: &[u8]| {
    if data.len() > 64 * 1024 {
        return;
    }
    static N: AtomicU64 = AtomicU64::new(0);
    let e = engine();
    let conn = Conn::new(
        format!("fuzz-{}", N.fetch_add(1, Ordering::Relaxed)),
        Principal {
            id: "fuzz".into(),
            scopes: vec![Scope::Exec],
        },
    );
    for line in data.split(|b| *b == b'\n') {
        let reply = match jsonrpc::parse(line) {
            Ok(msg) => e.handle(&conn, msg, &Discard),
            Err((id, err)) => Some(jsonrpc::error(id.as_ref(), &err)),
        };
        if let Some(r) = reply {
            serde_json::to_vec(&r).expect("an answer that serializes");
        }
    }
    e.close(&conn, true, true);
});
