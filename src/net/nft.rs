//! A small nf_tables client speaking netlink directly (no libnftnl, no `nft`
//! process): enough to build tables, base chains and rules out of a few
//! match kinds, in one atomic batch per change.
//!
//! Rules are described by [`Rule`]; the same value renders to `nft` syntax
//! ([`Rule::to_nft`]) for logs, docs and the command-line comparison bench.

use std::fmt::Write as _;
use std::net::Ipv4Addr;

use netlink_sys::{protocols::NETLINK_NETFILTER, Socket, SocketAddr};

use super::cidr::Cidr;
use super::NetError;

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 16;
const NFNL_MSG_BATCH_END: u16 = 17;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;

const MSG_NEWTABLE: u16 = 0;
const MSG_GETTABLE: u16 = 1;
const MSG_DELTABLE: u16 = 2;
const MSG_NEWCHAIN: u16 = 3;
const MSG_NEWRULE: u16 = 6;
const MSG_GETRULE: u16 = 7;
const MSG_DELRULE: u16 = 8;
const MSG_NEWSET: u16 = 9;
const MSG_NEWSETELEM: u16 = 12;
const MSG_DELSETELEM: u16 = 14;
const MSG_GETGEN: u16 = 16;

const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLM_F_DUMP: u16 = 0x300;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_APPEND: u16 = 0x800;
const NLA_F_NESTED: u16 = 0x8000;

pub const NFPROTO_IPV4: u8 = 2;

// Attribute numbers from include/uapi/linux/netfilter/nf_tables.h.
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;
const NFTA_META_DREG: u16 = 1;
const NFTA_META_KEY: u16 = 2;
const NFTA_CMP_SREG: u16 = 1;
const NFTA_CMP_OP: u16 = 2;
const NFTA_CMP_DATA: u16 = 3;
const NFTA_PAYLOAD_DREG: u16 = 1;
const NFTA_PAYLOAD_BASE: u16 = 2;
const NFTA_PAYLOAD_OFFSET: u16 = 3;
const NFTA_PAYLOAD_LEN: u16 = 4;
const NFTA_BITWISE_SREG: u16 = 1;
const NFTA_BITWISE_DREG: u16 = 2;
const NFTA_BITWISE_LEN: u16 = 3;
const NFTA_BITWISE_MASK: u16 = 4;
const NFTA_BITWISE_XOR: u16 = 5;
const NFTA_IMMEDIATE_DREG: u16 = 1;
const NFTA_REDIR_REG_PROTO_MIN: u16 = 1;
const NFTA_IMMEDIATE_DATA: u16 = 2;
const NFTA_CT_DREG: u16 = 1;
const NFTA_CT_KEY: u16 = 2;
const NFTA_CT_SREG: u16 = 4;

const NFTA_SET_TABLE: u16 = 1;
const NFTA_SET_NAME: u16 = 2;
const NFTA_SET_FLAGS: u16 = 3;
const NFTA_SET_KEY_TYPE: u16 = 4;
const NFTA_SET_KEY_LEN: u16 = 5;
const NFTA_SET_DESC: u16 = 9;
const NFTA_SET_ID: u16 = 10;
const NFTA_SET_DESC_SIZE: u16 = 1;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_TIMEOUT: u16 = 4;
const NFTA_LOOKUP_SET: u16 = 1;
const NFTA_LOOKUP_SREG: u16 = 2;
/// `flags timeout`: elements may carry a timeout.
const NFT_SET_TIMEOUT: u32 = 0x10;
/// nft(8)'s data type number for `ipv4_addr` (only shown by `nft list`).
const NFT_TYPE_IPADDR: u32 = 7;

const NFT_REG_VERDICT: u32 = 0;
const NFT_REG_1: u32 = 1;
const NFT_CMP_EQ: u32 = 0;
const NFT_CMP_NEQ: u32 = 1;
const NFT_META_IIFNAME: u32 = 6;
const NFT_META_OIFNAME: u32 = 7;
const NFT_META_L4PROTO: u32 = 16;
const NFT_PAYLOAD_NETWORK: u32 = 1;
const NFT_PAYLOAD_TRANSPORT: u32 = 2;
const NFT_CT_STATE: u32 = 0;
const NFT_CT_MARK: u32 = 3;
const NF_DROP: i32 = 0;
const NF_ACCEPT: i32 = 1;
const NFT_JUMP: i32 = -3;
const NFT_RETURN: i32 = -5;

