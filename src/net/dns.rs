//! Just enough of the DNS wire format (RFC 1035) for the session forwarder:
//! decide what to do with a guest's query, build the clean query we send
//! upstream, and check an upstream response and pull its A records out.
//!
//! Everything here is pure and bounded: names are at most 255 bytes, a
//! compression pointer must point strictly backwards (so no loops), at most
//! [`MAX_RECORDS`] records are read, and every offset is checked, so any
//! byte string is either handled or refused without panicking (fuzzed by a
//! test over random and mutated messages).

use std::net::Ipv4Addr;

use super::policy::{valid_label, DomainPattern};

pub const TYPE_A: u16 = 1;
pub const TYPE_CNAME: u16 = 5;
pub const TYPE_AAAA: u16 = 28;
pub const TYPE_OPT: u16 = 41;
const TYPE_IXFR: u16 = 251;
const TYPE_AXFR: u16 = 252;
pub const CLASS_IN: u16 = 1;

pub const RCODE_NOERROR: u8 = 0;
pub const RCODE_FORMERR: u8 = 1;
pub const RCODE_SERVFAIL: u8 = 2;
pub const RCODE_NXDOMAIN: u8 = 3;
pub const RCODE_NOTIMP: u8 = 4;
pub const RCODE_REFUSED: u8 = 5;

/// Largest query we take from a guest (UDP or TCP).
pub const MAX_QUERY: usize = 4096;
/// EDNS payload size we advertise upstream (the DNS flag day value).
pub const EDNS_SIZE: u16 = 1232;
/// Records read from one response, all sections together.
pub const MAX_RECORDS: usize = 256;
/// CNAME hops followed from the question name.
const MAX_CHAIN: usize = 16;
const HEADER: usize = 12;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DnsError {
    Truncated,
    BadName(&'static str),
    Malformed(&'static str),
}

impl std::fmt::Display for DnsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DnsError::Truncated => f.write_str("message truncated"),
            DnsError::BadName(w) => write!(f, "bad name: {w}"),
            DnsError::Malformed(w) => write!(f, "malformed: {w}"),
        }
    }
}

fn u16_at(m: &[u8], off: usize) -> Result<u16, DnsError> {
    match m.get(off..off + 2) {
        Some(b) => Ok(u16::from_be_bytes([b[0], b[1]])),
        None => Err(DnsError::Truncated),
    }
}

fn u32_at(m: &[u8], off: usize) -> Result<u32, DnsError> {
    match m.get(off..off + 4) {
        Some(b) => Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]])),
        None => Err(DnsError::Truncated),
    }
}

/// A decoded name: lower-case labels joined by dots (root: empty).
/// `clean` is false when a label holds bytes outside `[a-z0-9_-]`; such a
/// name never matches a pattern (a label "a.pypi" must not pass for two).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Name {
    pub text: String,
    pub clean: bool,
    pub labels: Vec<Vec<u8>>,
}

/// Read the name at `off`; returns it and the offset just after it (after
/// the first pointer if compressed).
pub fn read_name(m: &[u8], off: usize) -> Result<(Name, usize), DnsError> {
    let mut pos = off;
    let mut end = None;
    let mut wire_len = 0usize;
    let mut labels = Vec::new();
    let mut clean = true;
    // Each pointer must go strictly below the start of the label run it
    // was found in: offsets only decrease, so there can be no loop.
    let mut floor = off;
    loop {
        let len = *m.get(pos).ok_or(DnsError::Truncated)? as usize;
        match len & 0xc0 {
            0x00 => {
                if len == 0 {
                    if end.is_none() {
                        end = Some(pos + 1);
                    }
                    break;
                }
                let l = m.get(pos + 1..pos + 1 + len).ok_or(DnsError::Truncated)?;
                wire_len += len + 1;
                if wire_len + 1 > 255 {
                    return Err(DnsError::BadName("longer than 255 bytes"));
                }
                let low = l.to_ascii_lowercase();
                clean &= valid_label(&low);
                labels.push(low);
                pos += 1 + len;
            }
            0xc0 => {
                let b2 = *m.get(pos + 1).ok_or(DnsError::Truncated)? as usize;
                let target = ((len & 0x3f) << 8) | b2;
                if end.is_none() {
                    end = Some(pos + 2);
                }
                if target >= floor {
                    return Err(DnsError::BadName("compression pointer not backwards"));
                }
                floor = target;
                pos = target;
            }
            _ => return Err(DnsError::BadName("reserved label type")),
        }
    }
    let text = if clean {
        labels
            .iter()
            .map(|l| String::from_utf8_lossy(l))
            .collect::<Vec<_>>()
            .join(".")
    } else {
        // Something no pattern can equal, for logs.
        labels
            .iter()
            .map(|l| l.iter().map(|b| format!("\\{b:03}")).collect::<String>())
            .collect::<Vec<_>>()
            .join(".")
    };
    let end = end.ok_or(DnsError::Truncated)?;
    Ok((
        Name {
            text,
            clean,
            labels,
        },
        end,
    ))
}

