//! The egress filter of a session (mode and `CIDR[:port[/proto]]` rules,
//! part of a [`super::NetPolicy`]) and its compilation to nftables rules.
//!
//! JSON forms:
//! `{"mode":"internet"}`, `{"mode":"none"}`,
//! `{"mode":"allowlist","rules":["198.51.100.0/24:443/tcp","203.0.113.7"]}`,
//! `{"mode":"denylist","rules":["0.0.0.0/0:25/tcp"]}`.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::cidr::Cidr;
use super::nft::{Match, Rule, Verdict};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    pub fn number(self) -> u8 {
        match self {
            Proto::Tcp => 6,
            Proto::Udp => 17,
        }
    }
}

/// `CIDR[:port[/proto]]`; a port without a protocol means tcp and udp.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct EgressRule {
    pub net: Cidr,
    pub port: Option<u16>,
    pub proto: Option<Proto>,
}

impl fmt::Display for EgressRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.net)?;
        if let Some(p) = self.port {
            write!(f, ":{p}")?;
        }
        match self.proto {
            Some(Proto::Tcp) => write!(f, "/tcp"),
            Some(Proto::Udp) => write!(f, "/udp"),
            None => Ok(()),
        }
    }
}

impl FromStr for EgressRule {
    type Err = String;
    fn from_str(s: &str) -> Result<EgressRule, String> {
        let s = s.trim();
        let (net, rest) = match s.split_once(':') {
            Some((n, r)) => (n, Some(r)),
            None => (s, None),
        };
        let net: Cidr = net.parse()?;
        let (port, proto) = match rest {
            None => (None, None),
            Some(r) => {
                let (p, pr) = match r.split_once('/') {
                    Some((p, pr)) => (p, Some(pr)),
                    None => (r, None),
                };
                let port = p
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| format!("bad port in {s:?}"))?;
                let proto = match pr {
                    None => None,
                    Some("tcp") => Some(Proto::Tcp),
                    Some("udp") => Some(Proto::Udp),
                    Some(o) => return Err(format!("unknown protocol {o:?} in {s:?} (tcp or udp)")),
                };
                (Some(port), proto)
            }
        };
        Ok(EgressRule { net, port, proto })
    }
}

impl TryFrom<String> for EgressRule {
    type Error = String;
    fn try_from(s: String) -> Result<EgressRule, String> {
        s.parse()
    }
}

impl From<EgressRule> for String {
    fn from(r: EgressRule) -> String {
        r.to_string()
    }
}

/// What a session may reach beyond the always-blocked set.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "lowercase", deny_unknown_fields)]
pub enum EgressFilter {
    /// The public internet.
    #[default]
    Internet,
    /// Nothing.
    None,
    /// Only what the rules list.
    Allowlist { rules: Vec<EgressRule> },
    /// Everything public except what the rules list.
    Denylist { rules: Vec<EgressRule> },
}

/// Limit so a request cannot make us build a huge ruleset.
pub const MAX_RULES: usize = 256;

impl EgressFilter {
    pub fn validate(&self) -> Result<(), String> {
        match self {
            EgressFilter::Allowlist { rules } | EgressFilter::Denylist { rules }
                if rules.len() > MAX_RULES =>
            {
                Err(format!("{} egress rules, at most {MAX_RULES}", rules.len()))
            }
            _ => Ok(()),
        }
    }

    /// Refuses an allowlist rule of which no address is reachable: all
    /// of it lies in `blocked` (the union) and none in `exceptions`. Such a
    /// rule would be accepted and then silently never match anything.
    /// (A denylist rule there is merely redundant; `0.0.0.0/0:443` in an
    /// allowlist is fine: its public part is reachable.)
    pub fn check_reachable(&self, blocked: &[Cidr], exceptions: &[Cidr]) -> Result<(), String> {
        let EgressFilter::Allowlist { rules } = self else {
            return Ok(());
        };
        for r in rules {
            if r.net.covered_by(blocked) && !exceptions.iter().any(|e| e.overlaps(&r.net)) {
                let within = blocked
                    .iter()
                    .find(|b| r.net.overlaps(b))
                    .map(|b| format!(" (in {b})"))
                    .unwrap_or_default();
                return Err(format!(
                    "allowlist rule \"{r}\" names only always-blocked addresses{within}: \
                     no session may reach them whatever its policy"
                ));
            }
        }
        Ok(())
    }

