//! Secrets by construction: a value type whose `Debug` and `Display` print a fixed mask, and a
//! source that reads a secret from a variable or from a file that is re-read when it changes.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

/// What every secret prints as.
pub const MASK: &str = "<redacted>";

/// A secret string. The only way to see it is [`Secret::expose`], which call sites use at the
/// last moment (an HTTP header, a token request).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The secret itself; never log or format what this returns.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(MASK)
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(MASK)
    }
}

/// Why a secret could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("cannot read secret file {path}: {source}; check that the file exists and is readable")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("secret file {path} is empty; put the secret in it")]
    Empty { path: PathBuf },
}

/// Where a secret comes from: a literal value, or a file (a mounted Kubernetes secret) whose
/// content is cached and re-read when its modification time or length changes.
pub enum SecretSource {
    Value(Secret),
    File {
        path: PathBuf,
        cache: Mutex<Option<(FileStamp, Secret)>>,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct FileStamp {
    modified: Option<SystemTime>,
    len: u64,
}

impl SecretSource {
    pub fn value(secret: impl Into<String>) -> Self {
        SecretSource::Value(Secret::new(secret))
    }

    pub fn file(path: impl Into<PathBuf>) -> Self {
        SecretSource::File {
            path: path.into(),
            cache: Mutex::new(None),
        }
    }

    /// Whether both name one secret: the same value, or the same file (what it holds may
    /// change; both read the change). Compares in memory only; nothing is shown.
    pub fn same_as(&self, other: &SecretSource) -> bool {
        match (self, other) {
            (SecretSource::Value(a), SecretSource::Value(b)) => a == b,
            (SecretSource::File { path: a, .. }, SecretSource::File { path: b, .. }) => a == b,
            _ => false,
        }
    }

    /// The current secret. For a file, a `stat` per call and a read only when it changed; a
    /// trailing newline is trimmed.
    pub fn load(&self) -> Result<Secret, SecretError> {
        match self {
            SecretSource::Value(s) => Ok(s.clone()),
            SecretSource::File { path, cache } => {
                let stamp = stamp(path)?;
                if let Some((cached_stamp, secret)) = &*cache.lock().expect("secret cache poisoned")
                    && *cached_stamp == stamp
                {
                    return Ok(secret.clone());
                }
                let raw = std::fs::read_to_string(path).map_err(|source| SecretError::Read {
                    path: path.clone(),
                    source,
                })?;
                let trimmed = raw.trim_end_matches(['\n', '\r']);
                if trimmed.is_empty() {
                    return Err(SecretError::Empty { path: path.clone() });
                }
                let secret = Secret::new(trimmed);
                *cache.lock().expect("secret cache poisoned") = Some((stamp, secret.clone()));
                Ok(secret)
            }
        }
    }
}

fn stamp(path: &Path) -> Result<FileStamp, SecretError> {
    let meta = std::fs::metadata(path).map_err(|source| SecretError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(FileStamp {
        modified: meta.modified().ok(),
        len: meta.len(),
    })
}

impl fmt::Debug for SecretSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SecretSource::Value(_) => write!(f, "SecretSource::Value({MASK})"),
            SecretSource::File { path, .. } => write!(f, "SecretSource::File({})", path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_and_display_never_show_the_value() {
        let s = Secret::new("sk-very-secret");
        assert_eq!(format!("{s:?}"), MASK);
        assert_eq!(format!("{s}"), MASK);
        let src = SecretSource::value("sk-very-secret");
        assert!(!format!("{src:?}").contains("sk-very"));
    }

    #[test]
    fn file_secret_is_reread_when_it_changes() {
        let dir = std::env::temp_dir().join(format!("abada-secret-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("key");
        std::fs::write(&path, "first\n").unwrap();
        let src = SecretSource::file(&path);
        assert_eq!(src.load().unwrap().expose(), "first");
        std::fs::write(&path, "second-longer\n").unwrap();
        assert_eq!(src.load().unwrap().expose(), "second-longer");
        std::fs::write(&path, "").unwrap();
        assert!(matches!(src.load(), Err(SecretError::Empty { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
