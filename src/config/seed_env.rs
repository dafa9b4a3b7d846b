//! The seed's environment variables, so that a seed host's `.env` starts
//! ours with the same meaning. They form a layer of config keys between
//! the built-in defaults and the config file: the file and then the flags
//! win where both name a thing; `config check` and `serve --check` print
//! the result. A value we cannot honour is an error naming the variable.
//! Reference: docs/operations.md, "The seed's environment variables".

use super::FileConfig;
use crate::net::{EgressMode, EgressPolicy};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;

/// Every variable read here, in the order docs/operations.md lists them.
pub const VARS: &[&str] = &[
    "PORT",
    "AUTH_ENABLED",
    "AUTH_KEYS_PATH",
    "AUTH_KEY_PREFIX",
    "VM_VCPU_COUNT",
    "VM_MEM_SIZE_MIB",
    "VM_CPU_QUOTA_US",
    "VM_CPU_PERIOD_US",
    "VM_MEMORY_LIMIT_BYTES",
    "VM_NOFILE_LIMIT",
    "VM_DISK_LIMIT_BYTES",
    "FIRECRACKER_JAILER_BIN",
    "FIRECRACKER_BIN",
    "FIRECRACKER_JAIL_BASE",
    "FIRECRACKER_ARTIFACTS_DIR",
    "FIRECRACKER_UID",
    "FIRECRACKER_GID",
    "VM_DNS_MODE",
    "VM_DNS_DOMAINS",
    "VM_DNS_UPSTREAM",
    "VM_DEST_MODE",
    "VM_DEST_RULES",
    "VM_BW_ENABLED",
    "VM_BW_RATE_KBIT",
    "VM_BW_BURST_KBIT",
];

/// What the environment sets: config keys, the resolvers (applied where
/// networking is on and nothing else names them), and which variable set
/// which key (for error messages).
#[derive(Debug, Default)]
pub struct EnvLayer {
    pub file: FileConfig,
    pub dns_upstreams: Vec<SocketAddr>,
    pub origins: Vec<(&'static str, &'static str)>,
}

impl EnvLayer {
    /// The process environment.
    pub fn from_process() -> Result<EnvLayer, String> {
        Self::read(&|k| std::env::var(k).ok())
    }

    /// `err` with the variable behind the config key it names, if any.
    pub fn annotate(&self, err: String) -> String {
        match self.origins.iter().find(|(key, _)| err.contains(key)) {
            Some((_, var)) => format!("{err} (set by the environment variable {var})"),
            None => err,
        }
    }

