//! Renders a [`RuleSet`] as iptables-restore input, in exactly the text format of Istio's payloads.

use std::fmt::Write as _;

use crate::model::{format_addr, format_net, Match, Op, RedirectSpelling, Rule, RuleSet, Target};

/// Renders `rs` as an iptables-restore payload: per table `* name`, `-N` lines, rules, `COMMIT`.
///
/// Tables come in alphabetical order and tables without rules are left out. The payload is meant to be fed
/// without `--noflush`, so every table it names is replaced wholesale.
pub fn render(rs: &RuleSet) -> String {
    let mut out = String::new();
    for t in rs.tables.iter().filter(|t| !t.rules.is_empty()) {
        let _ = writeln!(out, "* {}", t.table.name());
        for chain in &t.chains {
            let _ = writeln!(out, "-N {chain}");
        }
        for rule in &t.rules {
            out.push_str(&render_rule(rule));
            out.push('\n');
        }
        out.push_str("COMMIT\n");
    }
    out
}

/// Renders one rule as an iptables command line without the table (`-A CHAIN ... -j TARGET ...`).
pub fn render_rule(rule: &Rule) -> String {
    let mut words: Vec<String> = match rule.op {
        Op::Append => vec!["-A".into(), rule.chain.clone()],
        Op::Insert(pos) => vec!["-I".into(), rule.chain.clone(), pos.to_string()],
    };
    for m in &rule.matches {
        push_match(&mut words, m);
    }
    push_target(&mut words, &rule.target);
    words.join(" ")
}

fn not(words: &mut Vec<String>, negate: bool) {
    if negate {
        words.push("!".into());
    }
}

fn push_all(words: &mut Vec<String>, items: &[&str]) {
    words.extend(items.iter().map(|s| s.to_string()));
}

fn mark_value(value: u32, mask: Option<u32>) -> String {
    match mask {
        Some(mask) => format!("{value:#x}/{mask:#x}"),
        None => value.to_string(),
    }
}

fn push_match(words: &mut Vec<String>, m: &Match) {
    match m {
        Match::Protocol(p) => push_all(words, &["-p", p.name()]),
        Match::Source { net, negate } => {
            not(words, *negate);
            push_all(words, &["-s", &format_net(net)]);
        }
        Match::Destination { net, negate } => {
            not(words, *negate);
            push_all(words, &["-d", &format_net(net)]);
        }
        Match::InInterface(name) => push_all(words, &["-i", name]),
        Match::OutInterface(name) => push_all(words, &["-o", name]),
        Match::DestPort { port, negate } => {
            not(words, *negate);
            push_all(words, &["--dport", &port.to_string()]);
        }
        Match::SourcePort { port, negate } => {
            not(words, *negate);
            push_all(words, &["--sport", &port.to_string()]);
        }
        Match::DestPorts { ports, negate } => {
            push_all(words, &["-m", "multiport"]);
            not(words, *negate);
            let list: Vec<String> = ports.iter().map(u16::to_string).collect();
            push_all(words, &["--dports", &list.join(",")]);
        }
        Match::OwnerUid { id, negate } => {
            push_all(words, &["-m", "owner"]);
            not(words, *negate);
            push_all(words, &["--uid-owner", &id.to_string()]);
        }
        Match::OwnerGid { id, negate } => {
            push_all(words, &["-m", "owner"]);
            not(words, *negate);
            push_all(words, &["--gid-owner", &id.to_string()]);
        }
        Match::SocketExists => push_all(words, &["-m", "owner", "--socket-exists"]),
        Match::Mark { value, mask, negate } => {
            push_all(words, &["-m", "mark"]);
            not(words, *negate);
            push_all(words, &["--mark", &mark_value(*value, *mask)]);
        }
        Match::Connmark { value, mask, negate } => {
            push_all(words, &["-m", "connmark"]);
            not(words, *negate);
            push_all(words, &["--mark", &mark_value(*value, *mask)]);
        }
        Match::Conntrack { states, negate } => {
            push_all(words, &["-m", "conntrack"]);
            not(words, *negate);
            let list: Vec<&str> = states.iter().map(|s| s.name()).collect();
            push_all(words, &["--ctstate", &list.join(",")]);
        }
        Match::Socket { transparent } => {
            push_all(words, &["-m", "socket"]);
            if *transparent {
                words.push("--transparent".into());
            }
        }
        Match::ProtocolModule(p) => push_all(words, &["-m", p.name()]),
        Match::SourceHost { addr, negate } => {
            not(words, *negate);
            push_all(words, &["-s", &format_addr(addr)]);
        }
        Match::DestinationHost { addr, negate } => {
            not(words, *negate);
            push_all(words, &["-d", &format_addr(addr)]);
        }
        Match::NotOutInterface(name) => push_all(words, &["!", "-o", name]),
        Match::DestinationInSet(set) => push_all(words, &["-m", "set", "--match-set", set, "dst"]),
    }
}

fn push_target(words: &mut Vec<String>, t: &Target) {
    words.push("-j".into());
    match t {
        Target::Jump(chain) => words.push(chain.clone()),
        Target::Return => words.push("RETURN".into()),
        Target::Accept => words.push("ACCEPT".into()),
        Target::Drop => words.push("DROP".into()),
        Target::Redirect { port, spelling } => {
            let opt = match spelling {
                RedirectSpelling::ToPorts => "--to-ports",
                RedirectSpelling::ToPort => "--to-port",
            };
            push_all(words, &["REDIRECT", opt, &port.to_string()]);
        }
        Target::Tproxy { mark, mask, port } => {
            push_all(words, &["TPROXY", "--tproxy-mark", &format!("{mark}/{mask:#x}"), "--on-port", &port.to_string()])
        }
        Target::SetMark(mark) => push_all(words, &["MARK", "--set-mark", &mark.to_string()]),
        Target::SaveConnmark => push_all(words, &["CONNMARK", "--save-mark"]),
        Target::RestoreConnmark => push_all(words, &["CONNMARK", "--restore-mark"]),
        Target::CtZone(zone) => push_all(words, &["CT", "--zone", &zone.to_string()]),
        Target::Snat(addr) => push_all(words, &["SNAT", "--to-source", &format_addr(addr)]),
        Target::SetConnmark { value, mask } => {
            push_all(words, &["CONNMARK", "--set-xmark", &format!("{value:#x}/{mask:#x}")])
        }
        Target::RestoreConnmarkMasked { nfmask, ctmask } => push_all(
            words,
            &["CONNMARK", "--restore-mark", "--nfmask", &format!("{nfmask:#x}"), "--ctmask", &format!("{ctmask:#x}")],
        ),
    }
}
