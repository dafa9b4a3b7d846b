//! `--url` forwarding (filled in below).
use std::path::Path;
pub fn key_from(_f: Option<&Path>) -> Result<Option<String>, String> {
    Err("not yet".into())
}
pub fn run<R: std::io::Read, W: std::io::Write + Send + 'static>(
    _u: &str,
    _k: Option<&str>,
    _r: R,
    _w: W,
) -> Result<(), String> {
    Err("not yet".into())
}
