//! Guest-supplied text on its way into the daemon's log.
//!
//! A guest controls what its agent says (error frames, console output). Put
//! verbatim into the log, a newline lets it forge whole daemon lines
//! (`session k/s: destroyed`), control bytes can drive an operator's
//! terminal, and a 1 MiB message per frame floods the disk. So guest text
//! is escaped, cut to [`MAX_LOGGED`] bytes, and the lines it causes are
//! rate-limited per connection ([`LogBucket`]).

use crate::sync::lock;
use std::fmt;
use std::sync::Mutex;
use std::time::Instant;

/// Bytes of one guest string that reach the log; the rest is counted.
pub const MAX_LOGGED: usize = 512;

/// Guest lines logged at once before the bucket throttles, and lines per
/// second after that.
const LOG_BURST: f64 = 10.0;
const LOG_PER_SEC: f64 = 1.0;

/// Displays `text` escaped (`\n`, `\r`, `\t`, `\\`, other control and
/// format characters as `\u{..}`) and cut to `max` bytes of the original,
/// with a note of how much was left out. Nothing it prints can end a log
/// line or start an escape sequence.
pub struct Untrusted<'a> {
    text: &'a str,
    max: usize,
}

/// [`Untrusted`] with the default cut, [`MAX_LOGGED`].
pub fn untrusted(text: &str) -> Untrusted<'_> {
    Untrusted {
        text,
        max: MAX_LOGGED,
    }
}

/// [`Untrusted`] cut at `max` bytes.
pub fn untrusted_max(text: &str, max: usize) -> Untrusted<'_> {
    Untrusted { text, max }
}

impl fmt::Display for Untrusted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut used = 0;
        for c in self.text.chars() {
            if used + c.len_utf8() > self.max {
                let left = self.text.len() - used;
                return write!(f, "...[{left} more bytes]");
            }
            used += c.len_utf8();
            match c {
                '\n' => f.write_str("\\n")?,
                '\r' => f.write_str("\\r")?,
                '\t' => f.write_str("\\t")?,
                '\\' => f.write_str("\\\\")?,
                // Control characters (C0, DEL, C1) and the invisible
                // format characters that reorder text (bidi overrides).
                c if c.is_control() || is_format(c) => write!(f, "\\u{{{:x}}}", c as u32)?,
                c => write!(f, "{c}")?,
            }
        }
        Ok(())
    }
}

/// Unicode format characters a terminal or viewer may act on: bidi
/// controls, zero-width characters, the byte-order mark.
fn is_format(c: char) -> bool {
    matches!(c as u32, 0x200b..=0x200f | 0x202a..=0x202e | 0x2060..=0x206f | 0xfeff)
}

/// A token bucket for log lines caused by one guest: a burst of
/// [`LOG_BURST`], then [`LOG_PER_SEC`]. What it drops is counted and
/// reported with the next line it lets through (or by [`LogBucket::take_suppressed`]).
pub struct LogBucket {
    state: Mutex<BucketState>,
}

struct BucketState {
    tokens: f64,
    last: Instant,
    suppressed: u64,
}

impl Default for LogBucket {
    fn default() -> Self {
        LogBucket {
            state: Mutex::new(BucketState {
                tokens: LOG_BURST,
                last: Instant::now(),
                suppressed: 0,
            }),
        }
    }
}

impl LogBucket {
    /// `Some(n)`: log this line, and say that `n` lines were suppressed
    /// since the last one logged. `None`: drop it (it is counted).
    pub fn admit(&self) -> Option<u64> {
        let mut st = lock(&self.state);
        let now = Instant::now();
        let refill = now.duration_since(st.last).as_secs_f64() * LOG_PER_SEC;
        st.tokens = (st.tokens + refill).min(LOG_BURST);
        st.last = now;
        if st.tokens >= 1.0 {
            st.tokens -= 1.0;
            Some(std::mem::take(&mut st.suppressed))
        } else {
            st.suppressed += 1;
            None
        }
    }

    /// Lines dropped and not yet reported (for a last note at the end).
    pub fn take_suppressed(&self) -> u64 {
        std::mem::take(&mut lock(&self.state).suppressed)
    }
}

/// " (N earlier lines suppressed)" when N > 0, for the end of a log line.
pub fn suppressed_note(n: u64) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(" ({n} earlier guest log lines suppressed)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_newlines_and_controls() {
        let s = "ok\n[INFO] session a/b: destroyed\r\x1b[2J\\ \u{202e}x";
        let out = untrusted(s).to_string();
        assert!(!out.contains('\n') && !out.contains('\r') && !out.contains('\x1b'));
        assert_eq!(
            out,
            "ok\\n[INFO] session a/b: destroyed\\r\\u{1b}[2J\\\\ \\u{202e}x"
        );
    }

    #[test]
    fn truncates_on_a_char_boundary() {
        let s = "é".repeat(1000); // 2000 bytes
        let out = untrusted(&s).to_string();
        assert!(out.starts_with(&"é".repeat(256)));
        assert!(out.ends_with("...[1488 more bytes]"), "{out}");
        assert_eq!(untrusted_max("abc", 3).to_string(), "abc");
    }

    #[test]
    fn bucket_limits_and_counts() {
        let b = LogBucket::default();
        for _ in 0..LOG_BURST as usize {
            assert_eq!(b.admit(), Some(0));
        }
        assert_eq!(b.admit(), None);
        assert_eq!(b.admit(), None);
        assert_eq!(b.take_suppressed(), 2);
        assert_eq!(b.take_suppressed(), 0);
    }
}
