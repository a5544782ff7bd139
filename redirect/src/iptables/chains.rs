//! iptables programming that touches only our chains: one `iptables-restore --noflush` per family that
//! flushes (or creates) our chains, removes the jumps into them from built-in chains, deletes our chains the
//! new rules no longer use, and adds the new rules. Tables others use (the host's nat, with kube-proxy's
//! rules) keep everything else, and the swap is atomic per family.

use super::error::IptablesError;
use super::flavour::IptablesBackend;
use super::render::{chain_name, render_rule};
use super::restore::{restore, save, RestoreMode, XtablesLock};
use crate::model::{is_builtin_chain, Family, RuleSet, Table};

/// Our chains per table: everything else in these tables belongs to someone else.
pub(crate) type Owned<'a> = &'a [(Table, &'a [&'a str])];

/// Replaces our chains in the calling thread's netns with `rules` (or removes them when `None`).
pub(crate) fn program(
    backend: IptablesBackend,
    family: Family,
    rules: Option<&RuleSet>,
    owned: Owned<'_>,
) -> Result<(), IptablesError> {
    // Rendered before anything is read or run: a refused name leaves the netns untouched.
    let rendered: Vec<(Table, Vec<String>)> = rules
        .iter()
        .flat_map(|rs| rs.tables.iter())
        .map(|t| Ok((t.table, t.rules.iter().map(render_rule).collect::<Result<_, _>>()?)))
        .collect::<Result<_, IptablesError>>()?;
    for chain in rules.iter().flat_map(|rs| rs.tables.iter().flat_map(|t| t.chains.iter())) {
        chain_name(chain)?;
    }
    let lock = XtablesLock::new()?;
    let lockfile = lock.file();
    let mut tables: Vec<Table> = owned.iter().map(|(t, _)| *t).collect();
    tables.extend(rules.iter().flat_map(|rs| rs.tables.iter().map(|t| t.table)));
    tables.sort();
    tables.dedup();

    let mut payload = String::new();
    for table in tables {
        let planned = rules.and_then(|rs| rs.table(table));
        let mut ours: Vec<String> = owned
            .iter()
            .filter(|(t, _)| *t == table)
            .flat_map(|(_, chains)| chains.iter().map(|c| c.to_string()))
            .collect();
        for chain in planned.iter().flat_map(|t| t.chains.iter()) {
            if !ours.contains(chain) {
                ours.push(chain.clone());
            }
        }
        let current = save(backend, family, Some(table), Some(&lockfile))?;
        let existing = chains_in(&current);
        let wanted: Vec<&String> = planned.map(|t| t.chains.iter().collect()).unwrap_or_default();

        let mut block = Vec::new();
        for chain in ours.iter().filter(|c| existing.contains(c) || wanted.contains(c)) {
            block.push(format!(":{chain} - [0:0]"));
        }
        for line in current.lines().filter_map(|l| l.strip_prefix("-A ")) {
            let mut words = line.split_whitespace();
            let chain = words.next().unwrap_or_default();
            let target = line.split(" -j ").nth(1).and_then(|t| t.split_whitespace().next());
            if is_builtin_chain(chain) && target.is_some_and(|t| ours.iter().any(|c| c == t)) {
                block.push(format!("-D {line}"));
            }
        }
        for chain in ours.iter().filter(|c| existing.contains(c) && !wanted.contains(c)) {
            block.push(format!("-X {chain}"));
        }
        block.extend(rendered.iter().filter(|(t, _)| *t == table).flat_map(|(_, lines)| lines.iter().cloned()));
        if !block.is_empty() {
            payload += &format!("* {}\n{}\nCOMMIT\n", table.name(), block.join("\n"));
        }
    }
    if payload.is_empty() {
        return Ok(());
    }
    restore(backend, family, &payload, RestoreMode::NoFlush, &lockfile)
}

/// Chain names declared in an iptables-save table dump.
fn chains_in(save: &str) -> Vec<String> {
    save.lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}
