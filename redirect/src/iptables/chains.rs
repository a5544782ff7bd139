//! iptables programming that touches only our chains: one `iptables-restore --noflush` per family that
//! flushes (or creates) our chains, removes the jumps into them from built-in chains, deletes our chains the
//! new rules no longer use, and adds the new rules. Tables others use (the host's nat, with kube-proxy's
//! rules) keep everything else, and the swap is atomic per family.

use super::error::IptablesError;
use super::flavour::IptablesBackend;
use super::render::{chain_name, render_rule};
use super::restore::{restore, save, RestoreMode, XtablesLock};
use crate::model::{is_builtin_chain, Family, RuleSet, Table};
use crate::nft::uapi::netfilter::{NFPROTO_IPV4, NFPROTO_IPV6};

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

    // One save of every table the family has (not one per table): each exec costs a process start, and a
    // table missing from the dump has no chains, as `-t TABLE` would show. A family with no table at all (a new
    // pod's netns) has nothing to save, which the kernel tells without an exec.
    let all =
        if holds_no_table(backend, family) { String::new() } else { save(backend, family, None, Some(&lockfile))? };
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
        let current = table_section(&all, table);
        let existing = chains_in(current);
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

/// Whether the calling thread's netns holds no table of `family` that `backend`'s save would list: for legacy, its
/// `ip[6]_tables_names` (of this thread's netns: `/proc/thread-self`, as the thread may have entered a pod's netns);
/// for nft, the netlink table dump has no `ip`/`ip6` table named as one of the tables we read. Any doubt (a read that fails)
/// answers false, so the caller saves as before.
fn holds_no_table(backend: IptablesBackend, family: Family) -> bool {
    match backend {
        IptablesBackend::Legacy => {
            let file = match family {
                Family::V4 => "/proc/thread-self/net/ip_tables_names",
                Family::V6 => "/proc/thread-self/net/ip6_tables_names",
            };
            std::fs::read_to_string(file).is_ok_and(|names| names.trim().is_empty())
        }
        IptablesBackend::Nft => {
            let proto = match family {
                Family::V4 => NFPROTO_IPV4,
                Family::V6 => NFPROTO_IPV6,
            };
            crate::nft::tables_here().is_ok_and(|tables| {
                let ours = [Table::Filter, Table::Mangle, Table::Nat, Table::Raw];
                !tables.iter().any(|t| t.family == proto && ours.iter().any(|x| x.name() == t.name))
            })
        }
    }
}

/// The lines of `table` in an iptables-save dump of all tables (from its `*TABLE` line to its `COMMIT`), or
/// nothing when the dump has no such table.
fn table_section(save: &str, table: Table) -> &str {
    let header = format!("*{}", table.name());
    let (mut begin, mut offset) = (None, 0);
    for line in save.split_inclusive('\n') {
        let text = line.trim_end();
        match begin {
            None if text == header => begin = Some(offset),
            Some(b) if text == "COMMIT" => return &save[b..offset + line.len()],
            _ => {}
        }
        offset += line.len();
    }
    begin.map_or("", |b| &save[b..])
}

/// Chain names declared in an iptables-save table dump.
fn chains_in(save: &str) -> Vec<String> {
    save.lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: &str = "# Generated by iptables-nft-save\n*mangle\n:PREROUTING ACCEPT [0:0]\n:ISTIO_PRERT - [0:0]\n\
        -A PREROUTING -j ISTIO_PRERT\nCOMMIT\n# Completed\n*nat\n:OUTPUT ACCEPT [0:0]\n:OTHER - [0:0]\nCOMMIT\n";

    #[test]
    fn a_table_is_read_out_of_a_dump_of_all_tables() {
        let mangle = table_section(ALL, Table::Mangle);
        assert!(mangle.starts_with("*mangle\n") && mangle.ends_with("COMMIT\n"), "{mangle:?}");
        assert_eq!(chains_in(mangle), ["PREROUTING", "ISTIO_PRERT"]);
        assert_eq!(chains_in(table_section(ALL, Table::Nat)), ["OUTPUT", "OTHER"]);
        assert_eq!(table_section(ALL, Table::Raw), "", "a table the dump lacks has no chains");
        assert_eq!(table_section("", Table::Nat), "");
        assert_eq!(chains_in(table_section("*nat\n:A - [0:0]", Table::Nat)), ["A"], "a dump cut before COMMIT");
    }
}
