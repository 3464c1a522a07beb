//! The keywords an `outputSchema` may use, with where each one holds subschemas: the one list
//! every reader of a schema goes by. The bounds walker counts the subschemas it names (and
//! only those), the keyword check refuses what it does not name, and the reporting copy of a
//! schema (`report`) finds `anyOf` and `oneOf` by it; the `jsonschema` validator is only ever
//! handed a schema whose every keyword is on it. So the weight the walker computes is the weight
//! the validator works through: a keyword the validator applies but the list did not know (the
//! hole this list closes: `dependencies`, which the walker once skipped, carried a chain of
//! `anyOf`s that cost gigabytes to report) is refused before anything is compiled.
//!
//! The list is checked against the validator itself (`tests` below): for every draft it
//! supports, every keyword it compiles as a subschema is on the list with that shape, refused,
//! or both. Source read: `jsonschema` 0.61.2 `src/keywords/mod.rs` (`get_for_draft`: which
//! keywords each draft compiles) and `referencing` 0.61.2 `src/spec/draft*.rs` (which keywords
//! hold subresources).

use serde_json::{Map, Value};

/// How a keyword's value holds subschemas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// The value is one subschema (`not`, `if`, `additionalProperties`, ...).
    Schema,
    /// An array of subschemas (`allOf`, `anyOf`, `oneOf`, `prefixItems`).
    SchemaList,
    /// An object of subschemas by name (`properties`, `patternProperties`,
    /// `dependentSchemas`).
    SchemaMap,
    /// `items`: one subschema, or (drafts 4 to 2019-09) an array of them.
    SchemaOrList,
    /// `dependencies`: each member a subschema, or an array of property names.
    SchemaOrNamesMap,
    /// `$defs`, `definitions`: subschemas by name that apply only where a `$ref` uses them, so
    /// the walker counts them there.
    Definitions,
    /// `$ref`: a reference the walker follows (inside the document only).
    Reference,
    /// `$id`, `id`: a base URI, allowed at the root only (a nested one would make the
    /// validator resolve the `$ref`s below it elsewhere than the walker follows them).
    Identifier,
    /// A value that holds no subschema: an assertion (`type`, `enum`, `pattern`, ...) or an
    /// annotation (`title`, `default`, `examples`, ...).
    Plain,
    /// A keyword the validator applies that the worker refuses, and why.
    Refused(&'static str),
}

/// Why `unevaluatedProperties` and `unevaluatedItems` are refused: measured on `jsonschema`
/// 0.61.2, a chain of N levels each `{"anyOf": [{"$ref": next}, {...}],
/// "unevaluatedProperties": false}` weighs about 4N but costs 2^N (each level evaluates its
/// `anyOf` branches again to learn what they evaluated): 22 levels, 2.2 KB, took 3.7 s for one
/// two-property answer. No weight bound holds such a cost.
const UNEVALUATED: &str = "its cost in the validator doubles with every level of anyOf, oneOf, if or $ref it sits above, which no size bound can hold; close the object with additionalProperties: false (or the array with items) instead";
/// Why the dynamic references are refused.
const DYNAMIC_REF: &str =
    "it resolves at validation time, where the bounds cannot follow it; use a $ref to #/$defs/...";

