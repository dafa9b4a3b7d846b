//! Bounds on what one session may be, and on what one API key may hold.
//!
//! - Shape: a session's vCPUs, memory and disk are within [`VCPUS`],
//!   [`MEM_MIB`], [`DISK_MIB`], at most the configured maxima (`max_vcpus`,
//!   `max_mem_mib`, `max_disk_mib`) and, for vCPUs and memory, what this
//!   host has: its online CPUs and [`HOST_MEM_PERCENT`] of its RAM. Beyond:
//!   400 `invalid_shape`, naming the field and the maximum.
//! - Quota: one key holds at most `max_sessions_per_key` live sessions with
//!   `max_vcpus_per_key` vCPUs and `max_mem_mib_per_key` MiB between them.
//!   Beyond: 429 `quota_exceeded`, naming the quota. The registry checks
//!   and inserts under one lock, so two creates never both take the last
//!   slot.

use super::SessionError;
use crate::config::Config;
use std::ops::RangeInclusive;

pub use crate::vm::shape::{DISK_MIB, MEM_MIB, VCPUS};

/// Share of the host's `MemTotal` one session's guest RAM may take: the
/// rest stays for the host, the daemon, VMM overhead and other sessions.
pub const HOST_MEM_PERCENT: u64 = 50;

/// One shape field's largest value and where that bound comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bound {
    pub max: u32,
    pub why: String,
}

impl Bound {
    /// The configured maximum, lowered to the host's capacity if less.
    fn of(key: &str, configured: u32, host: Option<(u32, String)>) -> Bound {
        match host {
            Some((h, why)) if h < configured => Bound { max: h, why },
            _ => Bound {
                max: configured,
                why: format!("config {key}"),
            },
        }
    }
}

/// What this host has, as sessions' shapes are bounded by it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Host {
    pub online_cpus: Option<u32>,
    pub mem_total_mib: Option<u64>,
}

impl Host {
    /// Online CPUs and `MemTotal` of this machine (`None` where unknown).
    pub fn probe() -> Host {
        // SAFETY: sysconf has no preconditions.
        let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        let mem_total_mib = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|t| mem_total_kib(&t))
            .map(|kib| kib / 1024);
        Host {
            online_cpus: u32::try_from(cpus).ok().filter(|&n| n > 0),
            mem_total_mib,
        }
    }
}

/// `MemTotal` in KiB from `/proc/meminfo` text.
fn mem_total_kib(meminfo: &str) -> Option<u64> {
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A session's size as its key's quota counts it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Charge {
    pub vcpus: u32,
    pub mem_mib: u32,
}

/// What one key may hold at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub sessions: usize,
    pub vcpus: u32,
    pub mem_mib: u32,
}

/// The effective bounds of a running daemon.
#[derive(Debug, Clone)]
pub struct Limits {
    pub vcpus: Bound,
    pub mem_mib: Bound,
    pub disk_mib: Bound,
    pub quota: Quota,
}

impl Limits {
    pub fn new(cfg: &Config, host: Host) -> Limits {
        let cpus = host
            .online_cpus
            .map(|n| (n, format!("this host's {n} online CPUs")));
        let mem = host.mem_total_mib.map(|t| {
            let m = u32::try_from(t * HOST_MEM_PERCENT / 100).unwrap_or(u32::MAX);
            (
                m,
                format!("{HOST_MEM_PERCENT}% of this host's {t} MiB of RAM"),
            )
        });
        Limits {
            vcpus: Bound::of("max_vcpus", cfg.max_vcpus, cpus),
            mem_mib: Bound::of("max_mem_mib", cfg.max_mem_mib, mem),
            disk_mib: Bound::of("max_disk_mib", cfg.max_disk_mib, None),
            quota: Quota {
                sessions: cfg.max_sessions_per_key,
                vcpus: cfg.max_vcpus_per_key,
                mem_mib: cfg.max_mem_mib_per_key,
            },
        }
    }

    /// A session shape within every bound, or 400 `invalid_shape` naming
    /// the (API) field and its limit.
    pub fn check_shape(&self, vcpus: u32, mem_mib: u32, disk_mib: u32) -> Result<(), SessionError> {
        for (field, v, range, bound) in [
            ("vcpus", vcpus, &VCPUS, &self.vcpus),
            ("memoryMib", mem_mib, &MEM_MIB, &self.mem_mib),
            ("diskMib", disk_mib, &DISK_MIB, &self.disk_mib),
        ] {
            if v < *range.start() {
                return Err(invalid_shape(format!(
                    "{field} {v} is below the minimum of {}",
                    range.start()
                )));
            }
            if v > bound.max {
                return Err(invalid_shape(format!(
                    "{field} {v} exceeds the maximum of {} ({})",
                    bound.max, bound.why
                )));
            }
        }
        Ok(())
    }

