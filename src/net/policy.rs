//! A session's network policy in two forms: [`EgressPolicy`], as clients,
//! the config file and the seed's variables give it (the one policy type
//! of the layers above `net`), and [`NetPolicy`], the parsed form this
//! module enforces: the egress mode and rules ([`EgressFilter`]), the
//! domain allowlist served by the session's DNS forwarder, and the
//! bandwidth limit. [`EgressPolicy::compile`] turns the first into the
//! second. A [`NetPolicy`] has a flat JSON shape of its own (tests and
//! benches write policies in it); every field but `mode` may be omitted:
//!
//! ```json
//! {"mode":"allowlist","rules":["198.51.100.0/24:443/tcp"],
//!  "domains":["*.pypi.org","github.com"],
//!  "bandwidth":{"down_kbit":8000,"up_kbit":2000}}
//! ```
//!
//! `denied_domains` (instead of `domains`) turns the forwarder around: it
//! answers every name but those, and opens nothing in the firewall (the
//! mode's rules decide, as with no list at all).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::egress::{EgressFilter, EgressRule, ALWAYS_BLOCKED, MAX_RULES};
use super::{firewall, NetConfig};

/// At most this many domain patterns per session.
pub const MAX_DOMAINS: usize = 256;
/// Bandwidth bounds (kbit/s): below 64 kbit/s a full-size frame takes
/// longer than TCP's patience; above 100 Gbit/s a limit means nothing.
pub const MIN_KBIT: u64 = 64;
pub const MAX_KBIT: u64 = 100_000_000;
/// Token bucket size bounds (kbit): at least two full frames (the kernel
/// refuses a bucket smaller than one), at most 1 GiB.
pub const MIN_BURST_KBIT: u64 = 25;
pub const MAX_BURST_KBIT: u64 = 8 << 20;

/// An allowed DNS name: `github.com` (exactly that name) or `*.pypi.org`
/// (any name below pypi.org, not pypi.org itself). Stored lower case,
/// without a trailing dot.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct DomainPattern {
    /// The name, or for a wildcard the suffix after `*.`.
    pub name: String,
    pub wildcard: bool,
}

impl DomainPattern {
    pub fn matches(&self, qname: &str) -> bool {
        if self.wildcard {
            qname.len() > self.name.len() + 1
                && qname.ends_with(self.name.as_str())
                && qname.as_bytes()[qname.len() - self.name.len() - 1] == b'.'
        } else {
            qname == self.name
        }
    }
}

/// A host name label as we accept it (what DNS names of real services use).
pub fn valid_label(l: &[u8]) -> bool {
    !l.is_empty()
        && l.len() <= 63
        && l.iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-' || *b == b'_')
}

impl FromStr for DomainPattern {
    type Err = String;
    fn from_str(s: &str) -> Result<DomainPattern, String> {
        let lower = s.trim().to_ascii_lowercase();
        let t = lower.strip_suffix('.').unwrap_or(&lower);
        let (wildcard, name) = match t.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, t),
        };
        if name.is_empty()
            || name.len() > 253
            || !name.split('.').all(|l| valid_label(l.as_bytes()))
        {
            return Err(format!(
                "bad domain {s:?}: want a host name like github.com or *.pypi.org"
            ));
        }
        Ok(DomainPattern {
            name: name.to_string(),
            wildcard,
        })
    }
}

impl fmt::Display for DomainPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.wildcard {
            write!(f, "*.{}", self.name)
        } else {
            f.write_str(&self.name)
        }
    }
}

impl TryFrom<String> for DomainPattern {
    type Error = String;
    fn try_from(s: String) -> Result<DomainPattern, String> {
        s.parse()
    }
}

impl From<DomainPattern> for String {
    fn from(d: DomainPattern) -> String {
        d.to_string()
    }
}

