//! What `/proc` says of a running process that the scenarios report: its resident memory, the CPU time it has
//! used and its thread count. Each reading panics if the process is gone: a scenario that lost its daemon
//! measured nothing.

use std::time::Duration;

/// Resident set size of `pid` in KiB (`VmRSS` of `/proc/<pid>/status`).
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read process status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix(" kB")?.trim().parse().ok())
        .expect("VmRSS in status")
}

/// CPU time (user + system) process `pid` has used so far, from `/proc/<pid>/stat`: whole clock ticks (10 ms
/// on most kernels).
pub fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read process stat");
    // The fields after the command name (which may hold spaces): state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = stat.rsplit_once(')').expect("a command name in stat").1.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().unwrap_or(100) as f64;
    Duration::from_secs_f64(ticks as f64 / hz)
}

/// How many threads process `pid` runs (entries of `/proc/<pid>/task`).
pub fn threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).map(Iterator::count).unwrap_or(0)
}

#[cfg(test)]
mod unit_tests {
    use super::*;

    #[test]
    fn this_process_has_memory_threads_and_cpu_time_that_grows() {
        let me = std::process::id();
        assert!(rss_kib(me) > 0);
        assert!(threads(me) >= 1);
        let before = cpu_time(me);
        let start = std::time::Instant::now();
        // Spin until the kernel has counted at least two ticks of this thread's CPU.
        while cpu_time(me) < before + Duration::from_millis(20) {
            assert!(start.elapsed() < Duration::from_secs(20), "no CPU time counted");
            std::hint::black_box((0..1000u64).sum::<u64>());
        }
    }
}
