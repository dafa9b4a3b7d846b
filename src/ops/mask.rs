//! Output masking: every occurrence of a secret value in a command's
//! output is replaced by `****` before the output leaves the daemon. One
//! facility for every kind of secret (an exec's secret files today; the
//! session's injected credentials can be fed into the same [`Masker`]).
//!
//! Output arrives in chunks, so a value may be split across two of them:
//! per stream the masker holds back a tail that could still be the start
//! of a value (at most the longest value's length - 1 bytes) and hands it
//! on with the next chunk, or at [`Masker::flush`] when the stream ends.
//! The held bytes are raw output, so masking works the same whatever
//! encoding (utf8 or base64) the front end hands the output out in.

use base64::Engine;

/// What a value is replaced with.
pub const MASK: &[u8] = b"****";

/// Values shorter than this are never masked: a 1-3 byte value would
/// turn ordinary output (digits, short words) into stars. Exec secrets
/// shorter than this are refused (see `validate::secrets`).
pub const MIN_MASKED_LEN: usize = 4;

/// The masker of one running call: its patterns and a held tail per
/// output stream (stdout, stderr).
#[derive(Default)]
pub struct Masker {
    /// Longest first, so the longest value matching at a position wins.
    patterns: Vec<Vec<u8>>,
    tails: [Vec<u8>; 2],
}

