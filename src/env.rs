//! Where configuration variables come from: an injectable source, so tests pass a map instead of
//! mutating the process environment. Below every module that reads a variable of its own.

use std::collections::HashMap;

/// Where variables come from.
pub trait EnvSource {
    fn get(&self, key: &str) -> Option<String>;
}

/// The process environment.
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn get(&self, key: &str) -> Option<String> {
        std::env::var(key).ok()
    }
}

impl EnvSource for HashMap<String, String> {
    fn get(&self, key: &str) -> Option<String> {
        HashMap::get(self, key).cloned()
    }
}

impl EnvSource for HashMap<&str, &str> {
    fn get(&self, key: &str) -> Option<String> {
        HashMap::get(self, key).map(|v| v.to_string())
    }
}
