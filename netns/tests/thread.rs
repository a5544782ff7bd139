//! `NetnsThread` against a real network namespace: sockets it creates belong to that namespace (a listener bound
//! through it is seen there and not in ours), every job runs on the one thread, and the thread exits once its
//! handle is dropped. Needs root.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};

use testbed::wait::eventually;
use testbed::NetnsGuard;

/// Whether a TCP listener on `port` shows up in `ns`.
fn listening_in(ns: &NetnsGuard, port: u16) -> bool {
    !ns.exec_ok(&["ss", "-Hltn", &format!("sport = :{port}")]).trim().is_empty()
}

/// Whether a thread of this process has id `tid`.
fn thread_alive(tid: i32) -> bool {
    std::path::Path::new(&format!("/proc/self/task/{tid}")).exists()
}

#[test]
fn sockets_made_on_a_netns_thread_belong_to_its_namespace_and_the_thread_ends_with_its_handle() {
    let ns = NetnsGuard::new("nsthread");
    let thread = ns.open().expect("open the test netns").spawn_thread("sockets").expect("spawn the netns thread");

    let listener = thread
        .run(|| TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))))
        .expect("run on the netns thread")
        .expect("bind in the test netns");
    let port = listener.local_addr().unwrap().port();
    assert!(listening_in(&ns, port), "the listener is in the test netns");
    let here = std::process::Command::new("ss").args(["-Hltn", &format!("sport = :{port}")]).output().unwrap();
    assert!(String::from_utf8_lossy(&here.stdout).trim().is_empty(), "and not in the test's own netns");

    // Every job runs on the same thread: sockets cost a channel send, not a thread.
    let tids: Vec<i32> = (0..20).map(|_| thread.run(|| nix::unistd::gettid().as_raw()).unwrap()).collect();
    assert!(tids.iter().all(|&tid| tid == tids[0]), "one thread for every job: {tids:?}");
    assert_ne!(tids[0], nix::unistd::gettid().as_raw());

    // A second listener made while the first lives, after many jobs: still in the test netns.
    let second = thread.run(|| TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))).unwrap().unwrap();
    assert!(listening_in(&ns, second.local_addr().unwrap().port()));

    drop(thread);
    eventually("the netns thread exits once its handle is dropped", || (!thread_alive(tids[0])).then_some(()));
    // The sockets it made outlive it, in the namespace they were made in.
    assert!(listening_in(&ns, port));
    drop((listener, second));
}
