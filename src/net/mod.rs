//! Per-session network plumbing of the host daemon, done in-process through
//! netlink (links, addresses, routes, namespaces, nftables) and ioctls (TAP).
//!
//! Per session: a named network namespace `{prefix}-{id}`, a veth pair
//! (`{prefix}{id}h` in the host namespace, `{prefix}{id}n` in the session
//! namespace), a persistent TAP with the same name and address in every
//! session namespace (so one VM snapshot serves all sessions), NAT of the
//! guest to the veth address inside the session namespace and of the veth
//! range to the uplink in the host namespace. See `docs/network.md`.
//!
//! The "host" namespace is a parameter: tests run all of this inside a
//! namespace of their own whose only uplink leads to a test "internet".

mod blocks;
mod cidr;
mod config;
pub mod connect;
pub mod dns;
mod dnsfwd;
pub mod doctor;
pub mod egress;
pub mod firewall;
pub mod inject;
pub mod isolated;
pub mod netns;
pub mod nft;
pub mod policy;
pub mod proxy;
pub mod rtnl;
pub mod tap;
pub mod tc;

use crate::sync::{lock, wait_timeout};
use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use blocks::{reaper, Alloc, Blocks, Reap, REAP_GRACE};
pub use cidr::Cidr;
pub use config::NetConfig;
pub use connect::GuestConnector;
use dnsfwd::{Forwarder, FwdConfig};
pub use egress::{EgressFilter, EgressRule};
pub use isolated::Isolated;
use nft::Nft;
pub use policy::{Bandwidth, DnsNames, DomainPattern, EgressMode, EgressPolicy, NetPolicy};
pub use proxy::ProxyStats;
use proxy::{Gate, Proxy, ProxyConfig};
use rtnl::Rtnl;

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("no free address block left in {range} (all {slots} in use)")]
    Exhausted { range: Cidr, slots: usize },
}

impl NetError {
    pub fn io(what: String, source: io::Error) -> NetError {
        NetError::Io { what, source }
    }
    pub fn invalid(msg: impl Into<String>) -> NetError {
        NetError::Invalid(msg.into())
    }
}

pub type Result<T> = std::result::Result<T, NetError>;

struct Host {
    rtnl: Rtnl,
    nft: Nft,
    /// The table in force and the uplink networks it was built with.
    table: nft::Table,
    uplink_nets: Vec<Cidr>,
}

impl Host {
    /// Re-read the uplink's attached networks and, when they changed (an
    /// address added by DHCP, a link that came up late), install the host
    /// table anew with them. One link lookup and two small dumps.
    fn refresh_uplink(&mut self, cfg: &NetConfig, ns: &str) -> Result<()> {
        let nets = self.rtnl.connected_nets(&cfg.uplink_if)?;
        if nets == self.uplink_nets {
            return Ok(());
        }
        let table = firewall::host_table(cfg, &nets);
        let mut b = self.nft.batch();
        b.replace_table(&table);
        self.nft.commit(b)?;
        verify(&mut self.nft, &table, ns)?;
        log::info!(
            "uplink {} networks now {:?}: blocked for sessions",
            cfg.uplink_if,
            nets.iter().map(Cidr::to_string).collect::<Vec<_>>()
        );
        self.table = table;
        self.uplink_nets = nets;
        Ok(())
    }
}

struct Inner {
    cfg: NetConfig,
    /// The host namespace (`None`: the daemon's), for DNS forwarder threads.
    host_ns: Option<File>,
    host: Mutex<Host>,
    blocks: Arc<Blocks>,
    reap: Sender<Reap>,
    /// How the egress proxy re-originates TLS for injected secrets (from
    /// `proxy_upstream_ca`; `None` when it could not be read).
    upstream_tls: Option<Arc<rustls::ClientConfig>>,
}

impl Inner {
    fn host_name(&self) -> String {
        match &self.cfg.host_netns {
            Some(p) => format!("host netns {}", p.display()),
            None => "host netns".into(),
        }
    }

    /// Close `nft` and free `slot` once `host_if` is gone, in the background.
    fn release_after(&self, slot: usize, host_if: &str, held: Option<Box<dyn Send>>) {
        lock(&self.blocks.state).draining += 1;
        let r = Reap {
            slot,
            host_if: host_if.to_string(),
            held,
        };
        if let Err(e) = self.reap.send(r) {
            // No reaper (cannot happen while `self` lives): do it inline.
            let r = e.into_inner();
            drop(r.held);
            if let Err(e) = lock(&self.host).rtnl.del_link(&r.host_if) {
                log::error!("{e}");
            }
            self.blocks.release(r.slot, true);
        }
    }
}