/// ct state bits (NF_CT_STATE_BIT): established = 1<<1, related = 1<<2.
const CT_ESTABLISHED_RELATED: u32 = 0b110;

/// Netfilter hooks of the ip family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    Prerouting = 0,
    Input = 1,
    Forward = 2,
    Output = 3,
    Postrouting = 4,
}

impl Hook {
    fn nft_name(self) -> &'static str {
        match self {
            Hook::Prerouting => "prerouting",
            Hook::Input => "input",
            Hook::Forward => "forward",
            Hook::Output => "output",
            Hook::Postrouting => "postrouting",
        }
    }
}

/// A base chain's hook; absent for a regular (jump target) chain.
#[derive(Debug, Clone)]
pub struct BaseChain {
    pub kind: &'static str, // "filter" or "nat"
    pub hook: Hook,
    pub priority: i32,
    pub accept_by_default: bool,
}

/// An interface name match: exact or a prefix (`asbx*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IfName {
    Exact(String),
    Prefix(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Match {
    Iif(IfName),
    Oif(IfName),
    Saddr(Cidr),
    Daddr(Cidr),
    /// IP protocol number (6 tcp, 17 udp).
    L4Proto(u8),
    /// Destination port; needs an `L4Proto` of tcp or udp before it.
    Dport(u16),
    CtEstablishedRelated,
    /// Destination address is an element of the named set of the table.
    DaddrInSet(String),
    /// The connection's conntrack mark equals this.
    CtMark(u32),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Accept,
    Drop,
    Return,
    Jump(String),
    Masquerade,
    /// Set the connection's conntrack mark, then accept.
    MarkAccept(u32),
    /// NAT to this port on the receiving interface's address (nat chains).
    Redirect(u16),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub matches: Vec<Match>,
    pub verdict: Verdict,
}

impl Rule {
    pub fn new(matches: Vec<Match>, verdict: Verdict) -> Rule {
        Rule { matches, verdict }
    }

    /// The rule in `nft` syntax.
    pub fn to_nft(&self) -> String {
        let mut s = String::new();
        for m in &self.matches {
            let _ = match m {
                Match::Iif(IfName::Exact(n)) => write!(s, "iifname \"{n}\" "),
                Match::Iif(IfName::Prefix(n)) => write!(s, "iifname \"{n}*\" "),
                Match::Oif(IfName::Exact(n)) => write!(s, "oifname \"{n}\" "),
                Match::Oif(IfName::Prefix(n)) => write!(s, "oifname \"{n}*\" "),
                Match::Saddr(c) => write!(s, "ip saddr {c} "),
                Match::Daddr(c) => write!(s, "ip daddr {c} "),
                Match::L4Proto(p) => write!(s, "meta l4proto {p} "),
                Match::Dport(p) => write!(s, "th dport {p} "),
                Match::CtEstablishedRelated => write!(s, "ct state established,related "),
                Match::DaddrInSet(n) => write!(s, "ip daddr @{n} "),
                Match::CtMark(v) => write!(s, "ct mark {v:#x} "),
            };
        }
        let _ = match &self.verdict {
            Verdict::Accept => write!(s, "accept"),
            Verdict::Drop => write!(s, "drop"),
            Verdict::Return => write!(s, "return"),
            Verdict::Jump(c) => write!(s, "jump {c}"),
            Verdict::Masquerade => write!(s, "masquerade"),
            Verdict::MarkAccept(v) => write!(s, "ct mark set {v:#x} accept"),
            Verdict::Redirect(p) => write!(s, "redirect to :{p}"),
        };
        s
    }
}

/// A chain and its rules, the unit our tables are built from.
#[derive(Debug, Clone)]
pub struct Chain {
    pub name: String,
    pub base: Option<BaseChain>,
    pub rules: Vec<Rule>,
}

/// A named set of IPv4 addresses whose elements expire (`flags timeout`),
/// holding at most `size` elements.
#[derive(Debug, Clone)]
pub struct Set {
    pub name: String,
    pub size: u32,
}

/// A whole table of ours.
#[derive(Debug, Clone)]
pub struct Table {
    pub name: String,
    pub sets: Vec<Set>,
    pub chains: Vec<Chain>,
}

impl Table {
    /// `nft -f` script that replaces the table (creates it when missing).
    pub fn to_nft_script(&self) -> String {
        let mut s = format!(
            "add table ip {0}\ndelete table ip {0}\ntable ip {0} {{\n",
            self.name
        );
        for set in &self.sets {
            let _ = writeln!(
                s,
                "  set {} {{ type ipv4_addr; flags timeout; size {}; }}",
                set.name, set.size
            );
        }
        for c in &self.chains {
            let _ = writeln!(s, "  chain {} {{", c.name);
            if let Some(b) = &c.base {
                let _ = writeln!(
                    s,
                    "    type {} hook {} priority {}; policy {};",
                    b.kind,
                    b.hook.nft_name(),
                    b.priority,
                    if b.accept_by_default {
                        "accept"
                    } else {
                        "drop"
                    }
                );
            }
            for r in &c.rules {
                let _ = writeln!(s, "    {}", r.to_nft());
            }
            s.push_str("  }\n");
        }
        s.push_str("}\n");
        s
    }

    pub fn rule_count(&self) -> usize {
        self.chains.iter().map(|c| c.rules.len()).sum()
    }
}

/// Builder of netlink attributes into a message buffer.
struct Msg<'a> {
    buf: &'a mut Vec<u8>,
    nests: Vec<usize>,
}

