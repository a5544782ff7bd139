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
//! nothing and the heap's free memory has grown by [`BURST`] since its lowest point after the last give-back,
//! `malloc_trim(0)` returns every free page of every arena to the kernel. Transfers keep their buffers while they
//! run (the thresholds stay); only the first buffers after a burst are faulted in again.
//!
//! While it stays quiet with the resident set still a burst over its lowest, the heap is given back again every
//! [`STILL_HIGH_EVERY`].
//!
//! The signal is memory freed, not the resident set grown: a give-back made while a burst's connections were still
//! open (their tunnels quiet, their state alive) would otherwise become the new reference, and the tens of MiB
//! those connections free when they close would never be given back (seen in `proxy_hostile_memory`).

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

/// Growth of the heap's free memory since its lowest point after the last give-back that makes the next quiet
/// moment give the heap back: glibc's own threshold for the top of the heap ([`TRIM_THRESHOLD`]).
pub const BURST: usize = TRIM_THRESHOLD;
/// Tunnel bytes held (all pods) below which the proxy counts as quiet.
pub const QUIET: usize = 1 << 20;
/// How often the heap is looked at.
pub const LOOK_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// When to give the heap back, from what it holds free: the lowest free memory seen since the last give-back is
/// the reference, so only memory freed since then counts, whether or not it was resident before.
#[derive(Debug)]
struct Freed {
    least: usize,
}

impl Freed {
    /// Whether a heap holding `free` bytes free, with the tunnels `quiet`, should be given back now.
    fn give_back(&mut self, free: usize, quiet: bool) -> bool {
        self.least = self.least.min(free);
        free - self.least >= BURST && quiet
    }

    /// A give-back left `free` bytes free (no longer resident): the reference starts again from there.
    fn given_back(&mut self, free: usize) {
        self.least = free;
    }
}

/// While quiet, the resident set at least [`BURST`] over the lowest it has been gives the heap back again this
/// often, whatever the free memory says: memory freed in pieces too small to count as a burst, in between live
/// blocks, is not left resident for good. One `malloc_trim` this often costs next to nothing.
pub const STILL_HIGH_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Gives the heap back to the kernel after each burst, for the life of the process; `held` tells the tunnel bytes
/// held now. Returns at once where the C library tells nothing of its heap.
pub async fn give_back_after_bursts(held: impl Fn() -> usize) {
    let Some(free) = free_heap_bytes() else { return };
    let mut freed = Freed { least: free };
    let mut lowest_resident = resident_bytes().unwrap_or(0);
    let mut last = tokio::time::Instant::now();
    let mut ticks = tokio::time::interval(LOOK_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(free) = free_heap_bytes() else { return };
        let quiet = held() < QUIET;
        let resident = resident_bytes().unwrap_or(0);
        lowest_resident = lowest_resident.min(resident);
        let still_high = quiet && resident >= lowest_resident + BURST as u64 && last.elapsed() >= STILL_HIGH_EVERY;
        if freed.give_back(free, quiet) || still_high {
            last = tokio::time::Instant::now();
            let before = resident_bytes();
            trim();
            let after = resident_bytes();
            let free_after = free_heap_bytes().unwrap_or(free);
            tracing::debug!(?before, ?after, free, still_high, "gave the heap back after a burst");
            freed.given_back(free_after);
        }
    }
}

/// The heap's free memory, all arenas (glibc's `mallinfo2().fordblks`): resident or not.
#[cfg(target_env = "gnu")]
fn free_heap_bytes() -> Option<usize> {
    // SAFETY: mallinfo2 only reads the allocator's statistics (taking each arena's lock).
    Some(unsafe { libc::mallinfo2() }.fordblks)
}

/// Other C libraries: nothing known of the heap.
#[cfg(not(target_env = "gnu"))]
fn free_heap_bytes() -> Option<usize> {
    None
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

#[cfg(test)]
mod freed_tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn memory_freed_after_an_early_give_back_is_given_back_too() {
        let mut freed = Freed { least: 4 * MIB };
        // A burst's connections open: their state is allocated, little is free, nothing to give back.
        assert!(!freed.give_back(2 * MIB, true));
        // Its buffers are freed while the connections stay open: quiet, a burst freed, given back.
        assert!(freed.give_back(2 * MIB + BURST, true));
        freed.given_back(MIB + BURST);
        // Nothing freed since: not again, however long it stays quiet.
        assert!(!freed.give_back(MIB + BURST, true));
        // The connections close and free their state: given back again, though the resident set never grew.
        assert!(!freed.give_back(MIB + BURST + BURST / 2, true), "half a burst freed is not enough");
        assert!(freed.give_back(MIB + 2 * BURST, true));
    }

    #[test]
    fn nothing_is_given_back_while_the_tunnels_hold_bytes_and_reuse_lowers_the_reference() {
        let mut freed = Freed { least: 30 * MIB };
        // The free memory is reused (faulted in again) by a transfer, then freed while another one runs.
        assert!(!freed.give_back(5 * MIB, false));
        assert!(!freed.give_back(5 * MIB + BURST, false), "the tunnels hold bytes");
        // Quiet: the burst freed since the low point is given back.
        assert!(freed.give_back(5 * MIB + BURST, true));
    }
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
