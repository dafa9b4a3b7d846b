//! Signals: the one table every front end parses and every exit report
//! names.
//!
//! On the wire a signal is its number ([`super::Request::Signal`],
//! [`super::ExitStatus::signal`]). The front ends (REST `POST
//! .../processes/:proc/signal`, MCP `kill_process`) take a [`Signal`]
//! through its `Deserialize`: a JSON number in [`RANGE`] (an integral float
//! such as `9.0` too, as every REST integer), or a name from [`NAMES`] in
//! any case, `SIG` before it or not. A string is always a name: `"9"` is
//! refused on every front end (send the number `9`). Exit reports name a
//! signal with [`Signal::name_of`].

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use std::fmt;
use std::ops::RangeInclusive;

/// The numbers a process may be sent: Linux's 1..=64, real-time ones too.
pub const RANGE: RangeInclusive<i32> = 1..=64;

/// Named signals and their Linux numbers (the same on x86_64 and aarch64,
/// the two guest architectures).
pub const NAMES: &[(&str, i32)] = &[
    ("HUP", 1),
    ("INT", 2),
    ("QUIT", 3),
    ("ABRT", 6),
    ("KILL", 9),
    ("USR1", 10),
    ("SEGV", 11),
    ("USR2", 12),
    ("PIPE", 13),
    ("ALRM", 14),
    ("TERM", 15),
    ("CONT", 18),
    ("STOP", 19),
];

/// A signal number in [`RANGE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Signal(i32);

impl Signal {
    pub const KILL: Signal = Signal(9);
    /// What a front end sends when the caller names no signal.
    pub const TERM: Signal = Signal(15);

    /// A name from [`NAMES`], any case, one optional `SIG` before it.
    pub fn parse(name: &str) -> Result<Signal, String> {
        let bare = match name.get(..3) {
            Some(p) if p.eq_ignore_ascii_case("SIG") => &name[3..],
            _ => name,
        };
        NAMES
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(bare))
            .map(|&(_, num)| Signal(num))
            .ok_or_else(|| {
                let names: Vec<&str> = NAMES.iter().map(|(n, _)| *n).collect();
                format!(
                    "unknown signal {name:?}: want one of {} (SIG before it or not, any case) \
                     or a number {}..={}",
                    names.join(", "),
                    RANGE.start(),
                    RANGE.end()
                )
            })
    }

    /// A number in [`RANGE`].
    pub fn from_number(n: i64) -> Result<Signal, String> {
        i32::try_from(n)
            .ok()
            .filter(|n| RANGE.contains(n))
            .map(Signal)
            .ok_or_else(|| {
                format!(
                    "signal {n} out of range {}..={}",
                    RANGE.start(),
                    RANGE.end()
                )
            })
    }

    pub fn number(self) -> i32 {
        self.0
    }

    /// `SIGKILL`; `SIG34` for a number without a name.
    pub fn name(self) -> String {
        Signal::name_of(self.0)
    }

    /// The name of any signal number an exit status reports.
    pub fn name_of(n: i32) -> String {
        match NAMES.iter().find(|&&(_, num)| num == n) {
            Some((name, _)) => format!("SIG{name}"),
            None => format!("SIG{n}"),
        }
    }

    /// A JSON-Schema `pattern` for exactly the names [`Signal::parse`]
    /// takes (docs/openapi.yaml and the MCP tool schema carry it).
    pub fn name_pattern() -> String {
        let any_case = |s: &str| -> String {
            s.chars()
                .map(|c| {
                    if c.is_ascii_alphabetic() {
                        format!("[{}{}]", c.to_ascii_uppercase(), c.to_ascii_lowercase())
                    } else {
                        c.to_string()
                    }
                })
                .collect()
        };
        let names: Vec<String> = NAMES.iter().map(|(n, _)| any_case(n)).collect();
        format!("^({})?({})$", any_case("SIG"), names.join("|"))
    }
}

impl<'de> Deserialize<'de> for Signal {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Signal, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Signal;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(
                    f,
                    "a signal name (TERM, SIGKILL, ...) or a number {}..={}",
                    RANGE.start(),
                    RANGE.end()
                )
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Signal, E> {
                Signal::from_number(n).map_err(E::custom)
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Signal, E> {
                match i64::try_from(n) {
                    Ok(n) => Signal::from_number(n).map_err(E::custom),
                    Err(_) => Err(E::custom(format!("signal {n} out of range"))),
                }
            }
            fn visit_f64<E: de::Error>(self, f: f64) -> Result<Signal, E> {
                // Integral and small: the number it spells; else refused.
                if f.fract() == 0.0 && f.abs() < 1e15 {
                    Signal::from_number(f as i64).map_err(E::custom)
                } else {
                    Err(E::custom(format!("signal {f}: want an integer")))
                }
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Signal, E> {
                Signal::parse(s).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_numbers() {
        for s in ["TERM", "SIGTERM", "term", "sigterm", "SigTerm"] {
            assert_eq!(Signal::parse(s), Ok(Signal::TERM), "{s}");
        }
        for s in ["", "SIG", "SIGSIGTERM", "9", "SIG9", "BOGUS", " TERM"] {
            assert!(Signal::parse(s).is_err(), "{s}");
        }
        assert_eq!(
            Signal::from_number(34).map(Signal::name),
            Ok("SIG34".into())
        );
        assert!(Signal::from_number(0).is_err() && Signal::from_number(65).is_err());
        // 2^32 + 9 must not wrap to 9.
        assert!(Signal::from_number((1 << 32) + 9).is_err());
        for &(name, n) in NAMES {
            let s = Signal::parse(name).unwrap();
            assert_eq!((s.number(), s.name()), (n, format!("SIG{name}")));
        }
    }

    #[test]
    fn pattern_matches_what_parse_takes() {
        let p = Signal::name_pattern();
        assert!(p.starts_with("^([Ss][Ii][Gg])?([Hh][Uu][Pp]|"), "{p}");
        assert!(p.ends_with("|[Ss][Tt][Oo][Pp])$"), "{p}");
    }
}
