//! Route netlink (links, addresses, routes) over a blocking socket, built on
//! netlink-packet-route. A socket acts in the namespace it was opened in.

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::RawFd;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL,
    NLM_F_REQUEST,
};
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{
    AfSpecInet, AfSpecInet6, AfSpecUnspec, In6AddrGenMode, InetDevConf, InfoData, InfoKind,
    InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

use super::{Cidr, NetError};

pub struct Rtnl {
    sock: Socket,
    seq: u32,
    buf: Vec<u8>,
    /// Where this socket acts, for error messages.
    ns: String,
}

/// A link as seen in a dump.
#[derive(Debug, Clone)]
pub struct Link {
    pub index: u32,
    pub name: String,
}

impl Rtnl {
    /// Open a route netlink socket in the calling thread's namespace.
    pub fn open(ns: &str) -> Result<Rtnl, NetError> {
        let ctx = |e| NetError::io(format!("netlink route socket in {ns}"), e);
        let mut sock = Socket::new(NETLINK_ROUTE).map_err(ctx)?;
        sock.bind_auto().map_err(ctx)?;
        sock.connect(&SocketAddr::new(0, 0)).map_err(ctx)?;
        Ok(Rtnl {
            sock,
            seq: 0,
            buf: Vec::with_capacity(64 * 1024),
            ns: ns.to_string(),
        })
    }

    /// Send one request and collect replies until its ACK (or DONE for
    /// dumps). A negative errno comes back as `Err(errno)` in the inner result.
    pub(super) fn request(
        &mut self,
        msg: RouteNetlinkMessage,
        flags: u16,
        what: &dyn Fn() -> String,
    ) -> Result<Result<Vec<RouteNetlinkMessage>, i32>, NetError> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let mut hdr = NetlinkHeader::default();
        hdr.flags = NLM_F_REQUEST | flags;
        hdr.sequence_number = seq;
        let mut nl = NetlinkMessage::new(hdr, NetlinkPayload::from(msg));
        nl.finalize();
        let mut out = vec![0u8; nl.buffer_len()];
        nl.serialize(&mut out);
        self.sock
            .send(&out, 0)
            .map_err(|e| NetError::io(format!("{} in {}: netlink send", what(), self.ns), e))?;
        let mut replies = Vec::new();
        loop {
            self.buf.clear();
            let n = self
                .sock
                .recv(&mut self.buf, 0)
                .map_err(|e| NetError::io(format!("{} in {}: netlink recv", what(), self.ns), e))?;
            let mut off = 0;
            while off + 16 <= n {
                let len = u32::from_ne_bytes([
                    self.buf[off],
                    self.buf[off + 1],
                    self.buf[off + 2],
                    self.buf[off + 3],
                ]) as usize;
                if len < 16 || off + len > n {
                    return Err(NetError::invalid(format!(
                        "{} in {}: truncated netlink reply",
                        what(),
                        self.ns
                    )));
                }
                let parsed =
                    NetlinkMessage::<RouteNetlinkMessage>::deserialize(&self.buf[off..off + len])
                        .map_err(|e| {
                        NetError::invalid(format!(
                            "{} in {}: bad netlink reply: {e}",
                            what(),
                            self.ns
                        ))
                    })?;
                off += (len + 3) & !3;
                if parsed.header.sequence_number != seq {
                    continue;
                }
                match parsed.payload {
                    NetlinkPayload::Error(e) => {
                        return Ok(match e.code {
                            None => Ok(replies),
                            Some(c) => Err(-c.get()),
                        })
                    }
                    NetlinkPayload::Done(_) => return Ok(Ok(replies)),
                    NetlinkPayload::InnerMessage(m) => replies.push(m),
                    _ => {}
                }
            }
        }
    }

    /// Like `request` but any errno is an error.
    pub(super) fn exec(
        &mut self,
        msg: RouteNetlinkMessage,
        flags: u16,
        what: &dyn Fn() -> String,
    ) -> Result<Vec<RouteNetlinkMessage>, NetError> {
        let ns = self.ns.clone();
        self.request(msg, flags, what)?.map_err(|errno| {
            NetError::io(
                format!("{} in {ns}", what()),
                std::io::Error::from_raw_os_error(errno),
            )
        })
    }

    /// Create a veth pair: `host` here, `peer` created directly in the
    /// namespace behind `peer_ns` (saves a separate move).
    pub fn add_veth(&mut self, host: &str, peer: &str, peer_ns: RawFd) -> Result<(), NetError> {
        let mut peer_msg = LinkMessage::default();
        peer_msg.attributes = vec![
            LinkAttribute::IfName(peer.to_string()),
            LinkAttribute::NetNsFd(peer_ns),
        ];
        let mut m = LinkMessage::default();
        m.attributes = vec![
            LinkAttribute::IfName(host.to_string()),
            LinkAttribute::LinkInfo(vec![
                LinkInfo::Kind(InfoKind::Veth),
                LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer_msg))),
            ]),
        ];
        self.exec(
            RouteNetlinkMessage::NewLink(m),
            NLM_F_CREATE | NLM_F_EXCL | NLM_F_ACK,
            &|| format!("create veth {host} (peer {peer})"),
        )?;
        Ok(())
    }

    /// Index of link `name`, `None` if it does not exist.
    pub fn link_index(&mut self, name: &str) -> Result<Option<u32>, NetError> {
        let mut m = LinkMessage::default();
        m.attributes = vec![LinkAttribute::IfName(name.to_string())];
        match self.request(RouteNetlinkMessage::GetLink(m), NLM_F_ACK, &|| {
            format!("get link {name}")
        })? {
            Ok(r) => Ok(r.into_iter().find_map(|m| match m {
                RouteNetlinkMessage::NewLink(l) => Some(l.header.index),
                _ => None,
            })),
            Err(libc::ENODEV) => Ok(None),
            Err(e) => Err(NetError::io(
                format!("get link {name} in {}", self.ns),
                std::io::Error::from_raw_os_error(e),
            )),
        }
    }

    /// Index of link `name`, which must exist.
    pub fn need_index(&mut self, name: &str) -> Result<u32, NetError> {
        let ns = self.ns.clone();
        self.link_index(name)?
            .ok_or_else(|| NetError::invalid(format!("link {name} missing in {ns}")))
    }

    /// Per-link settings of a session's host end, by netlink rather than
    /// `/proc/sys` (which would need a thread in the host namespace):
    /// strict reverse-path filter, and no IPv6 address generation, so the
    /// link has no IPv6 address and sends nothing on its own (no DAD, no
    /// router solicitation). Must run before the link is up.
    pub fn quiet_strict_link(&mut self, index: u32, what: &str) -> Result<(), NetError> {
        let mut conf = InetDevConf::default();
        conf.rp_filter = 1;
        let mut m = LinkMessage::default();
        m.header.index = index;
        m.attributes = vec![LinkAttribute::AfSpecUnspec(vec![
            AfSpecUnspec::Inet(vec![AfSpecInet::DevConfRequest(conf)]),
            AfSpecUnspec::Inet6(vec![AfSpecInet6::AddrGenMode(In6AddrGenMode::None)]),
        ])];
        self.exec(RouteNetlinkMessage::SetLink(m), NLM_F_ACK, &|| {
            format!("set rp_filter=1, addrgenmode none on {what}")
        })?;
        Ok(())
    }

    pub fn set_up(&mut self, index: u32, what: &str) -> Result<(), NetError> {
        let mut m = LinkMessage::default();
        m.header.index = index;
        m.header.flags = LinkFlags::Up;
        m.header.change_mask = LinkFlags::Up;
        self.exec(RouteNetlinkMessage::SetLink(m), NLM_F_ACK, &|| {
            format!("set {what} up")
        })?;
        Ok(())
    }

    pub fn add_addr(
        &mut self,
        index: u32,
        addr: Ipv4Addr,
        prefix_len: u8,
        what: &str,
    ) -> Result<(), NetError> {
        let mut m = AddressMessage::default();
        m.header.family = AddressFamily::Inet;
        m.header.prefix_len = prefix_len;
        m.header.index = index;
        m.attributes = vec![
            AddressAttribute::Local(addr.into()),
            AddressAttribute::Address(addr.into()),
        ];
        self.exec(
            RouteNetlinkMessage::NewAddress(m),
            NLM_F_CREATE | NLM_F_EXCL | NLM_F_ACK,
            &|| format!("add address {addr}/{prefix_len} to {what}"),
        )?;
        Ok(())
    }

    fn route_msg(dst: Ipv4Addr, plen: u8, kind: RouteType) -> RouteMessage {
        let mut m = RouteMessage::default();
        m.header.address_family = AddressFamily::Inet;
        m.header.destination_prefix_length = plen;
        m.header.table = 254; // main
        m.header.protocol = RouteProtocol::Static;
        m.header.scope = RouteScope::Universe;
        m.header.kind = kind;
        if plen > 0 {
            m.attributes
                .push(RouteAttribute::Destination(RouteAddress::Inet(dst)));
        }
        m
    }

    /// `ip route add DST/PLEN via GW dev OIF`.
    pub fn add_route_via(
        &mut self,
        dst: Ipv4Addr,
        plen: u8,
        gw: Ipv4Addr,
        oif: u32,
    ) -> Result<(), NetError> {
        let mut m = Self::route_msg(dst, plen, RouteType::Unicast);
        m.attributes
            .push(RouteAttribute::Gateway(RouteAddress::Inet(gw)));
        m.attributes.push(RouteAttribute::Oif(oif));
        self.exec(
            RouteNetlinkMessage::NewRoute(m),
            NLM_F_CREATE | NLM_F_EXCL | NLM_F_ACK,
            &|| format!("add route {dst}/{plen} via {gw}"),
        )?;
        Ok(())
    }

    /// `ip route replace blackhole DST/PLEN`: idempotent.
    pub fn replace_blackhole(&mut self, dst: Ipv4Addr, plen: u8) -> Result<(), NetError> {
        let m = Self::route_msg(dst, plen, RouteType::BlackHole);
        self.exec(
            RouteNetlinkMessage::NewRoute(m),
            NLM_F_CREATE | netlink_packet_core::NLM_F_REPLACE | NLM_F_ACK,
            &|| format!("add blackhole route {dst}/{plen}"),
        )?;
        Ok(())
    }

    /// Remove blackhole DST/PLEN; missing is fine.
    pub fn del_blackhole(&mut self, dst: Ipv4Addr, plen: u8) -> Result<(), NetError> {
        let m = Self::route_msg(dst, plen, RouteType::BlackHole);
        match self.request(RouteNetlinkMessage::DelRoute(m), NLM_F_ACK, &|| {
            format!("delete blackhole route {dst}/{plen}")
        })? {
            Ok(_) | Err(libc::ESRCH) | Err(libc::ENOENT) => Ok(()),
            Err(e) => Err(NetError::io(
                format!("delete blackhole route {dst}/{plen} in {}", self.ns),
                std::io::Error::from_raw_os_error(e),
            )),
        }
    }

    /// Delete link `name`; a missing link is not an error (idempotent).
    pub fn del_link(&mut self, name: &str) -> Result<(), NetError> {
        let mut m = LinkMessage::default();
        m.attributes = vec![LinkAttribute::IfName(name.to_string())];
        match self.request(RouteNetlinkMessage::DelLink(m), NLM_F_ACK, &|| {
            format!("delete link {name}")
        })? {
            Ok(_) | Err(libc::ENODEV) => Ok(()),
            Err(e) => Err(NetError::io(
                format!("delete link {name} in {}", self.ns),
                std::io::Error::from_raw_os_error(e),
            )),
        }
    }

    /// The IPv4 networks directly attached to link `name`: those of its
    /// addresses (a point-to-point address gives its peer's) and its
    /// on-link (scope link) routes other than a default route. Sorted,
    /// without duplicates; empty when the link does not exist.
    pub fn connected_nets(&mut self, name: &str) -> Result<Vec<Cidr>, NetError> {
        let Some(index) = self.link_index(name)? else {
            return Ok(Vec::new());
        };
        let mut nets = Vec::new();
        let mut am = AddressMessage::default();
        am.header.family = AddressFamily::Inet;
        let addrs = self.exec(RouteNetlinkMessage::GetAddress(am), NLM_F_DUMP, &|| {
            format!("list addresses of {name}")
        })?;
        for m in addrs {
            let RouteNetlinkMessage::NewAddress(a) = m else {
                continue;
            };
            if a.header.index != index {
                continue;
            }
            let addr = a.attributes.iter().find_map(|x| match x {
                AddressAttribute::Address(IpAddr::V4(v)) => Some(*v),
                _ => None,
            });
            if let Some(v) = addr {
                let c = Cidr::new(v, a.header.prefix_len.min(32));
                nets.push(Cidr::new(c.network(), c.prefix_len));
            }
        }
        let mut rm = RouteMessage::default();
        rm.header.address_family = AddressFamily::Inet;
        let routes = self.exec(RouteNetlinkMessage::GetRoute(rm), NLM_F_DUMP, &|| {
            format!("list routes of {name}")
        })?;
        for m in routes {
            let RouteNetlinkMessage::NewRoute(r) = m else {
                continue;
            };
            let h = &r.header;
            // Local and broadcast routes (table local) are of the host's
            // own addresses; a default route "dev X" is not one subnet.
            if h.kind != RouteType::Unicast
                || h.scope != RouteScope::Link
                || h.destination_prefix_length == 0
            {
                continue;
            }
            let mut oif = None;
            let mut dst = None;
            for x in &r.attributes {
                match x {
                    RouteAttribute::Oif(i) => oif = Some(*i),
                    RouteAttribute::Destination(RouteAddress::Inet(d)) => dst = Some(*d),
                    _ => {}
                }
            }
            if let (Some(i), Some(d)) = (oif, dst) {
                if i == index {
                    let c = Cidr::new(d, h.destination_prefix_length.min(32));
                    nets.push(Cidr::new(c.network(), c.prefix_len));
                }
            }
        }
        nets.sort_by_key(|c| (u32::from(c.addr), c.prefix_len));
        nets.dedup();
        Ok(nets)
    }

    /// All links of this namespace.
    pub fn links(&mut self) -> Result<Vec<Link>, NetError> {
        let r = self.exec(
            RouteNetlinkMessage::GetLink(LinkMessage::default()),
            NLM_F_DUMP,
            &|| "list links".to_string(),
        )?;
        Ok(r.into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewLink(l) => {
                    let name = l.attributes.iter().find_map(|a| match a {
                        LinkAttribute::IfName(n) => Some(n.clone()),
                        _ => None,
                    })?;
                    Some(Link {
                        index: l.header.index,
                        name,
                    })
                }
                _ => None,
            })
            .collect())
    }
}