    /// Whether the mode's rules let a TCP connection to `addr:port` out
    /// (what the `policy` chain decides; the always-blocked set is checked
    /// apart). For connections the daemon makes on the guest's behalf
    /// (the egress proxy), which that chain never sees.
    pub fn permits_tcp(&self, addr: Ipv4Addr, port: u16) -> bool {
        let hit = |rules: &[EgressRule]| {
            rules.iter().any(|r| {
                r.net.contains(addr)
                    && r.port.is_none_or(|p| p == port)
                    && r.proto.is_none_or(|p| p == Proto::Tcp)
            })
        };
        match self {
            EgressFilter::Internet => true,
            EgressFilter::None => false,
            EgressFilter::Allowlist { rules } => hit(rules),
            EgressFilter::Denylist { rules } => !hit(rules),
        }
    }

    /// Rules of the per-session `policy` chain (evaluated only for traffic
    /// that already passed the always-blocked checks).
    pub fn to_rules(&self) -> Vec<Rule> {
        let rule_matches = |r: &EgressRule| -> Vec<Vec<Match>> {
            let base = vec![Match::Daddr(r.net)];
            match (r.port, r.proto) {
                (None, None) => vec![base],
                (None, Some(p)) => vec![[base, vec![Match::L4Proto(p.number())]].concat()],
                (Some(port), Some(p)) => {
                    vec![[base, vec![Match::L4Proto(p.number()), Match::Dport(port)]].concat()]
                }
                (Some(port), None) => [Proto::Tcp, Proto::Udp]
                    .iter()
                    .map(|p| {
                        [
                            base.clone(),
                            vec![Match::L4Proto(p.number()), Match::Dport(port)],
                        ]
                        .concat()
                    })
                    .collect(),
            }
        };
        let list = |rules: &[EgressRule], v: Verdict, fin: Verdict| {
            let mut out: Vec<Rule> = rules
                .iter()
                .flat_map(rule_matches)
                .map(|m| Rule::new(m, v.clone()))
                .collect();
            out.push(Rule::new(vec![], fin));
            out
        };
        match self {
            EgressFilter::Internet => vec![Rule::new(vec![], Verdict::Accept)],
            EgressFilter::None => vec![Rule::new(vec![], Verdict::Drop)],
            EgressFilter::Allowlist { rules } => list(rules, Verdict::Accept, Verdict::Drop),
            EgressFilter::Denylist { rules } => list(rules, Verdict::Drop, Verdict::Accept),
        }
    }
}

