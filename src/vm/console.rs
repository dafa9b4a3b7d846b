//! A guest's serial console as error text: both backends show its last
//! lines when a guest does not come up (QEMU reads it through a pipe,
//! Firecracker writes it to a file in its jail).

/// The last lines of console output `bytes`, for an error message: empty
/// lines dropped, a kernel panic's reason kept in view above the last
/// twelve lines, every line escaped (guest output is untrusted).
pub fn tail_text(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let last = &lines[lines.len().saturating_sub(12)..];
    // A panic's reason is above its stack dump: keep it in view.
    let mut out: Vec<&str> = lines
        .iter()
        .filter(|l| l.contains("Kernel panic") && !last.contains(l))
        .take(2)
        .copied()
        .collect();
    out.extend_from_slice(last);
    out.iter()
        .map(|l| crate::agent::guestlog::untrusted(l).to_string())
        .collect::<Vec<_>>()
        .join(" | ")
}