/// Encode labels uncompressed.
fn write_name(out: &mut Vec<u8>, labels: &[Vec<u8>]) {
    for l in labels {
        out.push(l.len() as u8);
        out.extend_from_slice(l);
    }
    out.push(0);
}

/// The one question of a query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    pub name: Name,
    pub qtype: u16,
    pub qclass: u16,
}

/// What the guest sent, as far as the reply needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    pub id: u16,
    /// Recursion desired, echoed in replies.
    pub rd: bool,
    pub question: Question,
    /// Largest UDP reply the guest takes (512 without EDNS).
    pub udp_limit: usize,
}

/// What to do with a message from the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Not worth an answer (too short to carry an id, or not a query).
    Drop,
    /// Answer with these bytes, without asking upstream.
    Reply(Vec<u8>),
    /// Ask upstream.
    Forward(Query),
}

/// A header-only (plus question, when known) reply with `rcode`.
fn reply_with(id: u16, rd: bool, opcode: u8, q: Option<&Question>, rcode: u8) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&id.to_be_bytes());
    // QR, opcode, RD as asked; RA set (we recurse through upstream).
    out.push(0x80 | ((opcode & 0x0f) << 3) | u8::from(rd));
    out.push(0x80 | (rcode & 0x0f));
    out.extend_from_slice(&u16::from(q.is_some()).to_be_bytes());
    out.extend_from_slice(&[0; 6]);
    if let Some(q) = q {
        write_name(&mut out, &q.name.labels);
        out.extend_from_slice(&q.qtype.to_be_bytes());
        out.extend_from_slice(&q.qclass.to_be_bytes());
    }
    out
}

/// An error or empty answer for a query we understood.
pub fn reply(q: &Query, rcode: u8) -> Vec<u8> {
    reply_with(q.id, q.rd, 0, Some(&q.question), rcode)
}

/// Decide what to do with `msg` from the guest. Refusals: a name not
/// allowed gets NXDOMAIN; a malformed query FORMERR; other opcodes
/// NOTIMP; zone transfers and non-IN classes REFUSED; AAAA an empty
/// NOERROR (sessions have no IPv6 route, so the guest should not try).
pub fn classify(msg: &[u8], allowed: &[DomainPattern]) -> Action {
    classify_by(msg, |n| allowed.iter().any(|p| p.matches(n)))
}

