//! The README's demo: one simulated Kubernetes node, end to end, on the embedded defaults. A node netns with a
//! bridge, a conf dir with a real bridge + host-local conflist, install-cni chaining our plugin into it, the node
//! agent and the HBONE proxy with a fake API server as the pod source, one sidecar pod and two ambient pods created
//! through the fake CNI runtime, and real traffic between the ambient pods over HBONE. It prints a line per step,
//! tears everything down (also on Ctrl-C), checks nothing was left behind, and exits non-zero if a step failed
//! (130 when interrupted). Run as root, after `cargo build --workspace --bins`.

mod control;
mod proxy_log;
mod rules;
mod scene;
mod traffic;

use std::process::ExitCode;

use control::Stop;

fn main() -> ExitCode {
    control::handle_signals();
    std::panic::set_hook(Box::new(|info| {
        if control::interrupted() {
            eprintln!("demo: a step stopped by the interrupt: {}", info.payload_as_str().unwrap_or("(no message)"));
        } else {
            eprintln!("demo: a step failed: {info}");
        }
    }));
    let worker = std::thread::Builder::new().name("demo".into()).spawn(scene::run).expect("start the demo thread");
    let mut outcome = worker.join().unwrap_or_else(|_| Err(Stop::Failed("a step panicked (see above)".into())));
    if control::interrupted() {
        // Whatever failed after Ctrl-C failed because of it (the processes got the SIGINT too).
        outcome = Err(Stop::Interrupted);
    }
    let left = control::leftovers();
    if left.is_empty() {
        let (processes, dirs) = control::tracked();
        println!("teardown: done; {processes} processes stopped, every netns and {dirs} temp dirs removed");
    } else {
        eprintln!("teardown left behind: {}", left.join(", "));
    }
    match outcome {
        Ok(()) if left.is_empty() => {
            println!("demo OK");
            ExitCode::SUCCESS
        }
        Ok(()) => ExitCode::FAILURE,
        Err(Stop::Interrupted) => {
            println!("demo interrupted");
            ExitCode::from(130)
        }
        Err(Stop::Failed(why)) => {
            eprintln!("demo FAILED: {why}");
            ExitCode::FAILURE
        }
    }
}