impl Msg<'_> {
    fn attr(&mut self, kind: u16, data: &[u8]) {
        let len = 4 + data.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.pad();
    }
    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }
    fn str(&mut self, kind: u16, s: &str) {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        self.attr(kind, &v);
    }
    fn u32(&mut self, kind: u16, v: u32) {
        self.attr(kind, &v.to_be_bytes());
    }
    fn u64(&mut self, kind: u16, v: u64) {
        self.attr(kind, &v.to_be_bytes());
    }
    fn begin(&mut self, kind: u16) {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&[0, 0]);
        self.buf
            .extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
    }
    fn end(&mut self) {
        if let Some(start) = self.nests.pop() {
            let len = (self.buf.len() - start) as u16;
            self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        }
    }
    fn data_value(&mut self, kind: u16, v: &[u8]) {
        self.begin(kind);
        self.attr(NFTA_DATA_VALUE, v);
        self.end();
    }
    fn expr(&mut self, name: &str, body: impl FnOnce(&mut Self)) {
        self.begin(NFTA_LIST_ELEM);
        self.str(NFTA_EXPR_NAME, name);
        self.begin(NFTA_EXPR_DATA);
        body(self);
        self.end();
        self.end();
    }
    fn cmp(&mut self, op: u32, data: &[u8]) {
        self.expr("cmp", |m| {
            m.u32(NFTA_CMP_SREG, NFT_REG_1);
            m.u32(NFTA_CMP_OP, op);
            m.data_value(NFTA_CMP_DATA, data);
        });
    }
    fn meta(&mut self, key: u32) {
        self.expr("meta", |m| {
            m.u32(NFTA_META_KEY, key);
            m.u32(NFTA_META_DREG, NFT_REG_1);
        });
    }
    fn payload(&mut self, base: u32, off: u32, len: u32) {
        self.expr("payload", |m| {
            m.u32(NFTA_PAYLOAD_DREG, NFT_REG_1);
            m.u32(NFTA_PAYLOAD_BASE, base);
            m.u32(NFTA_PAYLOAD_OFFSET, off);
            m.u32(NFTA_PAYLOAD_LEN, len);
        });
    }
    fn bitwise(&mut self, mask: &[u8]) {
        let zero = vec![0u8; mask.len()];
        self.expr("bitwise", |m| {
            m.u32(NFTA_BITWISE_SREG, NFT_REG_1);
            m.u32(NFTA_BITWISE_DREG, NFT_REG_1);
            m.u32(NFTA_BITWISE_LEN, mask.len() as u32);
            m.data_value(NFTA_BITWISE_MASK, mask);
            m.data_value(NFTA_BITWISE_XOR, &zero);
        });
    }
    fn verdict(&mut self, code: i32, chain: Option<&str>) {
        self.expr("immediate", |m| {
            m.u32(NFTA_IMMEDIATE_DREG, NFT_REG_VERDICT);
            m.begin(NFTA_IMMEDIATE_DATA);
            m.begin(NFTA_DATA_VERDICT);
            m.u32(NFTA_VERDICT_CODE, code as u32);
            if let Some(c) = chain {
                m.str(NFTA_VERDICT_CHAIN, c);
            }
            m.end();
            m.end();
        });
    }
    fn ifname(&mut self, key: u32, n: &IfName) {
        self.meta(key);
        match n {
            IfName::Exact(s) => {
                let mut v = [0u8; 16];
                let b = s.as_bytes();
                let l = b.len().min(15);
                v[..l].copy_from_slice(&b[..l]);
                self.cmp(NFT_CMP_EQ, &v);
            }
            IfName::Prefix(s) => self.cmp(NFT_CMP_EQ, s.as_bytes()),
        }
    }
    fn addr(&mut self, off: u32, c: &Cidr) {
        if c.prefix_len == 0 {
            return; // matches everything
        }
        self.payload(NFT_PAYLOAD_NETWORK, off, 4);
        if c.prefix_len < 32 {
            self.bitwise(&c.mask().octets());
        }
        self.cmp(NFT_CMP_EQ, &c.network().octets());
    }
}