/// Every keyword the worker knows, with its shape. Any other keyword may carry a plain value
/// (a string, number, boolean or null: an annotation such as `x-order`, which the validator
/// ignores) but never an object or an array.
pub(crate) const KEYWORDS: &[(&str, Shape)] = &[
    // Applicators: one subschema.
    ("additionalProperties", Shape::Schema),
    ("additionalItems", Shape::Schema),
    ("not", Shape::Schema),
    ("if", Shape::Schema),
    ("then", Shape::Schema),
    ("else", Shape::Schema),
    ("contains", Shape::Schema),
    ("propertyNames", Shape::Schema),
    // An annotation in 2019-09 and 2020-12 (never applied by the validator), counted anyway.
    ("contentSchema", Shape::Schema),
    // Applicators: several.
    ("allOf", Shape::SchemaList),
    ("anyOf", Shape::SchemaList),
    ("oneOf", Shape::SchemaList),
    ("prefixItems", Shape::SchemaList),
    ("items", Shape::SchemaOrList),
    ("properties", Shape::SchemaMap),
    ("patternProperties", Shape::SchemaMap),
    ("dependentSchemas", Shape::SchemaMap),
    ("dependencies", Shape::SchemaOrNamesMap),
    ("$defs", Shape::Definitions),
    ("definitions", Shape::Definitions),
    // References and identifiers.
    ("$ref", Shape::Reference),
    ("$id", Shape::Identifier),
    ("id", Shape::Identifier),
    ("$schema", Shape::Plain),
    ("$anchor", Shape::Plain),
    ("$dynamicAnchor", Shape::Plain),
    ("$recursiveAnchor", Shape::Plain),
    ("$comment", Shape::Plain),
    // Assertions.
    ("type", Shape::Plain),
    ("enum", Shape::Plain),
    ("const", Shape::Plain),
    ("required", Shape::Plain),
    ("dependentRequired", Shape::Plain),
    ("minimum", Shape::Plain),
    ("maximum", Shape::Plain),
    ("exclusiveMinimum", Shape::Plain),
    ("exclusiveMaximum", Shape::Plain),
    ("multipleOf", Shape::Plain),
    ("minLength", Shape::Plain),
    ("maxLength", Shape::Plain),
    ("pattern", Shape::Plain),
    ("format", Shape::Plain),
    ("minItems", Shape::Plain),
    ("maxItems", Shape::Plain),
    ("uniqueItems", Shape::Plain),
    ("minContains", Shape::Plain),
    ("maxContains", Shape::Plain),
    ("minProperties", Shape::Plain),
    ("maxProperties", Shape::Plain),
    ("contentEncoding", Shape::Plain),
    ("contentMediaType", Shape::Plain),
    // Annotations.
    ("title", Shape::Plain),
    ("description", Shape::Plain),
    ("default", Shape::Plain),
    ("examples", Shape::Plain),
    ("readOnly", Shape::Plain),
    ("writeOnly", Shape::Plain),
    ("deprecated", Shape::Plain),
    // Applied by the validator, refused here.
    ("unevaluatedProperties", Shape::Refused(UNEVALUATED)),
    ("unevaluatedItems", Shape::Refused(UNEVALUATED)),
    ("$dynamicRef", Shape::Refused(DYNAMIC_REF)),
    ("$recursiveRef", Shape::Refused(DYNAMIC_REF)),
];

/// The shape of `keyword`, or `None` for a keyword the worker does not know.
pub(crate) fn shape(keyword: &str) -> Option<Shape> {
    KEYWORDS
        .iter()
        .find(|(name, _)| *name == keyword)
        .map(|(_, shape)| *shape)
}

/// One subschema of a schema object: its JSON pointer segments below the object, the shape of
/// the keyword that holds it, and the subschema.
pub(crate) struct Child<'a> {
    pub(crate) segment: String,
    pub(crate) shape: Shape,
    pub(crate) schema: &'a Value,
}

/// The subschemas of `schema` by the list, in document order (definitions included: the walker
/// skips them by their shape).
pub(crate) fn children(schema: &Map<String, Value>) -> Vec<Child<'_>> {
    let mut out = Vec::new();
    for (keyword, value) in schema {
        let Some(shape) = shape(keyword) else {
            continue;
        };
        let k = escape(keyword);
        let found: Vec<(String, &Value)> = match (shape, value) {
            (Shape::Schema, v) | (Shape::SchemaOrList, v @ (Value::Object(_) | Value::Bool(_))) => {
                vec![(k, v)]
            }
            (Shape::SchemaList | Shape::SchemaOrList, Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| (format!("{k}/{i}"), v))
                .collect(),
            (Shape::SchemaMap | Shape::Definitions, Value::Object(map)) => map
                .iter()
                .map(|(name, v)| (format!("{k}/{}", escape(name)), v))
                .collect(),
            // Members that are arrays name required properties; the others are subschemas.
            (Shape::SchemaOrNamesMap, Value::Object(map)) => map
                .iter()
                .filter(|(_, v)| !v.is_array())
                .map(|(name, v)| (format!("{k}/{}", escape(name)), v))
                .collect(),
            _ => Vec::new(),
        };
        out.extend(found.into_iter().map(|(segment, schema)| Child {
            segment,
            shape,
            schema,
        }));
    }
    out
}

