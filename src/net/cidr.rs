//! IPv4 networks (`a.b.c.d/len`): the address math the egress rules, the
//! firewall, the address blocks and the netlink encoders share.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// An IPv4 network, `a.b.c.d/len` (a bare address means /32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Cidr {
    pub addr: Ipv4Addr,
    pub prefix_len: u8,
}

impl Cidr {
    pub const fn new(addr: Ipv4Addr, prefix_len: u8) -> Cidr {
        Cidr { addr, prefix_len }
    }
    pub fn mask(&self) -> Ipv4Addr {
        if self.prefix_len == 0 {
            Ipv4Addr::UNSPECIFIED
        } else {
            Ipv4Addr::from(u32::MAX << (32 - u32::from(self.prefix_len.min(32))))
        }
    }
    pub fn network(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.addr) & u32::from(self.mask()))
    }
    /// Number of addresses (saturating at u32::MAX for /0).
    pub fn size(&self) -> u64 {
        1u64 << (32 - u32::from(self.prefix_len.min(32)))
    }
    pub fn contains(&self, a: Ipv4Addr) -> bool {
        u32::from(a) & u32::from(self.mask()) == u32::from(self.network())
    }
    /// Whether the two networks share an address.
    pub fn overlaps(&self, o: &Cidr) -> bool {
        let shorter = if self.prefix_len <= o.prefix_len {
            self
        } else {
            o
        };
        let other = if self.prefix_len <= o.prefix_len {
            o
        } else {
            self
        };
        shorter.contains(other.network())
    }
    /// Whether every address of `self` lies in `o`.
    pub fn within(&self, o: &Cidr) -> bool {
        self.prefix_len >= o.prefix_len && o.contains(self.network())
    }
    /// Whether every address of `self` lies in the union of `nets`.
    pub fn covered_by(&self, nets: &[Cidr]) -> bool {
        if nets.iter().any(|n| self.within(n)) {
            return true;
        }
        // Only a net strictly inside `self` can cover part of it: split
        // in halves while there is one (at most 32 levels deep).
        if self.prefix_len >= 32 || !nets.iter().any(|n| n.overlaps(self)) {
            return false;
        }
        let l = self.prefix_len + 1;
        let lo = Cidr::new(self.network(), l);
        let hi = Cidr::new(self.nth(1 << (32 - u32::from(l))), l);
        lo.covered_by(nets) && hi.covered_by(nets)
    }
    /// The `n`th address of the network.
    pub fn nth(&self, n: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network()).wrapping_add(n))
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network(), self.prefix_len)
    }
}

impl FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Cidr, String> {
        let (a, l) = match s.split_once('/') {
            Some((a, l)) => (
                a,
                l.parse::<u8>()
                    .map_err(|_| format!("bad prefix length in {s:?}"))?,
            ),
            None => (s, 32),
        };
        if l > 32 {
            return Err(format!("prefix length over 32 in {s:?}"));
        }
        let addr = a
            .parse::<Ipv4Addr>()
            .map_err(|_| format!("bad IPv4 address in {s:?}"))?;
        Ok(Cidr {
            addr,
            prefix_len: l,
        })
    }
}

impl TryFrom<String> for Cidr {
    type Error = String;
    fn try_from(s: String) -> Result<Cidr, String> {
        s.parse()
    }
}

impl From<Cidr> for String {
    fn from(c: Cidr) -> String {
        c.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidr_math() {
        let c: Cidr = "10.200.0.0/16".parse().unwrap();
        assert_eq!(c.size(), 65536);
        assert_eq!(c.nth(5), Ipv4Addr::new(10, 200, 0, 5));
        assert!(c.contains(Ipv4Addr::new(10, 200, 255, 1)));
        assert!(!c.contains(Ipv4Addr::new(10, 201, 0, 1)));
        assert_eq!(
            "0.0.0.0/0".parse::<Cidr>().unwrap().mask(),
            Ipv4Addr::UNSPECIFIED
        );
    }
}
