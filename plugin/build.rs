//! Links `istio-cni` as a position-dependent executable (and, in the image's static build, fully static).
//!
//! The runtime execs the plugin once per pod, so its start is paid on every ADD. A position-independent
//! executable (rustc's default) makes the loader apply about 17,000 relocations and dirty the pages they touch
//! before `main`, 0.6 ms of a 2.7 ms `VERSION` exec here (build without LTO); linked at a fixed address it starts
//! without them.
//! Istio's own plugin, a Go binary, is position-dependent too. The daemons stay position-independent: they start
//! once. BENCHMARKS.md (sidecar-setup) measures the exec.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    println!("cargo:rustc-link-arg-bin=istio-cni=-no-pie");
    // With `crt-static` rustc asks for a static PIE (`-static-pie`); `-no-pie` alone would then leave a static
    // binary that still names the dynamic loader. `-static` makes it a plain static executable.
    let features = std::env::var("CARGO_CFG_TARGET_FEATURE").unwrap_or_default();
    if features.split(',').any(|f| f == "crt-static") {
        println!("cargo:rustc-link-arg-bin=istio-cni=-static");
    }
}