/// The network side of the daemon: host configuration plus a factory of
/// session networks. Cheap to share (`Arc` inside).
#[derive(Clone)]
pub struct Net {
    inner: Arc<Inner>,
}

/// Write a sysctl that may legitimately be absent (IPv6 compiled out).
fn sysctl_opt(parts: &[&str], v: &str) -> Result<()> {
    match netns::sysctl_path(parts, v) {
        Err(NetError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Leftovers removed by [`Net::sweep`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SweepReport {
    pub namespaces: Vec<String>,
    pub links: Vec<String>,
    pub tables: Vec<String>,
}

impl SweepReport {
    pub fn is_empty(&self) -> bool {
        self.namespaces.is_empty() && self.links.is_empty() && self.tables.is_empty()
    }
}

fn is_session_link(prefix: &str, name: &str) -> bool {
    name.strip_prefix(prefix)
        .and_then(|r| r.strip_suffix('h'))
        .is_some_and(|id| id.len() == 6 && id.bytes().all(|b| b.is_ascii_hexdigit()))
}

impl Net {
    /// Prepare the host namespace: forwarding on, our host table installed
    /// and verified, the guest network blackholed there.
    pub fn new(cfg: NetConfig) -> Result<Net> {
        cfg.validate()?;
        if cfg.uplink_if.is_empty() {
            return Err(NetError::invalid("network config: uplink_if is not set"));
        }
        let host_ns = cfg.host_netns.as_deref().map(netns::open).transpose()?;
        let name = match &cfg.host_netns {
            Some(p) => format!("host netns {}", p.display()),
            None => "host netns".into(),
        };
        let guest = cfg.guest_cidr;
        let uplink = cfg.uplink_if.as_str();
        let (host, reaper_rtnl) = netns::run_in(host_ns.as_ref(), &name, || {
            netns::sysctl("net.ipv4.ip_forward", "1")?;
            let mut rtnl = Rtnl::open(&name)?;
            let uplink_nets = rtnl.connected_nets(uplink)?;
            log::info!(
                "uplink {uplink} networks {:?}: blocked for sessions",
                uplink_nets.iter().map(Cidr::to_string).collect::<Vec<_>>()
            );
            let table = firewall::host_table(&cfg, &uplink_nets);
            let mut nft = Nft::open(&name)?;
            let mut b = nft.batch();
            b.replace_table(&table);
            nft.commit(b)?;
            verify(&mut nft, &table, &name)?;
            // The guest network exists only behind TAPs in session
            // namespaces; here it must never route anywhere.
            rtnl.replace_blackhole(guest.network(), guest.prefix_len)?;
            if rtnl.link_index(uplink)?.is_none() {
                // Not fatal (it may appear later), but sessions have no
                // egress until it does.
                log::warn!("uplink interface {uplink} does not exist in {name}");
            }
            Ok((
                Host {
                    rtnl,
                    nft,
                    table,
                    uplink_nets,
                },
                Rtnl::open(&name)?,
            ))
        })?;
        let blocks = Arc::new(Blocks {
            state: Mutex::new(Alloc {
                used: vec![false; cfg.slots()],
                next: 0,
                draining: 0,
            }),
            changed: Condvar::new(),
        });
        // Read once here, before the daemon confines itself.
        let upstream_tls = match inject::upstream_tls(&cfg.proxy_upstream_ca) {
            Ok(c) => Some(c),
            Err(e) => {
                log::warn!("{e}: sessions with injected secrets will get 502 from the proxy");
                None
            }
        };
        let (tx, rx) = crossbeam_channel::unbounded();
        let b2 = blocks.clone();
        std::thread::Builder::new()
            .name("net-reaper".into())
            .spawn(move || {
                if let Err(e) = crate::harden::install_current(crate::harden::ThreadKind::NetReaper)
                {
                    // A reaper that cannot confine itself must not run.
                    log::error!("net-reaper: {e}; stopping the process");
                    std::process::abort();
                }
                reaper(b2, reaper_rtnl, rx)
            })
            .map_err(|e| NetError::io("spawn net-reaper thread".into(), e))?;
        Ok(Net {
            inner: Arc::new(Inner {
                cfg,
                host_ns,
                host: Mutex::new(host),
                blocks,
                reap: tx,
                upstream_tls,
            }),
        })
    }

    pub fn config(&self) -> &NetConfig {
        &self.inner.cfg
    }

    /// Wait until every torn-down session's host link is gone and its
    /// address block free again; false on timeout.
    pub fn settle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut a = lock(&self.inner.blocks.state);
        while a.draining > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            a = wait_timeout(&self.inner.blocks.changed, a, left);
        }
        true
    }

    /// Remove the host table and blackhole route once torn-down sessions
    /// have drained (live sessions must be gone).
    pub fn close(&self) -> Result<()> {
        if !self.settle(REAP_GRACE * 2) {
            log::warn!("closing the network with session links still draining");
        }
        let mut h = lock(&self.inner.host);
        let mut b = h.nft.batch();
        b.remove_table(&self.inner.cfg.prefix);
        h.nft.commit(b)?;
        let g = self.inner.cfg.guest_cidr;
        h.rtnl.del_blackhole(g.network(), g.prefix_len)
    }

    fn alloc_slot(&self) -> Result<usize> {
        let blocks = &self.inner.blocks;
        let deadline = Instant::now() + REAP_GRACE * 2;
        let mut a = lock(&blocks.state);
        loop {
            let n = a.used.len();
            for i in 0..n {
                let s = (a.next + i) % n;
                if !a.used[s] {
                    a.used[s] = true;
                    // Round robin: a just-freed block is reused last, so late
                    // packets of an old session do not meet a new one.
                    a.next = (s + 1) % n;
                    return Ok(s);
                }
            }
            // Full, but blocks are coming free: wait for them.
            let left = deadline.saturating_duration_since(Instant::now());
            if a.draining == 0 || left.is_zero() {
                return Err(NetError::Exhausted {
                    range: self.inner.cfg.veth_range,
                    slots: n,
                });
            }
            a = wait_timeout(&blocks.changed, a, left);
        }
    }

    /// Create the network of one session, NAT and policy installed and
    /// verified before it returns. On failure nothing of it remains.
    /// Takes a [`NetPolicy`] or a bare [`EgressFilter`] (by value or reference).
    pub fn create_session(&self, policy: impl Into<NetPolicy>) -> Result<SessionNet> {
        self.create_session_inner(&policy.into(), None, None)
    }

    /// [`Net::create_session`] with the TAP owned by `uid:gid` (the VM's
    /// own ids: a VMM that opens the TAP itself, like Firecracker, runs as
    /// them) instead of the configured `tap_uid`/`tap_gid`.
    pub fn create_session_for(
        &self,
        policy: impl Into<NetPolicy>,
        owner: (u32, u32),
    ) -> Result<SessionNet> {
        self.create_session_inner(&policy.into(), None, Some(owner))
    }

    /// Test hook: like [`Net::create_session`] but fail on purpose after
    /// step `step` (1: namespace and firewall, 2: host side, 3: everything),
    /// to prove that a failure leaves nothing behind.
    #[doc(hidden)]
    pub fn create_session_failing_after(
        &self,
        policy: impl Into<NetPolicy>,
        step: u8,
    ) -> Result<SessionNet> {
        self.create_session_inner(&policy.into(), Some(step), None)
    }

    fn create_session_inner(
        &self,
        policy: &NetPolicy,
        fault: Option<u8>,
        owner: Option<(u32, u32)>,
    ) -> Result<SessionNet> {
        self.inner.check_policy(policy)?;
        let slot = self.alloc_slot()?;
        let mut last = None;
        for _ in 0..8 {
            let id = random_id()?;
            match self.try_create(slot, &id, policy, fault, owner) {
                // A namespace of that name exists (another daemon, a leftover):
                // try another id.
                Err(NetError::Io { source, what })
                    if source.kind() == io::ErrorKind::AlreadyExists
                        && what.starts_with("create /run/netns") =>
                {
                    last = Some(NetError::Io { source, what });
                }
                r => return r,
            }
        }
        self.inner.blocks.release(slot, false);
        Err(last.unwrap_or_else(|| NetError::invalid("no free session id")))
    }

    fn try_create(
        &self,
        slot: usize,
        id: &str,
        policy: &NetPolicy,
        fault: Option<u8>,
        owner: Option<(u32, u32)>,
    ) -> Result<SessionNet> {
        let cfg = &self.inner.cfg;
        let p = &cfg.prefix;
        let (host_addr, peer_addr) = cfg.veth_addrs(slot);
        let mut s = SessionNet {
            net: self.inner.clone(),
            id: id.to_string(),
            netns: format!("{p}-{id}"),
            host_if: format!("{p}{id}h"),
            peer_if: format!("{p}{id}n"),
            host_addr,
            peer_addr,
            slot,
            ctl: Mutex::new(None),
            audit: Default::default(),
            done: false,
        };
        match self.setup(&mut s, policy, fault, owner) {
            Ok(()) => Ok(s),
            Err(e) => {
                // Synchronous here, so that an error means nothing remains.
                if let Err(e2) = s.teardown_now() {
                    log::warn!("cleanup of failed session {id}: {e2}");
                }
                Err(e)
            }
        }
    }

    fn setup(
        &self,
        s: &mut SessionNet,
        policy: &NetPolicy,
        fault: Option<u8>,
        owner: Option<(u32, u32)>,
    ) -> Result<()> {
        let injected = |step: u8| -> Result<()> {
            if fault == Some(step) {
                return Err(NetError::invalid(format!(
                    "injected failure after step {step}"
                )));
            }
            Ok(())
        };
        let cfg = &self.inner.cfg;
        let table = firewall::session_table(cfg, &s.peer_if, policy, false);
        let nsn = s.netns.clone();
        // 1. The namespace, set up from inside: no IPv6 (nothing of ours
        //    chatters), forwarding, strict reverse-path filter, the firewall
        //    (before any link exists), then the TAP.
        let (ns, (rtnl, nft)) = netns::create(&s.netns, || {
            for k in ["all", "default"] {
                sysctl_opt(&["net", "ipv6", "conf", k, "disable_ipv6"], "1")?;
                netns::sysctl_path(&["net", "ipv4", "conf", k, "rp_filter"], "1")?;
            }
            netns::sysctl("net.ipv4.ip_forward", "1")?;
            let rtnl = Rtnl::open(&nsn)?;
            let mut nft = Nft::open(&nsn)?;
            let mut b = nft.batch();
            // A fresh namespace has no table to replace (and a delete would
            // queue work on nf_tables' global destroy list).
            b.create_table(&table);
            nft.commit(b)?;
            verify(&mut nft, &table, &nsn)?;
            let (uid, gid) = match owner {
                Some((u, g)) => (Some(u), Some(g)),
                None => (cfg.tap_uid, cfg.tap_gid),
            };
            tap::create_persistent(&cfg.tap_name, uid, gid)?;
            Ok((rtnl, nft))
        })
        .map_err(|e| match e {
            NetError::Io { what, source } => NetError::Io {
                what: format!("session {}: {what}", s.id),
                source,
            },
            e => e,
        })?;
        *lock(&s.ctl) = Some(Ctl {
            nft,
            rtnl,
            tap_index: 0,
            peer_index: 0,
            policy: policy.clone(),
            generation: 1,
            dns: None,
            proxy: None,
            inject: None,
            connector: None,
        });
        injected(1)?;
        // 2. Host side: the veth pair, its host end configured before it is
        //    up. Pure netlink on the host socket: no thread needed.
        let (host_if, peer_if, host_addr, plen) =
            (&s.host_if, &s.peer_if, s.host_addr, cfg.veth_prefix_len);
        let inner = &self.inner;
        let nsfd = ns.as_raw_fd();
        {
            let mut h = lock(&inner.host);
            let h = &mut *h;
            // Fail closed: the host table must be in place before any
            // session link is; someone may have flushed the ruleset since.
            if verify(&mut h.nft, &h.table, &inner.host_name()).is_err() {
                log::warn!(
                    "host nftables table {} missing or changed; reinstalling",
                    cfg.prefix
                );
                let mut b = h.nft.batch();
                b.replace_table(&h.table);
                h.nft.commit(b)?;
                verify(&mut h.nft, &h.table, &inner.host_name())?;
            }
            h.refresh_uplink(cfg, &inner.host_name())?;
            h.rtnl.add_veth(host_if, peer_if, nsfd)?;
            let idx = h.rtnl.need_index(host_if)?;
            h.rtnl.quiet_strict_link(idx, host_if)?;
            h.rtnl.add_addr(idx, host_addr, plen, host_if)?;
            h.rtnl.set_up(idx, host_if)?;
        }
        injected(2)?;
        // 3. Session side: veth end, TAP (shaped before they are up),
        //    default route to the host, then the DNS forwarder if asked for.
        let mut g = lock(&s.ctl);
        let ctl = g
            .as_mut()
            .ok_or_else(|| NetError::invalid(format!("session {}: torn down", s.id)))?;
        let rtnl = &mut ctl.rtnl;
        let peer = rtnl.need_index(&s.peer_if)?;
        rtnl.add_addr(peer, s.peer_addr, plen, &s.peer_if)?;
        let tapi = rtnl.need_index(&cfg.tap_name)?;
        rtnl.add_addr(
            tapi,
            cfg.tap_addr(),
            cfg.guest_cidr.prefix_len,
            &cfg.tap_name,
        )?;
        ctl.tap_index = tapi;
        ctl.peer_index = peer;
        if let Some(b) = policy.bandwidth {
            apply_bandwidth(ctl, &s.id, None, Some(b))?;
        }
        let rtnl = &mut ctl.rtnl;
        rtnl.set_up(peer, &s.peer_if)?;
        rtnl.set_up(tapi, &cfg.tap_name)?;
        // Loopback: the inspection proxy asks the session's forwarder on
        // the TAP address, a local address, which needs `lo` up. The guest
        // never reaches it (127/8 and the namespace itself are dropped).
        let lo = rtnl.need_index("lo")?;
        rtnl.set_up(lo, "lo")?;
        rtnl.add_route_via(Ipv4Addr::UNSPECIFIED, 0, s.host_addr, peer)?;
        if let Some(names) = self.inner.dns_names(policy) {
            ctl.dns = Some(self.inner.start_dns(&s.id, &ns, names, &s.audit)?);
        }
        if firewall::proxied(policy) {
            ctl.proxy = Some(self.inner.start_proxy(&s.id, &ns, policy, None, &s.audit)?);
        }
        drop(g);
        drop(ns);
        injected(3)
    }

    /// Remove every namespace, host link and nftables table with our prefix
    /// (after a crash; run before [`Net::new`]). Sessions of a running `Net`
    /// with the same prefix would be destroyed too.
    pub fn sweep(cfg: &NetConfig) -> Result<SweepReport> {
        cfg.validate()?;
        let mut rep = SweepReport::default();
        let host_ns = cfg.host_netns.as_deref().map(netns::open).transpose()?;
        let name = "host netns (sweep)";
        let prefix = cfg.prefix.clone();
        let guest = cfg.guest_cidr;
        let (links, tables) = netns::run_in(host_ns.as_ref(), name, || {
            let mut rtnl = Rtnl::open(name)?;
            let mut links = Vec::new();
            for l in rtnl.links()? {
                if is_session_link(&prefix, &l.name) {
                    rtnl.del_link(&l.name)?;
                    links.push(l.name);
                }
            }
            let mut nft = Nft::open(name)?;
            let tables: Vec<String> = nft.tables()?.into_iter().filter(|t| *t == prefix).collect();
            for t in &tables {
                let mut b = nft.batch();
                b.remove_table(t);
                nft.commit(b)?;
            }
            rtnl.del_blackhole(guest.network(), guest.prefix_len)?;
            Ok((links, tables))
        })?;
        rep.links = links;
        rep.tables = tables;
        for n in netns::list(&format!("{}-", cfg.prefix))? {
            netns::delete(&n)?;
            rep.namespaces.push(n);
        }
        Ok(rep)
    }
}

/// Commit verification: the table holds exactly the rules we built.
fn verify(nft: &mut Nft, t: &nft::Table, ns: &str) -> Result<()> {
    let n = nft.rule_count(&t.name)?;
    if n != t.rule_count() {
        return Err(NetError::invalid(format!(
            "nftables table {} in {ns}: {n} rules after commit, expected {}",
            t.name,
            t.rule_count()
        )));
    }
    Ok(())
}

fn random_id() -> Result<String> {
    let mut b = [0u8; 3];
    // SAFETY: writes at most 3 bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 3 {
        return Err(NetError::io("getrandom".into(), io::Error::last_os_error()));
    }
    Ok(format!("{:02x}{:02x}{:02x}", b[0], b[1], b[2]))
}

/// One session's network. Dropping it tears it down; [`SessionNet::teardown`]
/// does so explicitly and reports errors.
pub struct SessionNet {
    net: Arc<Inner>,
    id: String,
    netns: String,
    host_if: String,
    peer_if: String,
    host_addr: Ipv4Addr,
    peer_addr: Ipv4Addr,
    slot: usize,
    /// What live policy changes work with; `None` once torn down.
    ctl: Mutex<Option<Ctl>>,
    /// The session its proxies record egress decisions for.
    audit: crate::audit::Slot,
    done: bool,
}

/// A live session's handles inside its namespace, and its policy in force.
struct Ctl {
    /// Netfilter and route netlink sockets in the session namespace.
    nft: Nft,
    rtnl: Rtnl,
    tap_index: u32,
    peer_index: u32,
    policy: NetPolicy,
    /// Conntrack mark of connections the DNS set let in (see
    /// [`firewall::policy_rules`]); the session table starts with 1.
    generation: u32,
    dns: Option<Forwarder>,
    /// The inspection proxy, while the policy is [`firewall::proxied`] or
    /// the session has secrets to inject.
    proxy: Option<Proxy>,
    /// The session's injected secrets ([`inject`]), if any.
    inject: Option<Arc<inject::Injection>>,
    /// Dials the guest's ports ([`connect`]), once asked for.
    connector: Option<GuestConnector>,
}

/// Install `to`'s bandwidth limits (changed from `from`) and read them back.
fn apply_bandwidth(
    ctl: &mut Ctl,
    id: &str,
    from: Option<Bandwidth>,
    to: Option<Bandwidth>,
) -> Result<()> {
    let (f, t) = (from.unwrap_or_default(), to.unwrap_or_default());
    let links = [
        (ctl.tap_index, "TAP (down)", f.down_kbit, t.down_kbit),
        (ctl.peer_index, "veth (up)", f.up_kbit, t.up_kbit),
    ];
    for (idx, dir, old, new) in links {
        if old == new && f.burst_kbit == t.burst_kbit && from.is_some() {
            continue;
        }
        let what = format!("session {id} {dir}");
        tc::set_limit(&mut ctl.rtnl, idx, &what, new, t.burst_kbit)?;
        let got = tc::read_limit(&mut ctl.rtnl, idx, &what)?;
        let want = new.map(|k| tc::tbf_params(k, t.burst_kbit).0);
        if got != want {
            return Err(NetError::invalid(format!(
                "{what}: bandwidth limit reads back as {got:?} bytes/s, expected {want:?}"
            )));
        }
    }
    Ok(())
}

/// What the proxy applies of `p`.
fn gate(p: &NetPolicy) -> Gate {
    let proxied = firewall::proxied(p);
    Gate {
        proxied,
        names: if proxied {
            DnsNames::Only(p.domains.clone())
        } else {
            // No resolver (`none`, CIDR allowlist): the filter decides.
            p.dns_names().unwrap_or(DnsNames::Any)
        },
        filter: p.egress.clone(),
    }
}

impl Inner {
    fn check_policy(&self, p: &NetPolicy) -> Result<()> {
        p.validate().map_err(NetError::Invalid)?;
        p.check_reachable(Some(&self.cfg))
            .map_err(NetError::Invalid)?;
        if !p.domains.is_empty() && self.cfg.dns_upstreams.is_empty() {
            return Err(NetError::invalid(
                "a domain allowlist needs dns_upstreams in the network config",
            ));
        }
        Ok(())
    }

    /// What the session's resolver serves; `None`: none runs (the policy
    /// wants none, or no upstream is configured for an unrestricted one).
    fn dns_names(&self, p: &NetPolicy) -> Option<DnsNames> {
        p.dns_names()
            .filter(|n| !(*n == DnsNames::Any && self.cfg.dns_upstreams.is_empty()))
    }

    fn start_dns(
        &self,
        id: &str,
        ns: &File,
        names: DnsNames,
        audit: &crate::audit::Slot,
    ) -> Result<Forwarder> {
        let cfg = &self.cfg;
        let host_ns = match &self.host_ns {
            Some(f) => Some(
                f.try_clone()
                    .map_err(|e| NetError::io("dup host netns fd".into(), e))?,
            ),
            None => None,
        };
        let fc = FwdConfig {
            upstreams: cfg.dns_upstreams.clone(),
            timeout: Duration::from_millis(cfg.dns_timeout_ms),
            ttl_min: cfg.dns_ttl_min_secs,
            ttl_max: cfg.dns_ttl_max_secs,
            max_addrs: cfg.dns_max_addrs as usize,
            table: cfg.prefix.clone(),
            blocked: firewall::blocked_set(cfg),
            exceptions: cfg.allow_exceptions.clone(),
        };
        Forwarder::start(id, ns, cfg.tap_addr(), host_ns, fc, names, audit.clone())
    }

    fn start_proxy(
        &self,
        id: &str,
        ns: &File,
        p: &NetPolicy,
        inject: Option<Arc<inject::Injection>>,
        audit: &crate::audit::Slot,
    ) -> Result<Proxy> {
        let cfg = &self.cfg;
        let pc = ProxyConfig {
            listen: std::net::SocketAddrV4::new(cfg.tap_addr(), cfg.proxy_listen_port),
            ports: cfg.proxy_ports.clone(),
            resolver: (cfg.tap_addr(), 53).into(),
            // The forwarder tries each upstream in turn.
            resolve_timeout: Duration::from_millis(
                cfg.dns_timeout_ms * cfg.dns_upstreams.len().max(1) as u64 + 500,
            ),
            blocked: firewall::blocked_set(cfg),
            exceptions: cfg.allow_exceptions.clone(),
            upstream_tls: self.upstream_tls.clone(),
        };
        Proxy::start(id, ns, pc, gate(p), inject, audit.clone())
    }
}

impl std::fmt::Debug for SessionNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionNet")
            .field("id", &self.id)
            .field("netns", &self.netns)
            .field("host_if", &self.host_if)
            .field("host_addr", &self.host_addr)
            .field("peer_addr", &self.peer_addr)
            .finish()
    }
}