/// One netlink transaction under construction.
pub struct Batch {
    buf: Vec<u8>,
    seq: u32,
    /// What each message does, by sequence number offset, for errors.
    what: Vec<(u32, String)>,
}

impl Batch {
    fn new(seq: u32) -> Batch {
        let mut b = Batch {
            buf: Vec::with_capacity(4096),
            seq,
            what: Vec::new(),
        };
        b.header(
            NFNL_MSG_BATCH_BEGIN,
            NLM_F_REQUEST,
            0,
            NFNL_SUBSYS_NFTABLES.to_be(),
        );
        b.close_msg(0);
        b
    }

    /// Start a message; returns its start offset for `close_msg`.
    fn header(&mut self, ty: u16, flags: u16, family: u8, res_id: u16) -> usize {
        let start = self.buf.len();
        self.seq = self.seq.wrapping_add(1);
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(&flags.to_ne_bytes());
        self.buf.extend_from_slice(&self.seq.to_ne_bytes());
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self.buf.push(family);
        self.buf.push(0); // NFNETLINK_V0
        self.buf.extend_from_slice(&res_id.to_ne_bytes());
        start
    }

    fn close_msg(&mut self, start: usize) {
        let len = (self.buf.len() - start) as u32;
        self.buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    }

    fn msg(&mut self, ty: u16, flags: u16, what: String, body: impl FnOnce(&mut Msg)) {
        let start = self.header(
            (NFNL_SUBSYS_NFTABLES << 8) | ty,
            NLM_F_REQUEST | NLM_F_ACK | flags,
            NFPROTO_IPV4,
            0,
        );
        self.what.push((self.seq, what));
        let mut m = Msg {
            buf: &mut self.buf,
            nests: Vec::new(),
        };
        body(&mut m);
        self.close_msg(start);
    }

    pub fn add_table(&mut self, name: &str) {
        self.msg(
            MSG_NEWTABLE,
            NLM_F_CREATE,
            format!("add table {name}"),
            |m| m.str(NFTA_TABLE_NAME, name),
        );
    }

    pub fn del_table(&mut self, name: &str) {
        self.msg(MSG_DELTABLE, 0, format!("delete table {name}"), |m| {
            m.str(NFTA_TABLE_NAME, name)
        });
    }

    /// Delete `name` whether or not it exists (add-then-delete, which works on
    /// kernels older than NFT_MSG_DESTROYTABLE).
    pub fn remove_table(&mut self, name: &str) {
        self.add_table(name);
        self.del_table(name);
    }

    pub fn add_chain(&mut self, table: &str, chain: &Chain) {
        self.msg(
            MSG_NEWCHAIN,
            NLM_F_CREATE,
            format!("add chain {table} {}", chain.name),
            |m| {
                m.str(NFTA_CHAIN_TABLE, table);
                m.str(NFTA_CHAIN_NAME, &chain.name);
                if let Some(b) = &chain.base {
                    m.begin(NFTA_CHAIN_HOOK);
                    m.u32(NFTA_HOOK_HOOKNUM, b.hook as u32);
                    m.u32(NFTA_HOOK_PRIORITY, b.priority as u32);
                    m.end();
                    m.u32(
                        NFTA_CHAIN_POLICY,
                        if b.accept_by_default {
                            NF_ACCEPT
                        } else {
                            NF_DROP
                        } as u32,
                    );
                    m.str(NFTA_CHAIN_TYPE, b.kind);
                }
            },
        );
    }

