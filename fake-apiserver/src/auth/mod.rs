//! Authentication: who a request's bearer token says it is, token issue, and rotation with a grace period.
//!
//! Tokens are signed with a key that lives in the state directory (`sa.key`) when there is one, so tokens
//! handed out before a restart stay valid after it. Rotating a subject's token issues a new one and retires
//! every older one of that subject after the configured grace period; rotations are kept in the state
//! directory too (`token-rotations.json`).

mod token;

use crate::state;
use crate::Error;
use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const SIGNING_KEY: &str = "sa.key";
const ROTATIONS: &str = "token-rotations.json";

/// Who a request runs as: what RBAC bindings name and what the request log shows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct User {
    /// The user name, e.g. `system:serviceaccount:istio-system:istio-cni`.
    pub name: String,
    /// Groups the user is in, e.g. `system:serviceaccounts`, `system:authenticated`.
    pub groups: Vec<String>,
}

/// The user the kubeconfig of a fake server authenticates as.
pub const ADMIN_USER: &str = "fake-admin";
/// The group that passes every RBAC check, as on a real cluster.
pub const MASTERS_GROUP: &str = "system:masters";

impl User {
    /// A user with these groups plus `system:authenticated`.
    pub fn new(name: &str, groups: &[&str]) -> User {
        let mut groups: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
        if !groups.iter().any(|g| g == "system:authenticated") {
            groups.push("system:authenticated".to_string());
        }
        User { name: name.to_string(), groups }
    }

    /// The service account `namespace/name`, with the groups the real server gives it.
    pub fn service_account(namespace: &str, name: &str) -> User {
        User::new(
            &format!("system:serviceaccount:{namespace}:{name}"),
            &["system:serviceaccounts", &format!("system:serviceaccounts:{namespace}")],
        )
    }

    /// The kubeconfig's user: [`ADMIN_USER`] in [`MASTERS_GROUP`].
    pub fn admin() -> User {
        User::new(ADMIN_USER, &[MASTERS_GROUP])
    }

    /// Who a request without a token runs as (kube-apiserver's default `--anonymous-auth=true`), and, when
    /// authentication is not required, one with an invalid token too.
    pub fn anonymous() -> User {
        User { name: "system:anonymous".to_string(), groups: vec!["system:unauthenticated".to_string()] }
    }

    /// `(namespace, name)` when this is a service account.
    pub fn service_account_parts(&self) -> Option<(&str, &str)> {
        self.name.strip_prefix("system:serviceaccount:")?.split_once(':')
    }

    /// Whether this user is in `group`.
    pub fn in_group(&self, group: &str) -> bool {
        self.groups.iter().any(|g| g == group)
    }
}

/// Why a request is not authenticated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unauthenticated {
    /// No `Authorization: Bearer` header.
    Missing,
    /// A token this server did not sign, or one retired by a rotation.
    Invalid,
}

/// Older generations of one subject's tokens stop working at `until`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Retired {
    below: u64,
    until_unix_ms: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
struct Subject {
    generation: u64,
    retired: Vec<Retired>,
}

/// Issues and checks tokens.
#[derive(Debug)]
pub(crate) struct Tokens {
    key: hmac::Key,
    grace: Duration,
    dir: Option<PathBuf>,
    subjects: Mutex<BTreeMap<String, Subject>>,
}

/// 32 bytes from the system's CSPRNG (falling back to the fake's id generator, which never happens on Linux).
fn random_secret() -> Vec<u8> {
    let mut secret = vec![0u8; 32];
    if SystemRandom::new().fill(&mut secret).is_err() {
        for chunk in secret.chunks_mut(8) {
            chunk.copy_from_slice(&crate::ids::next_random().to_le_bytes()[..chunk.len()]);
        }
    }
    secret
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or_default()
}

impl Tokens {
    /// The signing key and rotations kept in `dir`, created when missing; in memory without a directory.
    pub fn load_or_create(dir: Option<&Path>, grace: Duration) -> Result<Tokens, Error> {
        let stored = dir.map(|d| state::read(d, SIGNING_KEY)).transpose()?.flatten();
        let secret = match stored.as_deref().map(|s| STANDARD.decode(s.trim())) {
            Some(Ok(secret)) if secret.len() >= 32 => secret,
            Some(_) => {
                let path = dir.map(|d| d.join(SIGNING_KEY)).unwrap_or_default();
                return Err(Error::Certificate(format!("{}: not a base64 key of 32 bytes or more", path.display())));
            }
            None => {
                let secret = random_secret();
                if let Some(d) = dir {
                    state::write(d, SIGNING_KEY, &STANDARD.encode(&secret), true)?;
                }
                secret
            }
        };
        let subjects = match dir.map(|d| state::read(d, ROTATIONS)).transpose()?.flatten() {
            Some(text) => serde_json::from_str(&text).unwrap_or_else(|e| {
                tracing::warn!("ignoring unreadable {ROTATIONS}: {e}");
                BTreeMap::new()
            }),
            None => BTreeMap::new(),
        };
        Ok(Tokens {
            key: hmac::Key::new(hmac::HMAC_SHA256, &secret),
            grace,
            dir: dir.map(Path::to_path_buf),
            subjects: Mutex::new(subjects),
        })
    }

