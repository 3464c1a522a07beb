//! Canonical JSON: one spelling of a value whatever order its maps kept, so that a digest or a
//! content-derived key of the same call is the same on every worker (the journal's content keys,
//! approval's call digest).

use serde_json::Value;

/// Compact JSON with object keys sorted at every level, whatever order the map kept.
pub(crate) fn canonical(value: &Value) -> String {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            let fields: Vec<String> = keys
                .into_iter()
                .map(|k| format!("{}:{}", Value::String(k.clone()), canonical(&map[k])))
                .collect();
            format!("{{{}}}", fields.join(","))
        }
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(canonical).collect();
            format!("[{}]", items.join(","))
        }
        other => other.to_string(),
    }
}
