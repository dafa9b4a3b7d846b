//! Bandwidth limits: a token bucket filter (`tbf`) as the root qdisc of a
//! link, over route netlink (netlink-packet-route has the tc messages but
//! no tbf options, so those few bytes are encoded here).
//!
//! A session is shaped on the egress of two links inside its namespace:
//! the TAP (traffic towards the guest: download) and the namespace end of
//! the veth (traffic from the guest: upload). Every packet of either
//! direction leaves through exactly one of them.

use netlink_packet_core::{
    DefaultNla, Nla, NlasIterator, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_REPLACE,
};
use netlink_packet_route::tc::{TcAttribute, TcHandle, TcMessage, TcOption};
use netlink_packet_route::RouteNetlinkMessage;

use super::rtnl::Rtnl;
use super::{NetError, Result};

const TCA_TBF_PARMS: u16 = 1;
const TCA_TBF_RATE64: u16 = 4;
const TCA_TBF_BURST: u16 = 6;
const TC_LINKLAYER_ETHERNET: u8 = 1;
/// psched ticks are 64 ns (PSCHED_SHIFT 6).
const PSCHED_SHIFT: u32 = 6;

/// Token bucket parameters for `kbit` kbit/s: (rate bytes/s, burst bytes,
/// queue limit bytes). The burst is `burst_kbit` if given, else 20 ms
/// worth (at least two full frames either way), the queue 50 ms on top of
/// it (at least 64 KiB), so TCP sees a steady rate without a deep buffer.
pub fn tbf_params(kbit: u64, burst_kbit: Option<u64>) -> (u64, u32, u32) {
    let rate = kbit.saturating_mul(1000) / 8;
    let burst = burst_kbit
        .map(|b| b.saturating_mul(1000) / 8)
        .unwrap_or(rate / 50)
        .clamp(2 * 1514, u64::from(u32::MAX / 4)) as u32;
    let limit = (rate / 20 + u64::from(burst)).clamp(64 * 1024, u64::from(u32::MAX / 2)) as u32;
    (rate, burst, limit)
}

fn root_msg(index: u32) -> TcMessage {
    let mut m = TcMessage::with_index(index as i32);
    m.header.parent = TcHandle::ROOT;
    m
}

/// Limit the egress of link `index` to `kbit` kbit/s (`tc qdisc replace
/// dev X root tbf ...`), or remove our limit when `None`.
pub fn set_limit(
    rtnl: &mut Rtnl,
    index: u32,
    what: &str,
    kbit: Option<u64>,
    burst_kbit: Option<u64>,
) -> Result<()> {
    let Some(kbit) = kbit else {
        let m = root_msg(index);
        return match rtnl.request(
            RouteNetlinkMessage::DelQueueDiscipline(m),
            NLM_F_ACK,
            &|| format!("remove bandwidth limit of {what}"),
        )? {
            // ENOENT: only the default qdisc there, nothing to remove.
            Ok(_) | Err(libc::ENOENT) | Err(libc::EINVAL) => Ok(()),
            Err(e) => Err(NetError::io(
                format!("remove bandwidth limit of {what}"),
                std::io::Error::from_raw_os_error(e),
            )),
        };
    };
    let (rate, burst, limit) = tbf_params(kbit, burst_kbit);
    // struct tc_tbf_qopt: rate and peakrate (struct tc_ratespec, 12 bytes
    // each), limit, buffer, mtu. An Ethernet link layer means the kernel
    // computes the rate itself (no rate table needed).
    let mut qopt = [0u8; 36];
    qopt[1] = TC_LINKLAYER_ETHERNET;
    qopt[8..12].copy_from_slice(&(rate.min(u64::from(u32::MAX)) as u32).to_ne_bytes());
    qopt[24..28].copy_from_slice(&limit.to_ne_bytes());
    let buffer_ns = u64::from(burst) * 1_000_000_000 / rate.max(1);
    let ticks = (buffer_ns >> PSCHED_SHIFT).min(u64::from(u32::MAX)) as u32;
    qopt[28..32].copy_from_slice(&ticks.to_ne_bytes());
    let mut opts = vec![
        TcOption::Other(DefaultNla::new(TCA_TBF_PARMS, qopt.to_vec())),
        TcOption::Other(DefaultNla::new(TCA_TBF_BURST, burst.to_ne_bytes().to_vec())),
    ];
    if rate > u64::from(u32::MAX) {
        opts.push(TcOption::Other(DefaultNla::new(
            TCA_TBF_RATE64,
            rate.to_ne_bytes().to_vec(),
        )));
    }
    let mut m = root_msg(index);
    m.header.handle = TcHandle { major: 1, minor: 0 };
    m.attributes = vec![TcAttribute::Kind("tbf".into()), TcAttribute::Options(opts)];
    rtnl.exec(
        RouteNetlinkMessage::NewQueueDiscipline(m),
        NLM_F_CREATE | NLM_F_REPLACE | NLM_F_ACK,
        &|| format!("set bandwidth limit of {what} to {kbit} kbit/s"),
    )?;
    Ok(())
}

