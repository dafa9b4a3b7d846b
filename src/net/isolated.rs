//! A namespace holding nothing but a TAP: the network device of a VM that
//! must not talk to anything. Snapshots are made with it (a restored VM has
//! exactly the devices of the saved one, so every snapshot has a NIC), and
//! sessions use it when the host runs without per-session networking.

use std::path::PathBuf;

use super::{netns, tap, NetConfig, Result};

/// Removed (with its TAP) on drop.
#[derive(Debug)]
pub struct Isolated {
    name: String,
    tap: String,
}

impl Isolated {
    /// `{prefix}-i{pid}-{random}` (a session's) with `cfg.tap_name` owned
    /// by the configured TAP uid/gid, loopback down: a dead end for any
    /// frame. The creator's pid in the name lets [`Isolated::sweep`] tell a
    /// dead process's leftovers from a live one's.
    pub fn create(cfg: &NetConfig) -> Result<Isolated> {
        Self::create_kind(cfg, 'i', (cfg.tap_uid, cfg.tap_gid))
    }

    /// [`Isolated::create`] with the TAP owned by the VM's own `uid:gid`.
    pub fn create_for(cfg: &NetConfig, owner: (u32, u32)) -> Result<Isolated> {
        Self::create_kind(cfg, 'i', (Some(owner.0), Some(owner.1)))
    }

    /// The same for snapshot builds: `{prefix}-s{pid}-{random}`, one per
    /// daemon for its lifetime.
    pub fn create_for_snapshots(cfg: &NetConfig) -> Result<Isolated> {
        Self::create_kind(cfg, 's', (cfg.tap_uid, cfg.tap_gid))
    }

    fn create_kind(
        cfg: &NetConfig,
        kind: char,
        (uid, gid): (Option<u32>, Option<u32>),
    ) -> Result<Isolated> {
        cfg.validate()?;
        let mut last = None;
        for _ in 0..8 {
            let name = format!(
                "{}-{kind}{}-{}",
                cfg.prefix,
                std::process::id(),
                super::random_id()?
            );
            match netns::create(&name, || tap::create_persistent(&cfg.tap_name, uid, gid)) {
                Ok(_) => {
                    return Ok(Isolated {
                        name,
                        tap: cfg.tap_name.clone(),
                    })
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| super::NetError::invalid("no free namespace name")))
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn path(&self) -> PathBuf {
        netns::path_of(&self.name)
    }
    pub fn tap(&self) -> &str {
        &self.tap
    }
}

impl Isolated {
    /// Remove isolated namespaces of `prefix` whose creating process is
    /// gone (several daemons or in-process MCP servers may share a prefix
    /// when networking is off). Returns the names removed.
    pub fn sweep(prefix: &str) -> Result<Vec<String>> {
        let mut gone = Vec::new();
        let head = format!("{prefix}-");
        for name in netns::list(&head)? {
            let rest = &name[head.len()..];
            let Some(tagged) = rest.strip_prefix('i').or_else(|| rest.strip_prefix('s')) else {
                continue; // a session namespace of a networked daemon
            };
            let pid = tagged.split('-').next().and_then(|p| p.parse::<u32>().ok());
            let alive = pid.is_some_and(|p| std::path::Path::new(&format!("/proc/{p}")).exists());
            if !alive {
                netns::delete(&name)?;
                gone.push(name);
            }
        }
        Ok(gone)
    }
}

impl Drop for Isolated {
    fn drop(&mut self) {
        if let Err(e) = netns::delete(&self.name) {
            log::warn!("remove isolated namespace {}: {e}", self.name);
        }
    }
}