/// [`classify`] with the name check given as a function (`|_| true`: a
/// resolver for every name, as in the `internet` mode).
pub fn classify_by(msg: &[u8], allowed: impl Fn(&str) -> bool) -> Action {
    if msg.len() < HEADER || msg.len() > MAX_QUERY {
        return Action::Drop;
    }
    let id = u16::from_be_bytes([msg[0], msg[1]]);
    let flags = msg[2];
    if flags & 0x80 != 0 {
        return Action::Drop; // a response: never answer those (no loops)
    }
    let opcode = (flags >> 3) & 0x0f;
    let rd = flags & 1 != 0;
    if opcode != 0 {
        return Action::Reply(reply_with(id, rd, opcode, None, RCODE_NOTIMP));
    }
    let formerr = || Action::Reply(reply_with(id, rd, 0, None, RCODE_FORMERR));
    let (Ok(qd), Ok(an), Ok(ns), Ok(ar)) = (
        u16_at(msg, 4),
        u16_at(msg, 6),
        u16_at(msg, 8),
        u16_at(msg, 10),
    ) else {
        return formerr();
    };
    if qd != 1 || an != 0 || ns != 0 || ar > 1 {
        return formerr();
    }
    let Ok((name, off)) = read_name(msg, HEADER) else {
        return formerr();
    };
    let (Ok(qtype), Ok(qclass)) = (u16_at(msg, off), u16_at(msg, off + 2)) else {
        return formerr();
    };
    let mut udp_limit = 512;
    if ar == 1 {
        // Only an EDNS OPT record belongs there: root name, type OPT.
        let p = off + 4;
        match (msg.get(p), u16_at(msg, p + 1), u16_at(msg, p + 3)) {
            (Some(0), Ok(TYPE_OPT), Ok(size)) => {
                udp_limit = usize::from(size).clamp(512, MAX_QUERY);
            }
            _ => return formerr(),
        }
    }
    let q = Query {
        id,
        rd,
        question: Question {
            name,
            qtype,
            qclass,
        },
        udp_limit,
    };
    let name = &q.question.name;
    let ok = name.clean && !name.text.is_empty() && allowed(&name.text);
    if !ok {
        return Action::Reply(reply(&q, RCODE_NXDOMAIN));
    }
    if qclass != CLASS_IN || qtype == TYPE_AXFR || qtype == TYPE_IXFR || qtype == TYPE_OPT {
        return Action::Reply(reply(&q, RCODE_REFUSED));
    }
    if qtype == TYPE_AAAA {
        return Action::Reply(reply(&q, RCODE_NOERROR));
    }
    Action::Forward(q)
}

/// The query we send upstream: our own id, the guest's question
/// re-encoded, recursion desired, an EDNS OPT record and nothing else (no
/// guest-chosen bytes beyond the allowed name ride along).
pub fn upstream_query(q: &Query, id: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&[0x01, 0x00]); // RD
    out.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 1]);
    write_name(&mut out, &q.question.name.labels);
    out.extend_from_slice(&q.question.qtype.to_be_bytes());
    out.extend_from_slice(&q.question.qclass.to_be_bytes());
    out.push(0); // OPT: root name
    out.extend_from_slice(&TYPE_OPT.to_be_bytes());
    out.extend_from_slice(&EDNS_SIZE.to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0, 0, 0]); // ext rcode, version, flags, rdlen
    out
}

/// A checked upstream response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// Reply for the guest: its id, header + question + answer + authority
    /// (no additional section, so no OPT the guest did not ask for), TTLs
    /// capped at `ttl_max`.
    pub reply: Vec<u8>,
    /// A records of the question name or of names it is a CNAME of, with
    /// their TTLs (capped).
    pub addrs: Vec<(Ipv4Addr, u32)>,
    /// The upstream set TC: the guest should retry over TCP.
    pub truncated: bool,
    pub rcode: u8,
}

struct Record {
    name: Name,
    rtype: u16,
    class: u16,
    ttl_off: usize,
    ttl: u32,
    rdata: (usize, usize),
}