/// Token-bucket limits per direction, kbit/s (1 kbit = 1000 bit); `None`:
/// unlimited that way. `down` is towards the guest, `up` from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bandwidth {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub down_kbit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub up_kbit: Option<u64>,
    /// Token bucket size both ways, kbit (`None`: 20 ms of the rate, see
    /// `tc::tbf_params`): how much may pass at line rate after a pause.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst_kbit: Option<u64>,
}

impl Bandwidth {
    /// The same limit both ways.
    pub fn both(kbit: u64) -> Bandwidth {
        Bandwidth {
            down_kbit: Some(kbit),
            up_kbit: Some(kbit),
            burst_kbit: None,
        }
    }
}

/// Everything a session's network may do; see the module docs for JSON.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "RawPolicy", into = "RawPolicy")]
pub struct NetPolicy {
    pub egress: EgressFilter,
    /// Names the session's resolver answers; their A records become
    /// reachable for their TTL (before the mode's final verdict). Empty: no
    /// DNS forwarder runs.
    pub domains: Vec<DomainPattern>,
    /// Names the session's resolver refuses while it answers every other
    /// one; exclusive with `domains`.
    pub denied_domains: Vec<DomainPattern>,
    pub bandwidth: Option<Bandwidth>,
}

/// The names a session's DNS forwarder resolves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DnsNames {
    /// Every name, without touching the firewall (`internet`, `denylist`:
    /// the addresses are reachable, or not, by the mode's own rules).
    Any,
    /// Only these; their answers are let through the firewall for the TTL.
    Only(Vec<DomainPattern>),
    /// Every name but these, without touching the firewall.
    Except(Vec<DomainPattern>),
}

impl DnsNames {
    pub fn allows(&self, name: &str) -> bool {
        match self {
            DnsNames::Any => true,
            DnsNames::Only(l) => l.iter().any(|p| p.matches(name)),
            DnsNames::Except(l) => !l.iter().any(|p| p.matches(name)),
        }
    }

    /// Whether answers are let through the firewall (only an allowlist of
    /// names does; otherwise the mode's rules decide).
    pub fn opens_firewall(&self) -> bool {
        matches!(self, DnsNames::Only(_))
    }
}

impl NetPolicy {
    /// What the session's resolver (the guest's gateway, port 53) answers:
    /// `None` means no resolver runs (`none`, and `allowlist` without
    /// domains: the guest reaches only the addresses it was given).
    pub fn dns_names(&self) -> Option<DnsNames> {
        if !self.domains.is_empty() {
            return Some(DnsNames::Only(self.domains.clone()));
        }
        if !self.denied_domains.is_empty() {
            // Refusing names is no reason to start a resolver where the
            // mode has none.
            return match self.egress {
                EgressFilter::Internet | EgressFilter::Denylist { .. } => {
                    Some(DnsNames::Except(self.denied_domains.clone()))
                }
                EgressFilter::None | EgressFilter::Allowlist { .. } => None,
            };
        }
        match self.egress {
            EgressFilter::Internet | EgressFilter::Denylist { .. } => Some(DnsNames::Any),
            EgressFilter::None | EgressFilter::Allowlist { .. } => None,
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        self.egress.validate()?;
        for (key, l) in [
            ("domains", &self.domains),
            ("denied_domains", &self.denied_domains),
        ] {
            if l.len() > MAX_DOMAINS {
                return Err(format!("{} {key}, at most {MAX_DOMAINS}", l.len()));
            }
        }
        if !self.domains.is_empty() && !self.denied_domains.is_empty() {
            return Err(
                "domains (names allowed) and denied_domains (names refused) exclude each other"
                    .into(),
            );
        }
        if let Some(b) = &self.bandwidth {
            for (dir, v) in [("down_kbit", b.down_kbit), ("up_kbit", b.up_kbit)] {
                if let Some(k) = v {
                    if !(MIN_KBIT..=MAX_KBIT).contains(&k) {
                        return Err(format!(
                            "bandwidth {dir} {k}: between {MIN_KBIT} and {MAX_KBIT} kbit/s"
                        ));
                    }
                }
            }
            if let Some(k) = b.burst_kbit {
                if !(MIN_BURST_KBIT..=MAX_BURST_KBIT).contains(&k) {
                    return Err(format!(
                        "bandwidth burst_kbit {k}: between {MIN_BURST_KBIT} and {MAX_BURST_KBIT} kbit"
                    ));
                }
            }
        }
        Ok(())
    }
}

impl NetPolicy {
    /// [`EgressFilter::check_reachable`] against what `net` always blocks
    /// (the built-in set when networking is off: such a rule could never
    /// match either). The API runs this before accepting a policy.
    pub fn check_reachable(&self, net: Option<&NetConfig>) -> Result<(), String> {
        match net {
            Some(c) => self
                .egress
                .check_reachable(&firewall::blocked_set(c), &c.allow_exceptions),
            None => self.egress.check_reachable(ALWAYS_BLOCKED, &[]),
        }
    }
}

impl From<EgressFilter> for NetPolicy {
    fn from(egress: EgressFilter) -> NetPolicy {
        NetPolicy {
            egress,
            ..NetPolicy::default()
        }
    }
}

impl From<&EgressFilter> for NetPolicy {
    fn from(e: &EgressFilter) -> NetPolicy {
        e.clone().into()
    }
}

impl From<&NetPolicy> for NetPolicy {
    fn from(p: &NetPolicy) -> NetPolicy {
        p.clone()
    }
}

/// The egress mode of an [`EgressPolicy`] (and of the flat JSON shape of
/// a [`NetPolicy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum EgressMode {
    #[default]
    Internet,
    None,
    Allowlist,
    Denylist,
}