/// A JSON pointer segment.
pub(crate) fn escape(segment: &str) -> String {
    segment.replace('~', "~0").replace('/', "~1")
}

/// A keyword of a schema the worker will not hand to the validator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum KeywordRefusal {
    /// Not on the list, with an object or array value the validator might apply.
    Unknown { keyword: String, pointer: String },
    /// On the list as refused.
    Refused {
        keyword: String,
        pointer: String,
        why: &'static str,
    },
    /// A base URI below the root.
    NestedIdentifier { keyword: String, pointer: String },
}

/// Checks every schema object of the document (each once, `$defs` included, `$ref`s not
/// followed): each keyword is on the list, or unknown with a plain value. `pointer` is where
/// `node` is; the walk is as deep as the document (bounded before this is called).
pub(crate) fn check(node: &Value, pointer: &str) -> Result<(), KeywordRefusal> {
    let Value::Object(schema) = node else {
        return Ok(());
    };
    for (keyword, value) in schema {
        let at = || {
            if pointer.is_empty() {
                "/".into()
            } else {
                pointer.to_string()
            }
        };
        match shape(keyword) {
            None if value.is_object() || value.is_array() => {
                return Err(KeywordRefusal::Unknown {
                    keyword: keyword.clone(),
                    pointer: at(),
                });
            }
            Some(Shape::Refused(why)) => {
                return Err(KeywordRefusal::Refused {
                    keyword: keyword.clone(),
                    pointer: at(),
                    why,
                });
            }
            Some(Shape::Identifier) if !pointer.is_empty() && value.is_string() => {
                return Err(KeywordRefusal::NestedIdentifier {
                    keyword: keyword.clone(),
                    pointer: at(),
                });
            }
            _ => {}
        }
    }
    for child in children(schema) {
        check(child.schema, &format!("{pointer}/{}", child.segment))?;
    }
    Ok(())
}

/// The pointer `target` (inside `root`, `#` stripped) as it reads in the reporting copy of
/// `root`, where every `anyOf: [A, B]` became `anyOf: [{"not": {"not": {"anyOf": [A, B]}}}]`
/// (and `oneOf` alike): a segment after such a keyword gains `0/not/not/<keyword>/` before it.
/// Segments are followed by the list, so a `$ref` keeps pointing at the same subschema.
pub(crate) fn reporting_pointer(root: &Value, target: &str) -> String {
    let mut segments = target.split('/').skip(1);
    let mut out = String::new();
    // The schema the next segment is a keyword of; `None` once inside a plain value.
    let mut node = Some(root);
    while let Some(segment) = segments.next() {
        out.push('/');
        out.push_str(segment);
        let Some(schema) = node else {
            continue;
        };
        let keyword = unescape(segment);
        let value = schema.get(&keyword);
        node = match (shape(&keyword), value) {
            (Some(Shape::Schema), v) => v,
            (Some(Shape::SchemaOrList), Some(v @ (Value::Object(_) | Value::Bool(_)))) => Some(v),
            (Some(Shape::SchemaList | Shape::SchemaOrList), Some(Value::Array(items))) => {
                let Some(index) = segments.next() else {
                    break;
                };
                if matches!(keyword.as_str(), "anyOf" | "oneOf") {
                    out.push_str(&format!("/0/not/not/{keyword}"));
                }
                out.push('/');
                out.push_str(index);
                index.parse::<usize>().ok().and_then(|i| items.get(i))
            }
            (
                Some(Shape::SchemaMap | Shape::Definitions | Shape::SchemaOrNamesMap),
                Some(Value::Object(map)),
            ) => {
                let Some(name) = segments.next() else {
                    break;
                };
                out.push('/');
                out.push_str(name);
                map.get(&unescape(name))
            }
            _ => None,
        };
    }
    out
}

