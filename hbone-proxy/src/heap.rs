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

use std::time::{Duration, Instant};

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
pub const LOOK_EVERY: Duration = Duration::from_secs(1);

/// While quiet, the resident set at least [`BURST`] over the lowest it has been gives the heap back again this
/// often, whatever the free memory says: memory freed in pieces too small to count as a burst, in between live
/// blocks, is not left resident for good. One `malloc_trim` this often costs next to nothing.
pub const STILL_HIGH_EVERY: Duration = Duration::from_secs(10);

/// Why the heap is given back now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    /// A [`BURST`] of memory was freed since the lowest free memory after the last give-back.
    Freed,
    /// The resident set is still a [`BURST`] over its lowest, [`STILL_HIGH_EVERY`] after the last give-back.
    StillHigh,
}

/// When to give the heap back, from two looks at it: the lowest free memory seen since the last give-back is the
/// reference for what was freed (so only memory freed since then counts, whether or not it was resident before),
/// and the lowest resident set ever seen is the reference for "still high". Both only while the tunnels are quiet.
#[derive(Debug)]
struct Trigger {
    least_free: usize,
    lowest_resident: u64,
    last: Instant,
}

impl Trigger {
    fn new(free: usize, resident: u64, now: Instant) -> Self {
        Trigger { least_free: free, lowest_resident: resident, last: now }
    }

    /// Whether (and why) a heap holding `free` bytes free, in a process holding `resident` bytes, with the tunnels
    /// `quiet`, should be given back at `now`.
    fn due(&mut self, free: usize, resident: u64, quiet: bool, now: Instant) -> Option<Why> {
        self.least_free = self.least_free.min(free);
        self.lowest_resident = self.lowest_resident.min(resident);
        if !quiet {
            None
        } else if free - self.least_free >= BURST {
            Some(Why::Freed)
        } else if resident >= self.lowest_resident + BURST as u64 && now - self.last >= STILL_HIGH_EVERY {
            Some(Why::StillHigh)
        } else {
            None
        }
    }

    /// A give-back at `now` left `free` bytes free (no longer resident): the freed reference starts again there.
    fn given_back(&mut self, free: usize, now: Instant) {
        self.least_free = free;
        self.last = now;
    }
}

/// Gives the heap back to the kernel after each burst, for the life of the process; `held` tells the tunnel bytes
/// held now. Returns at once where the C library tells nothing of its heap.
pub async fn give_back_after_bursts(held: impl Fn() -> usize) {
    let Some(free) = free_heap_bytes() else { return };
    let mut trigger = Trigger::new(free, resident_bytes().unwrap_or(0), Instant::now());
    let mut ticks = tokio::time::interval(LOOK_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(free) = free_heap_bytes() else { return };
        let resident = resident_bytes().unwrap_or(0);
        if let Some(why) = trigger.due(free, resident, held() < QUIET, Instant::now()) {
            trim();
            let after = resident_bytes();
            let free_after = free_heap_bytes().unwrap_or(free);
            tracing::debug!(before = resident, ?after, free, ?why, "gave the heap back after a burst");
            trigger.given_back(free_after, Instant::now());
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
mod trigger_tests {
    use super::*;

    const MIB: usize = 1 << 20;
    /// A resident set that stays put: only the freed trigger can fire.
    const FLAT: u64 = 40 << 20;

    #[test]
    fn memory_freed_after_an_early_give_back_is_given_back_too() {
        let t0 = Instant::now();
        let mut trigger = Trigger::new(4 * MIB, FLAT, t0);
        // A burst's connections open: their state is allocated, little is free, nothing to give back.
        assert_eq!(trigger.due(2 * MIB, FLAT, true, t0), None);
        // Its buffers are freed while the connections stay open: quiet, a burst freed, given back.
        assert_eq!(trigger.due(2 * MIB + BURST, FLAT, true, t0), Some(Why::Freed));
        trigger.given_back(MIB + BURST, t0);
        // Nothing freed since: not again, however long it stays quiet.
        assert_eq!(trigger.due(MIB + BURST, FLAT, true, t0 + 10 * STILL_HIGH_EVERY), None);
        // The connections close and free their state: given back again, though the resident set never grew.
        assert_eq!(trigger.due(MIB + BURST + BURST / 2, FLAT, true, t0), None, "half a burst freed is not enough");
        assert_eq!(trigger.due(MIB + 2 * BURST, FLAT, true, t0), Some(Why::Freed));
    }

    #[test]
    fn nothing_is_given_back_while_the_tunnels_hold_bytes_and_reuse_lowers_the_reference() {
        let t0 = Instant::now();
        let mut trigger = Trigger::new(30 * MIB, FLAT, t0);
        // The free memory is reused (faulted in again) by a transfer, then freed while another one runs.
        assert_eq!(trigger.due(5 * MIB, FLAT, false, t0), None);
        assert_eq!(trigger.due(5 * MIB + BURST, FLAT + 2 * BURST as u64, false, t0 + STILL_HIGH_EVERY), None);
        // Quiet: the burst freed since the low point is given back.
        assert_eq!(trigger.due(5 * MIB + BURST, FLAT, true, t0), Some(Why::Freed));
    }

    #[test]
    fn a_resident_set_still_a_burst_over_its_lowest_is_given_back_every_still_high_period() {
        let t0 = Instant::now();
        let high = FLAT + BURST as u64;
        let mut trigger = Trigger::new(MIB, FLAT, t0);
        // Nothing freed in one piece, but the resident set stays high: not before the period is over.
        assert_eq!(trigger.due(MIB, high, true, t0 + STILL_HIGH_EVERY / 2), None);
        assert_eq!(trigger.due(MIB, high, true, t0 + STILL_HIGH_EVERY), Some(Why::StillHigh));
        let t1 = t0 + STILL_HIGH_EVERY;
        trigger.given_back(MIB, t1);
        // Still high: once more a period later, not sooner; and never while the tunnels hold bytes.
        assert_eq!(trigger.due(MIB, high, true, t1 + STILL_HIGH_EVERY / 2), None);
        assert_eq!(trigger.due(MIB, high, false, t1 + STILL_HIGH_EVERY), None);
        assert_eq!(trigger.due(MIB, high, true, t1 + STILL_HIGH_EVERY), Some(Why::StillHigh));
        // Back within a burst of its lowest: no more give-backs.
        assert_eq!(trigger.due(MIB, high - 1, true, t1 + 5 * STILL_HIGH_EVERY), None);
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