/// Destinations no session may reach whatever its policy: "this" network,
/// RFC1918, CGNAT, loopback, link-local (incl. 169.254.169.254), IETF
/// protocol assignments, benchmarking, multicast and reserved. The host's
/// own addresses and the other sessions are added from the configuration.
pub const ALWAYS_BLOCKED: &[Cidr] = &[
    Cidr::new(Ipv4Addr::new(0, 0, 0, 0), 8),
    Cidr::new(Ipv4Addr::new(10, 0, 0, 0), 8),
    Cidr::new(Ipv4Addr::new(100, 64, 0, 0), 10),
    Cidr::new(Ipv4Addr::new(127, 0, 0, 0), 8),
    Cidr::new(Ipv4Addr::new(169, 254, 0, 0), 16),
    Cidr::new(Ipv4Addr::new(172, 16, 0, 0), 12),
    Cidr::new(Ipv4Addr::new(192, 0, 0, 0), 24),
    Cidr::new(Ipv4Addr::new(192, 168, 0, 0), 16),
    Cidr::new(Ipv4Addr::new(198, 18, 0, 0), 15),
    Cidr::new(Ipv4Addr::new(224, 0, 0, 0), 4),
    Cidr::new(Ipv4Addr::new(240, 0, 0, 0), 4),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_rules() {
        let r: EgressRule = "198.51.100.0/24:443/tcp".parse().unwrap();
        assert_eq!(r.port, Some(443));
        assert_eq!(r.proto, Some(Proto::Tcp));
        assert_eq!(r.to_string(), "198.51.100.0/24:443/tcp");
        let r: EgressRule = "203.0.113.7".parse().unwrap();
        assert_eq!(r.net.prefix_len, 32);
        assert!("1.2.3.4:0".parse::<EgressRule>().is_err());
        assert!("1.2.3.4:53/icmp".parse::<EgressRule>().is_err());
        assert!("1.2.3.4/33".parse::<EgressRule>().is_err());
        assert!("nonsense".parse::<EgressRule>().is_err());
    }

    #[test]
    fn permits_tcp_as_the_chain_decides() {
        let rules = |r: &[&str]| r.iter().map(|x| x.parse().unwrap()).collect::<Vec<_>>();
        let a = Ipv4Addr::new(198, 51, 100, 7);
        let allow = EgressFilter::Allowlist {
            rules: rules(&["198.51.100.0/24:443/tcp", "203.0.113.0/24:53/udp"]),
        };
        assert!(allow.permits_tcp(a, 443));
        assert!(!allow.permits_tcp(a, 80));
        assert!(!allow.permits_tcp(Ipv4Addr::new(203, 0, 113, 1), 53));
        let deny = EgressFilter::Denylist {
            rules: rules(&["198.51.100.0/24"]),
        };
        assert!(!deny.permits_tcp(a, 443));
        assert!(deny.permits_tcp(Ipv4Addr::new(203, 0, 113, 1), 443));
        assert!(EgressFilter::Internet.permits_tcp(a, 1));
        assert!(!EgressFilter::None.permits_tcp(a, 1));
    }

    #[test]
    fn policy_json() {
        let p: EgressFilter =
            serde_json::from_str(r#"{"mode":"allowlist","rules":["1.2.3.0/24:53"]}"#).unwrap();
        assert_eq!(p.to_rules().len(), 3); // tcp, udp, final drop
        let p: EgressFilter = serde_json::from_str(r#"{"mode":"none"}"#).unwrap();
        assert_eq!(p, EgressFilter::None);
        assert!(
            serde_json::from_str::<EgressFilter>(r#"{"mode":"allowlist","rules":["x"]}"#).is_err()
        );
        assert_eq!(
            serde_json::to_string(&EgressFilter::default()).unwrap(),
            r#"{"mode":"internet"}"#
        );
    }

    #[test]
    fn unreachable_allowlist_rules_are_refused() {
        let allow = |r: &str| EgressFilter::Allowlist {
            rules: vec![r.parse().unwrap()],
        };
        for bad in [
            "10.1.2.3:443/tcp",
            "169.254.169.254",
            "192.168.0.0/16",
            "100.64.0.0/10:53",
            // Two adjacent blocked ranges together (224/4 and 240/4).
            "224.0.0.0/3",
        ] {
            let e = allow(bad).check_reachable(ALWAYS_BLOCKED, &[]).unwrap_err();
            assert!(e.contains(bad.split(':').next().unwrap()), "{bad}: {e}");
        }
        for good in [
            "0.0.0.0/0:443",
            "198.51.100.0/24",
            "10.0.0.0/7",
            "8.8.8.8:53",
        ] {
            allow(good)
                .check_reachable(ALWAYS_BLOCKED, &[])
                .unwrap_or_else(|e| panic!("{good}: {e}"));
        }
        // An operator's exception makes part of a blocked range reachable.
        let exc: Cidr = "10.1.2.0/24".parse().unwrap();
        assert!(allow("10.1.2.3")
            .check_reachable(ALWAYS_BLOCKED, &[exc])
            .is_ok());
        assert!(allow("10.0.0.0/8")
            .check_reachable(ALWAYS_BLOCKED, &[exc])
            .is_ok());
        assert!(allow("10.9.0.0/16")
            .check_reachable(ALWAYS_BLOCKED, &[exc])
            .is_err());
        // Union coverage: two halves, each blocked on its own.
        let halves: Vec<Cidr> = vec![
            "203.0.113.0/25".parse().unwrap(),
            "203.0.113.128/25".parse().unwrap(),
        ];
        assert!(allow("203.0.113.0/24")
            .check_reachable(&halves, &[])
            .is_err());
        assert!(allow("203.0.112.0/23")
            .check_reachable(&halves, &[])
            .is_ok());
        // Denylists may name anything.
        let deny = EgressFilter::Denylist {
            rules: vec!["10.0.0.0/8".parse().unwrap()],
        };
        assert!(deny.check_reachable(ALWAYS_BLOCKED, &[]).is_ok());
    }
}
