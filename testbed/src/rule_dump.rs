//! Rule dumps made comparable: `iptables-save` and `nft list ruleset` text with what differs between two equal
//! rule sets (counters, comment lines, the order chains and sets are listed in) taken out, so two netns's dumps
//! compare equal exactly when their rules are the same. Rules keep their order within a chain: that order is
//! the rules' meaning. Used by the differential suites that run Istio's binaries beside ours.

use std::collections::BTreeMap;

/// `iptables-save` output without comment lines and counters, each table's chain declarations in name order and
/// its rules grouped by chain (in their order within the chain).
pub fn normalize_iptables_save(dump: &str) -> String {
    let mut out = Vec::new();
    type Table = (String, Vec<String>, BTreeMap<String, Vec<String>>);
    let mut table: Option<Table> = None;
    for line in dump.lines().map(str::trim_end) {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        if let Some(name) = line.strip_prefix('*') {
            table = Some((name.to_owned(), Vec::new(), BTreeMap::new()));
        } else if let Some((_, decls, rules)) = table.as_mut().filter(|_| line != "COMMIT") {
            if let Some(decl) = line.strip_prefix(':') {
                decls.push(decl.rsplit_once(" [").map_or(decl, |(d, _)| d).to_owned());
            } else {
                let chain = line.split_whitespace().nth(1).unwrap_or_default().to_owned();
                rules.entry(chain).or_default().push(line.to_owned());
            }
        } else if line == "COMMIT" {
            let (name, mut decls, rules) = table.take().unwrap();
            decls.sort();
            out.push(format!("*{name}"));
            out.extend(decls.into_iter().map(|d| format!(":{d}")));
            out.extend(rules.into_values().flatten());
            out.push("COMMIT".into());
        } else {
            out.push(line.to_owned());
        }
    }
    out.join("\n")
}

/// `nft list ruleset` without counter values, each table's chains and sets in name order (rules keep their order
/// within a chain), tables in name order.
pub fn normalize_nft_ruleset(dump: &str) -> String {
    let mut tables: Vec<(String, Vec<Vec<String>>)> = Vec::new();
    let mut block: Option<Vec<String>> = None;
    for line in dump.lines().map(str::trim_end).filter(|l| !l.trim().is_empty() && !l.trim().starts_with('#')) {
        let words: Vec<&str> = line.split_whitespace().collect();
        // "counter packets N bytes M" -> "counter"
        let kept = words.iter().enumerate().filter(|(i, w)| {
            !(matches!(**w, "packets" | "bytes") || *i > 0 && matches!(words[i - 1], "packets" | "bytes"))
        });
        let indent = &line[..line.len() - line.trim_start().len()];
        let line = format!("{indent}{}", kept.map(|(_, w)| *w).collect::<Vec<_>>().join(" "));
        if line.starts_with("table ") {
            tables.push((line, Vec::new()));
        } else if line == "}" {
            // the end of the table
        } else if let Some(b) = block.as_mut() {
            b.push(line.clone());
            if line.starts_with("\t}") && !line.starts_with("\t\t") {
                tables.last_mut().expect("a block inside a table").1.push(block.take().unwrap());
            }
        } else {
            block = Some(vec![line]);
        }
    }
    tables.sort();
    let mut out = Vec::new();
    for (header, mut blocks) in tables {
        blocks.sort();
        out.push(header);
        out.extend(blocks.into_iter().flatten());
        out.push("}".into());
    }
    out.join("\n")
}
