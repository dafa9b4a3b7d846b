//! The sandbox guest agent and its wire protocol.
//!
//! `proto` is shared with the host daemon, so the protocol has exactly one
//! definition. The agent itself (PID 1 inside every sandbox VM) lives in
//! `agent` and is started by the `sandbox-agent` binary. `sync` holds the
//! poison-tolerant `lock` both crates use.

#[cfg(target_os = "linux")]
pub mod agent;
pub mod proto;
pub mod sync;
