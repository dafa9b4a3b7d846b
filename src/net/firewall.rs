//! Our nftables tables. Netfilter state is per network namespace, so:
//!
//! - the **host table** (in the host namespace) is static: it does not change
//!   per session. It drops anything from a session link to the host itself,
//!   to another session or to the always-blocked set, forwards session
//!   traffic only to the uplink, masquerades it there, and guards the exit:
//!   nothing leaves with a guest source address.
//! - each **session table** lives in the session's namespace: masquerade of
//!   the guest to the veth address plus the egress policy. It is built in one
//!   transaction before any link of the session is up, replaced atomically
//!   on a policy change and dies with the namespace.

use super::cidr::Cidr;
use super::egress::ALWAYS_BLOCKED;
use super::nft::{BaseChain, Chain, Hook, IfName, Match, Rule, Set, Table, Verdict};
use super::{EgressFilter, NetConfig, NetPolicy};

/// Name of the session table's set of addresses the DNS forwarder
/// resolved for allowed names (it fills the set, this table matches it).
pub const SET: &str = "dns_allowed";

/// Chain holding the mode rules; flushed and refilled on a live change.
pub const POLICY_CHAIN: &str = "session_policy";

/// Chain (nat prerouting) sending the guest's TCP to the proxied ports to
/// the inspection proxy; refilled on a live change like the policy chain.
pub const PROXY_CHAIN: &str = "session_proxy";

/// Whether `p`'s sessions go through the inspection proxy: a domain
/// allowlist in a mode that ends in drop. (`internet` and `denylist` reach
/// any address anyway: a name check there would stop nothing.)
pub fn proxied(p: &NetPolicy) -> bool {
    !p.domains.is_empty()
        && matches!(
            p.egress,
            EgressFilter::None | EgressFilter::Allowlist { .. }
        )
}

/// Rules of the proxy chain: destinations an allowlist rule names pass as
/// they are (plain CIDR rules stay address rules); other TCP to a proxied
/// port goes to the proxy. With `injecting` (the session has secrets for
/// the proxy to put in) all TCP to those ports goes to it, whatever the
/// mode: it applies the mode's rules itself.
pub fn proxy_rules(cfg: &NetConfig, p: &NetPolicy, injecting: bool) -> Vec<Rule> {
    if !proxied(p) && !injecting {
        return Vec::new();
    }
    let mut rules: Vec<Rule> = match &p.egress {
        EgressFilter::Allowlist { .. } if proxied(p) => {
            let mut v = p.egress.to_rules();
            v.pop(); // the final drop
            v.into_iter()
                .map(|r| Rule::new(r.matches, Verdict::Accept))
                .collect()
        }
        _ => Vec::new(),
    };
    for port in &cfg.proxy_ports {
        rules.push(Rule::new(
            vec![Match::L4Proto(6), Match::Dport(*port)],
            Verdict::Redirect(cfg.proxy_listen_port),
        ));
    }
    rules
}

fn base(kind: &'static str, hook: Hook, priority: i32, accept: bool) -> Option<BaseChain> {
    Some(BaseChain {
        kind,
        hook,
        priority,
        accept_by_default: accept,
    })
}

/// Rules of the policy chain: the mode's rules, with addresses the DNS
/// forwarder resolved for allowed names accepted just before the mode's
/// final verdict (so a denylist still applies to them).
///
/// A connection opened that way is marked with `generation`, and its later
/// packets pass while the mark is current: a download outlives the TTL of
/// the address it started on. A policy change that touches names or rules
/// uses a new generation, which cuts those connections.
pub fn policy_rules(p: &NetPolicy, generation: u32) -> Vec<Rule> {
    let mut rules = p.egress.to_rules();
    if !p.domains.is_empty() {
        let mut at = rules.len().saturating_sub(1);
        if proxied(p) {
            // QUIC carries its SNI where the proxy does not look: HTTP/3
            // clients fall back to TCP, which the proxy inspects.
            rules.insert(
                at,
                Rule::new(vec![Match::L4Proto(17), Match::Dport(443)], Verdict::Drop),
            );
            at += 1;
        }
        rules.insert(
            at,
            Rule::new(
                vec![Match::DaddrInSet(SET.into())],
                Verdict::MarkAccept(generation),
            ),
        );
        rules.insert(
            0,
            Rule::new(
                vec![Match::CtEstablishedRelated, Match::CtMark(generation)],
                Verdict::Accept,
            ),
        );
    }
    rules
}

