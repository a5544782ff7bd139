//! Resource leaks of the native nftables backend over many pods. Its own test binary, so no other test opens or
//! closes file descriptors or allocates while it measures.

use netns::Netns;
use redirect::nft::apply;
use redirect::sidecar::{build, InterceptMode, Plan, SidecarConfig};

/// Open file descriptors and resident memory (KiB) of this process.
fn fds_and_rss() -> (usize, u64) {
    let fds = std::fs::read_dir("/proc/self/fd").unwrap().count();
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    (fds, rss)
}

/// Programs the plan into a brand-new netns owned by a short-lived thread, as one pod ADD would.
fn program_one_pod(plan: &Plan) {
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare netns");
            // As in every pod, loopback is up before our plugin runs (TPROXY routes live on it).
            let up = std::process::Command::new("ip").args(["link", "set", "lo", "up"]).status().expect("run ip");
            assert!(up.success(), "ip link set lo up");
            let ns = Netns::current().expect("open own netns");
            apply(&ns, plan).expect("program pod");
        })
        .join()
        .expect("pod thread");
    });
}

#[test]
fn a_thousand_pods_leak_no_fds_and_no_memory() {
    let plan =
        build(&SidecarConfig { mode: InterceptMode::Tproxy, enable_ipv6: true, ..SidecarConfig::cni_pod_defaults() });
    for _ in 0..100 {
        program_one_pod(&plan);
    }
    let (fds_before, rss_before) = fds_and_rss();
    for _ in 0..1000 {
        program_one_pod(&plan);
    }
    let (fds_after, rss_after) = fds_and_rss();
    assert_eq!(fds_after, fds_before, "file descriptors leaked over 1000 pods");
    // Flat within allocator noise: a leak of even 1 KiB per pod would show as ~1 MiB.
    assert!(rss_after <= rss_before + 512, "RSS grew from {rss_before} KiB to {rss_after} KiB over 1000 pods");
}