    /// Reads the variables through `get`; an empty value counts as unset
    /// (dotenv files write `KEY=` for "no value").
    pub fn read(get: &dyn Fn(&str) -> Option<String>) -> Result<EnvLayer, String> {
        let var = |k: &str| {
            get(k)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let mut l = EnvLayer::default();
        let f = &mut l.file;
        let o = &mut l.origins;

        if let Some(v) = var("PORT") {
            let port: u16 = num("PORT", &v)?;
            if port == 0 {
                return Err("PORT 0: a port between 1 and 65535".into());
            }
            // The seed bound every interface; we keep loopback unless the
            // config file or --listen says otherwise (docs/operations.md).
            f.listen = Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
            o.push(("listen", "PORT"));
        }
        if let Some(v) = var("AUTH_ENABLED") {
            f.auth = Some(boolean("AUTH_ENABLED", &v)?);
            o.push(("auth", "AUTH_ENABLED"));
        }
        if let Some(v) = var("AUTH_KEYS_PATH") {
            f.keys_file = Some(abs_path("AUTH_KEYS_PATH", &v)?);
            o.push(("keys_file", "AUTH_KEYS_PATH"));
        }
        if let Some(v) = var("AUTH_KEY_PREFIX") {
            crate::config::validate_key_prefix(&v).map_err(|e| format!("AUTH_KEY_PREFIX: {e}"))?;
            f.key_prefix = Some(v);
            o.push(("key_prefix", "AUTH_KEY_PREFIX"));
        }
        let vcpus: Option<u32> = var("VM_VCPU_COUNT")
            .map(|v| num("VM_VCPU_COUNT", &v))
            .transpose()?;
        if let Some(n) = vcpus {
            f.default_vcpus = Some(n);
            o.push(("default_vcpus", "VM_VCPU_COUNT"));
        }
        let mem: Option<u32> = var("VM_MEM_SIZE_MIB")
            .map(|v| num("VM_MEM_SIZE_MIB", &v))
            .transpose()?;
        if let Some(m) = mem {
            f.default_mem_mib = Some(m);
            o.push(("default_mem_mib", "VM_MEM_SIZE_MIB"));
        }
        match (var("VM_CPU_QUOTA_US"), var("VM_CPU_PERIOD_US")) {
            (None, None) => {}
            (None, Some(_)) => return Err("VM_CPU_PERIOD_US needs VM_CPU_QUOTA_US".into()),
            // cgroup's own words for no limit.
            (Some(q), _) if q == "-1" || q == "max" => {}
            (Some(q), p) => {
                let c = crate::vm::cgroup::CpuMax {
                    quota_us: num("VM_CPU_QUOTA_US", &q)?,
                    period_us: p
                        .map(|p| num("VM_CPU_PERIOD_US", &p))
                        .transpose()?
                        .unwrap_or(100_000),
                };
                c.validate()
                    .map_err(|e| format!("VM_CPU_QUOTA_US/VM_CPU_PERIOD_US: {e}"))?;
                f.vm_cpu_max = Some(c);
                o.push(("vm_cpu_max", "VM_CPU_QUOTA_US"));
            }
        }
        if let Some(v) = var("VM_MEMORY_LIMIT_BYTES") {
            // The seed's VMs all had one size, so its limit is that size's
            // guest RAM plus the VMM's overhead: the overhead is what
            // carries over to sessions of every size.
            let bytes: u64 = num("VM_MEMORY_LIMIT_BYTES", &v)?;
            let guest = u64::from(mem.unwrap_or(super::Config::default().default_mem_mib));
            let limit_mib = bytes >> 20;
            if limit_mib < guest + MIN_VMM_OVERHEAD_MIB {
                return Err(format!(
                    "VM_MEMORY_LIMIT_BYTES {bytes}: leaves less than {MIN_VMM_OVERHEAD_MIB} MiB \
                     for the VMM beyond the guest's {guest} MiB (VM_MEM_SIZE_MIB)"
                ));
            }
            f.vm_memory_overhead_mib = Some(limit_mib - guest);
            o.push(("vm_memory_overhead_mib", "VM_MEMORY_LIMIT_BYTES"));
        }
        if let Some(v) = var("VM_NOFILE_LIMIT") {
            f.vm_nofile_limit = Some(num("VM_NOFILE_LIMIT", &v)?);
            o.push(("vm_nofile_limit", "VM_NOFILE_LIMIT"));
        }
        if let Some(v) = var("VM_DISK_LIMIT_BYTES") {
            // A session's disk: at most this, and by default no more.
            let bytes: u64 = num("VM_DISK_LIMIT_BYTES", &v)?;
            let mib = u32::try_from(bytes >> 20).unwrap_or(u32::MAX);
            f.max_disk_mib = Some(mib);
            f.default_disk_mib = Some(mib.min(super::Config::default().default_disk_mib));
            o.push(("disk_mib", "VM_DISK_LIMIT_BYTES"));
        }
        for (name, slot, key) in [
            ("FIRECRACKER_JAILER_BIN", &mut f.jailer, "jailer"),
            ("FIRECRACKER_BIN", &mut f.firecracker, "firecracker"),
            ("FIRECRACKER_JAIL_BASE", &mut f.jail_dir, "jail_dir"),
            ("FIRECRACKER_ARTIFACTS_DIR", &mut f.cache_dir, "cache_dir"),
        ] {
            if let Some(v) = var(name) {
                *slot = Some(abs_path(name, &v)?);
                o.push((key, name));
            }
        }
        let uid: Option<u32> = var("FIRECRACKER_UID")
            .map(|v| num("FIRECRACKER_UID", &v))
            .transpose()?;
        let gid: Option<u32> = var("FIRECRACKER_GID")
            .map(|v| num("FIRECRACKER_GID", &v))
            .transpose()?;
        if let Some(first) = match (uid, gid) {
            (Some(u), Some(g)) if u != g => {
                return Err(format!(
                    "FIRECRACKER_GID {g}: must equal FIRECRACKER_UID {u} (each VM runs as its \
                     own uid and the gid of the same number, from a range starting there)"
                ))
            }
            (u, g) => u.or(g),
        } {
            let ids = crate::vm::ids::IdRange {
                first,
                count: crate::vm::ids::DEFAULT_COUNT,
            };
            ids.validate()
                .map_err(|e| format!("FIRECRACKER_UID {first}: {e}"))?;
            if let Some(who) = existing_ids_in(&ids) {
                return Err(format!(
                    "FIRECRACKER_UID {first}: the VMs' ids {first}..={} include {who}; choose a \
                     start whose next {} ids no user or group has",
                    ids.last(),
                    ids.count
                ));
            }
            f.vm_ids = Some(ids);
            o.push(("vm_ids", "FIRECRACKER_UID"));
        }
        if let Some(v) = var("VM_DNS_UPSTREAM") {
            l.dns_upstreams = v
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| {
                    s.parse::<SocketAddr>()
                        .or_else(|_| s.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 53)))
                        .map_err(|_| format!("VM_DNS_UPSTREAM: {s:?} is not ADDR or ADDR:PORT"))
                })
                .collect::<Result<_, _>>()?;
        }
        if let Some(e) = egress(&var)? {
            l.file.egress = Some(e);
            l.origins
                .push(("egress", "VM_DEST_MODE/VM_DNS_MODE/VM_BW_*"));
        }
        Ok(l)
    }
}

