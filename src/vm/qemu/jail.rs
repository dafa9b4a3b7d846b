//! The jail of each QEMU: the host paths it may see (its binary, libraries,
//! modules, firmware, harmless devices) plus its VM's own files.

use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use super::{io_err, lock, Accel, QemuBackend, JAIL_ROOT};
use crate::vm::launch::{Bind, Jail};
use crate::vm::{Result, VmConfig, VmError};

impl QemuBackend {
    /// The host paths every jailed QEMU needs: its binary, its dynamic
    /// loader and the libraries it links (the loader's own trace, as `ldd`
    /// prints it), its modules (TCG is one in Debian's build), its
    /// firmware directories (`-L help`), the loader cache and
    /// the harmless devices. Found once, by running the binary.
    pub(super) fn jail_base(&self) -> Result<Arc<Vec<Bind>>> {
        let mut slot = lock(&self.jail_base);
        if let Some(b) = slot.as_ref() {
            return Ok(b.clone());
        }
        let bin = self.binary();
        let deadline = Instant::now() + self.cfg.timeouts.qmp;
        let trace = self.cfg.launcher.run_env(
            &[bin.clone().into_os_string()],
            &[("LD_TRACE_LOADED_OBJECTS".into(), "1".into())],
            deadline,
        )?;
        let trace_text = String::from_utf8_lossy(&trace.stdout);
        if trace.code != Some(0) {
            return Err(VmError::Other(format!(
                "qemu jail: the library trace of {} failed (exit code {:?}): {}",
                bin.display(),
                trace.code,
                String::from_utf8_lossy(&trace.stderr).trim()
            )));
        }
        let mut paths = vec![bin.clone()];
        paths.extend(
            parse_ld_trace(&trace_text)
                .map_err(|e| VmError::Other(format!("qemu jail: {} links {e}", bin.display())))?,
        );
        let help = self.cfg.launcher.run(
            &[bin.clone().into_os_string(), "-L".into(), "help".into()],
            deadline,
        )?;
        let firmware = String::from_utf8_lossy(&help.stdout).into_owned();
        paths.extend(
            firmware
                .lines()
                .filter_map(|l| fs::canonicalize(l.trim()).ok())
                .filter(|p| p.is_dir()),
        );
        let canon = fs::canonicalize(&bin).unwrap_or_else(|_| bin.clone());
        if let Some(prefix) = canon.parent().and_then(Path::parent) {
            let triplet = format!("{}-linux-gnu", std::env::consts::ARCH);
            for d in [
                prefix.join("lib").join(triplet).join("qemu"),
                prefix.join("lib/qemu"),
                prefix.join("lib64/qemu"),
            ] {
                // Only the modules (the same dir names may hold helper
                // programs, some setuid root, that QEMU must not see).
                let Ok(rd) = fs::read_dir(&d) else { continue };
                paths.extend(
                    rd.flatten()
                        .map(|e| e.path())
                        .filter(|p| p.extension().is_some_and(|x| x == "so") && p.is_file()),
                );
            }
        }
        paths.push(PathBuf::from("/etc/ld.so.cache"));
        paths.extend(JAIL_DEVICES.iter().map(PathBuf::from));
        let binds: Vec<Bind> = paths
            .into_iter()
            .filter(|p| p.exists())
            .map(|p| Bind {
                path: p.display().to_string(),
                writable: false,
            })
            .collect();
        let binds = Arc::new(binds);
        log::info!(
            "qemu: VMMs run jailed (own mount, pid, network and IPC namespaces); their root holds {} host paths besides each VM's files",
            binds.len()
        );
        *slot = Some(binds.clone());
        Ok(binds)
    }

