//! The one error a repair message quotes, found at a bounded cost.
//!
//! The `jsonschema` validator reports an `anyOf` (or `oneOf`) that failed with the errors of
//! every branch, each branch's own `anyOf`s with theirs, all the way down: a tree that grows
//! with the schema's weight times the answer, built whole before the first error is returned
//! (`validate` and `iter_errors` alike). A chain of `anyOf`s of two `$ref`s, 20 levels deep,
//! took 3.1 GB to report one error. The repair message quotes one error and never the branches.
//!
//! So the error is looked for in a reporting copy of the schema, compiled beside it, where every
//! `anyOf: [A, B]` is `anyOf: [{"not": {"not": {"anyOf": [A, B]}}}]` (and `oneOf` alike): the
//! same verdict (`not not X` is `X`), but a `not` checks its subschema with a yes or no and
//! reports only itself, so a failed `anyOf` reports one error with one branch of one error, at
//! the `anyOf`'s own place in the schema. `$ref`s into a branch are rewritten to the same
//! subschema in the copy (`keywords::reporting_pointer`). Reporting costs at most about two
//! checks of the answer, and one error's memory.

use serde_json::{Map, Value, json};

use super::keywords::{Shape, reporting_pointer, shape};

/// The reporting copy of `schema` (see the module header).
pub(crate) fn reporting_copy(schema: &Value) -> Value {
    rewrite(schema, schema)
}

fn rewrite(root: &Value, node: &Value) -> Value {
    let Value::Object(schema) = node else {
        return node.clone();
    };
    let each = |items: &[Value]| Value::Array(items.iter().map(|i| rewrite(root, i)).collect());
    let mut out = Map::new();
    for (keyword, value) in schema {
        let copied = match (shape(keyword), value) {
            (Some(Shape::Reference), Value::String(r)) => match r.strip_prefix('#') {
                Some(target) if target.starts_with('/') => {
                    Value::String(format!("#{}", reporting_pointer(root, target)))
                }
                _ => value.clone(),
            },
            (Some(Shape::Schema), v) => rewrite(root, v),
            (Some(Shape::SchemaList), Value::Array(items)) => {
                let items = each(items);
                if keyword == "anyOf" || keyword == "oneOf" {
                    json!([{"not": {"not": {keyword.as_str(): items}}}])
                } else {
                    items
                }
            }
            (Some(Shape::SchemaOrList), Value::Array(items)) => each(items),
            (Some(Shape::SchemaOrList), v) => rewrite(root, v),
            (Some(Shape::SchemaMap | Shape::Definitions), Value::Object(map)) => Value::Object(
                map.iter()
                    .map(|(name, v)| (name.clone(), rewrite(root, v)))
                    .collect(),
            ),
            (Some(Shape::SchemaOrNamesMap), Value::Object(map)) => Value::Object(
                map.iter()
                    .map(|(name, v)| {
                        let v = if v.is_array() {
                            v.clone()
                        } else {
                            rewrite(root, v)
                        };
                        (name.clone(), v)
                    })
                    .collect(),
            ),
            _ => value.clone(),
        };
        out.insert(keyword.clone(), copied);
    }
    Value::Object(out)
}

/// The first error of `value` against the reporting copy, as (instance path, schema path,
/// message); `None` when the copy finds none (it agrees with the schema on every answer, so
/// only a bug gets there).
pub(crate) fn first_error(
    reporter: &jsonschema::Validator,
    value: &Value,
) -> Option<(String, String, String)> {
    let error = reporter.validate(value).err()?;
    use jsonschema::error::ValidationErrorKind as Kind;
    let message = match error.kind() {
        // The copy's one-branch `oneOf` says "none"; the schema's may have matched two.
        Kind::OneOfNotValid { .. } => format!(
            "{} matches none, or more than one, of the schemas listed in the 'oneOf' keyword",
            error.instance()
        ),
        // A `not` quotes its subschema, which is the copy's: say it without.
        Kind::Not { .. } => format!(
            "{} is not allowed: it matches the schema under 'not'",
            error.instance()
        ),
        _ => error.to_string(),
    };
    Some((
        error.instance_path().as_str().to_string(),
        original_path(error.schema_path().as_str()),
        message,
    ))
}

/// A schema path in the copy as it reads in the schema: the wrapper around each `anyOf` and
/// `oneOf` taken out (an error below one, reached by a `$ref` into a branch, names it).
fn original_path(path: &str) -> String {
    path.replace("/anyOf/0/not/not/anyOf", "/anyOf")
        .replace("/oneOf/0/not/not/oneOf", "/oneOf")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_copy_wraps_every_any_of_and_one_of_and_keeps_refs_on_their_subschema() {
        let schema = json!({
            "properties": {"a": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/n/oneOf/1"}]}},
            "$defs": {"n": {"oneOf": [{"type": "null"}, {"type": "integer"}]}},
            "dependencies": {"a": ["b"], "c": {"anyOf": [{}]}},
            "enum": [{"anyOf": [1]}]
        });
        let copy = reporting_copy(&schema);
        assert_eq!(
            copy["properties"]["a"]["anyOf"][0]["not"]["not"]["anyOf"][1]["$ref"],
            "#/$defs/n/oneOf/0/not/not/oneOf/1"
        );
        assert_eq!(
            copy.pointer("/$defs/n/oneOf/0/not/not/oneOf/1"),
            Some(&json!({"type": "integer"}))
        );
        assert_eq!(copy["dependencies"]["a"], json!(["b"]));
        assert_eq!(
            copy["dependencies"]["c"],
            json!({"anyOf": [{"not": {"not": {"anyOf": [{}]}}}]})
        );
        assert_eq!(copy["enum"], schema["enum"], "data is not rewritten");
    }
}