/// Least room for the VMM beyond guest RAM that VM_MEMORY_LIMIT_BYTES may
/// leave (Firecracker's own need; QEMU needs more, under TCG far more).
const MIN_VMM_OVERHEAD_MIB: u64 = 16;

/// The default egress policy from the DNS, destination and bandwidth
/// variables; `None` if none of them is set.
fn egress(var: &dyn Fn(&str) -> Option<String>) -> Result<Option<EgressPolicy>, String> {
    let names = [
        "VM_DNS_MODE",
        "VM_DNS_DOMAINS",
        "VM_DEST_MODE",
        "VM_DEST_RULES",
        "VM_BW_ENABLED",
        "VM_BW_RATE_KBIT",
        "VM_BW_BURST_KBIT",
    ];
    if names.iter().all(|n| var(n).is_none()) {
        return Ok(None);
    }
    let list = |name: &str| -> Vec<String> {
        var(name)
            .map(|v| {
                v.split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut e = EgressPolicy::default();
    let rules = list("VM_DEST_RULES");
    match mode("VM_DEST_MODE", var("VM_DEST_MODE"))? {
        Filter::None => {
            if !rules.is_empty() {
                return Err("VM_DEST_RULES needs VM_DEST_MODE allow or deny".into());
            }
        }
        Filter::Allow => {
            e.mode = EgressMode::Allowlist;
            e.rules = rules;
        }
        Filter::Deny => {
            e.mode = EgressMode::Denylist;
            e.rules = rules;
        }
    }
    let domains = list("VM_DNS_DOMAINS");
    match mode("VM_DNS_MODE", var("VM_DNS_MODE"))? {
        Filter::None => {
            if !domains.is_empty() {
                return Err("VM_DNS_DOMAINS needs VM_DNS_MODE allow or deny".into());
            }
        }
        Filter::Allow if domains.is_empty() => {
            return Err("VM_DNS_MODE allow needs VM_DNS_DOMAINS (comma-separated names)".into())
        }
        Filter::Allow => e.domains = domains,
        Filter::Deny => e.denied_domains = domains,
    }
    if boolean_or_false("VM_BW_ENABLED", var("VM_BW_ENABLED"))? {
        let rate = var("VM_BW_RATE_KBIT").ok_or("VM_BW_ENABLED true needs VM_BW_RATE_KBIT")?;
        e.bandwidth_kbps = Some(num("VM_BW_RATE_KBIT", &rate)?);
        e.bandwidth_burst_kbit = var("VM_BW_BURST_KBIT")
            .map(|b| num("VM_BW_BURST_KBIT", &b))
            .transpose()?;
    }
    // The networking layer's own check, named after the variables.
    e.compile()
        .and_then(|p| p.validate())
        .map_err(|m| format!("VM_DEST_*/VM_DNS_*/VM_BW_*: {m}"))?;
    Ok(Some(e))
}

enum Filter {
    None,
    Allow,
    Deny,
}

fn mode(name: &str, v: Option<String>) -> Result<Filter, String> {
    match v.as_deref().map(str::to_ascii_lowercase).as_deref() {
        None | Some("none") => Ok(Filter::None),
        Some("allow") => Ok(Filter::Allow),
        Some("deny") => Ok(Filter::Deny),
        Some(_) => Err(format!(
            "{name} {:?}: one of none, allow, deny",
            v.unwrap_or_default()
        )),
    }
}

fn num<T: std::str::FromStr>(name: &str, v: &str) -> Result<T, String> {
    v.parse()
        .map_err(|_| format!("{name} {v:?}: not a number in range"))
}

fn boolean(name: &str, v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(format!("{name} {v:?}: true or false")),
    }
}

fn boolean_or_false(name: &str, v: Option<String>) -> Result<bool, String> {
    v.map(|v| boolean(name, &v))
        .transpose()
        .map(|b| b == Some(true))
}

fn abs_path(name: &str, v: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(v);
    if !p.is_absolute() {
        return Err(format!("{name} {v:?}: not an absolute path"));
    }
    Ok(p)
}

/// A user or group of this host whose id lies in `ids`, by name.
fn existing_ids_in(ids: &crate::vm::ids::IdRange) -> Option<String> {
    for (file, what) in [("/etc/passwd", "user"), ("/etc/group", "group")] {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        for line in text.lines() {
            let mut it = line.split(':');
            let (Some(name), _, Some(id)) = (it.next(), it.next(), it.next()) else {
                continue;
            };
            if id
                .parse::<u32>()
                .is_ok_and(|n| (ids.first..=ids.last()).contains(&n))
            {
                return Some(format!("{what} {name}"));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn layer(vars: &[(&str, &str)]) -> Result<EnvLayer, String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        EnvLayer::read(&|k| m.get(k).cloned())
    }

    #[test]
    fn a_seed_env_maps_onto_config_keys() {
        let l = layer(&[
            ("PORT", "8080"),
            ("AUTH_ENABLED", "false"),
            ("AUTH_KEYS_PATH", "/etc/seed/keys.json"),
            ("VM_VCPU_COUNT", "2"),
            ("VM_MEM_SIZE_MIB", "512"),
            ("VM_CPU_QUOTA_US", "50000"),
            ("VM_MEMORY_LIMIT_BYTES", "805306368"),
            ("VM_NOFILE_LIMIT", "2048"),
            ("VM_DISK_LIMIT_BYTES", "536870912"),
            ("FIRECRACKER_BIN", "/opt/fc/firecracker"),
            ("FIRECRACKER_JAIL_BASE", "/srv/jailer"),
            ("VM_DEST_MODE", "deny"),
            ("VM_DEST_RULES", "198.51.100.0/24:443/tcp, 203.0.113.7"),
            ("VM_DNS_MODE", "deny"),
            ("VM_DNS_DOMAINS", "evil.example,*.ads.example"),
            ("VM_DNS_UPSTREAM", "127.0.0.53,127.0.0.1:5353"),
            ("VM_BW_ENABLED", "true"),
            ("VM_BW_RATE_KBIT", "8000"),
            ("VM_BW_BURST_KBIT", "800"),
            ("AUTH_KEY_PREFIX", "sk_live_"),
        ])
        .unwrap();
        let f = &l.file;
        assert_eq!(f.key_prefix.as_deref(), Some("sk_live_"));
        assert_eq!(f.listen, Some("127.0.0.1:8080".parse().unwrap()));
        assert_eq!(f.auth, Some(false));
        assert_eq!(f.keys_file, Some("/etc/seed/keys.json".into()));
        assert_eq!((f.default_vcpus, f.default_mem_mib), (Some(2), Some(512)));
        let c = f.vm_cpu_max.unwrap();
        assert_eq!((c.quota_us, c.period_us), (50_000, 100_000));
        assert_eq!(f.vm_memory_overhead_mib, Some(768 - 512));
        assert_eq!(f.vm_nofile_limit, Some(2048));
        assert_eq!((f.max_disk_mib, f.default_disk_mib), (Some(512), Some(512)));
        assert_eq!(f.firecracker, Some("/opt/fc/firecracker".into()));
        assert_eq!(f.jail_dir, Some("/srv/jailer".into()));
        let e = f.egress.as_ref().unwrap();
        assert_eq!(e.mode, EgressMode::Denylist);
        assert_eq!(e.rules, ["198.51.100.0/24:443/tcp", "203.0.113.7"]);
        assert_eq!(e.denied_domains, ["evil.example", "*.ads.example"]);
        assert!(e.domains.is_empty());
        assert_eq!(
            (e.bandwidth_kbps, e.bandwidth_burst_kbit),
            (Some(8000), Some(800))
        );
        assert_eq!(
            l.dns_upstreams,
            [
                "127.0.0.53:53".parse::<SocketAddr>().unwrap(),
                "127.0.0.1:5353".parse().unwrap()
            ]
        );
    }

    #[test]
    fn nothing_set_changes_nothing() {
        let l = layer(&[("PORT", ""), ("VM_BW_ENABLED", "")]).unwrap();
        assert!(l.file.listen.is_none() && l.file.egress.is_none());
        assert!(l.origins.is_empty());
    }

    #[test]
    fn dns_allow_is_a_name_allowlist_and_dest_allow_a_rule_allowlist() {
        let l = layer(&[
            ("VM_DEST_MODE", "allow"),
            ("VM_DEST_RULES", "198.51.100.0/24:443/tcp"),
            ("VM_DNS_MODE", "ALLOW"),
            ("VM_DNS_DOMAINS", "pypi.org,*.pythonhosted.org"),
        ])
        .unwrap();
        let e = l.file.egress.unwrap();
        assert_eq!(e.mode, EgressMode::Allowlist);
        assert_eq!(e.domains, ["pypi.org", "*.pythonhosted.org"]);
        // Bandwidth stays off unless enabled, whatever its rate says.
        let l = layer(&[("VM_BW_ENABLED", "false"), ("VM_BW_RATE_KBIT", "100")]).unwrap();
        assert_eq!(l.file.egress.unwrap().bandwidth_kbps, None);
    }

    #[test]
    fn values_we_cannot_honour_name_their_variable() {
        for (vars, var) in [
            (vec![("PORT", "http")], "PORT"),
            (vec![("PORT", "0")], "PORT"),
            (vec![("AUTH_ENABLED", "maybe")], "AUTH_ENABLED"),
            (vec![("AUTH_KEYS_PATH", "keys.json")], "AUTH_KEYS_PATH"),
            (vec![("AUTH_KEY_PREFIX", "sk live")], "AUTH_KEY_PREFIX"),
            (vec![("VM_VCPU_COUNT", "-1")], "VM_VCPU_COUNT"),
            (vec![("VM_CPU_PERIOD_US", "100000")], "VM_CPU_PERIOD_US"),
            (vec![("VM_CPU_QUOTA_US", "10")], "VM_CPU_QUOTA_US"),
            (
                vec![
                    ("VM_MEM_SIZE_MIB", "512"),
                    ("VM_MEMORY_LIMIT_BYTES", "536870912"),
                ],
                "VM_MEMORY_LIMIT_BYTES",
            ),
            (vec![("FIRECRACKER_UID", "root")], "FIRECRACKER_UID"),
            (vec![("FIRECRACKER_UID", "0")], "FIRECRACKER_UID"),
            (
                vec![
                    ("FIRECRACKER_UID", "3000000000"),
                    ("FIRECRACKER_GID", "3000000001"),
                ],
                "FIRECRACKER_GID",
            ),
            (vec![("VM_DNS_MODE", "block")], "VM_DNS_MODE"),
            (vec![("VM_DNS_MODE", "allow")], "VM_DNS_MODE"),
            (vec![("VM_DNS_DOMAINS", "a.example")], "VM_DNS_DOMAINS"),
            (vec![("VM_DNS_UPSTREAM", "dns.example")], "VM_DNS_UPSTREAM"),
            (vec![("VM_DEST_RULES", "10.0.0.0/8")], "VM_DEST_RULES"),
            (
                vec![("VM_DEST_MODE", "deny"), ("VM_DEST_RULES", "not-a-cidr")],
                "VM_DEST_",
            ),
            (vec![("VM_BW_ENABLED", "true")], "VM_BW_RATE_KBIT"),
            (
                vec![("VM_BW_ENABLED", "true"), ("VM_BW_RATE_KBIT", "1")],
                "VM_BW_",
            ),
        ] {
            let e = layer(&vars).expect_err(var);
            assert!(e.contains(var), "{vars:?}: {e}");
        }
    }

    #[test]
    fn every_variable_is_documented() {
        let doc = include_str!("../../docs/operations.md");
        for v in VARS {
            assert!(
                doc.contains(&format!("`{v}`")),
                "{v} missing in docs/operations.md"
            );
        }
    }
}