    /// Remove every rule of a chain (`nft flush chain`).
    pub fn flush_chain(&mut self, table: &str, chain: &str) {
        self.msg(
            MSG_DELRULE,
            0,
            format!("flush chain {table} {chain}"),
            |m| {
                m.str(NFTA_RULE_TABLE, table);
                m.str(NFTA_RULE_CHAIN, chain);
            },
        );
    }

    pub fn add_rule(&mut self, table: &str, chain: &str, rule: &Rule) {
        self.msg(
            MSG_NEWRULE,
            NLM_F_CREATE | NLM_F_APPEND,
            format!("add rule {table} {chain} {}", rule.to_nft()),
            |m| {
                m.str(NFTA_RULE_TABLE, table);
                m.str(NFTA_RULE_CHAIN, chain);
                m.begin(NFTA_RULE_EXPRESSIONS);
                for x in &rule.matches {
                    match x {
                        Match::Iif(n) => m.ifname(NFT_META_IIFNAME, n),
                        Match::Oif(n) => m.ifname(NFT_META_OIFNAME, n),
                        Match::Saddr(c) => m.addr(12, c),
                        Match::Daddr(c) => m.addr(16, c),
                        Match::L4Proto(p) => {
                            m.meta(NFT_META_L4PROTO);
                            m.cmp(NFT_CMP_EQ, &[*p]);
                        }
                        Match::Dport(p) => {
                            m.payload(NFT_PAYLOAD_TRANSPORT, 2, 2);
                            m.cmp(NFT_CMP_EQ, &p.to_be_bytes());
                        }
                        Match::CtEstablishedRelated => {
                            m.expr("ct", |m| {
                                m.u32(NFTA_CT_KEY, NFT_CT_STATE);
                                m.u32(NFTA_CT_DREG, NFT_REG_1);
                            });
                            m.bitwise(&CT_ESTABLISHED_RELATED.to_ne_bytes());
                            m.cmp(NFT_CMP_NEQ, &[0; 4]);
                        }
                        Match::CtMark(v) => {
                            m.expr("ct", |m| {
                                m.u32(NFTA_CT_KEY, NFT_CT_MARK);
                                m.u32(NFTA_CT_DREG, NFT_REG_1);
                            });
                            // Registers hold the mark in host byte order.
                            m.cmp(NFT_CMP_EQ, &v.to_ne_bytes());
                        }
                        Match::DaddrInSet(set) => {
                            m.payload(NFT_PAYLOAD_NETWORK, 16, 4);
                            m.expr("lookup", |m| {
                                m.str(NFTA_LOOKUP_SET, set);
                                m.u32(NFTA_LOOKUP_SREG, NFT_REG_1);
                            });
                        }
                    }
                }
                match &rule.verdict {
                    Verdict::Accept => m.verdict(NF_ACCEPT, None),
                    Verdict::Drop => m.verdict(NF_DROP, None),
                    Verdict::Return => m.verdict(NFT_RETURN, None),
                    Verdict::Jump(c) => m.verdict(NFT_JUMP, Some(c)),
                    Verdict::Masquerade => m.expr("masq", |_| {}),
                    Verdict::Redirect(port) => {
                        // The port in network order in a register, then
                        // `redir proto_min reg 1` (the kernel sets
                        // NF_NAT_RANGE_PROTO_SPECIFIED itself).
                        m.expr("immediate", |m| {
                            m.u32(NFTA_IMMEDIATE_DREG, NFT_REG_1);
                            m.data_value(NFTA_IMMEDIATE_DATA, &port.to_be_bytes());
                        });
                        m.expr("redir", |m| {
                            m.u32(NFTA_REDIR_REG_PROTO_MIN, NFT_REG_1);
                        });
                    }
                    Verdict::MarkAccept(v) => {
                        m.expr("immediate", |m| {
                            m.u32(NFTA_IMMEDIATE_DREG, NFT_REG_1);
                            m.data_value(NFTA_IMMEDIATE_DATA, &v.to_ne_bytes());
                        });
                        m.expr("ct", |m| {
                            m.u32(NFTA_CT_KEY, NFT_CT_MARK);
                            m.u32(NFTA_CT_SREG, NFT_REG_1);
                        });
                        m.verdict(NF_ACCEPT, None);
                    }
                }
                m.end();
            },
        );
    }