/// Egress policy of a session as clients, the config file and the seed's
/// variables give it (REST `egress` and `PUT /v1/sessions/:id/network`,
/// MCP `egress`, config `default_egress`): the one policy type of the
/// layers above `net`. Strings stay strings here so a bad one is refused
/// by [`EgressPolicy::validate`] with its reason; [`EgressPolicy::compile`]
/// makes the [`NetPolicy`] the networking layer enforces.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct EgressPolicy {
    #[serde(default)]
    pub mode: EgressMode,
    /// `CIDR[:port[/proto]]` rules for `allowlist` / `denylist`.
    #[serde(default)]
    pub rules: Vec<String>,
    /// Domain names (`*.pypi.org`) resolvable and reachable under `allowlist`.
    #[serde(default)]
    pub domains: Vec<String>,
    /// Domain names the session's resolver refuses, answering every other
    /// (`internet` / `denylist`); exclusive with `domains`.
    #[serde(
        default,
        rename = "deniedDomains",
        alias = "denied_domains",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub denied_domains: Vec<String>,
    /// Bandwidth cap in kbit/s.
    #[serde(default, rename = "bandwidthKbps", alias = "bandwidth_kbps")]
    pub bandwidth_kbps: Option<u64>,
    /// Token bucket size of that cap in kbit (default: 20 ms of the rate).
    #[serde(
        default,
        rename = "bandwidthBurstKbit",
        alias = "bandwidth_burst_kbit",
        skip_serializing_if = "Option::is_none"
    )]
    pub bandwidth_burst_kbit: Option<u64>,
}

impl EgressPolicy {
    /// Checks the policy the way the networking layer will apply it, so a
    /// bad one is a 400 at create time, not a failed start: also refuses
    /// an allowlist rule that `net` (the daemon's network configuration)
    /// always blocks.
    pub fn validate(&self, net: Option<&NetConfig>) -> Result<(), String> {
        self.compile()?.check_reachable(net)
    }