impl Masker {
    /// A masker for `values` and their standard base64 forms (what
    /// `base64 /run/secrets/X` prints). Values under [`MIN_MASKED_LEN`]
    /// are left out.
    pub fn new<'a>(values: impl IntoIterator<Item = &'a [u8]>) -> Masker {
        let mut patterns = Vec::new();
        for v in values {
            if v.len() < MIN_MASKED_LEN {
                continue;
            }
            patterns.push(v.to_vec());
            patterns.push(
                base64::engine::general_purpose::STANDARD
                    .encode(v)
                    .into_bytes(),
            );
        }
        patterns.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        patterns.dedup();
        Masker {
            patterns,
            tails: Default::default(),
        }
    }

    /// `data` whole, masked (an audit record's text: one piece, no tail).
    pub fn mask_all(&mut self, data: &[u8]) -> Vec<u8> {
        let mut out = self.push(0, data);
        out.extend(self.flush(0));
        out
    }

    /// `s` masked on its own, whatever the streams hold (a record's text
    /// while output is still passing).
    pub fn mask_text(&self, s: &str) -> String {
        Masker {
            patterns: self.patterns.clone(),
            tails: Default::default(),
        }
        .mask_str(s)
    }

    /// [`Masker::mask_all`] of a string, lossily back to a string.
    pub fn mask_str(&mut self, s: &str) -> String {
        String::from_utf8_lossy(&self.mask_all(s.as_bytes())).into_owned()
    }

    /// Nothing to mask: output passes through untouched.
    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// The bytes of `data` (after what was held of `stream`) that can be
    /// handed on now, masked; a tail that may be the start of a value is
    /// held for the next call.
    pub fn push(&mut self, stream: usize, data: &[u8]) -> Vec<u8> {
        if self.is_empty() {
            return data.to_vec();
        }
        let mut buf = std::mem::take(&mut self.tails[stream % 2]);
        buf.extend_from_slice(data);
        let (out, used) = self.scan(&buf, false);
        self.tails[stream % 2] = buf[used..].to_vec();
        out
    }

    /// The held tail of `stream`, masked: the stream has ended.
    pub fn flush(&mut self, stream: usize) -> Vec<u8> {
        let buf = std::mem::take(&mut self.tails[stream % 2]);
        self.scan(&buf, true).0
    }

    /// Masks `buf` from the left; unless `last`, stops at the first
    /// position where the rest of `buf` is a proper prefix of a value
    /// (more output could complete it, or complete a longer value than
    /// one matching there now). Answers the output and the bytes used.
    fn scan(&self, buf: &[u8], last: bool) -> (Vec<u8>, usize) {
        let mut out = Vec::with_capacity(buf.len());
        let mut i = 0;
        'outer: while i < buf.len() {
            let rest = &buf[i..];
            let mut full = None;
            for p in &self.patterns {
                // Cheap first-byte test: most positions start no value.
                if p[0] != rest[0] {
                    continue;
                }
                if rest.len() >= p.len() {
                    if full.is_none() && rest.starts_with(p) {
                        full = Some(p.len());
                    }
                } else if !last && p.starts_with(rest) {
                    break 'outer;
                }
            }
            match full {
                Some(n) => {
                    out.extend_from_slice(MASK);
                    i += n;
                }
                None => {
                    out.push(buf[i]);
                    i += 1;
                }
            }
        }
        (out, i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn masker(vals: &[&str]) -> Masker {
        Masker::new(vals.iter().map(|v| v.as_bytes()))
    }

    fn run(m: &mut Masker, chunks: &[&str]) -> String {
        let mut out = Vec::new();
        for c in chunks {
            out.extend(m.push(0, c.as_bytes()));
        }
        out.extend(m.flush(0));
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn whole_and_repeated_values_are_masked() {
        let mut m = masker(&["hunter22"]);
        assert_eq!(
            run(&mut m, &["pw=hunter22 again hunter22\n"]),
            "pw=**** again ****\n"
        );
    }

    #[test]
    fn a_value_split_across_chunks_is_masked() {
        let mut m = masker(&["s3cr3t-value"]);
        assert_eq!(run(&mut m, &["a s3cr", "3t-va", "lue b"]), "a **** b");
        // One byte at a time.
        let s = "xx s3cr3t-value yy";
        let chunks: Vec<String> = s.chars().map(|c| c.to_string()).collect();
        let refs: Vec<&str> = chunks.iter().map(|s| s.as_str()).collect();
        assert_eq!(run(&mut m, &refs), "xx **** yy");
    }

    #[test]
    fn held_tail_is_bounded_and_flushed_unmasked_when_no_value_follows() {
        let mut m = masker(&["abcdef"]);
        let now = m.push(0, b"xyzabcde");
        assert_eq!(now, b"xyz");
        assert!(m.tails[0].len() < 6);
        assert_eq!(m.flush(0), b"abcde");
        // A held prefix that turns out not to be the value goes on.
        assert_eq!(run(&mut m, &["abc", "xyz"]), "abcxyz");
    }

    #[test]
    fn streams_are_held_apart() {
        let mut m = masker(&["abcdef"]);
        assert_eq!(m.push(0, b"abc"), b"");
        assert_eq!(m.push(1, b"def"), b"def");
        assert_eq!(m.push(0, b"def"), b"****");
    }

    #[test]
    fn overlapping_values_longest_wins() {
        let mut m = masker(&["abcd", "abcdefgh", "cdef"]);
        assert_eq!(run(&mut m, &["abcdefgh"]), "****");
        // Split right after the shorter value: the longer one still wins.
        assert_eq!(run(&mut m, &["abcd", "efgh"]), "****");
        assert_eq!(run(&mut m, &["abcdxx"]), "****xx");
        assert_eq!(run(&mut m, &["xxcdefxx"]), "xx****xx");
        // Overlapping occurrences: leftmost first, then what is left.
        assert_eq!(run(&mut m, &["abcdef"]), "****ef");
    }

    #[test]
    fn base64_form_is_masked_too() {
        let v = "my-api-key-123";
        let b64 = base64::engine::general_purpose::STANDARD.encode(v);
        let mut m = masker(&[v]);
        let line = format!("{b64}\n");
        let (a, b) = line.split_at(7);
        assert_eq!(run(&mut m, &[a, b]), "****\n");
    }

    #[test]
    fn short_values_and_empty_masker_pass_output_through() {
        let mut m = masker(&["abc"]);
        assert!(m.is_empty());
        assert_eq!(run(&mut m, &["abc abc"]), "abc abc");
    }

    #[test]
    fn binary_output_is_masked_bytewise() {
        let mut m = Masker::new([&b"\xff\x00\xfe\x01"[..]]);
        let mut out = m.push(1, b"\x00\xff\x00");
        out.extend(m.push(1, b"\xfe\x01\x02"));
        out.extend(m.flush(1));
        assert_eq!(out, b"\x00****\x02");
    }
}
