//! CNI spec versions: parsing, ordering and which commands each one supports.

use std::fmt;

use crate::error::{CniError, ErrorCode};

/// Every spec version this project speaks, oldest first.
pub const SUPPORTED_VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// A parsed `major.minor.patch` spec version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version(pub u32, pub u32, pub u32);

impl Version {
    /// The newest version we speak; used when a request names none we can parse.
    pub const LATEST: Version = Version(1, 1, 0);

    /// Parses a version string such as `1.0.0`.
    pub fn parse(s: &str) -> Option<Version> {
        let mut parts = s.trim().split('.').map(|p| p.parse::<u32>().ok());
        let v = Version(parts.next()??, parts.next().unwrap_or(Some(0))?, parts.next().unwrap_or(Some(0))?);
        parts.next().is_none().then_some(v)
    }

    /// Parses and checks that the version is one we support (error code 1 otherwise).
    pub fn supported(s: &str) -> Result<Version, CniError> {
        match Version::parse(s) {
            Some(v) if SUPPORTED_VERSIONS.contains(&v.to_string().as_str()) => Ok(v),
            _ => Err(CniError::new(
                ErrorCode::IncompatibleVersion,
                format!("unsupported cniVersion {s:?}; supported: {}", SUPPORTED_VERSIONS.join(", ")),
            )),
        }
    }

    /// Results before 1.0.0 carry a `version` field on every IP.
    pub fn ips_carry_version(self) -> bool {
        self < Version(1, 0, 0)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_orders() {
        assert!(Version::parse("0.3.1").unwrap() < Version::parse("0.4.0").unwrap());
        assert_eq!(Version::parse("1.1.0"), Some(Version::LATEST));
        assert_eq!(Version::parse("1.0"), Some(Version(1, 0, 0)));
        assert_eq!(Version::parse("x"), None);
        assert_eq!(Version::parse("1.0.0.0"), None);
    }

    #[test]
    fn unsupported_versions_get_code_1() {
        for v in ["0.2.0", "0.1.0", "2.0.0", "", "abc"] {
            assert_eq!(Version::supported(v).unwrap_err().code, 1, "{v}");
        }
        for v in SUPPORTED_VERSIONS {
            assert!(Version::supported(v).is_ok(), "{v}");
        }
    }
}
