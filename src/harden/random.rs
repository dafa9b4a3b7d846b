//! Random bytes from the kernel's CSPRNG, for key material, nonces and
//! ids in every layer (agent nonces, API keys, MCP session ids).

/// Fills `buf` from getrandom(2), the kernel's CSPRNG (it blocks only
/// until the pool is seeded at boot). There is no fallback: keys, nonces
/// and ids made from a guessable source would be worse than an error.
pub fn secure_random(buf: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: writes at most rest.len() bytes into rest.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(std::io::Error::new(e.kind(), format!("getrandom(2): {e}")));
        }
        done += n as usize;
    }
    Ok(())
}

/// A random u64 from [`secure_random`].
pub fn random_u64() -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    secure_random(&mut b)?;
    Ok(u64::from_le_bytes(b))
}
