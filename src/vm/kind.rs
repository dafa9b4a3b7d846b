//! The sandbox backends `serve --backend` and `mcp --backend` know: the one
//! list, parsed once at the edge (config, CLI) and matched as an enum.

use std::fmt;
use std::str::FromStr;

/// Where sessions run: a VMM (QEMU, Firecracker) or, for development and
/// tests only, the agent as a plain host process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    Qemu,
    Firecracker,
    LocalProcess,
}

impl BackendKind {
    /// Every kind, in the order messages list them (the default first).
    pub const ALL: [BackendKind; 3] = [
        BackendKind::Qemu,
        BackendKind::Firecracker,
        BackendKind::LocalProcess,
    ];

    /// The name in config files, flags, logs and metric labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            BackendKind::Qemu => "qemu",
            BackendKind::Firecracker => "firecracker",
            BackendKind::LocalProcess => "local-process",
        }
    }

    /// `qemu, firecracker, local-process`: the choices, for messages.
    pub fn names() -> String {
        Self::ALL.map(Self::as_str).join(", ")
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is none of [`BackendKind::ALL`]; callers word the message
/// (it names the config key or the flag).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownBackend(pub String);

impl fmt::Display for UnknownBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown backend {:?} (one of {})",
            self.0,
            BackendKind::names()
        )
    }
}

impl std::error::Error for UnknownBackend {}

impl FromStr for BackendKind {
    type Err = UnknownBackend;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| UnknownBackend(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for k in BackendKind::ALL {
            assert_eq!(k.as_str().parse::<BackendKind>(), Ok(k));
        }
        assert_eq!(BackendKind::names(), "qemu, firecracker, local-process");
        let e = "vmware".parse::<BackendKind>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown backend \"vmware\" (one of qemu, firecracker, local-process)"
        );
        // Names are exact: no case folding, no trimming.
        assert!("QEMU".parse::<BackendKind>().is_err());
        assert!(" qemu".parse::<BackendKind>().is_err());
    }
}
