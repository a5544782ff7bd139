//! How the proxy's heap treats the large buffers every bulk transfer cycles through.
//!
//! Each HBONE stream reads 256 KiB at a time (`hbone::copy`) and receives HTTP/2 frames of up to 1 MiB. glibc's
//! malloc serves blocks that size with `mmap` and returns them with `munmap`, or trims its arena after the free,
//! so every buffer's pages were faulted in and zeroed again: page faults and `madvise` took about 5% of all CPU
//! in an across-nodes transfer, and fixed thresholds took about 15% off the proxies' CPU per GB (BENCHMARKS.md,
//! #19). The cost was memory the proxy kept after a burst: up to [`TRIM_THRESHOLD`] of free heap per arena, and
//! free pages stranded between live blocks (fragmentation), which no threshold gives back.
//!
//! So after a burst the heap is given back explicitly ([`give_back_after_bursts`]): once the tunnels hold almost
//! nothing and the resident set has grown by [`BURST`] since the last give-back, `malloc_trim(0)` returns every
//! free page of every arena to the kernel. Transfers keep their buffers while they run (the thresholds stay); only
//! the first buffers after a burst are faulted in again.

/// Blocks up to this size come from the heap, not from their own mapping: above the largest HTTP/2 frame we accept
/// (`hbone::settings::MAX_FRAME_SIZE`, 1 MiB) and its header.
pub const MMAP_THRESHOLD: usize = 2 << 20;
/// Free memory an arena keeps at its top before it gives it back to the kernel: a few transfers' buffers.
pub const TRIM_THRESHOLD: usize = 8 << 20;

/// Sets glibc's thresholds, once at start (they are process-wide). Fixing them also turns off glibc's own
/// adjustment, which would otherwise trim after every free of a buffer just over the last one.
#[cfg(target_env = "gnu")]
pub fn keep_transfer_buffers() -> Result<(), &'static str> {
    for (param, value, name) in [
        (libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD, "M_MMAP_THRESHOLD"),
        (libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD, "M_TRIM_THRESHOLD"),
    ] {
        // SAFETY: mallopt only sets the allocator's parameters; both values are in range for a c_int.
        if unsafe { libc::mallopt(param, value as libc::c_int) } != 1 {
            return Err(name);
        }
    }
    Ok(())
}

/// Growth of the resident set since the last give-back that makes the next quiet moment give the heap back.
pub const BURST: u64 = 16 << 20;
/// Tunnel bytes held (all pods) below which the proxy counts as quiet.
pub const QUIET: usize = 1 << 20;
/// How often the resident set is looked at.
pub const LOOK_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Gives the heap back to the kernel after each burst, for the life of the process; `held` tells the tunnel bytes
/// held now.
pub async fn give_back_after_bursts(held: impl Fn() -> usize) {
    let mut floor = resident_bytes().unwrap_or(0);
    let mut ticks = tokio::time::interval(LOOK_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(now) = resident_bytes() else { return };
        if now < floor {
            floor = now;
        } else if now - floor >= BURST && held() < QUIET {
            trim();
            let after = resident_bytes().unwrap_or(now);
            tracing::debug!(before = now, after, "gave the heap back after a burst");
            floor = after;
        }
    }
}

/// The process's resident set, from `/proc/self/statm`.
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}

/// Returns every free page of every arena to the kernel.
#[cfg(target_env = "gnu")]
fn trim() {
    // SAFETY: malloc_trim only releases free memory the allocator holds.
    unsafe { libc::malloc_trim(0) };
}

/// Other C libraries: nothing to trim through.
#[cfg(not(target_env = "gnu"))]
fn trim() {}

/// Other C libraries have their own allocator policy; nothing to set.
#[cfg(not(target_env = "gnu"))]
pub fn keep_transfer_buffers() -> Result<(), &'static str> {
    Ok(())
}

#[cfg(all(test, target_env = "gnu"))]
mod tests {
    use super::*;

    #[test]
    fn a_bulk_transfer_buffer_comes_from_the_heap_not_its_own_mapping() {
        keep_transfer_buffers().expect("glibc takes both thresholds");
        // SAFETY: mallinfo2 only reads the allocator's statistics.
        let mapped = || unsafe { libc::mallinfo2() }.hblks;
        let before = mapped();
        // Without the tuning, glibc maps any block over 128 KiB by itself (its default threshold).
        let buffer = std::hint::black_box(Vec::<u8>::with_capacity(MMAP_THRESHOLD / 2 + 1));
        assert_eq!(mapped(), before, "a {} byte buffer got its own mapping", buffer.capacity());
    }
}
