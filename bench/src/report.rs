//! The report: each scenario's markdown section, printed and written into BENCHMARKS.md between its own markers
//! (`<!-- bench:NAME:begin -->` / `end`), so a run of one scenario leaves the others' figures in place.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// One scenario's results, ready to print.
pub struct Section {
    /// Marker name, e.g. `sidecar-setup`.
    pub name: &'static str,
    /// Heading.
    pub title: String,
    /// Markdown body (tables and notes).
    pub body: String,
}

impl Section {
    /// The section as written to BENCHMARKS.md, with the command and machine that produced it.
    pub fn render(&self) -> String {
        self.render_as(&format!("`scripts/bench.sh {}` (release build)", self.name))
    }

    /// The section with `command` as its producing command (a `--quick` run names itself).
    pub fn render_as(&self, command: &str) -> String {
        format!(
            "<!-- bench:{name}:begin -->\n## {title}\n\nCommand: {command}.\n\n\
             Machine:\n\n{machine}\n{body}<!-- bench:{name}:end -->\n",
            name = self.name,
            title = self.title,
            machine = machine(),
            body = self.body
        )
    }
}

/// Replaces the section's part of BENCHMARKS.md (or appends it), keeping every other section.
pub fn write(section: &Section) -> std::io::Result<PathBuf> {
    let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), "..", "BENCHMARKS.md"].iter().collect();
    let old = std::fs::read_to_string(&path).unwrap_or_else(|_| "# Benchmarks\n".to_owned());
    let begin = format!("<!-- bench:{}:begin -->", section.name);
    let end = format!("<!-- bench:{}:end -->", section.name);
    let text = section.render();
    let new = match (old.find(&begin), old.find(&end)) {
        (Some(b), Some(e)) if b < e => {
            format!("{}{text}{}", &old[..b], old[e + end.len()..].trim_start_matches('\n'))
        }
        _ => format!("{}\n\n{text}", old.trim_end_matches('\n')),
    };
    let tmp = path.with_extension("md.tmp");
    std::fs::write(&tmp, new)?;
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

/// Output of `cmd args`, first line, or a note that it is unavailable.
fn first_line(cmd: &str, args: &[&str]) -> String {
    match Command::new(cmd).args(args).stdin(Stdio::null()).output() {
        Ok(out) => String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or("").trim().to_owned(),
        Err(e) => format!("unavailable ({e})"),
    }
}

/// The machine's description: CPU, kernel, firewall tool versions, commit.
pub fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim()))
        .unwrap_or("unknown");
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut s = String::new();
    let _ = writeln!(s, "- CPU: {nproc} × {model}");
    let _ = writeln!(s, "- Kernel: {}", first_line("uname", &["-srvm"]));
    let nft = first_line("iptables-nft", &["--version"]);
    let legacy = first_line("iptables-legacy", &["--version"]);
    let _ = writeln!(s, "- iptables: {nft} / {legacy}");
    let _ = writeln!(s, "- nft: {}", first_line("nft", &["--version"]));
    let _ = writeln!(s, "- Commit: {}", built_commit());
    s
}

/// The commit the measured binaries were built from: `scripts/bench.sh` records it (with `-dirty` when the
/// tree had uncommitted changes) in `BENCH_BUILT_COMMIT` just before it builds them, so a commit made while the
/// benchmark runs is not credited with its figures.
fn built_commit() -> String {
    match std::env::var("BENCH_BUILT_COMMIT") {
        Ok(commit) if !commit.trim().is_empty() => commit.trim().to_owned(),
        _ => "unknown (not built by scripts/bench.sh)".to_owned(),
    }
}
