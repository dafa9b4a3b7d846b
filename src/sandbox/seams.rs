//! The seams the VM factory ([`super::vm::VmSandboxFactory`]) is built
//! on: the template/snapshot registry and per-session networking, as small
//! traits `wiring` implements over `vm::templates` and `net`. Here, below
//! both the factory and its standby VMMs, which use them alike.

use super::{Result, SandboxError, TemplateInfo};
use crate::net::EgressPolicy;
use crate::vm::NetAttachment;
use std::path::PathBuf;

/// What a template resolves to for one boot.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedTemplate {
    pub kernel: PathBuf,
    pub rootfs: PathBuf,
    /// A snapshot made on this host for this template, if any: restored
    /// instead of cold-booting.
    pub snapshot_dir: Option<PathBuf>,
    pub cmdline_extra: String,
    /// The VM shape to boot with: a snapshot fixes it.
    pub vcpus: u32,
    pub mem_mib: u32,
}

/// The template/snapshot registry (implemented over `vm::templates`).
pub trait TemplateSource: Send + Sync {
    fn list(&self) -> Vec<TemplateInfo>;
    fn resolve(&self, name: &str, vcpus: u32, mem_mib: u32) -> Result<ResolvedTemplate>;
    /// Release what snapshot builds hold (at shutdown).
    fn close(&self) {}
    /// Makes `name`'s snapshot now (a template just built).
    fn ensure_snapshot(&self, name: &str) -> Result<()> {
        self.resolve(name, 0, 0).map(drop)
    }
    /// Whether `name` is one of the daemon's own templates (built or not).
    fn is_builtin(&self, name: &str) -> bool {
        let _ = name;
        false
    }
    /// [`crate::sandbox::SandboxFactory::delete_template`].
    fn delete(&self, name: &str) -> Result<bool> {
        let _ = name;
        Err(crate::sandbox::SandboxError::Unsupported(
            "no templates built from images here".into(),
        ))
    }
}

/// Per-session networking (implemented over `crate::net`).
pub trait NetProvider: Send + Sync {
    /// Namespace + links + firewall for sandbox `id`, fail-closed: returns
    /// only once the rules are installed and verified. The TAP belongs to
    /// `owner` (the VM's uid/gid).
    fn setup(
        &self,
        id: &str,
        egress: &EgressPolicy,
        owner: (u32, u32),
    ) -> Result<Box<dyn NetLease>>;
    fn sweep_orphans(&self) -> Result<usize> {
        Ok(0)
    }
    /// The MAC every session's guest gets (part of what a snapshot fixes).
    fn guest_mac(&self) -> Option<String> {
        None
    }
    /// After the last session: remove host-wide state (tables, routes).
    fn close(&self) -> Result<()> {
        Ok(())
    }
}

pub trait NetLease: Send {
    fn attachment(&self) -> NetAttachment;
    /// Live policy change (`PUT /v1/sessions/:id/network`).
    fn set_egress(&mut self, policy: &EgressPolicy) -> Result<()>;
    fn teardown(&mut self) -> Result<()>;
    /// What the session's inspection proxy did (while one runs).
    fn proxy_stats(&self) -> Option<crate::net::ProxyStats> {
        None
    }
    /// Dials the guest's ports (`net::connect`), where the network can.
    fn guest_connector(&mut self) -> Option<crate::net::GuestConnector> {
        None
    }
    /// The session the proxy records egress decisions for.
    fn set_audit(&self, tag: Option<crate::audit::Tag>) {
        let _ = tag;
    }
    /// Secrets for the session's proxy to inject (`net::inject`).
    fn set_injection(
        &mut self,
        inj: Option<std::sync::Arc<crate::net::inject::Injection>>,
    ) -> Result<()> {
        if inj.is_none() {
            return Ok(());
        }
        Err(SandboxError::Unsupported(
            "injected secrets need per-session networking (serve --network on)".into(),
        ))
    }
}
