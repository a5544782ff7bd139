//! The text `node-agent explain` prints by default: the report's facts, one per line, with the verdict first.

use std::fmt::Write as _;

use super::report::{Mode, Report, Rules, Summary};

/// The report of one pod, as text.
pub fn report(r: &Report) -> String {
    let mut out = String::new();
    let mut line = |label: &str, value: String| {
        let _ = writeln!(out, "{:<12}{value}", format!("{label}:"));
    };
    line("Pod", format!("{} (uid {})", r.pod, r.uid));
    line("Verdict", r.verdict.clone());
    line("Mode", format!("{} ({})", r.mode.name(), r.reason));
    let inode = r.netns.inode.map(|i| format!("net:[{i}], ")).unwrap_or_default();
    line("Netns", format!("{inode}{}", r.netns.source));
    let ips: Vec<String> = r.ips.iter().map(ToString::to_string).collect();
    line("IPs", if ips.is_empty() { "none".into() } else { ips.join(", ") });
    if let Some(sidecar) = &r.sidecar {
        line("Plugin", sidecar.decision.clone());
        let count = match (&sidecar.rule_count, &sidecar.error) {
            (Some(n), _) if r.rules.error.is_none() => {
                format!("{n} rules of ours in its netns ({})", rules_summary(&r.rules))
            }
            (Some(n), _) => format!("{n} rules of ours in its netns"),
            (None, Some(e)) => format!("not counted: {e}"),
            (None, None) => "not counted: its netns was not found".into(),
        };
        line("Rules", count);
    } else if r.mode != Mode::None || r.rules.error.is_none() {
        line("Rules", rules_summary(&r.rules));
    }
    if let Some(zds) = &r.zds {
        line("ZDS", zds.describe());
    }
    if let Some(l) = &r.listeners {
        let text = match &l.error {
            Some(e) => format!("not read: {e}"),
            None => {
                let found: Vec<String> =
                    l.found.iter().map(|l| format!("{} {} ({}, {})", l.port, l.protocol, l.role, l.address)).collect();
                let mut text = if found.is_empty() { "none".to_string() } else { found.join("; ") };
                if !l.missing.is_empty() {
                    let missing: Vec<String> = l.missing.iter().map(ToString::to_string).collect();
                    let _ = write!(text, "; nothing on {}", missing.join(", "));
                }
                text
            }
        };
        line("Listeners", text);
    }
    if let Some(p) = &r.host_probe {
        let text = match &p.error {
            Some(e) => format!("not read: {e}"),
            None if p.in_set => "yes (kubelet probes are SNATed past the proxy)".into(),
            None => "no: kubelet probes of the pod reach the proxy's capture".into(),
        };
        line("Probe set", text);
    }
    if let Some(e) = &r.last_error {
        line("Last error", format!("{} ({})", e.message, e.at));
    } else if r.mode == Mode::Ambient {
        line("Last error", "none".into());
    }
    if let Some(d) = &r.drift {
        let state = match &d.error {
            Some(e) => format!("failed: {e}"),
            None if d.drifted => format!("drifted ({} missing, {} unexpected)", d.missing.len(), d.unexpected.len()),
            None => "in sync".into(),
        };
        let repaired = match &d.last_repair {
            Some(at) => format!("; repaired {} times, last at {at}", d.repairs),
            None => String::new(),
        };
        line("Drift check", format!("{state} at {}{repaired}", d.checked_at));
    }
    if let Some(t) = &r.probe_selftest {
        let tested = t.pod.as_deref().map(|p| format!(" with pod {p}")).unwrap_or_default();
        line("Self-test", format!("{}{tested} at {}: {}", t.verdict, t.at, t.detail));
    }
    for diff in [("missing", &r.rules.missing), ("unexpected", &r.rules.unexpected)] {
        if !diff.1.is_empty() {
            let _ = writeln!(out, "Rules {}:", diff.0);
            for rule in diff.1 {
                let _ = writeln!(out, "  {rule}");
            }
        }
    }
    if let Some(t) = &r.timeline {
        let total = t.total_ms.map(|ms| format!(", {ms} ms in all")).unwrap_or_default();
        let _ = writeln!(out, "Timeline:   from the {}, started {}{total}: {}", t.source, t.started_at, t.outcome);
        for p in &t.phases {
            let error = p.error.as_ref().map(|e| format!("  failed: {e}")).unwrap_or_default();
            let _ = writeln!(out, "  {:<10} {:>10.3} ms  (at {}){error}", p.phase, p.duration_ms, p.started_at);
        }
    }
    out
}

fn rules_summary(rules: &Rules) -> String {
    if let Some(e) = &rules.error {
        return format!("not inspected: {e}");
    }
    let backend = rules.backend.as_deref().unwrap_or("unknown backend");
    let state = if rules.missing.is_empty() && rules.unexpected.is_empty() { "in sync" } else { "DRIFTED" };
    format!(
        "{backend}: {state}: {} expected, {} found, {} missing, {} unexpected",
        rules.expected.len(),
        rules.found.len(),
        rules.missing.len(),
        rules.unexpected.len()
    )
}

/// `explain --all`: one line per pod.
pub fn summaries(all: &[Summary]) -> String {
    let width = all.iter().map(|s| s.pod.len()).max().unwrap_or(3).max(3);
    let mut out = format!("{:<width$}  {:<8} VERDICT\n", "POD", "MODE");
    for s in all {
        let _ = writeln!(out, "{:<width$}  {:<8} {}", s.pod, s.mode.name(), s.verdict);
    }
    out
}
