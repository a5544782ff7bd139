//! Which iptables flavour programs the rules, and the names of its binaries.

use crate::model::Family;

/// Which iptables flavour programs the rules; it must match what the node's kube-proxy uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IptablesBackend {
    /// x_tables via `iptables-legacy-*`.
    Legacy,
    /// nf_tables via `iptables-nft-*`.
    Nft,
}

impl IptablesBackend {
    /// The binary of this flavour for `family`: `tool` is `""` (plain `iptables-nft`), `"save"` or `"restore"`.
    pub(crate) fn binary(self, family: Family, tool: &str) -> String {
        let prefix = match family {
            Family::V4 => "iptables",
            Family::V6 => "ip6tables",
        };
        let flavour = match self {
            IptablesBackend::Legacy => "legacy",
            IptablesBackend::Nft => "nft",
        };
        match tool {
            "" => format!("{prefix}-{flavour}"),
            tool => format!("{prefix}-{flavour}-{tool}"),
        }
    }
}