    /// The jail of one QEMU: [`Self::jail_base`] plus the VM's kernel (a
    /// boot only), root file system and run dir (the one writable path),
    /// and /dev/kvm under KVM. `None` when the launcher cannot jail.
    pub(super) fn jail_for(
        &self,
        cfg: &VmConfig,
        accel: Accel,
        incoming: bool,
    ) -> Result<Option<Jail>> {
        if !self.cfg.launcher.can_jail() {
            self.unjailed_said.call_once(|| {
                log::info!(
                    "qemu: VMMs run in the host's mount, pid and network namespaces: the {} launcher cannot jail them (only the spawner of a daemon running as root can)",
                    self.cfg.launcher.kind()
                )
            });
            return Ok(None);
        }
        let mut binds: Vec<Bind> = self.jail_base()?.as_ref().clone();
        let ro = |p: &Path| Bind {
            path: p.display().to_string(),
            writable: false,
        };
        if !incoming {
            binds.push(ro(&cfg.kernel));
        }
        binds.push(ro(&cfg.rootfs));
        if accel == Accel::Kvm {
            binds.push(ro(Path::new("/dev/kvm")));
        }
        binds.push(Bind {
            path: cfg.run_dir.display().to_string(),
            writable: true,
        });
        let root = cfg.run_dir.join(JAIL_ROOT);
        fs::DirBuilder::new()
            .mode(0o755)
            .create(&root)
            .map_err(|e| io_err(format!("create jail mount point {}", root.display()), e))?;
        Ok(Some(Jail {
            root: root.display().to_string(),
            binds: without_overlaps(binds),
            proc: true,
        }))
    }
}

/// Devices every jailed QEMU gets (glib and QEMU read random bytes).
pub(super) const JAIL_DEVICES: &[&str] = &["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"];

/// The paths in the dynamic loader's trace (`LD_TRACE_LOADED_OBJECTS=1`):
/// `name => /path (addr)` and the loader's own `/path (addr)`; the vDSO
/// has no path. A library not found is an error.
pub(super) fn parse_ld_trace(text: &str) -> std::result::Result<Vec<PathBuf>, String> {
    let mut out = Vec::new();
    for l in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let target = match l.split_once("=>") {
            Some((name, rest)) => {
                let rest = rest.trim();
                if rest.starts_with("not found") {
                    return Err(format!("{} which is not found", name.trim()));
                }
                rest
            }
            None => l,
        };
        if let Some(p) = target
            .split_whitespace()
            .next()
            .filter(|p| p.starts_with('/'))
        {
            out.push(PathBuf::from(p));
        }
    }
    if out.is_empty() {
        return Err(format!("no library (loader trace: {text:?})"));
    }
    Ok(out)
}

/// `binds` without duplicates and without paths inside another bind
/// (visible through it already; the spawner refuses nested binds).
pub(super) fn without_overlaps(mut binds: Vec<Bind>) -> Vec<Bind> {
    binds.sort_by(|a, b| a.path.cmp(&b.path));
    let mut out: Vec<Bind> = Vec::with_capacity(binds.len());
    for b in binds {
        if !out.iter().any(|o| Path::new(&b.path).starts_with(&o.path)) {
            out.push(b);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loader_trace_gives_library_paths_and_refuses_missing_ones() {
        let trace = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                     \tlibz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x00007f11)\n\
                     \t/lib64/ld-linux-x86-64.so.2 (0x00007f12)\n";
        assert_eq!(
            parse_ld_trace(trace).unwrap(),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libz.so.1"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2")
            ]
        );
        let e = parse_ld_trace("\tlibgone.so.3 => not found\n").unwrap_err();
        assert!(e.contains("libgone.so.3"), "{e}");
        assert!(parse_ld_trace("\tstatically linked\n").is_err());
    }

    #[test]
    fn jail_binds_lose_duplicates_and_nested_paths() {
        let b = |p: &str, w: bool| Bind {
            path: p.into(),
            writable: w,
        };
        let got = without_overlaps(vec![
            b("/usr/share/qemu/keymaps", false),
            b("/usr/share/qemu", false),
            b("/usr/share/qemu-extra", false),
            b("/run/vm", true),
            b("/run/vm", true),
        ]);
        assert_eq!(
            got,
            [
                b("/run/vm", true),
                b("/usr/share/qemu", false),
                b("/usr/share/qemu-extra", false)
            ]
        );
    }
}
