//! Can this host run session networks? A `doctor`-style check that tries
//! what sessions need and says plainly what is missing.
//!
//! There is no iptables fallback: the firewall is nf_tables spoken over
//! netlink (Linux ≥ 3.13 with `CONFIG_NF_TABLES`, `NFT_NAT`, `NFT_MASQ`,
//! `NFT_CT`, `NFT_SET_HASH`; the default of Debian, Ubuntu, Fedora, Arch
//! and NixOS kernels). It works whether the host's own tools are `nft`,
//! `iptables-nft` or `iptables-legacy`; it only needs the kernel side.

use std::path::Path;

use super::nft::Nft;
use super::rtnl::Rtnl;
use super::{firewall, netns, tc, NetConfig, NetError, NetPolicy, Result};

fn missing(what: &str, e: NetError) -> NetError {
    NetError::invalid(format!(
        "{what}: {e}. Session networking needs a Linux kernel with nf_tables \
         (CONFIG_NF_TABLES and CONFIG_NFT_NAT/NFT_MASQ/NFT_CT/NFT_SET_HASH, \
         Linux >= 3.13; Debian/Ubuntu kernels have them), tc tbf \
         (CONFIG_NET_SCH_TBF) for bandwidth limits, and /dev/net/tun; \
         iptables alone is not supported"
    ))
}

/// Check the host: nf_tables answers in the host namespace, and a
/// throwaway namespace accepts a full session table (sets, NAT, conntrack
/// matches) and a tbf qdisc. Leaves nothing behind.
pub fn check(cfg: &NetConfig) -> Result<()> {
    cfg.validate()?;
    if !Path::new("/dev/net/tun").exists() {
        return Err(missing(
            "/dev/net/tun is missing",
            NetError::invalid("no TUN/TAP device"),
        ));
    }
    let host_ns = cfg.host_netns.as_deref().map(netns::open).transpose()?;
    netns::run_in(host_ns.as_ref(), "host netns (doctor)", || {
        let mut nft =
            Nft::open("host netns").map_err(|e| missing("nf_tables netlink socket", e))?;
        nft.tables()
            .map_err(|e| missing("listing nf_tables tables", e))?;
        Ok(())
    })?;
    let name = format!("{}-doctor-{}", cfg.prefix, std::process::id());
    let table = firewall::session_table(cfg, "lo", &NetPolicy::default(), false);
    let r = netns::create(&name, || {
        let mut nft = Nft::open(&name)?;
        let mut b = nft.batch();
        b.create_table(&table);
        nft.commit(b)
            .map_err(|e| missing("installing a session table", e))?;
        let mut rtnl = Rtnl::open(&name)?;
        let lo = rtnl.need_index("lo")?;
        tc::set_limit(&mut rtnl, lo, "lo (doctor)", Some(1000), None)
            .map_err(|e| missing("adding a tbf qdisc", e))?;
        Ok(())
    });
    let d = netns::delete(&name);
    r?;
    d
}
