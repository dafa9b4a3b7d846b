//! Input checks of REST bodies (serde helpers); the request checks.

/// The checks are the operations layer's (one definition for every
/// front end).
pub use crate::ops::validate::{count, env, on_idle, path, session_id, snapshot_id, snapshot_name};

/// An integer body field that also takes an integral float (`2.0`): JSON
/// Schema's `integer` admits it, and clients that compute sizes as floats
/// send it. A fraction or a value out of `T`'s range is refused.
pub fn int<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: TryFrom<i64>,
{
    use serde::de::{Deserialize, Error};
    let n = serde_json::Number::deserialize(d)?;
    let v = match (n.as_i64(), n.as_f64()) {
        (Some(i), _) => Some(i),
        // Exactly representable: |f| < 2^63 and no fraction.
        (None, Some(f)) if f.fract() == 0.0 && f.abs() < 9.2e18 => Some(f as i64),
        _ => None,
    };
    v.and_then(|i| T::try_from(i).ok())
        .ok_or_else(|| D::Error::custom(format!("{n}: want an integer in range")))
}

/// [`int`] for an optional field (absent or null: `None`).
pub fn opt_int<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: TryFrom<i64>,
{
    #[derive(serde::Deserialize)]
    struct W<T: TryFrom<i64>>(#[serde(deserialize_with = "int")] T);
    use serde::Deserialize;
    Ok(Option::<W<T>>::deserialize(d)?.map(|W(v)| v))
}

#[cfg(test)]
mod tests {
    #[derive(serde::Deserialize, Debug, PartialEq)]
    struct B {
        #[serde(default, deserialize_with = "super::opt_int")]
        n: Option<u16>,
    }

    fn parse(s: &str) -> Result<B, String> {
        serde_json::from_str(s).map_err(|e| e.to_string())
    }

    #[test]
    fn integer_fields_take_integral_floats_only() {
        assert_eq!(parse(r#"{"n": 14}"#), Ok(B { n: Some(14) }));
        assert_eq!(parse(r#"{"n": 14.0}"#), Ok(B { n: Some(14) }));
        assert_eq!(parse(r#"{"n": 1.4e1}"#), Ok(B { n: Some(14) }));
        assert_eq!(parse(r#"{"n": null}"#), Ok(B { n: None }));
        assert_eq!(parse("{}"), Ok(B { n: None }));
        for bad in [
            r#"{"n": 14.5}"#,
            r#"{"n": -1}"#,
            r#"{"n": 65536}"#,
            r#"{"n": 65536.0}"#,
            r#"{"n": 1e300}"#,
            r#"{"n": "14"}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad} accepted");
        }
    }
}