impl SessionNet {
    pub fn id(&self) -> &str {
        &self.id
    }
    /// Name of the namespace (`ip netns` name); path via [`SessionNet::netns_path`].
    pub fn netns(&self) -> &str {
        &self.netns
    }
    pub fn netns_path(&self) -> PathBuf {
        netns::path_of(&self.netns)
    }
    pub fn host_if(&self) -> &str {
        &self.host_if
    }
    pub fn peer_if(&self) -> &str {
        &self.peer_if
    }
    pub fn host_addr(&self) -> Ipv4Addr {
        self.host_addr
    }
    pub fn peer_addr(&self) -> Ipv4Addr {
        self.peer_addr
    }
    pub fn tap_name(&self) -> &str {
        &self.net.cfg.tap_name
    }

    /// The policy in force.
    pub fn policy(&self) -> Option<NetPolicy> {
        lock(&self.ctl).as_ref().map(|c| c.policy.clone())
    }

    /// Replace the policy of the running session (egress rules, domain
    /// allowlist, bandwidth). Returns Ok only when all of it is installed
    /// and read back; on error the previous policy is put back (the
    /// firewall part of a change is one atomic transaction).
    pub fn set_policy(&self, policy: impl Into<NetPolicy>) -> Result<()> {
        let to: NetPolicy = policy.into();
        self.net.check_policy(&to)?;
        let mut g = lock(&self.ctl);
        let ctl = g
            .as_mut()
            .ok_or_else(|| NetError::invalid(format!("session {} is torn down", self.id)))?;
        let from = ctl.policy.clone();
        match self.apply(ctl, &from, &to) {
            Ok(()) => {
                ctl.policy = to;
                Ok(())
            }
            Err(e) => {
                if let Err(e2) = self.apply(ctl, &to, &from) {
                    log::error!(
                        "session {}: putting the previous policy back failed too: {e2}",
                        self.id
                    );
                }
                Err(e)
            }
        }
    }