/// Check `resp` against the query we sent (`id`, `q`) and extract what we
/// need. Any inconsistency is an error (the guest then gets SERVFAIL).
pub fn parse_response(resp: &[u8], id: u16, q: &Query, ttl_max: u32) -> Result<Answer, DnsError> {
    if resp.len() < HEADER {
        return Err(DnsError::Truncated);
    }
    if u16_at(resp, 0)? != id {
        return Err(DnsError::Malformed("id does not match"));
    }
    let flags = u16_at(resp, 2)?;
    if flags & 0x8000 == 0 || (flags >> 11) & 0x0f != 0 {
        return Err(DnsError::Malformed("not a response to a query"));
    }
    let truncated = flags & 0x0200 != 0;
    let rcode = (flags & 0x0f) as u8;
    let (qd, an, ns, ar) = (
        u16_at(resp, 4)?,
        u16_at(resp, 6)?,
        u16_at(resp, 8)?,
        u16_at(resp, 10)?,
    );
    if qd != 1 {
        return Err(DnsError::Malformed("response must echo one question"));
    }
    let (qn, mut off) = read_name(resp, HEADER)?;
    let (qt, qc) = (u16_at(resp, off)?, u16_at(resp, off + 2)?);
    off += 4;
    if qn.labels != q.question.name.labels || qt != q.question.qtype || qc != q.question.qclass {
        return Err(DnsError::Malformed("question does not match"));
    }
    let total = usize::from(an) + usize::from(ns) + usize::from(ar);
    if total > MAX_RECORDS {
        return Err(DnsError::Malformed("too many records"));
    }
    // A truncated response may end early; keep what is complete.
    let mut records = Vec::new();
    let mut kept_ns = 0u16;
    for i in 0..usize::from(an) + usize::from(ns) {
        let r = match read_record(resp, off) {
            Ok(r) => r,
            Err(DnsError::Truncated) if truncated => break,
            Err(e) => return Err(e),
        };
        off = r.1;
        if i < usize::from(an) {
            records.push(r.0);
        } else {
            kept_ns += 1;
        }
    }
    let mut reply = resp[..off].to_vec();
    reply[0..2].copy_from_slice(&q.id.to_be_bytes());
    // Counts for what we keep: answer and authority as read, no additional.
    let kept_an = records.len() as u16;
    reply[6..8].copy_from_slice(&kept_an.to_be_bytes());
    reply[8..10].copy_from_slice(&kept_ns.to_be_bytes());
    reply[10..12].copy_from_slice(&[0, 0]);
    // Names the answer is about: the question and its CNAME chain.
    let mut names = vec![qn.labels.clone()];
    for _ in 0..MAX_CHAIN {
        let mut grew = false;
        for r in &records {
            if r.rtype == TYPE_CNAME && r.class == CLASS_IN && names.contains(&r.name.labels) {
                let (t, _) = read_name(resp, r.rdata.0)?;
                if !names.contains(&t.labels) {
                    names.push(t.labels);
                    grew = true;
                }
            }
        }
        if !grew {
            break;
        }
    }
    let mut addrs = Vec::new();
    for r in &records {
        let ttl = r.ttl.min(ttl_max);
        reply[r.ttl_off..r.ttl_off + 4].copy_from_slice(&ttl.to_be_bytes());
        if r.rtype == TYPE_A && r.class == CLASS_IN && names.contains(&r.name.labels) {
            let (s, e) = r.rdata;
            if e - s != 4 {
                return Err(DnsError::Malformed("A record without 4 bytes"));
            }
            addrs.push((
                Ipv4Addr::new(resp[s], resp[s + 1], resp[s + 2], resp[s + 3]),
                ttl,
            ));
        }
    }
    Ok(Answer {
        reply,
        addrs,
        truncated,
        rcode,
    })
}

fn read_record(m: &[u8], off: usize) -> Result<(Record, usize), DnsError> {
    let (name, p) = read_name(m, off)?;
    let rtype = u16_at(m, p)?;
    let class = u16_at(m, p + 2)?;
    let ttl = u32_at(m, p + 4)?;
    let rdlen = usize::from(u16_at(m, p + 8)?);
    let s = p + 10;
    if s + rdlen > m.len() {
        return Err(DnsError::Truncated);
    }
    Ok((
        Record {
            name,
            rtype,
            class,
            ttl_off: p + 4,
            // A TTL with the top bit set is 0 (RFC 2181 8).
            ttl: if ttl > i32::MAX as u32 { 0 } else { ttl },
            rdata: (s, s + rdlen),
        },
        s + rdlen,
    ))
}