    /// The networking layer's form: `bandwidthKbps` limits both ways.
    /// Fields are checked in a fixed order (bandwidth, denied domains,
    /// domains, rules, then the whole), so the first error named is the
    /// same whatever else is wrong.
    pub fn compile(&self) -> Result<NetPolicy, String> {
        if self.rules.len() > MAX_RULES
            || self.domains.len() > MAX_DOMAINS
            || self.denied_domains.len() > MAX_DOMAINS
        {
            return Err(format!(
                "at most {MAX_RULES} egress rules and {MAX_DOMAINS} domains"
            ));
        }
        let bandwidth = match (self.bandwidth_kbps, self.bandwidth_burst_kbit) {
            (Some(k), burst_kbit) => Some(Bandwidth {
                burst_kbit,
                ..Bandwidth::both(k)
            }),
            (None, Some(_)) => return Err("bandwidthBurstKbit needs bandwidthKbps".into()),
            (None, None) => None,
        };
        fn parse<T: FromStr<Err = String>>(l: &[String]) -> Result<Vec<T>, String> {
            l.iter().map(|s| s.parse()).collect()
        }
        let parts = || -> Result<NetPolicy, String> {
            let denied_domains = parse(&self.denied_domains)?;
            let domains = parse(&self.domains)?;
            // A mode without rules is given none, unless it names some.
            let rules = (!self.rules.is_empty()
                || matches!(self.mode, EgressMode::Allowlist | EgressMode::Denylist))
            .then(|| parse(&self.rules))
            .transpose()?;
            NetPolicy::from_parts(self.mode, rules, domains, denied_domains, bandwidth)
        };
        parts().map_err(|e| format!("egress: {e}"))
    }
}

/// The flat JSON shape, checked strictly (unknown fields are errors).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    #[serde(default)]
    mode: EgressMode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rules: Option<Vec<EgressRule>>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    domains: Vec<DomainPattern>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    denied_domains: Vec<DomainPattern>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    bandwidth: Option<Bandwidth>,
}

impl NetPolicy {
    /// The policy of these parsed parts, validated: `rules` only where the
    /// mode takes them (`None`: none given).
    fn from_parts(
        mode: EgressMode,
        rules: Option<Vec<EgressRule>>,
        domains: Vec<DomainPattern>,
        denied_domains: Vec<DomainPattern>,
        bandwidth: Option<Bandwidth>,
    ) -> Result<NetPolicy, String> {
        let egress = match (mode, rules) {
            (EgressMode::Internet, None) => EgressFilter::Internet,
            (EgressMode::None, None) => EgressFilter::None,
            (EgressMode::Allowlist, rules) => EgressFilter::Allowlist {
                rules: rules.unwrap_or_default(),
            },
            (EgressMode::Denylist, rules) => EgressFilter::Denylist {
                rules: rules.unwrap_or_default(),
            },
            (m, Some(_)) => {
                return Err(format!(
                    "mode {m:?} takes no rules (allowlist and denylist do)"
                ))
            }
        };
        let p = NetPolicy {
            egress,
            domains,
            denied_domains,
            bandwidth: bandwidth.filter(|b| *b != Bandwidth::default()),
        };
        p.validate()?;
        Ok(p)
    }
}

impl TryFrom<RawPolicy> for NetPolicy {
    type Error = String;
    fn try_from(r: RawPolicy) -> Result<NetPolicy, String> {
        NetPolicy::from_parts(r.mode, r.rules, r.domains, r.denied_domains, r.bandwidth)
    }
}