    fn apply(&self, ctl: &mut Ctl, from: &NetPolicy, to: &NetPolicy) -> Result<()> {
        let cfg = &self.net.cfg;
        // 1. Firewall: the policy chain, and the resolved addresses dropped
        //    when the allowed names change; one transaction, read back.
        let names_changed = from.domains != to.domains;
        if names_changed || from.egress != to.egress {
            // Connections the old names let in are cut (0 is "unmarked").
            ctl.generation = ctl.generation.wrapping_add(1).max(1);
        }
        let shared = ctl.dns.as_ref().map(|d| d.shared.clone());
        let mut sh = shared.as_ref().map(|s| lock(s));
        let mut b = ctl.nft.batch();
        b.replace_chain_rules(
            &cfg.prefix,
            firewall::POLICY_CHAIN,
            &firewall::policy_rules(to, ctl.generation),
        );
        let injecting = ctl.inject.is_some();
        b.replace_chain_rules(
            &cfg.prefix,
            firewall::PROXY_CHAIN,
            &firewall::proxy_rules(cfg, to, injecting),
        );
        if names_changed {
            b.flush_set(&cfg.prefix, firewall::SET);
        }
        ctl.nft.commit(b)?;
        verify(
            &mut ctl.nft,
            &firewall::session_table(cfg, &self.peer_if, to, injecting),
            &self.netns,
        )?;
        let names = self.net.dns_names(to);
        if let (Some(sh), Some(n)) = (sh.as_mut(), &names) {
            if names_changed {
                sh.known.clear();
            }
            if *sh.allowed != *n {
                sh.allowed = Arc::new(n.clone());
            }
        }
        drop(sh);
        // 2. Bandwidth, each direction read back.
        if from.bandwidth != to.bandwidth {
            apply_bandwidth(
                ctl,
                &self.id,
                Some(from.bandwidth.unwrap_or_default()),
                to.bandwidth,
            )?;
        }
        // 3. The forwarder runs exactly while there are names to serve.
        match (ctl.dns.is_some(), names) {
            (false, Some(n)) => {
                let ns = netns::open(&self.netns_path())?;
                ctl.dns = Some(self.net.start_dns(&self.id, &ns, n, &self.audit)?);
            }
            (true, None) => ctl.dns = None,
            _ => {}
        }
        // 4. The proxy (after the forwarder: it resolves through it).
        self.run_proxy(ctl, to)
    }