/// The rate (bytes/s) of the root tbf on link `index`, `None` if its root
/// qdisc is not a tbf.
pub fn read_limit(rtnl: &mut Rtnl, index: u32, what: &str) -> Result<Option<u64>> {
    let mut q = TcMessage::default();
    q.header.index = index as i32;
    let r = rtnl.exec(
        RouteNetlinkMessage::GetQueueDiscipline(q),
        NLM_F_DUMP,
        &|| format!("list qdiscs of {what}"),
    )?;
    for m in r {
        let RouteNetlinkMessage::NewQueueDiscipline(m) = m else {
            continue;
        };
        if m.header.index != index as i32 || m.header.parent != TcHandle::ROOT {
            continue;
        }
        let is_tbf = m
            .attributes
            .iter()
            .any(|a| matches!(a, TcAttribute::Kind(k) if k == "tbf"));
        if !is_tbf {
            return Ok(None);
        }
        for a in &m.attributes {
            let TcAttribute::Options(opts) = a else {
                continue;
            };
            for o in opts {
                let TcOption::Other(nla) = o else { continue };
                let mut v = vec![0u8; nla.value_len()];
                nla.emit_value(&mut v);
                return Ok(Some(tbf_rate(&v).ok_or_else(|| {
                    NetError::invalid(format!("tbf on {what}: no rate in the kernel's answer"))
                })?));
            }
        }
    }
    Ok(None)
}

/// Rate from tbf's nested options (TCA_TBF_RATE64 wins over the 32-bit one).
fn tbf_rate(nested: &[u8]) -> Option<u64> {
    let mut rate = None;
    for nla in NlasIterator::new(nested) {
        let nla = nla.ok()?;
        let v = nla.value();
        match nla.kind() {
            TCA_TBF_PARMS if v.len() >= 12 && rate.is_none() => {
                rate = Some(u64::from(u32::from_ne_bytes([v[8], v[9], v[10], v[11]])));
            }
            TCA_TBF_RATE64 if v.len() >= 8 => {
                let mut b = [0u8; 8];
                b.copy_from_slice(&v[..8]);
                rate = Some(u64::from_ne_bytes(b));
            }
            _ => {}
        }
    }
    rate
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params() {
        let (rate, burst, limit) = tbf_params(8000, None);
        assert_eq!(rate, 1_000_000);
        assert_eq!(burst, 20_000);
        assert_eq!(limit, 70_000);
        let (rate, burst, _) = tbf_params(64, None);
        assert_eq!((rate, burst), (8000, 3028));
        let (rate, _, _) = tbf_params(100_000_000, None);
        assert!(rate > u64::from(u32::MAX));
        // A configured bucket: 800 kbit is 100 kB, a tiny one still two frames.
        assert_eq!(tbf_params(8000, Some(800)).1, 100_000);
        assert_eq!(tbf_params(8000, Some(1)).1, 3028);
    }
}
