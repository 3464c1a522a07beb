//! A scratch directory for the files a test hands a worker (agents and tools files, secrets),
//! removed when dropped.

use std::path::PathBuf;

pub struct ScratchDir(pub PathBuf);

impl ScratchDir {
    /// A fresh directory under the system's temp dir, its name starting with `abada-{what}-`.
    pub fn new(what: &str) -> Self {
        let path = std::env::temp_dir().join(format!("abada-{what}-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&path).unwrap();
        ScratchDir(path)
    }

    /// Writes `content` to `name` in the directory and returns its path.
    pub fn write(&self, name: &str, content: &str) -> PathBuf {
        let path = self.0.join(name);
        // Write then rename, as the kubelet updates a mounted Secret: never a half-written file.
        let tmp = self.0.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, content).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