/// A JSON pointer segment read back.
fn unescape(segment: &str) -> String {
    segment.replace("~1", "/").replace("~0", "~")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The drafts the validator supports, by their `$schema`.
    const DRAFTS: [&str; 5] = [
        "http://json-schema.org/draft-04/schema#",
        "http://json-schema.org/draft-06/schema#",
        "http://json-schema.org/draft-07/schema#",
        "https://json-schema.org/draft/2019-09/schema",
        "https://json-schema.org/draft/2020-12/schema",
    ];

    /// Every keyword any of those drafts defines (their meta-schemas, `referencing` 0.61.2
    /// `metaschemas/`), every keyword `jsonschema` 0.61.2 compiles (`BuiltinKeyword::as_str`
    /// in `src/keywords/mod.rs`), a few it does not (OpenAPI's `discriminator`, an `x-`
    /// extension), and the list itself.
    fn universe() -> Vec<String> {
        let mut names: Vec<String> = [
            "$schema",
            "$id",
            "id",
            "$ref",
            "$anchor",
            "$dynamicAnchor",
            "$dynamicRef",
            "$recursiveAnchor",
            "$recursiveRef",
            "$vocabulary",
            "$comment",
            "$defs",
            "definitions",
            "allOf",
            "anyOf",
            "oneOf",
            "not",
            "if",
            "then",
            "else",
            "dependentSchemas",
            "dependencies",
            "prefixItems",
            "items",
            "additionalItems",
            "contains",
            "properties",
            "patternProperties",
            "additionalProperties",
            "propertyNames",
            "unevaluatedItems",
            "unevaluatedProperties",
            "type",
            "enum",
            "const",
            "multipleOf",
            "maximum",
            "exclusiveMaximum",
            "minimum",
            "exclusiveMinimum",
            "maxLength",
            "minLength",
            "pattern",
            "maxItems",
            "minItems",
            "uniqueItems",
            "maxContains",
            "minContains",
            "maxProperties",
            "minProperties",
            "required",
            "dependentRequired",
            "format",
            "contentEncoding",
            "contentMediaType",
            "contentSchema",
            "title",
            "description",
            "default",
            "deprecated",
            "readOnly",
            "writeOnly",
            "examples",
            "discriminator",
            "x-extension",
            "nullable",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        names.extend(KEYWORDS.iter().map(|(k, _)| k.to_string()));
        names.sort();
        names.dedup();
        names
    }

    /// The shapes the validator may give a keyword's value.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Probe {
        Single,
        Array,
        Map,
    }

    /// Whether the validator, for `draft`, compiles the value of `keyword` as subschemas in
    /// the `probe` position: the value holds a subschema `{"$ref": "#/nowhere"}` there, which
    /// the validator resolves when (and only when) it compiles it, and fails on. A value the
    /// draft's meta-schema refuses is never compiled either way.
    fn validator_applies(draft: &str, keyword: &str, probe: Probe) -> bool {
        let dangling = json!({"$ref": "#/nowhere"});
        let value = match probe {
            Probe::Single => dangling,
            Probe::Array => json!([dangling]),
            Probe::Map => json!({"a": dangling}),
        };
        let mut schema = json!({"$schema": draft});
        // What some keywords need beside them to be compiled at all.
        match keyword {
            "then" | "else" => schema["if"] = json!({}),
            "additionalItems" if !draft.contains("2020-12") => schema["items"] = json!([{}]),
            "contentSchema" => schema["contentMediaType"] = json!("application/json"),
            "minContains" | "maxContains" => schema["contains"] = json!({}),
            _ => {}
        }
        schema[keyword] = value;
        match jsonschema::options().offline().build(&schema) {
            Ok(_) => false,
            Err(e) => e.to_string().contains("'/nowhere' does not exist"),
        }
    }

    fn covers(shape: Shape, probe: Probe) -> bool {
        matches!(
            (shape, probe),
            (Shape::Refused(_), _)
                | (Shape::Schema, Probe::Single)
                | (Shape::SchemaList, Probe::Array)
                | (Shape::SchemaOrList, Probe::Single | Probe::Array)
                | (
                    Shape::SchemaMap | Shape::Definitions | Shape::SchemaOrNamesMap,
                    Probe::Map
                )
        )
    }

    /// The list and the validator cannot drift apart: in every draft, every keyword the
    /// validator compiles as a subschema (one, an array, a map of them) is on the list with
    /// that shape, or refused. A `jsonschema` upgrade that adds an applicator, or a list
    /// edit that drops one, fails here.
    #[test]
    fn every_keyword_the_validator_applies_is_on_the_list_with_its_shape() {
        let mut applied = Vec::new();
        let mut missing = Vec::new();
        for draft in DRAFTS {
            for keyword in universe() {
                for probe in [Probe::Single, Probe::Array, Probe::Map] {
                    if !validator_applies(draft, &keyword, probe) {
                        continue;
                    }
                    applied.push((keyword.clone(), probe));
                    if !shape(&keyword).is_some_and(|s| covers(s, probe)) {
                        missing.push(format!("{keyword} as {probe:?} in {draft}"));
                    }
                }
            }
        }
        assert!(
            missing.is_empty(),
            "the validator applies these, the list does not know them so: {missing:?}"
        );
        // The probe sees what it must (else the check above proves nothing).
        for (keyword, probe) in [
            ("not", Probe::Single),
            ("anyOf", Probe::Array),
            ("properties", Probe::Map),
            ("dependencies", Probe::Map),
            ("additionalItems", Probe::Single),
            ("unevaluatedProperties", Probe::Single),
            ("items", Probe::Array),
        ] {
            assert!(
                applied.contains(&(keyword.to_string(), probe)),
                "{keyword} {probe:?}: {applied:?}"
            );
        }
        // And what must not be: a keyword the list calls plain is never applied.
        for (keyword, shape) in KEYWORDS {
            if matches!(shape, Shape::Plain | Shape::Identifier) {
                assert!(
                    !applied.iter().any(|(k, _)| k == keyword),
                    "{keyword} is applied by the validator"
                );
            }
        }
    }

    #[test]
    fn unknown_keywords_may_hold_plain_values_only() {
        assert_eq!(check(&json!({"x-order": 3, "nullable": true}), ""), Ok(()));
        assert_eq!(
            check(
                &json!({"properties": {"a": {"x-rules": {"anyOf": []}}}}),
                ""
            ),
            Err(KeywordRefusal::Unknown {
                keyword: "x-rules".into(),
                pointer: "/properties/a".into()
            })
        );
        assert!(matches!(
            check(&json!({"$defs": {"d": {"unevaluatedProperties": false}}}), ""),
            Err(KeywordRefusal::Refused { pointer, .. }) if pointer == "/$defs/d"
        ));
        assert!(matches!(
            check(&json!({"items": {"$id": "urn:x"}}), ""),
            Err(KeywordRefusal::NestedIdentifier { pointer, .. }) if pointer == "/items"
        ));
        // Inside a plain value, anything goes: it is data, not a schema.
        assert_eq!(
            check(&json!({"enum": [{"anyOf": {}}], "default": {"x": [1]}}), ""),
            Ok(())
        );
        // A property named like a keyword is a property.
        assert_eq!(
            check(
                &json!({"properties": {"unevaluatedItems": {"type": "string"}}}),
                ""
            ),
            Ok(())
        );
    }

    #[test]
    fn reporting_pointers_follow_the_rewrite_of_any_of_and_one_of() {
        let root = json!({
            "anyOf": [{"type": "string"}, {"oneOf": [{"$ref": "#/$defs/a"}, {}]}],
            "$defs": {"a": {"anyOf": [{}, {"items": [{"anyOf": [{}]}]}]}},
            "enum": [{"anyOf": [1]}]
        });
        assert_eq!(reporting_pointer(&root, ""), "");
        assert_eq!(
            reporting_pointer(&root, "/anyOf/1/oneOf/0"),
            "/anyOf/0/not/not/anyOf/1/oneOf/0/not/not/oneOf/0"
        );
        assert_eq!(
            reporting_pointer(&root, "/$defs/a/anyOf/1/items/0/anyOf/0"),
            "/$defs/a/anyOf/0/not/not/anyOf/1/items/0/anyOf/0/not/not/anyOf/0"
        );
        assert_eq!(
            reporting_pointer(&root, "/enum/0/anyOf/0"),
            "/enum/0/anyOf/0"
        );
    }
}
