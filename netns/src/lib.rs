//! Network namespace handling shared by every component.
//!
//! Entering a netns with `setns(2)` changes only the calling thread, so work that must run inside a pod's
//! namespace is executed on a dedicated thread, thrown away afterwards ([`Netns::run`]). The caller's threads (and
//! the tokio runtime) never change namespace. (The proxy's recurring socket work in pods runs on its own shared
//! socket threads, `hbone-proxy/src/sockets.rs`, which enter a pod's namespace for a run of its jobs.)

pub mod discover;
pub mod netlink;

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::sched::{setns, CloneFlags};

/// Errors from opening or entering a network namespace.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// The netns path could not be opened (usually: it no longer exists).
    #[error("open netns {path}: {source}")]
    Open {
        /// Path that was opened.
        path: PathBuf,
        /// Underlying I/O error.
        source: std::io::Error,
    },
    /// The path exists but is not a namespace file at all (a regular file, a directory, a FIFO, ...).
    #[error("{0} is not a network namespace")]
    NotNetns(PathBuf),
    /// The path is a namespace file of another kind: a mount or user namespace, say. Entering one of those in
    /// place of a pod's netns would be a privilege boundary crossed, so it is refused as early as the path.
    #[error("{path} is a {kind} namespace, not a network namespace")]
    OtherNamespace {
        /// Path (or label) of the namespace.
        path: PathBuf,
        /// Its kind as the kernel reports it (`mount`, `user`, `pid`, ...).
        kind: &'static str,
    },
    /// The kernel could not say which kind of namespace the file is (`NS_GET_NSTYPE`, Linux 4.11 and later).
    #[error("asking the kernel which namespace {path} is: {source}")]
    Kind {
        /// Path (or label) of the namespace.
        path: PathBuf,
        /// Errno from the kernel.
        source: nix::Error,
    },
    /// `setns(2)` failed.
    #[error("enter netns {path}: {source}")]
    Enter {
        /// Path of the namespace.
        path: PathBuf,
        /// Errno from the kernel.
        source: nix::Error,
    },
    /// The worker thread could not be spawned or panicked.
    #[error("netns worker thread for {path}: {reason}")]
    Thread {
        /// Path of the namespace.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
}

/// An open handle on a network namespace. Holding it keeps the namespace alive.
#[derive(Debug)]
pub struct Netns {
    file: File,
    path: PathBuf,
    dev: u64,
    ino: u64,
}

/// NSFS_MAGIC from linux/magic.h: the filesystem type of namespace files.
const NSFS_MAGIC: i64 = 0x6e73_6673;

/// What a namespace file is, by the `CLONE_NEW*` flag `NS_GET_NSTYPE` answers with.
fn namespace_kind(nstype: libc::c_int) -> &'static str {
    match nstype {
        libc::CLONE_NEWNET => "network",
        libc::CLONE_NEWNS => "mount",
        libc::CLONE_NEWUSER => "user",
        libc::CLONE_NEWPID => "pid",
        libc::CLONE_NEWUTS => "uts",
        libc::CLONE_NEWIPC => "ipc",
        libc::CLONE_NEWCGROUP => "cgroup",
        libc::CLONE_NEWTIME => "time",
        _ => "unknown",
    }
}