    /// The proxy runs exactly while the policy is proxied or there are
    /// secrets to inject, with the policy's gate and the secrets.
    fn run_proxy(&self, ctl: &mut Ctl, p: &NetPolicy) -> Result<()> {
        let want = firewall::proxied(p) || ctl.inject.is_some();
        match (&ctl.proxy, want) {
            (None, true) => {
                let ns = netns::open(&self.netns_path())?;
                ctl.proxy = Some(self.net.start_proxy(
                    &self.id,
                    &ns,
                    p,
                    ctl.inject.clone(),
                    &self.audit,
                )?);
            }
            (Some(_), false) => ctl.proxy = None,
            (Some(px), true) => {
                px.set_gate(gate(p));
                px.set_injection(ctl.inject.clone());
            }
            (None, false) => {}
        }
        Ok(())
    }

    /// Give the session's proxy these secrets to inject (`None`: none):
    /// TCP to the proxied ports goes through it from now on whatever the
    /// mode. Read back like a policy change; on error nothing changed.
    pub fn set_injection(&self, inj: Option<Arc<inject::Injection>>) -> Result<()> {
        let cfg = &self.net.cfg;
        if inj.is_some() && cfg.dns_upstreams.is_empty() {
            return Err(NetError::invalid(
                "injected secrets need dns_upstreams in the network config: the proxy \
                 resolves a secret's host itself",
            ));
        }
        let mut g = lock(&self.ctl);
        let ctl = g
            .as_mut()
            .ok_or_else(|| NetError::invalid(format!("session {} is torn down", self.id)))?;
        let policy = ctl.policy.clone();
        let injecting = inj.is_some();
        if injecting != ctl.inject.is_some() {
            let mut b = ctl.nft.batch();
            b.replace_chain_rules(
                &cfg.prefix,
                firewall::PROXY_CHAIN,
                &firewall::proxy_rules(cfg, &policy, injecting),
            );
            ctl.nft.commit(b)?;
            verify(
                &mut ctl.nft,
                &firewall::session_table(cfg, &self.peer_if, &policy, injecting),
                &self.netns,
            )?;
        }
        let old = std::mem::replace(&mut ctl.inject, inj);
        if let Err(e) = self.run_proxy(ctl, &policy) {
            ctl.inject = old;
            return Err(e);
        }
        Ok(())
    }