    pub fn add_set(&mut self, table: &str, set: &Set, id: u32) {
        self.msg(
            MSG_NEWSET,
            NLM_F_CREATE,
            format!("add set {table} {}", set.name),
            |m| {
                m.str(NFTA_SET_TABLE, table);
                m.str(NFTA_SET_NAME, &set.name);
                m.u32(NFTA_SET_FLAGS, NFT_SET_TIMEOUT);
                m.u32(NFTA_SET_KEY_TYPE, NFT_TYPE_IPADDR);
                m.u32(NFTA_SET_KEY_LEN, 4);
                m.u32(NFTA_SET_ID, id);
                m.begin(NFTA_SET_DESC);
                m.u32(NFTA_SET_DESC_SIZE, set.size);
                m.end();
            },
        );
    }

    fn set_elems(
        &mut self,
        ty: u16,
        what: String,
        table: &str,
        set: &str,
        elems: Option<&[(Ipv4Addr, Option<u64>)]>,
    ) {
        let flags = if ty == MSG_NEWSETELEM {
            NLM_F_CREATE
        } else {
            0
        };
        self.msg(ty, flags, what, |m| {
            m.str(NFTA_SET_ELEM_LIST_TABLE, table);
            m.str(NFTA_SET_ELEM_LIST_SET, set);
            if let Some(elems) = elems {
                m.begin(NFTA_SET_ELEM_LIST_ELEMENTS);
                for (a, timeout_ms) in elems {
                    m.begin(NFTA_LIST_ELEM);
                    m.data_value(NFTA_SET_ELEM_KEY, &a.octets());
                    if let Some(t) = timeout_ms {
                        m.u64(NFTA_SET_ELEM_TIMEOUT, *t);
                    }
                    m.end();
                }
                m.end();
            }
        });
    }

    /// Add addresses to a timeout set, each expiring after its timeout
    /// (milliseconds) counted from this commit. An element already present
    /// is given exactly the new timeout (add, delete, add: re-adding alone
    /// does not refresh a timeout on kernels before 6.10).
    pub fn put_set_elems(&mut self, table: &str, set: &str, elems: &[(Ipv4Addr, u64)]) {
        if elems.is_empty() {
            return;
        }
        let with: Vec<(Ipv4Addr, Option<u64>)> =
            elems.iter().map(|(a, t)| (*a, Some(*t))).collect();
        let bare: Vec<(Ipv4Addr, Option<u64>)> = elems.iter().map(|(a, _)| (*a, None)).collect();
        let what = format!("add {} element(s) to set {table} {set}", elems.len());
        self.set_elems(MSG_NEWSETELEM, what.clone(), table, set, Some(&with));
        self.set_elems(MSG_DELSETELEM, what.clone(), table, set, Some(&bare));
        self.set_elems(MSG_NEWSETELEM, what, table, set, Some(&with));
    }

    /// Remove every element of a set.
    pub fn flush_set(&mut self, table: &str, set: &str) {
        let what = format!("flush set {table} {set}");
        self.set_elems(MSG_DELSETELEM, what, table, set, None);
    }

    /// Build `table`, which must not exist yet.
    pub fn create_table(&mut self, t: &Table) {
        self.add_table(&t.name);
        for (i, s) in t.sets.iter().enumerate() {
            self.add_set(&t.name, s, i as u32 + 1);
        }
        for c in &t.chains {
            self.add_chain(&t.name, c);
        }
        for c in &t.chains {
            for r in &c.rules {
                self.add_rule(&t.name, &c.name, r);
            }
        }
    }

    /// Replace `table` as a whole: delete any old one and build the new one,
    /// in the same transaction, so there is no moment without rules.
    pub fn replace_table(&mut self, t: &Table) {
        self.remove_table(&t.name);
        self.create_table(t);
    }

    /// Replace the rules of one chain atomically.
    pub fn replace_chain_rules(&mut self, table: &str, chain: &str, rules: &[Rule]) {
        self.flush_chain(table, chain);
        for r in rules {
            self.add_rule(table, chain, r);
        }
    }

    fn finish(mut self) -> (Vec<u8>, u32, Vec<(u32, String)>) {
        let start = self.header(
            NFNL_MSG_BATCH_END,
            NLM_F_REQUEST,
            0,
            NFNL_SUBSYS_NFTABLES.to_be(),
        );
        self.close_msg(start);
        (self.buf, self.seq, self.what)
    }
}

