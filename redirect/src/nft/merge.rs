//! Merges the IPv4 and IPv6 rules of one table into the single rule list of an `inet` table, as Istio's
//! nftables layout does: rules both families share appear once, and each address-bearing rule keeps its IPv6
//! twin straight after the IPv4 version.

use crate::model::{Family, Match, Rule};

/// A rule of the merged list and the family it came from (`None`: both families have it).
pub(super) type Tagged<'a> = (&'a Rule, Option<Family>);

enum Step {
    Both(usize),
    V4(usize),
    V6(usize),
}

/// Aligns `v4` and `v6` on their longest common subsequence of identical rules; between two shared rules,
/// the IPv4-only rules come in order, each followed by its IPv6 twin if that is the next IPv6-only rule, and
/// the remaining IPv6-only rules follow.
pub(super) fn merge<'a>(v4: &'a [Rule], v6: &'a [Rule]) -> Vec<Tagged<'a>> {
    let (n, m) = (v4.len(), v6.len());
    let mut lcs = vec![vec![0u16; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] = if v4[i] == v6[j] { lcs[i + 1][j + 1] + 1 } else { lcs[i + 1][j].max(lcs[i][j + 1]) };
        }
    }
    let (mut i, mut j, mut steps) = (0, 0, Vec::new());
    while i < n || j < m {
        if i < n && j < m && v4[i] == v6[j] {
            steps.push(Step::Both(i));
            i += 1;
            j += 1;
        } else if i < n && (j == m || lcs[i + 1][j] >= lcs[i][j + 1]) {
            steps.push(Step::V4(i));
            i += 1;
        } else {
            steps.push(Step::V6(j));
            j += 1;
        }
    }

    let mut out = Vec::with_capacity(n + m);
    let (mut only4, mut only6): (Vec<&Rule>, Vec<&Rule>) = (Vec::new(), Vec::new());
    for step in steps {
        match step {
            Step::V4(i) => only4.push(&v4[i]),
            Step::V6(j) => only6.push(&v6[j]),
            Step::Both(i) => {
                flush(&mut out, &mut only4, &mut only6);
                out.push((&v4[i], None));
            }
        }
    }
    flush(&mut out, &mut only4, &mut only6);
    out
}

fn flush<'a>(out: &mut Vec<Tagged<'a>>, only4: &mut Vec<&'a Rule>, only6: &mut Vec<&'a Rule>) {
    let mut rest6 = only6.drain(..).peekable();
    for r4 in only4.drain(..) {
        out.push((r4, Some(Family::V4)));
        if let Some(r6) = rest6.next_if(|r6| twins(r4, r6)) {
            out.push((r6, Some(Family::V6)));
        }
    }
    out.extend(rest6.map(|r6| (r6, Some(Family::V6))));
}

/// Same rule except for the addresses it matches (at least one).
fn twins(a: &Rule, b: &Rule) -> bool {
    a.op == b.op
        && a.chain == b.chain
        && a.target == b.target
        && a.matches.len() == b.matches.len()
        && a.matches.iter().any(is_address)
        && a.matches.iter().zip(&b.matches).all(|(x, y)| x == y || same_shape(x, y))
}

fn is_address(m: &Match) -> bool {
    matches!(
        m,
        Match::Source { .. } | Match::Destination { .. } | Match::SourceHost { .. } | Match::DestinationHost { .. }
    )
}

fn same_shape(x: &Match, y: &Match) -> bool {
    match (x, y) {
        (Match::Source { negate: a, .. }, Match::Source { negate: b, .. }) => a == b,
        (Match::Destination { negate: a, .. }, Match::Destination { negate: b, .. }) => a == b,
        (Match::SourceHost { negate: a, .. }, Match::SourceHost { negate: b, .. }) => a == b,
        (Match::DestinationHost { negate: a, .. }, Match::DestinationHost { negate: b, .. }) => a == b,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Target;

    fn dst(chain: &str, net: &str) -> Rule {
        Rule::append(chain, vec![Match::Destination { net: net.parse().unwrap(), negate: false }], Target::Return)
    }

    #[test]
    fn twins_follow_their_ipv4_rule_and_shared_rules_appear_once() {
        let shared = Rule::append("OUT", vec![], Target::Accept);
        let v4 = vec![shared.clone(), dst("OUT", "127.0.0.1/32"), dst("OUT", "1.1.0.0/16")];
        let v6 = vec![shared.clone(), dst("OUT", "::1/128")];
        let merged: Vec<(String, Option<Family>)> =
            merge(&v4, &v6).into_iter().map(|(r, f)| (format!("{:?}", r.matches), f)).collect();
        assert_eq!(merged.len(), 4);
        assert_eq!(merged[0].1, None);
        assert!(merged[1].0.contains("127.0.0.1") && merged[1].1 == Some(Family::V4));
        assert!(merged[2].0.contains("::1") && merged[2].1 == Some(Family::V6));
        assert!(merged[3].0.contains("1.1.0.0"));
    }
}
