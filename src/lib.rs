//! agent-sandbox: a host daemon that gives every AI-agent session its own
//! disposable microVM.

pub use sandbox_agent::proto;
/// The one poison-tolerant `lock()`, shared with the agent crate.
pub use sandbox_agent::sync;

pub mod admin;
pub mod agent;
pub mod api;
pub mod budget;
pub mod config;
pub mod harden;
pub mod mcp;
pub mod metrics;
pub mod net;
pub mod ops;
pub mod sandbox;
pub mod session;
pub mod vm;
