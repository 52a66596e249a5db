//! The key-value store used to bootstrap process groups.
//!
//! The engine needs only [`Store`]: `set`, a blocking `get` with a timeout, and `wait`. The
//! worker runtime implements it over the rendezvous store; [`LocalStore`] serves thread tests
//! and [`FileStore`] serves multi-process tests and single-host runs without a daemon.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::error::{CommError, Result};

/// A blocking key-value store shared by all ranks of a job.
///
/// Keys are written once per group prefix; values are small (addresses, host identities,
/// 128-byte NCCL ids).
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing any previous value.
    ///
    /// # Errors
    /// The store is unreachable or failed.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// Returns the value of `key`, waiting up to `timeout` for it to be set.
    ///
    /// # Errors
    /// [`CommError::StoreTimeout`] when the key is still missing at the deadline.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;

    /// Waits until every key in `keys` is set.
    ///
    /// # Errors
    /// As [`Store::get`].
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        for k in keys {
            self.get(k, deadline.saturating_duration_since(Instant::now()))?;
        }
        Ok(())
    }
}

impl<S: Store + ?Sized> Store for Arc<S> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        (**self).set(key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        (**self).get(key, timeout)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        (**self).wait(keys, timeout)
    }
}

/// Returns `Ok(None)` instead of a timeout when the key is absent right now.
pub(crate) fn try_get(store: &dyn Store, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>> {
    match store.get(key, timeout) {
        Ok(v) => Ok(Some(v)),
        Err(CommError::StoreTimeout { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

fn timeout_err(key: &str, timeout: Duration) -> CommError {
    CommError::StoreTimeout {
        key: key.to_string(),
        timeout_ms: timeout.as_millis() as u64,
    }
}

type Shared<T> = Arc<(Mutex<T>, Condvar)>;

/// An in-process store (for ranks running as threads).
#[derive(Clone, Default)]
pub struct LocalStore {
    inner: Shared<HashMap<String, Vec<u8>>>,
}

impl LocalStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

impl std::fmt::Debug for LocalStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalStore").finish_non_exhaustive()
    }
}

impl Store for LocalStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let (map, cv) = &*self.inner;
        // A poisoned lock only means another rank thread panicked while holding it; the map
        // itself is always consistent (single insert), so keep using it.
        let mut m = map.lock().unwrap_or_else(|p| p.into_inner());
        m.insert(key.to_string(), value.to_vec());
        cv.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let (map, cv) = &*self.inner;
        let mut m = map.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(v) = m.get(key) {
                return Ok(v.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(timeout_err(key, timeout));
            }
            m = cv
                .wait_timeout(m, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// A store in a directory shared by all ranks (one file per key, written by atomic rename).
///
/// Readers poll with a backoff of at most 5 ms. Suitable for ranks on one host (or on a shared
/// file system) when no rendezvous daemon is running.
#[derive(Debug, Clone)]
pub struct FileStore {
    dir: PathBuf,
}

impl FileStore {
    /// A store rooted at `dir` (created if missing).
    ///
    /// # Errors
    /// The directory cannot be created.
    pub fn new(dir: impl AsRef<Path>) -> Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = dir.as_ref().to_path_buf();
        // Owner only: values include the mesh's listener tokens, which keep strangers out.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| CommError::io(format!("creating store directory {}", dir.display()), e))?;
        Ok(FileStore { dir })
    }

    /// The directory holding the keys.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, key: &str) -> PathBuf {
        // Encode the key into one safe file name.
        let mut name = String::with_capacity(key.len() + 4);
        for b in key.bytes() {
            if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.' {
                name.push(b as char);
            } else {
                name.push_str(&format!("%{b:02x}"));
            }
        }
        self.dir.join(name)
    }
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let path = self.path(key);
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // A random part too: hosts sharing the directory (NFS) may run the same pids.
        let tmp = self.dir.join(format!(".tmp-{}-{n}-{:016x}", std::process::id(), super::mesh::random_token()));
        let err = |e| CommError::Store {
            key: key.to_string(),
            reason: format!("{e}"),
        };
        let file = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp).map_err(err)?
        };
        // Only a temp file this call created is removed on error.
        let written = {
            use std::io::Write;
            let mut file = file;
            file.write_all(value)
        };
        if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, &path)) {
            let _ = std::fs::remove_file(&tmp);
            return Err(err(e));
        }
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let path = self.path(key);
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_micros(100);
        loop {
            match std::fs::read(&path) {
                Ok(v) => return Ok(v),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(CommError::Store {
                        key: key.to_string(),
                        reason: e.to_string(),
                    });
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(timeout_err(key, timeout));
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(Duration::from_millis(5));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_store_waits_for_key() {
        let s = LocalStore::new();
        let s2 = s.clone();
        let t = std::thread::spawn(move || s2.get("a/b", Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(20));
        s.set("a/b", b"v").unwrap();
        assert_eq!(t.join().unwrap().unwrap(), b"v");
        assert!(matches!(
            s.get("x", Duration::from_millis(10)),
            Err(CommError::StoreTimeout { .. })
        ));
    }

    #[test]
    fn file_store_round_trip() {
        let d = tempfile::tempdir().unwrap();
        let s = FileStore::new(d.path()).unwrap();
        s.set("grp/0/addr", b"127.0.0.1:1").unwrap();
        assert_eq!(
            s.get("grp/0/addr", Duration::from_secs(1)).unwrap(),
            b"127.0.0.1:1"
        );
        assert!(try_get(&s, "missing", Duration::ZERO).unwrap().is_none());
        // Owner only: the values include the mesh's listener tokens.
        use std::os::unix::fs::PermissionsExt;
        let made = FileStore::new(d.path().join("a/b")).unwrap();
        made.set("k", b"v").unwrap();
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(made.dir()), 0o700);
        assert_eq!(mode(&made.dir().join("k")), 0o600);
        assert_eq!(std::fs::read_dir(made.dir()).unwrap().count(), 1, "a temporary file was left");
    }
}