/// Every destination a session may never reach (without exceptions).
pub fn blocked_set(cfg: &NetConfig) -> Vec<Cidr> {
    let mut v: Vec<Cidr> = ALWAYS_BLOCKED.to_vec();
    v.push(cfg.veth_range);
    v.push(cfg.guest_cidr);
    v.extend(cfg.blocked_extra.iter().copied());
    v
}

/// The host table. `uplink_nets`: the networks attached to the uplink
/// ([`super::rtnl::Rtnl::connected_nets`]), blocked whatever their
/// addresses: the host's LAN is no more the sessions' business than
/// RFC 1918 space is, and a public LAN is not in [`ALWAYS_BLOCKED`].
pub fn host_table(cfg: &NetConfig, uplink_nets: &[Cidr]) -> Table {
    let ours = || IfName::Prefix(cfg.prefix.clone());
    let uplink = IfName::Exact(cfg.uplink_if.clone());
    let r = Rule::new;
    let mut forward = Vec::new();
    for c in &cfg.allow_exceptions {
        forward.push(r(
            vec![
                Match::Iif(ours()),
                Match::Oif(uplink.clone()),
                Match::Daddr(*c),
            ],
            Verdict::Accept,
        ));
    }
    for c in blocked_set(cfg)
        .into_iter()
        .chain(uplink_nets.iter().copied())
    {
        forward.push(r(vec![Match::Iif(ours()), Match::Daddr(c)], Verdict::Drop));
    }
    forward.extend([
        r(
            vec![Match::Iif(ours()), Match::Oif(uplink.clone())],
            Verdict::Accept,
        ),
        r(vec![Match::Iif(ours())], Verdict::Drop),
        r(
            vec![Match::Oif(ours()), Match::CtEstablishedRelated],
            Verdict::Accept,
        ),
        r(vec![Match::Oif(ours())], Verdict::Drop),
    ]);
    Table {
        name: cfg.prefix.clone(),
        sets: vec![],
        chains: vec![
            Chain {
                // Sessions never talk to the host itself (any address of it).
                name: "input".into(),
                base: base("filter", Hook::Input, -10, true),
                rules: vec![r(vec![Match::Iif(ours())], Verdict::Drop)],
            },
            Chain {
                name: "forward".into(),
                base: base("filter", Hook::Forward, -10, true),
                rules: forward,
            },
            Chain {
                name: "nat".into(),
                base: base("nat", Hook::Postrouting, 100, true),
                rules: vec![r(
                    vec![Match::Oif(uplink.clone()), Match::Saddr(cfg.veth_range)],
                    Verdict::Masquerade,
                )],
            },
            Chain {
                // After NAT: whatever still carries a guest or un-NATed session
                // source address must not leave.
                name: "guard".into(),
                base: base("filter", Hook::Postrouting, 300, true),
                rules: vec![
                    r(vec![Match::Saddr(cfg.guest_cidr)], Verdict::Drop),
                    r(
                        vec![Match::Oif(uplink), Match::Saddr(cfg.veth_range)],
                        Verdict::Drop,
                    ),
                ],
            },
        ],
    }
}

