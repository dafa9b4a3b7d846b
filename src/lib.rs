//! agent-sandbox: a host daemon that gives every AI-agent session its own
//! disposable microVM.

pub use sandbox_agent::proto;
/// The one poison-tolerant `lock()`, shared with the agent crate.
pub use sandbox_agent::sync;

pub mod admin;
pub mod agent;
pub mod api;
pub mod audit;
pub mod budget;
pub mod config;
pub mod harden;
pub mod mcp;
pub mod metrics;
pub mod net;
pub mod ops;
pub mod router;
pub mod sandbox;
pub mod server;
pub mod session;
pub mod vm;

/// The daemon's HTTP server: the REST API and, when config `mcp_http` is
/// on, MCP at `/mcp` (the composition root wires the front ends, which do
/// not know each other, to the server below both).
pub fn start_daemon(
    cfg: config::Config,
    factory: std::sync::Arc<dyn sandbox::SandboxFactory>,
) -> Result<api::Server, String> {
    api::Server::start_with(cfg, factory, Some(mcp::http::endpoint))
}
