//! agent-sandbox: a host daemon that gives every AI-agent session its own
//! disposable microVM.

pub use sandbox_agent::proto;

pub mod agent;
pub mod harden;
pub mod net;
pub mod vm;