    /// A handle that dials the guest's TCP ports from inside the session
    /// namespace (started on first use).
    pub fn guest_connector(&self) -> Result<GuestConnector> {
        let mut g = lock(&self.ctl);
        let ctl = g
            .as_mut()
            .ok_or_else(|| NetError::invalid(format!("session {} is torn down", self.id)))?;
        if let Some(c) = &ctl.connector {
            return Ok(c.clone());
        }
        let ns = netns::open(&self.netns_path())?;
        let c = GuestConnector::start(&self.id, &ns, self.net.cfg.guest_addr())?;
        ctl.connector = Some(c.clone());
        Ok(c)
    }

    /// The session whose audit log the proxy's egress decisions go to
    /// (`None`: none, while the network waits in a pool).
    pub fn set_audit(&self, tag: Option<crate::audit::Tag>) {
        *lock(&self.audit) = tag;
    }

    /// What the inspection proxy did, while it runs.
    pub fn proxy_stats(&self) -> Option<ProxyStats> {
        lock(&self.ctl)
            .as_ref()
            .and_then(|c| c.proxy.as_ref().map(Proxy::stats))
    }

    /// Remove everything of this session. Idempotent.
    ///
    /// The VMM must be gone first (its TAP fd holds the namespace). Once the
    /// namespace is unmounted and our socket in it closed, the kernel
    /// destroys it with its TAP, table and veth pair, asynchronously; the
    /// address block is reused only after the host link is gone (see
    /// [`Net::settle`]). A namespace that lingers (someone still holds it)
    /// loses its host link after a grace period anyway.
    pub fn teardown(&mut self) -> Result<()> {
        if self.done {
            return Ok(());
        }
        let ctl = lock(&self.ctl).take();
        let r = netns::delete(&self.netns);
        let held = ctl.map(|mut c| {
            c.dns = None; // stop serving now
            c.proxy = None;
            c.inject = None;
            c.connector = None;
            Box::new(c) as Box<dyn Send>
        });
        self.net.release_after(self.slot, &self.host_if, held);
        self.done = true;
        r
    }
}

impl SessionNet {
    /// Teardown that returns only when the host link is gone.
    fn teardown_now(&mut self) -> Result<()> {
        if self.done {
            return Ok(());
        }
        *lock(&self.ctl) = None;
        let r1 = lock(&self.net.host).rtnl.del_link(&self.host_if);
        let r2 = netns::delete(&self.netns);
        self.net.blocks.release(self.slot, false);
        self.done = true;
        r1.and(r2)
    }
}

impl Drop for SessionNet {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            log::error!("teardown of session network {}: {e}", self.id);
        }
    }
}
