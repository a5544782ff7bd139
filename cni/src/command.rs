//! CNI commands and the environment each one requires.

use std::collections::HashMap;

use crate::args::CniArgs;
use crate::error::{CniError, ErrorCode};

/// The operation the runtime asks for in `CNI_COMMAND`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Attach a container to the network.
    Add,
    /// Detach; must tolerate missing state and repeats.
    Del,
    /// Verify an attachment (0.4.0+).
    Check,
    /// Report the supported versions.
    Version,
    /// Report whether the plugin is ready (1.1.0+).
    Status,
    /// Remove state for attachments that are gone (1.1.0+).
    Gc,
}

impl Command {
    /// Parses `CNI_COMMAND`.
    pub fn parse(s: &str) -> Result<Command, CniError> {
        Ok(match s {
            "ADD" => Command::Add,
            "DEL" => Command::Del,
            "CHECK" => Command::Check,
            "VERSION" => Command::Version,
            "STATUS" => Command::Status,
            "GC" => Command::Gc,
            "" => return Err(CniError::new(ErrorCode::InvalidEnv, "CNI_COMMAND is required")),
            other => return Err(CniError::new(ErrorCode::InvalidEnv, format!("unknown CNI_COMMAND {other:?}"))),
        })
    }
}

/// One plugin invocation: the command plus the `CNI_*` environment, validated for that command.
#[derive(Debug, Clone)]
pub struct Invocation {
    /// `CNI_COMMAND`.
    pub command: Command,
    /// `CNI_CONTAINERID` (empty when the command does not take one).
    pub container_id: String,
    /// `CNI_NETNS`; empty is allowed for DEL, where the netns may already be gone.
    pub netns: String,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// Parsed `CNI_ARGS`.
    pub args: CniArgs,
    /// `CNI_PATH` split on `:`.
    pub path: Vec<String>,
}

impl Invocation {
    /// Reads and validates the `CNI_*` variables from an environment map (error code 4 when invalid).
    pub fn from_env(env: &HashMap<String, String>) -> Result<Invocation, CniError> {
        let get = |k: &str| env.get(k).cloned().unwrap_or_default();
        let command = Command::parse(&get("CNI_COMMAND"))?;
        let inv = Invocation {
            command,
            container_id: get("CNI_CONTAINERID"),
            netns: get("CNI_NETNS"),
            ifname: get("CNI_IFNAME"),
            args: CniArgs::parse(&get("CNI_ARGS")),
            path: get("CNI_PATH").split(':').filter(|p| !p.is_empty()).map(String::from).collect(),
        };
        let required: &[(&str, &str)] = match command {
            Command::Add | Command::Check => {
                &[("CNI_CONTAINERID", &inv.container_id), ("CNI_NETNS", &inv.netns), ("CNI_IFNAME", &inv.ifname)]
            }
            Command::Del => &[("CNI_CONTAINERID", &inv.container_id), ("CNI_IFNAME", &inv.ifname)],
            Command::Version | Command::Status | Command::Gc => &[],
        };
        for (name, value) in required {
            if value.is_empty() {
                return Err(CniError::new(ErrorCode::InvalidEnv, format!("{name} is required for {command:?}")));
            }
        }
        if inv.ifname.len() > 15 || inv.ifname.contains('/') {
            return Err(CniError::new(ErrorCode::InvalidEnv, format!("invalid CNI_IFNAME {:?}", inv.ifname)));
        }
        Ok(inv)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn add_requires_netns_container_and_ifname() {
        let base = [("CNI_COMMAND", "ADD"), ("CNI_CONTAINERID", "c"), ("CNI_NETNS", "/n"), ("CNI_IFNAME", "eth0")];
        assert!(Invocation::from_env(&env(&base)).is_ok());
        for skip in 1..base.len() {
            let partial: Vec<_> = base.iter().enumerate().filter(|(i, _)| *i != skip).map(|(_, p)| *p).collect();
            let err = Invocation::from_env(&env(&partial)).unwrap_err();
            assert_eq!(err.code, 4);
            assert!(err.msg.contains(base[skip].0), "{}", err.msg);
        }
    }

    #[test]
    fn del_allows_empty_netns_and_version_needs_nothing() {
        let del = env(&[("CNI_COMMAND", "DEL"), ("CNI_CONTAINERID", "c"), ("CNI_IFNAME", "eth0")]);
        assert!(Invocation::from_env(&del).is_ok());
        let ver = env(&[("CNI_COMMAND", "VERSION"), ("CNI_NETNS", "dummy"), ("CNI_CONTAINERID", "")]);
        assert_eq!(Invocation::from_env(&ver).unwrap().command, Command::Version);
    }

    #[test]
    fn unknown_or_missing_command_is_invalid_env() {
        assert_eq!(Invocation::from_env(&env(&[("CNI_COMMAND", "FOO")])).unwrap_err().code, 4);
        assert_eq!(Invocation::from_env(&env(&[])).unwrap_err().code, 4);
    }
}