    /// Whether a key holding `held` (its live sessions' charges) may add a
    /// session charged `new`; 429 `quota_exceeded` naming the quota if not.
    pub fn check_quota(&self, key: &str, held: &[Charge], new: Charge) -> Result<(), SessionError> {
        let q = &self.quota;
        if held.len() >= q.sessions {
            return Err(quota_exceeded(format!(
                "key {key} holds {} sessions, its quota max_sessions_per_key is {}; \
                 delete one first",
                held.len(),
                q.sessions
            )));
        }
        let vcpus: u64 = held.iter().map(|c| u64::from(c.vcpus)).sum();
        if vcpus + u64::from(new.vcpus) > u64::from(q.vcpus) {
            return Err(quota_exceeded(format!(
                "key {key} holds {vcpus} vCPUs and asks for {} more, its quota \
                 max_vcpus_per_key is {}",
                new.vcpus, q.vcpus
            )));
        }
        let mem: u64 = held.iter().map(|c| u64::from(c.mem_mib)).sum();
        if mem + u64::from(new.mem_mib) > u64::from(q.mem_mib) {
            return Err(quota_exceeded(format!(
                "key {key} holds {mem} MiB of session memory and asks for {} more, \
                 its quota max_mem_mib_per_key is {}",
                new.mem_mib, q.mem_mib
            )));
        }
        Ok(())
    }
}

/// A shape field outside [`VCPUS`] / [`MEM_MIB`] / [`DISK_MIB`] (before
/// it reaches the registry, e.g. too large for a `u32`).
pub fn check_range(field: &str, v: u64, range: &RangeInclusive<u32>) -> Result<u32, SessionError> {
    match u32::try_from(v) {
        Ok(v) if range.contains(&v) => Ok(v),
        _ => Err(invalid_shape(format!(
            "{field} {v} is outside {}..={}",
            range.start(),
            range.end()
        ))),
    }
}

fn invalid_shape(msg: String) -> SessionError {
    SessionError::InvalidShape(msg)
}

fn quota_exceeded(msg: String) -> SessionError {
    SessionError::QuotaExceeded(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(host: Host) -> Limits {
        let cfg = Config {
            max_vcpus: 8,
            max_mem_mib: 8192,
            max_disk_mib: 4096,
            max_sessions_per_key: 2,
            max_vcpus_per_key: 3,
            max_mem_mib_per_key: 1024,
            ..Config::default()
        };
        Limits::new(&cfg, host)
    }

    #[test]
    fn shape_is_bounded_by_config_and_host() {
        let l = limits(Host {
            online_cpus: Some(2),
            mem_total_mib: Some(4096),
        });
        assert!(l.check_shape(2, 2048, 4096).is_ok());
        let e = l.check_shape(3, 256, 1024).unwrap_err();
        assert_eq!(e.code(), "invalid_shape");
        assert!(e.to_string().contains("vcpus 3") && e.to_string().contains("maximum of 2"));
        assert!(e.to_string().contains("online CPUs"), "{}", e.to_string());
        let e = l.check_shape(1, 2049, 1024).unwrap_err();
        assert!(e.to_string().contains("memoryMib") && e.to_string().contains("2048"));
        let e = l.check_shape(1, 256, 4097).unwrap_err();
        assert!(e.to_string().contains("diskMib") && e.to_string().contains("config max_disk_mib"));
        let e = l.check_shape(0, 256, 1024).unwrap_err();
        assert!(e.to_string().contains("minimum of 1"), "{}", e.to_string());
        // A bigger host: the configured maxima rule.
        let l = limits(Host {
            online_cpus: Some(128),
            mem_total_mib: Some(1 << 20),
        });
        let e = l.check_shape(9, 256, 1024).unwrap_err();
        assert!(
            e.to_string().contains("config max_vcpus"),
            "{}",
            e.to_string()
        );
        assert!(l.check_shape(8, 8192, 4096).is_ok());
    }

    #[test]
    fn quota_names_what_is_exceeded() {
        let l = limits(Host::default());
        let c = |vcpus, mem_mib| Charge { vcpus, mem_mib };
        assert!(l.check_quota("k1", &[c(1, 256)], c(2, 256)).is_ok());
        let e = l.check_quota("k1", &[c(1, 256)], c(3, 256)).unwrap_err();
        assert_eq!(e.code(), "quota_exceeded");
        assert!(
            e.to_string().contains("max_vcpus_per_key is 3"),
            "{}",
            e.to_string()
        );
        let e = l.check_quota("k1", &[c(1, 512)], c(1, 513)).unwrap_err();
        assert!(
            e.to_string().contains("max_mem_mib_per_key"),
            "{}",
            e.to_string()
        );
        let e = l
            .check_quota("k1", &[c(1, 64), c(1, 64)], c(1, 64))
            .unwrap_err();
        assert!(e.to_string().contains("max_sessions_per_key is 2"));
    }

    /// docs/openapi.yaml's `CreateSession` bounds are these constants (the
    /// code uses them everywhere; the spec cannot).
    #[test]
    fn openapi_spells_the_shape_ranges() {
        let spec: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(include_str!("../../docs/openapi.yaml")).unwrap();
        let props = &spec["components"]["schemas"]["CreateSession"]["properties"];
        for (field, range) in [
            ("vcpus", VCPUS),
            ("memoryMib", MEM_MIB),
            ("diskMib", DISK_MIB),
        ] {
            let bound = |k: &str| props[field][k].as_u64();
            assert_eq!(
                (bound("minimum"), bound("maximum")),
                (
                    Some(u64::from(*range.start())),
                    Some(u64::from(*range.end()))
                ),
                "docs/openapi.yaml CreateSession.{field}"
            );
        }
    }

    #[test]
    fn meminfo() {
        let t = "MemFree: 5 kB\nMemTotal:       24683584 kB\n";
        assert_eq!(mem_total_kib(t), Some(24683584));
        assert_eq!(mem_total_kib("x"), None);
    }
}