/// A netfilter netlink socket, acting in the namespace it was opened in.
pub struct Nft {
    sock: Socket,
    seq: u32,
    buf: Vec<u8>,
    ns: String,
}

/// One parsed netlink message: type, seq, payload after the nlmsghdr.
struct Reply {
    ty: u16,
    seq: u32,
    body: Vec<u8>,
}

impl Nft {
    /// Open in the calling thread's namespace; `ns` names it for errors.
    pub fn open(ns: &str) -> Result<Nft, NetError> {
        let ctx = |e| NetError::io(format!("netlink netfilter socket in {ns}"), e);
        let mut sock = Socket::new(NETLINK_NETFILTER).map_err(ctx)?;
        sock.bind_auto().map_err(ctx)?;
        sock.connect(&SocketAddr::new(0, 0)).map_err(ctx)?;
        Ok(Nft {
            sock,
            seq: 1,
            buf: Vec::with_capacity(64 * 1024),
            ns: ns.to_string(),
        })
    }

    pub fn batch(&self) -> Batch {
        Batch::new(self.seq)
    }

    fn recv_some(&mut self, what: &str) -> Result<Vec<Reply>, NetError> {
        self.buf.clear();
        let n = self
            .sock
            .recv(&mut self.buf, 0)
            .map_err(|e| NetError::io(format!("{what} in {}: netlink recv", self.ns), e))?;
        let mut out = Vec::new();
        let mut off = 0;
        while off + 16 <= n {
            let b = &self.buf;
            let len = u32::from_ne_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]]) as usize;
            if len < 16 || off + len > n {
                return Err(NetError::invalid(format!(
                    "{what} in {}: truncated netlink reply",
                    self.ns
                )));
            }
            out.push(Reply {
                ty: u16::from_ne_bytes([b[off + 4], b[off + 5]]),
                seq: u32::from_ne_bytes([b[off + 8], b[off + 9], b[off + 10], b[off + 11]]),
                body: b[off + 16..off + len].to_vec(),
            });
            off += (len + 3) & !3;
        }
        Ok(out)
    }

    /// Send a simple request and return replies until ACK/DONE.
    fn request(&mut self, ty: u16, flags: u16, what: &str) -> Result<Vec<Reply>, NetError> {
        self.request_with(ty, flags, what, |_| {})
    }

    fn request_with(
        &mut self,
        ty: u16,
        flags: u16,
        what: &str,
        attrs: impl FnOnce(&mut Msg),
    ) -> Result<Vec<Reply>, NetError> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(&20u32.to_ne_bytes());
        buf.extend_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | ty).to_ne_bytes());
        buf.extend_from_slice(&(NLM_F_REQUEST | flags).to_ne_bytes());
        buf.extend_from_slice(&seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&[NFPROTO_IPV4, 0, 0, 0]);
        attrs(&mut Msg {
            buf: &mut buf,
            nests: Vec::new(),
        });
        let len = buf.len() as u32;
        buf[..4].copy_from_slice(&len.to_ne_bytes());
        self.sock
            .send(&buf, 0)
            .map_err(|e| NetError::io(format!("{what} in {}: netlink send", self.ns), e))?;
        let mut out = Vec::new();
        loop {
            for r in self.recv_some(what)? {
                if r.seq != seq {
                    continue;
                }
                match r.ty {
                    NLMSG_DONE => return Ok(out),
                    NLMSG_ERROR => {
                        let code = err_code(&r.body);
                        if code != 0 {
                            return Err(NetError::io(
                                format!("{what} in {}", self.ns),
                                std::io::Error::from_raw_os_error(-code),
                            ));
                        }
                        return Ok(out);
                    }
                    _ => out.push(r),
                }
            }
        }
    }

    /// Commit a batch. All or nothing: on error nothing of it is applied and
    /// the error names the first message the kernel refused.
    pub fn commit(&mut self, batch: Batch) -> Result<(), NetError> {
        let (buf, last, what) = batch.finish();
        self.sock
            .send(&buf, 0)
            .map_err(|e| NetError::io(format!("nftables batch in {}: netlink send", self.ns), e))?;
        self.seq = last;
        // The kernel answers a batch while handling our send; a GETGEN after it
        // marks the end of those answers.
        self.seq = self.seq.wrapping_add(1);
        let fence = self.seq;
        let mut req = Vec::with_capacity(20);
        req.extend_from_slice(&20u32.to_ne_bytes());
        req.extend_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | MSG_GETGEN).to_ne_bytes());
        req.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
        req.extend_from_slice(&fence.to_ne_bytes());
        req.extend_from_slice(&0u32.to_ne_bytes());
        req.extend_from_slice(&[0, 0, 0, 0]);
        self.sock
            .send(&req, 0)
            .map_err(|e| NetError::io(format!("nftables batch in {}: netlink send", self.ns), e))?;
        let mut first_err: Option<(u32, i32)> = None;
        loop {
            for r in self.recv_some("nftables batch")? {
                if r.ty == NLMSG_ERROR {
                    let code = err_code(&r.body);
                    if r.seq == fence {
                        return match first_err {
                            None => Ok(()),
                            Some((seq, code)) => {
                                let w = what
                                    .iter()
                                    .find(|(s, _)| *s == seq)
                                    .map(|(_, w)| w.as_str())
                                    .unwrap_or("batch");
                                Err(NetError::io(
                                    format!("nftables: {w} in {}", self.ns),
                                    std::io::Error::from_raw_os_error(-code),
                                ))
                            }
                        };
                    }
                    if code != 0 && first_err.map(|(s, _)| r.seq < s).unwrap_or(true) {
                        first_err = Some((r.seq, code));
                    }
                }
            }
        }
    }

    /// Names of the ip-family tables in this namespace.
    pub fn tables(&mut self) -> Result<Vec<String>, NetError> {
        let r = self.request(MSG_GETTABLE, NLM_F_DUMP, "list nftables tables")?;
        Ok(r.iter()
            .filter_map(|r| find_str_attr(&r.body[4..], NFTA_TABLE_NAME))
            .collect())
    }

    /// Number of rules in table `name` (for verification after a commit).
    pub fn rule_count(&mut self, table: &str) -> Result<usize, NetError> {
        // The table filter keeps the dump small on hosts with big rulesets.
        let r = self.request_with(MSG_GETRULE, NLM_F_DUMP, "list nftables rules", |m| {
            m.str(NFTA_RULE_TABLE, table)
        })?;
        Ok(r.iter()
            .filter(|r| {
                r.ty == ((NFNL_SUBSYS_NFTABLES << 8) | MSG_NEWRULE)
                    && find_str_attr(&r.body[4..], NFTA_RULE_TABLE).as_deref() == Some(table)
            })
            .count())
    }
}

