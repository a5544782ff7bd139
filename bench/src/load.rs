//! What else the machine was doing while a scenario ran: the load average and the build processes (compilers,
//! linkers, `cargo`, `go`) other people's work had running, sampled at the scenario's start and end. Round-robin
//! ordering keeps a scenario's ratios fair under such load; its absolute figures are noisier, and the section says
//! so.

use std::collections::BTreeMap;

/// Process names counted as builds.
const BUILDERS: [&str; 9] = ["rustc", "cargo", "go", "compile", "link", "cc1", "cc1plus", "ld", "clang"];

/// One sample of the machine's load.
pub struct Load {
    /// `/proc/loadavg`'s 1, 5 and 15 minute averages.
    pub averages: String,
    /// Build processes running, by name.
    pub builds: BTreeMap<String, usize>,
}

impl Load {
    /// Samples the machine now.
    pub fn sample() -> Load {
        let loadavg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        let averages = loadavg.split_whitespace().take(3).collect::<Vec<_>>().join(" ");
        let mut builds = BTreeMap::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            if !entry.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let Ok(comm) = std::fs::read_to_string(entry.path().join("comm")) else { continue };
            let comm = comm.trim();
            if BUILDERS.contains(&comm) {
                *builds.entry(comm.to_owned()).or_insert(0) += 1;
            }
        }
        Load { averages, builds }
    }

    fn describe(&self) -> String {
        let builds = if self.builds.is_empty() {
            "no build processes".to_owned()
        } else {
            let names: Vec<String> = self.builds.iter().map(|(n, k)| format!("{n} ×{k}")).collect();
            format!("build processes running: {}", names.join(", "))
        };
        format!("load average {} (1/5/15 min), {builds}", self.averages)
    }
}

/// A markdown paragraph on the machine's load at a scenario's start and end.
pub fn note(start: &Load, end: &Load) -> String {
    let busy = !start.builds.is_empty() || !end.builds.is_empty();
    let reading = if busy {
        "Other work was running on the machine: round-robin ordering keeps the ratios fair, but the absolute \
         figures are noisier than on an idle machine."
    } else {
        "No other builds were seen on the machine."
    };
    format!("Machine load: at the start, {}; at the end, {}. {reading}\n", start.describe(), end.describe())
}
