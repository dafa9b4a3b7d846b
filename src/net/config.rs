//! Network configuration of the daemon (serde, from the config file).

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{Cidr, NetError, Result};

/// Network configuration of the daemon.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NetConfig {
    /// Namespace that plays "the host" (a `/run/netns/NAME` or
    /// `/proc/PID/ns/net` path); `None`: the daemon's own namespace.
    pub host_netns: Option<PathBuf>,
    /// Host interface session traffic leaves by (masqueraded). Empty in a
    /// config file: the daemon takes the default route's interface.
    pub uplink_if: String,
    /// Name prefix of everything we create (at most 6 characters).
    pub prefix: String,
    /// Range the veth pairs' addresses come from.
    pub veth_range: Cidr,
    /// Size of one session's veth block: 30 or 31.
    pub veth_prefix_len: u8,
    /// Guest network behind the TAP, identical in every session: the TAP
    /// gets its first address, the guest the second.
    pub guest_cidr: Cidr,
    /// TAP name, identical in every session namespace.
    pub tap_name: String,
    /// Owner of the TAP, so an unprivileged VMM can attach to it.
    pub tap_uid: Option<u32>,
    pub tap_gid: Option<u32>,
    /// Extra destinations no session may reach (e.g. the host's public
    /// addresses on other interfaces, the daemon's port's address).
    pub blocked_extra: Vec<Cidr>,
    /// Explicit exceptions to the always-blocked set (host configuration only).
    pub allow_exceptions: Vec<Cidr>,
    /// Resolvers the per-session DNS forwarder asks (`"9.9.9.9:53"`), in
    /// order, from the host namespace. Needed only by sessions with a
    /// domain allowlist; never read from the host's resolv.conf.
    pub dns_upstreams: Vec<SocketAddr>,
    /// Per upstream and query.
    pub dns_timeout_ms: u64,
    /// Bounds on how long a resolved address stays allowed (the record's
    /// TTL, clamped): long enough for a connect after a TTL-0 answer.
    pub dns_ttl_min_secs: u32,
    pub dns_ttl_max_secs: u32,
    /// Addresses a session's DNS answers may keep allowed at once.
    pub dns_max_addrs: u32,
    /// TCP ports whose guest connections go through the inspection proxy
    /// (names checked by TLS SNI / HTTP Host) in sessions with a domain
    /// allowlist; see `src/net/proxy.rs`.
    pub proxy_ports: Vec<u16>,
    /// Port the proxy listens on at the TAP address (the redirect's target).
    pub proxy_listen_port: u16,
    /// CA bundle (PEM) the proxy verifies a secret's host against when it
    /// re-originates TLS for credential injection (`src/net/inject.rs`).
    pub proxy_upstream_ca: PathBuf,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            host_netns: None,
            uplink_if: String::new(),
            prefix: "asbx".into(),
            veth_range: Cidr::new(Ipv4Addr::new(10, 200, 0, 0), 16),
            veth_prefix_len: 30,
            guest_cidr: Cidr::new(Ipv4Addr::new(172, 16, 0, 0), 30),
            tap_name: "tap0".into(),
            tap_uid: None,
            tap_gid: None,
            blocked_extra: Vec::new(),
            allow_exceptions: Vec::new(),
            dns_upstreams: Vec::new(),
            dns_timeout_ms: 2000,
            dns_ttl_min_secs: 30,
            dns_ttl_max_secs: 86_400,
            dns_max_addrs: 4096,
            proxy_ports: vec![80, 443],
            proxy_listen_port: 3129,
            proxy_upstream_ca: PathBuf::from("/etc/ssl/certs/ca-certificates.crt"),
        }
    }
}

fn valid_ifname(s: &str) -> bool {
    !s.is_empty()
        && s.len() < libc::IFNAMSIZ
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

impl NetConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(NetError::Invalid(format!("network config: {m}")));
        if self.prefix.is_empty()
            || self.prefix.len() > 6
            || !self
                .prefix
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        {
            return bad(format!(
                "prefix {:?}: 1-6 lowercase letters or digits",
                self.prefix
            ));
        }
        if !self.uplink_if.is_empty() && !valid_ifname(&self.uplink_if) {
            return bad(format!(
                "uplink_if {:?} is not an interface name",
                self.uplink_if
            ));
        }
        if !valid_ifname(&self.tap_name) {
            return bad(format!(
                "tap_name {:?} is not an interface name",
                self.tap_name
            ));
        }
        if !(30..=31).contains(&self.veth_prefix_len) || self.veth_range.prefix_len > 30 {
            return bad(format!(
                "veth range {} / blocks /{}: blocks must be /30 or /31 inside the range",
                self.veth_range, self.veth_prefix_len
            ));
        }
        if self.guest_cidr.prefix_len > 30 {
            return bad(format!(
                "guest_cidr {} must hold at least 2 hosts (/30)",
                self.guest_cidr
            ));
        }
        if self.dns_ttl_min_secs == 0 || self.dns_ttl_min_secs > self.dns_ttl_max_secs {
            return bad(format!(
                "dns_ttl_min_secs {} must be between 1 and dns_ttl_max_secs {}",
                self.dns_ttl_min_secs, self.dns_ttl_max_secs
            ));
        }
        if !(100..=30_000).contains(&self.dns_timeout_ms) {
            return bad(format!(
                "dns_timeout_ms {}: between 100 and 30000",
                self.dns_timeout_ms
            ));
        }
        if !(1..=65_536).contains(&self.dns_max_addrs) {
            return bad(format!(
                "dns_max_addrs {}: between 1 and 65536",
                self.dns_max_addrs
            ));
        }
        if self.proxy_ports.is_empty()
            || self.proxy_ports.len() > 16
            || self.proxy_ports.iter().any(|p| *p == 0 || *p == 53)
        {
            return bad(format!(
                "proxy_ports {:?}: 1 to 16 TCP ports, none 0 or 53",
                self.proxy_ports
            ));
        }
        if self.proxy_listen_port == 0
            || self.proxy_listen_port == 53
            || self.proxy_ports.contains(&self.proxy_listen_port)
        {
            return bad(format!(
                "proxy_listen_port {}: not 0, 53 or one of proxy_ports",
                self.proxy_listen_port
            ));
        }
        Ok(())
    }

    pub(super) fn slots(&self) -> usize {
        (self.veth_range.size() >> (32 - u32::from(self.veth_prefix_len))) as usize
    }

    /// (host side, namespace side) addresses of block `slot`.
    pub(super) fn veth_addrs(&self, slot: usize) -> (Ipv4Addr, Ipv4Addr) {
        let block = 1u32 << (32 - u32::from(self.veth_prefix_len));
        let first = slot as u32 * block + if self.veth_prefix_len == 31 { 0 } else { 1 };
        (self.veth_range.nth(first), self.veth_range.nth(first + 1))
    }

    pub fn tap_addr(&self) -> Ipv4Addr {
        self.guest_cidr.nth(1)
    }
    pub fn guest_addr(&self) -> Ipv4Addr {
        self.guest_cidr.nth(2)
    }
}