/// The table inside a session namespace. `peer_if` is the namespace end of
/// the veth pair.
pub fn session_table(cfg: &NetConfig, peer_if: &str, policy: &NetPolicy, injecting: bool) -> Table {
    let r = Rule::new;
    let tap = IfName::Exact(cfg.tap_name.clone());
    let peer = IfName::Exact(peer_if.to_string());
    let guest = Match::Saddr(cfg.guest_cidr);
    let mut egress = Vec::new();
    for c in &cfg.allow_exceptions {
        egress.push(r(
            vec![Match::Daddr(*c)],
            Verdict::Jump(POLICY_CHAIN.into()),
        ));
    }
    for c in blocked_set(cfg) {
        egress.push(r(vec![Match::Daddr(c)], Verdict::Drop));
    }
    egress.push(r(vec![], Verdict::Jump(POLICY_CHAIN.into())));
    egress.push(r(vec![], Verdict::Drop));
    // Replies to connections the namespace opened to the guest (the
    // daemon dialing a guest port for a preview URL, `net::connect`); the
    // guest itself opens none to the namespace but the two below.
    let mut input = vec![r(
        vec![Match::Iif(tap.clone()), Match::CtEstablishedRelated],
        Verdict::Accept,
    )];
    // The guest may ask the DNS forwarder on its gateway (port 53); when
    // none runs it gets a port-unreachable at once.
    for proto in [6u8, 17] {
        input.push(r(
            vec![
                Match::Iif(tap.clone()),
                Match::Daddr(Cidr::new(cfg.tap_addr(), 32)),
                Match::L4Proto(proto),
                Match::Dport(53),
            ],
            Verdict::Accept,
        ));
    }
    // The inspection proxy, reached through the redirect (its own port
    // reached directly is closed by the proxy at once).
    input.push(r(
        vec![
            Match::Iif(tap.clone()),
            Match::Daddr(Cidr::new(cfg.tap_addr(), 32)),
            Match::L4Proto(6),
            Match::Dport(cfg.proxy_listen_port),
        ],
        Verdict::Accept,
    ));
    input.push(r(vec![Match::Iif(tap.clone())], Verdict::Drop));
    Table {
        name: cfg.prefix.clone(),
        sets: vec![Set {
            name: SET.into(),
            size: cfg.dns_max_addrs,
        }],
        chains: vec![
            Chain {
                name: "forward".into(),
                base: base("filter", Hook::Forward, 0, false),
                rules: vec![
                    r(
                        vec![
                            Match::Iif(peer.clone()),
                            Match::Oif(tap.clone()),
                            Match::CtEstablishedRelated,
                        ],
                        Verdict::Accept,
                    ),
                    r(
                        vec![
                            Match::Iif(tap.clone()),
                            Match::Oif(peer.clone()),
                            guest.clone(),
                        ],
                        Verdict::Jump("egress".into()),
                    ),
                ],
            },
            Chain {
                name: "egress".into(),
                base: None,
                rules: egress,
            },
            Chain {
                name: POLICY_CHAIN.into(),
                base: None,
                rules: policy_rules(policy, 1),
            },
            Chain {
                // The guest does not reach the namespace itself; the host
                // side reaches it only with replies.
                name: "input".into(),
                base: base("filter", Hook::Input, 0, true),
                rules: [
                    input,
                    vec![
                        r(
                            vec![Match::Iif(peer.clone()), Match::CtEstablishedRelated],
                            Verdict::Accept,
                        ),
                        r(vec![Match::Iif(peer.clone())], Verdict::Drop),
                    ],
                ]
                .concat(),
            },
            Chain {
                name: "nat".into(),
                base: base("nat", Hook::Postrouting, 100, true),
                rules: vec![r(
                    vec![Match::Oif(peer), guest.clone()],
                    Verdict::Masquerade,
                )],
            },
            Chain {
                name: "prerouting".into(),
                base: base("nat", Hook::Prerouting, -100, true),
                rules: vec![r(
                    vec![Match::Iif(tap), guest],
                    Verdict::Jump(PROXY_CHAIN.into()),
                )],
            },
            Chain {
                name: PROXY_CHAIN.into(),
                base: None,
                rules: proxy_rules(cfg, policy, injecting),
            },
        ],
    }
}