fn err_code(body: &[u8]) -> i32 {
    if body.len() < 4 {
        return -libc::EPROTO;
    }
    i32::from_ne_bytes([body[0], body[1], body[2], body[3]])
}

fn find_str_attr(mut b: &[u8], kind: u16) -> Option<String> {
    while b.len() >= 4 {
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let ty = u16::from_ne_bytes([b[2], b[3]]) & 0x3fff;
        if len < 4 || len > b.len() {
            return None;
        }
        if ty == kind {
            let v = &b[4..len];
            let v = v.split(|c| *c == 0).next().unwrap_or(v);
            return Some(String::from_utf8_lossy(v).into_owned());
        }
        let adv = (len + 3) & !3;
        if adv >= b.len() {
            return None;
        }
        b = &b[adv..];
    }
    None
}

/// An address as an exact-match CIDR.
pub fn host(a: Ipv4Addr) -> Cidr {
    Cidr {
        addr: a,
        prefix_len: 32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_nft_syntax() {
        let r = Rule::new(
            vec![
                Match::Iif(IfName::Prefix("asbx".into())),
                Match::Daddr("10.0.0.0/8".parse().unwrap()),
                Match::L4Proto(6),
                Match::Dport(443),
            ],
            Verdict::Drop,
        );
        assert_eq!(
            r.to_nft(),
            "iifname \"asbx*\" ip daddr 10.0.0.0/8 meta l4proto 6 th dport 443 drop"
        );
    }

    #[test]
    fn batch_framing() {
        let mut b = Batch::new(7);
        b.add_table("asbx");
        let (buf, last, what) = b.finish();
        // begin + newtable + end, each a whole number of 4-byte words.
        let mut off = 0;
        let mut n = 0;
        while off < buf.len() {
            let len = u32::from_ne_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]]);
            assert_eq!(len % 4, 0);
            off += len as usize;
            n += 1;
        }
        assert_eq!((off, n), (buf.len(), 3));
        assert_eq!(last, 10);
        assert_eq!(what, vec![(9, "add table asbx".to_string())]);
    }
}
