//! Model Context Protocol server: the same tools over two transports.
//!
//! - [`stdio`]: `agent-sandbox mcp`, newline-delimited JSON-RPC on
//!   stdin/stdout, either with the whole host in-process or forwarding to
//!   a running daemon ([`forward`]).
//! - [`http`]: Streamable HTTP at `/mcp` on the daemon.
//!
//! [`server::Engine`] is transport-agnostic: protocol versions, the
//! initialize / `server/discover` handshakes, cancellation and progress.
//! [`tools`] holds the tool definitions and runs them as operations
//! ([`crate::ops`]), exactly like the REST API does.

pub mod forward;
pub mod http;
pub mod jsonrpc;
pub mod server;
pub mod stdio;
pub mod tools;

use crate::ops::Ops;
use std::sync::Arc;

pub const V2025_06_18: &str = "2025-06-18";
pub const V2025_11_25: &str = "2025-11-25";
pub const V2026_07_28: &str = "2026-07-28";
/// Versions reached through the `initialize` handshake, oldest first.
pub const HANDSHAKE_VERSIONS: &[&str] = &[V2025_06_18, V2025_11_25];
/// Stateless versions: every request carries its version in `_meta`.
pub const MODERN_VERSIONS: &[&str] = &[V2026_07_28];
pub const ALL_VERSIONS: &[&str] = &[V2025_06_18, V2025_11_25, V2026_07_28];
pub const LATEST_HANDSHAKE: &str = V2025_11_25;

/// `_meta` keys of the 2026-07-28 request envelope.
pub const META_VERSION: &str = "io.modelcontextprotocol/protocolVersion";
pub const META_SERVER_INFO: &str = "io.modelcontextprotocol/serverInfo";

/// Largest JSON-RPC message accepted on either transport.
pub const MAX_MESSAGE: usize = 4 << 20;
/// Tool calls running at once per engine; more are refused, not queued.
pub const MAX_INFLIGHT: usize = 64;

/// What the tools run against: the daemon's operations.
#[derive(Clone)]
pub struct Host {
    pub ops: Arc<Ops>,
}

impl Host {
    pub fn new(ops: Arc<Ops>) -> Host {
        Host { ops }
    }
}

pub fn is_modern(v: &str) -> bool {
    MODERN_VERSIONS.contains(&v)
}