/// A reply that tells a UDP guest to ask again over TCP.
pub fn truncated_reply(q: &Query) -> Vec<u8> {
    let mut r = reply(q, RCODE_NOERROR);
    r[2] |= 0x02; // TC
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut m = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for l in name.split('.') {
            m.push(l.len() as u8);
            m.extend_from_slice(l.as_bytes());
        }
        m.push(0);
        m.extend_from_slice(&qtype.to_be_bytes());
        m.extend_from_slice(&CLASS_IN.to_be_bytes());
        m
    }

    fn allow() -> Vec<DomainPattern> {
        vec!["*.pypi.org".parse().unwrap(), "github.com".parse().unwrap()]
    }

    fn rcode(a: &Action) -> u8 {
        match a {
            Action::Reply(r) => r[3] & 0x0f,
            other => panic!("not a reply: {other:?}"),
        }
    }

    #[test]
    fn classify_queries() {
        let a = classify(&query("Files.PyPI.org", TYPE_A), &allow());
        let Action::Forward(q) = a else {
            panic!("{a:?}")
        };
        assert_eq!(q.question.name.text, "files.pypi.org");
        assert_eq!(q.id, 0x1234);
        assert_eq!(
            rcode(&classify(&query("pypi.org", TYPE_A), &allow())),
            RCODE_NXDOMAIN
        );
        assert_eq!(
            rcode(&classify(&query("evil.com", TYPE_A), &allow())),
            RCODE_NXDOMAIN
        );
        assert_eq!(
            rcode(&classify(&query("github.com", TYPE_AAAA), &allow())),
            RCODE_NOERROR
        );
        assert_eq!(
            rcode(&classify(&query("github.com", TYPE_AXFR), &allow())),
            RCODE_REFUSED
        );
        // A label holding a dot is not two labels.
        let mut m = vec![0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 10];
        m.extend_from_slice(b"github.com");
        m.extend_from_slice(&[0, 0, 1, 0, 1]);
        assert_eq!(rcode(&classify(&m, &allow())), RCODE_NXDOMAIN);
        // Responses and runts are dropped.
        let mut r = query("github.com", TYPE_A);
        r[2] |= 0x80;
        assert_eq!(classify(&r, &allow()), Action::Drop);
        assert_eq!(classify(&[1, 2, 3], &allow()), Action::Drop);
        // Truncated question, compression loop, pointer forward: FORMERR.
        let q = query("github.com", TYPE_A);
        assert_eq!(rcode(&classify(&q[..q.len() - 2], &allow())), RCODE_FORMERR);
        let lp = [0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0xc0, 12, 0, 1, 0, 1];
        assert_eq!(rcode(&classify(&lp, &allow())), RCODE_FORMERR);
        let fw = [0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0xc0, 14, 0, 0, 1, 0, 1];
        assert_eq!(rcode(&classify(&fw, &allow())), RCODE_FORMERR);
    }

    fn response(q: &[u8], answers: &[(&[u8], u16, u32, &[u8])]) -> Vec<u8> {
        let mut r = q.to_vec();
        r[2] |= 0x80;
        r[7] = answers.len() as u8;
        for (name, t, ttl, data) in answers {
            r.extend_from_slice(name);
            r.extend_from_slice(&t.to_be_bytes());
            r.extend_from_slice(&CLASS_IN.to_be_bytes());
            r.extend_from_slice(&ttl.to_be_bytes());
            r.extend_from_slice(&(data.len() as u16).to_be_bytes());
            r.extend_from_slice(data);
        }
        r
    }

    #[test]
    fn parse_answers_and_cname_chain() {
        let Action::Forward(q) = classify(&query("cdn.pypi.org", TYPE_A), &allow()) else {
            panic!()
        };
        let up = upstream_query(&q, 0x4321);
        let mut base = up[..up.len() - 11].to_vec(); // without the OPT
        base[11] = 0;
        let target = b"\x04edge\x07example\x03net\x00";
        // The CNAME's rdata starts after its owner pointer and fixed part.
        let off_target = (base.len() + 12) as u8;
        let r = response(
            &base,
            &[
                (&[0xc0, 12], TYPE_CNAME, 300, target),
                (&[0xc0, off_target], TYPE_A, 30, &[198, 51, 100, 9]),
                // Not about our name: ignored.
                (b"\x05other\x03com\x00", TYPE_A, 30, &[203, 0, 113, 1]),
            ],
        );
        let a = parse_response(&r, 0x4321, &q, 100).unwrap();
        assert_eq!(a.addrs, vec![(Ipv4Addr::new(198, 51, 100, 9), 30)]);
        assert_eq!(&a.reply[..2], &[0x12, 0x34]);
        // The CNAME's TTL was capped in the reply.
        assert_eq!(
            parse_response(&a.reply[..], 0x1234, &q, 100)
                .unwrap()
                .addrs
                .len(),
            1
        );
        // Wrong id or question: refused.
        assert!(parse_response(&r, 1, &q, 100).is_err());
        let Action::Forward(q2) = classify(&query("github.com", TYPE_A), &allow()) else {
            panic!()
        };
        assert!(parse_response(&r, 0x4321, &q2, 100).is_err());
    }

    /// xorshift64*, so the fuzz loop needs no crate.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Fuzz: random and mutated messages through every entry point, for
    /// about two seconds. Nothing may panic; what is forwarded must be a
    /// clean, allowed name.
    #[test]
    fn fuzz_parsers() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ u64::from(std::process::id()));
        let allowed = allow();
        let Action::Forward(fq) = classify(&query("a.pypi.org", TYPE_A), &allowed) else {
            panic!()
        };
        let seeds: Vec<Vec<u8>> = vec![
            query("files.pypi.org", TYPE_A),
            query("github.com", TYPE_AAAA),
            response(
                &query("a.pypi.org", TYPE_A),
                &[(&[0xc0, 12], TYPE_A, 5, &[1, 2, 3, 4])],
            ),
            // a.pypi.org CNAME b.pypi.org (compressed), b.pypi.org A 1.2.3.4
            response(
                &query("a.pypi.org", TYPE_A),
                &[
                    (&[0xc0, 12], TYPE_CNAME, 5, &[1, b'b', 0xc0, 14]),
                    (&[0xc0, 40], TYPE_A, 5, &[1, 2, 3, 4]),
                ],
            ),
        ];
        let a = parse_response(&seeds[3], 0x1234, &fq, 60).unwrap();
        assert_eq!(a.addrs, vec![(Ipv4Addr::new(1, 2, 3, 4), 5)]);
        let start = std::time::Instant::now();
        let mut n = 0u64;
        while start.elapsed() < std::time::Duration::from_secs(2) {
            let mut m = if rng.below(4) == 0 {
                let len = rng.below(600);
                (0..len).map(|_| rng.next() as u8).collect::<Vec<u8>>()
            } else {
                seeds[rng.below(seeds.len())].clone()
            };
            for _ in 0..rng.below(8) {
                if m.is_empty() {
                    break;
                }
                let i = rng.below(m.len());
                match rng.below(5) {
                    0 => m[i] = rng.next() as u8,
                    1 => m[i] = 0xc0,
                    2 => m.truncate(i),
                    3 => m.insert(i, rng.next() as u8),
                    _ => {
                        let j = rng.below(m.len());
                        let chunk = m[j..].to_vec();
                        m.extend_from_slice(&chunk[..chunk.len().min(64)]);
                    }
                }
            }
            if let Action::Forward(q) = classify(&m, &allowed) {
                assert!(q.question.name.clean);
                assert!(allowed.iter().any(|p| p.matches(&q.question.name.text)));
                let up = upstream_query(&q, 7);
                assert!(up.len() <= 12 + 256 + 4 + 11);
            }
            let id = u16::from_be_bytes([
                m.first().copied().unwrap_or(0),
                m.get(1).copied().unwrap_or(0),
            ]);
            if let Ok(a) = parse_response(&m, id, &fq, 60) {
                assert!(a.reply.len() <= m.len());
                assert!(a.addrs.iter().all(|(_, t)| *t <= 60));
            }
            let _ = read_name(&m, rng.below(m.len() + 1));
            n += 1;
        }
        eprintln!("dns fuzz: {n} cases in 2 s");
        assert!(n > 10_000, "only {n} cases in 2 s");
    }
}
