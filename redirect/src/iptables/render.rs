//! Renders a [`RuleSet`] as iptables-restore input, in exactly the text format of Istio's payloads.
//!
//! Every name that goes into the text (interfaces, chains, sets, owners) is checked with
//! [`istio_contract::validate`] first: `iptables-restore` reads one rule per line and splits words at blanks,
//! so a name holding a newline or a blank would add rules of its author's choosing. A name outside the allowed set
//! is an error; nothing is emitted.

use std::fmt::Write as _;

use istio_contract::validate::{self, InvalidValue, MAX_IPSET_NAME, MAX_IPTABLES_CHAIN, MAX_NFT_NAME};

use crate::model::{format_addr, format_net, Match, Op, OwnerId, RedirectSpelling, Rule, RuleSet, Target};

/// Renders `rs` as an iptables-restore payload: per table `* name`, `-N` lines, rules, `COMMIT`.
///
/// Tables come in alphabetical order and tables without rules are left out. The payload is meant to be fed
/// without `--noflush`, so every table it names is replaced wholesale. Refuses (and renders nothing of) a rule
/// set holding a name that is not one plain word within its tool's limit.
pub fn render(rs: &RuleSet) -> Result<String, InvalidValue> {
    let mut out = String::new();
    for t in rs.tables.iter().filter(|t| !t.rules.is_empty()) {
        let _ = writeln!(out, "* {}", t.table.name());
        for chain in &t.chains {
            let _ = writeln!(out, "-N {}", chain_name(chain)?);
        }
        for rule in &t.rules {
            out.push_str(&render_rule(rule)?);
            out.push('\n');
        }
        out.push_str("COMMIT\n");
    }
    Ok(out)
}

/// Renders one rule as an iptables command line without the table (`-A CHAIN ... -j TARGET ...`), or refuses a
/// rule holding a name that is not one plain word (see the module docs).
pub fn render_rule(rule: &Rule) -> Result<String, InvalidValue> {
    let chain = chain_name(&rule.chain)?.to_string();
    let mut words: Vec<String> = match rule.op {
        Op::Append => vec!["-A".into(), chain],
        Op::Insert(pos) => vec!["-I".into(), chain, pos.to_string()],
    };
    for m in &rule.matches {
        push_match(&mut words, m)?;
    }
    push_target(&mut words, &rule.target)?;
    Ok(words.join(" "))
}

/// A chain name iptables takes as one word.
pub(crate) fn chain_name(chain: &str) -> Result<&str, InvalidValue> {
    validate::identifier(chain, MAX_IPTABLES_CHAIN)
}

/// An owner as `--uid-owner`/`--gid-owner` takes it: a number, or a user or group name that is one word.
fn owner(id: &OwnerId) -> Result<String, InvalidValue> {
    match id {
        OwnerId::Id(n) => Ok(n.to_string()),
        OwnerId::Name(name) => validate::identifier(name, MAX_NFT_NAME).map(String::from),
    }
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

fn push_match(words: &mut Vec<String>, m: &Match) -> Result<(), InvalidValue> {
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
        Match::InInterface(name) => push_all(words, &["-i", validate::interface_name(name)?]),
        Match::OutInterface(name) => push_all(words, &["-o", validate::interface_name(name)?]),
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
            push_all(words, &["--uid-owner", &owner(id)?]);
        }
        Match::OwnerGid { id, negate } => {
            push_all(words, &["-m", "owner"]);
            not(words, *negate);
            push_all(words, &["--gid-owner", &owner(id)?]);
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
        Match::NotOutInterface(name) => push_all(words, &["!", "-o", validate::interface_name(name)?]),
        Match::DestinationInSet(set) => {
            let set = validate::identifier(set, MAX_IPSET_NAME)?;
            push_all(words, &["-m", "set", "--match-set", set, "dst"])
        }
    }
    Ok(())
}

fn push_target(words: &mut Vec<String>, t: &Target) -> Result<(), InvalidValue> {
    words.push("-j".into());
    match t {
        Target::Jump(chain) => words.push(chain_name(chain)?.to_string()),
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Family, Table};

    const INJECTED: &str = "eth9\n-I OUTPUT -j ACCEPT";

    fn rule(matches: Vec<Match>, target: Target) -> Rule {
        Rule::append("ISTIO_OUTPUT", matches, target)
    }

    #[test]
    fn every_name_that_is_not_one_plain_word_is_refused_and_nothing_is_rendered() {
        let bad = [
            rule(vec![Match::InInterface(INJECTED.into())], Target::Return),
            rule(vec![Match::OutInterface("eth0 -j ACCEPT".into())], Target::Return),
            rule(vec![Match::NotOutInterface("abcdefghijklmnop".into())], Target::Return),
            rule(vec![Match::DestinationInSet("set\n-A X".into())], Target::Return),
            rule(vec![Match::OwnerGid { id: OwnerId::Name("g\nCOMMIT".into()), negate: false }], Target::Return),
            rule(vec![], Target::Jump("ISTIO_REDIRECT\n-A OUTPUT -j ACCEPT".into())),
            Rule::append("OUTPUT -j ACCEPT", vec![], Target::Return),
        ];
        for r in bad {
            assert!(render_rule(&r).is_err(), "{r:?}");
            let rs = RuleSet::from_rules(Family::V4, vec![(Table::Nat, r.clone())]);
            assert!(render(&rs).is_err(), "{r:?}");
        }
    }

    #[test]
    fn a_15_byte_interface_name_renders_whole() {
        let r = rule(vec![Match::OutInterface("abcdefghijklmno".into())], Target::Return);
        assert_eq!(render_rule(&r).unwrap(), "-A ISTIO_OUTPUT -o abcdefghijklmno -j RETURN");
    }
}