impl Netns {
    /// Opens the namespace at `path` (a bind mount under /var/run/netns or a /proc/<pid>/ns/net link) and checks
    /// that it is a network namespace: a file on nsfs whose `NS_GET_NSTYPE` is `CLONE_NEWNET`, so a regular file,
    /// a mount namespace or a user namespace is refused before anyone enters it. The open never blocks (a FIFO
    /// planted at the path is refused, not waited on) and never makes the file a controlling terminal.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, NetnsError> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = path.as_ref().to_path_buf();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK)
            .open(&path)
            .map_err(|source| NetnsError::Open { path: path.clone(), source })?;
        Self::from_file(file, path)
    }

    /// Wraps a netns fd received from elsewhere (e.g. over `SCM_RIGHTS`), which has no path of its own.
    ///
    /// `label` only names the namespace in errors and logs. The fd is checked like [`Netns::open`] checks a
    /// path, so a wrong fd fails here rather than at `setns` time.
    pub fn from_fd(fd: OwnedFd, label: impl Into<PathBuf>) -> Result<Self, NetnsError> {
        Self::from_file(File::from(fd), label.into())
    }

    fn from_file(file: File, path: PathBuf) -> Result<Self, NetnsError> {
        let fs = nix::sys::statfs::fstatfs(file.as_fd())
            .map_err(|e| NetnsError::Open { path: path.clone(), source: e.into() })?;
        let magic = fs.filesystem_type().0 as i64;
        if magic != NSFS_MAGIC {
            return Err(NetnsError::NotNetns(path));
        }
        // SAFETY: NS_GET_NSTYPE takes no argument and only reads the fd, which `file` keeps open.
        let nstype = unsafe { libc::ioctl(file.as_raw_fd(), libc::NS_GET_NSTYPE) };
        if nstype < 0 {
            return Err(NetnsError::Kind { path, source: nix::Error::last() });
        }
        if nstype != libc::CLONE_NEWNET {
            return Err(NetnsError::OtherNamespace { path, kind: namespace_kind(nstype) });
        }
        let meta = file.metadata().map_err(|source| NetnsError::Open { path: path.clone(), source })?;
        Ok(Self { file, path, dev: meta.dev(), ino: meta.ino() })
    }

    /// Opens the calling thread's own network namespace.
    pub fn current() -> Result<Self, NetnsError> {
        Self::open(format!("/proc/self/task/{}/ns/net", nix::unistd::gettid()))
    }

    /// Path this handle was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `(dev, ino)` identifies a namespace uniquely while it exists.
    pub fn id(&self) -> (u64, u64) {
        (self.dev, self.ino)
    }

    /// The open file, for passing the namespace to another process.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// A duplicate of the namespace fd that the caller owns, so it can be handed to another party (the ZDS
    /// peer) while this handle keeps the namespace open.
    pub fn try_clone_fd(&self) -> std::io::Result<OwnedFd> {
        self.file.as_fd().try_clone_to_owned()
    }

    /// Runs `f` on a new thread that has entered this namespace, and returns its result.
    ///
    /// Processes spawned from inside `f` inherit the namespace. The thread exits afterwards, so no
    /// thread is ever returned to a pool while still inside a foreign namespace.
    pub fn run<F, T>(&self, f: F) -> Result<T, NetnsError>
    where
        F: FnOnce() -> T + Send,
        T: Send,
    {
        std::thread::scope(|scope| {
            let worker = std::thread::Builder::new()
                .name("netns".into())
                .spawn_scoped(scope, || {
                    setns(self.file.as_fd(), CloneFlags::CLONE_NEWNET)
                        .map_err(|source| NetnsError::Enter { path: self.path.clone(), source })?;
                    Ok(f())
                })
                .map_err(|e| NetnsError::Thread { path: self.path.clone(), reason: e.to_string() })?;
            worker.join().map_err(|_| NetnsError::Thread { path: self.path.clone(), reason: "panicked".into() })?
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_netns_opens_and_runs() {
        let ns = Netns::current().expect("open own netns");
        let inner = ns.run(|| Netns::current().map(|n| n.id())).unwrap().unwrap();
        assert_eq!(inner, ns.id());
    }

    #[test]
    fn regular_file_is_rejected() {
        let err = Netns::open("/proc/self/status").unwrap_err();
        assert!(matches!(err, NetnsError::NotNetns(_)), "{err}");
    }

    #[test]
    fn fd_round_trips_through_from_fd() {
        let ns = Netns::current().expect("open own netns");
        let dup = Netns::from_fd(ns.try_clone_fd().unwrap(), "dup").unwrap();
        assert_eq!(dup.id(), ns.id());
        assert_eq!(dup.path(), Path::new("dup"));
    }

    #[test]
    fn from_fd_rejects_a_regular_file() {
        let fd = OwnedFd::from(File::open("/proc/self/status").unwrap());
        let err = Netns::from_fd(fd, "status fd").unwrap_err();
        assert!(matches!(err, NetnsError::NotNetns(ref p) if p == Path::new("status fd")), "{err}");
    }

    #[test]
    fn other_kinds_of_namespace_are_refused_by_kind() {
        for (file, kind) in [("mnt", "mount"), ("user", "user"), ("uts", "uts"), ("ipc", "ipc"), ("pid", "pid")] {
            let path = format!("/proc/self/ns/{file}");
            let err = Netns::open(&path).unwrap_err();
            assert!(matches!(err, NetnsError::OtherNamespace { kind: k, .. } if k == kind), "{path}: {err:?}");
            assert!(err.to_string().contains(&format!("{kind} namespace")), "{err}");
        }
    }

    #[test]
    fn from_fd_rejects_a_mount_namespace() {
        let fd = OwnedFd::from(File::open("/proc/self/ns/mnt").unwrap());
        let err = Netns::from_fd(fd, "mnt fd").unwrap_err();
        assert!(matches!(err, NetnsError::OtherNamespace { kind: "mount", .. }), "{err}");
    }

    #[test]
    fn a_fifo_or_a_directory_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        // A blocking open would wait here for a writer that never comes.
        for path in [fifo.as_path(), dir.path()] {
            let err = Netns::open(path).unwrap_err();
            assert!(matches!(err, NetnsError::NotNetns(_)), "{}: {err}", path.display());
        }
    }

    #[test]
    fn missing_path_names_the_path() {
        let err = Netns::open("/nonexistent/ns").unwrap_err();
        assert!(err.to_string().contains("/nonexistent/ns"), "{err}");
    }
}
