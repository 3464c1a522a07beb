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

/// The variable and value that give a worker an agents file declaring the names its metrics
/// may carry: the agent `agent`, its `models` (`provider/model`) and the tool `servers`
/// (`(name, url)`). Only the operator's files declare label values (`metrics::labels`); the
/// entry's key is no topic or activity, so no task uses it.
pub fn declaring_label_names(
    dir: &ScratchDir,
    agent: &str,
    models: &[&str],
    servers: &[(&str, &str)],
) -> (String, String) {
    let fallbacks: Vec<String> = models[1..].iter().map(|m| format!("{m:?}")).collect();
    let servers: Vec<String> = servers
        .iter()
        .map(|(name, url)| format!("{{ name = {name:?}, url = {url:?} }}"))
        .collect();
    let path = dir.write(
        "declared-names.toml",
        &format!(
            "[agents.\"declared-label-names\"]\nname = {agent:?}\nmodel = {:?}\nfallbackModels = [{}]\ninput = \"unused\"\ntoolServers = [{}]\n",
            models[0],
            fallbacks.join(", "),
            servers.join(", ")
        ),
    );
    (
        "ABADA_AGENT_AGENTS_FILE".to_string(),
        path.display().to_string(),
    )
}