impl From<NetPolicy> for RawPolicy {
    fn from(p: NetPolicy) -> RawPolicy {
        let (mode, rules) = match p.egress {
            EgressFilter::Internet => (EgressMode::Internet, None),
            EgressFilter::None => (EgressMode::None, None),
            EgressFilter::Allowlist { rules } => (EgressMode::Allowlist, Some(rules)),
            EgressFilter::Denylist { rules } => (EgressMode::Denylist, Some(rules)),
        };
        RawPolicy {
            mode,
            rules,
            domains: p.domains,
            denied_domains: p.denied_domains,
            bandwidth: p.bandwidth,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns() {
        let w: DomainPattern = "*.PyPI.org.".parse().unwrap();
        assert!(w.wildcard && w.name == "pypi.org");
        assert!(w.matches("files.pypi.org"));
        assert!(w.matches("a.b.pypi.org"));
        assert!(!w.matches("pypi.org"));
        assert!(!w.matches("evilpypi.org"));
        assert!(!w.matches("pypi.org.evil.com"));
        let e: DomainPattern = "github.com".parse().unwrap();
        assert!(e.matches("github.com") && !e.matches("api.github.com"));
        for bad in [
            "",
            "*",
            "*.",
            "a..b",
            "a b.com",
            "*.*.com",
            "x.*.com",
            &"a".repeat(64),
        ] {
            assert!(bad.parse::<DomainPattern>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn policy_json() {
        let p: NetPolicy = serde_json::from_str(
            r#"{"mode":"allowlist","domains":["*.pypi.org"],"bandwidth":{"down_kbit":8000}}"#,
        )
        .unwrap();
        assert_eq!(p.egress, EgressFilter::Allowlist { rules: vec![] });
        assert_eq!(p.domains.len(), 1);
        assert_eq!(p.bandwidth.unwrap().down_kbit, Some(8000));
        let back = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<NetPolicy>(&back).unwrap(), p);
        let d: NetPolicy = serde_json::from_str("{}").unwrap();
        assert_eq!(d, NetPolicy::default());
        assert_eq!(serde_json::to_string(&d).unwrap(), r#"{"mode":"internet"}"#);
        for bad in [
            r#"{"mode":"internet","rules":[]}"#,
            r#"{"mode":"none","domian":["x.com"]}"#,
            r#"{"bandwidth":{"down_kbit":1}}"#,
            r#"{"bandwidth":{"down":100}}"#,
            r#"{"domains":["*"]}"#,
        ] {
            assert!(serde_json::from_str::<NetPolicy>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn egress_policy_compiles_with_its_first_error() {
        let p = |json: &str| {
            serde_json::from_str::<EgressPolicy>(json)
                .unwrap()
                .compile()
        };
        let n = p(
            r#"{"mode":"allowlist","rules":["1.2.3.0/24:443/tcp"],"domains":["*.pypi.org"],
                      "bandwidthKbps":8000,"bandwidthBurstKbit":800}"#,
        )
        .unwrap();
        assert_eq!(
            serde_json::to_string(&n).unwrap(),
            r#"{"mode":"allowlist","rules":["1.2.3.0/24:443/tcp"],"domains":["*.pypi.org"],"bandwidth":{"down_kbit":8000,"up_kbit":8000,"burst_kbit":800}}"#
        );
        assert_eq!(
            p(r#"{"mode":"denylist"}"#).unwrap().egress,
            EgressFilter::Denylist { rules: vec![] }
        );
        for (json, err) in [
            (r#"{"bandwidthBurstKbit":800,"rules":["x"]}"#, "bandwidthBurstKbit needs bandwidthKbps"),
            (r#"{"mode":"none","rules":["1.2.3.4"]}"#, "egress: mode None takes no rules (allowlist and denylist do)"),
            // Denied domains, then domains, then rules are parsed.
            (r#"{"mode":"allowlist","rules":["x"],"domains":["*"],"deniedDomains":["a..b"]}"#, r#"egress: bad domain "a..b": want a host name like github.com or *.pypi.org"#),
            (r#"{"mode":"allowlist","rules":["x"],"domains":["*"]}"#, r#"egress: bad domain "*": want a host name like github.com or *.pypi.org"#),
            (r#"{"mode":"allowlist","rules":["x"]}"#, r#"egress: bad IPv4 address in "x""#),
            (r#"{"domains":["a.com"],"deniedDomains":["b.com"]}"#, "egress: domains (names allowed) and denied_domains (names refused) exclude each other"),
            (r#"{"bandwidthKbps":1}"#, "egress: bandwidth down_kbit 1: between 64 and 100000000 kbit/s"),
        ] {
            assert_eq!(p(json).unwrap_err(), err, "{json}");
        }
    }
}