    /// A fresh signing key in memory, for a server without a state directory.
    pub fn ephemeral(grace: Duration) -> Tokens {
        Tokens {
            key: hmac::Key::new(hmac::HMAC_SHA256, &random_secret()),
            grace,
            dir: None,
            subjects: Mutex::new(BTreeMap::new()),
        }
    }

    fn subjects(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Subject>> {
        self.subjects.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A token for `user` at its current generation.
    pub fn issue(&self, user: &User) -> String {
        let generation = self.subjects().get(&user.name).map(|s| s.generation).unwrap_or_default();
        token::sign(&self.key, user, generation)
    }

    /// A token of the next generation for `user`; every older one stops working after the grace period.
    pub fn rotate(&self, user: &User) -> Result<String, Error> {
        let mut subjects = self.subjects();
        let subject = subjects.entry(user.name.clone()).or_default();
        subject.generation += 1;
        let until_unix_ms = unix_ms(SystemTime::now() + self.grace);
        subject.retired.push(Retired { below: subject.generation, until_unix_ms });
        let generation = subject.generation;
        if let Some(dir) = &self.dir {
            let text = serde_json::to_string_pretty(&*subjects).unwrap_or_default();
            state::write(dir, ROTATIONS, &text, false)?;
        }
        Ok(token::sign(&self.key, user, generation))
    }

    /// The user an `Authorization` header value authenticates.
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<User, Unauthenticated> {
        let header = authorization.ok_or(Unauthenticated::Missing)?.trim();
        let (scheme, token) = header.split_once(' ').ok_or(Unauthenticated::Missing)?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(Unauthenticated::Missing);
        }
        if token.trim().is_empty() {
            return Err(Unauthenticated::Missing);
        }
        let claims = token::verify(&self.key, token.trim()).ok_or(Unauthenticated::Invalid)?;
        let now = unix_ms(SystemTime::now());
        let retired = self
            .subjects()
            .get(&claims.user.name)
            .is_some_and(|s| s.retired.iter().any(|r| claims.generation < r.below && now >= r.until_unix_ms));
        if retired {
            return Err(Unauthenticated::Invalid);
        }
        Ok(claims.user)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_retires_old_tokens_after_the_grace_period() {
        let tokens = Tokens::ephemeral(Duration::ZERO);
        let sa = User::service_account("ns", "sa");
        let old = tokens.issue(&sa);
        let bearer = |t: &str| format!("Bearer {t}");
        assert_eq!(tokens.authenticate(Some(&bearer(&old))), Ok(sa.clone()));
        let new = tokens.rotate(&sa).unwrap();
        assert_eq!(tokens.authenticate(Some(&bearer(&old))), Err(Unauthenticated::Invalid));
        assert_eq!(tokens.authenticate(Some(&bearer(&new))), Ok(sa.clone()));
        assert_eq!(tokens.authenticate(Some(&bearer(&tokens.issue(&sa)))), Ok(sa), "issue uses the new generation");
        let admin = tokens.issue(&User::admin());
        assert_eq!(tokens.authenticate(Some(&bearer(&admin))), Ok(User::admin()), "other subjects are untouched");
        assert_eq!(tokens.authenticate(None), Err(Unauthenticated::Missing));
        assert_eq!(tokens.authenticate(Some("Basic YTpi")), Err(Unauthenticated::Missing));

        let graceful = Tokens::ephemeral(Duration::from_secs(3600));
        let old = graceful.issue(&User::admin());
        graceful.rotate(&User::admin()).unwrap();
        assert!(graceful.authenticate(Some(&bearer(&old))).is_ok(), "still inside the grace period");
    }

    #[test]
    fn a_state_dir_keeps_the_key_and_the_rotations() {
        let dir = tempfile::tempdir().unwrap();
        let first = Tokens::load_or_create(Some(dir.path()), Duration::ZERO).unwrap();
        let sa = User::service_account("ns", "sa");
        let old = first.issue(&sa);
        let new = first.rotate(&sa).unwrap();
        let restarted = Tokens::load_or_create(Some(dir.path()), Duration::ZERO).unwrap();
        assert_eq!(restarted.authenticate(Some(&format!("Bearer {new}"))), Ok(sa));
        assert_eq!(restarted.authenticate(Some(&format!("Bearer {old}"))), Err(Unauthenticated::Invalid));
        let elsewhere = Tokens::ephemeral(Duration::ZERO);
        assert_eq!(elsewhere.authenticate(Some(&format!("Bearer {new}"))), Err(Unauthenticated::Invalid));
    }
}
