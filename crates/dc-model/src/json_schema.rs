//! JSON schemas for constrained output: the part of JSON Schema a recogniser can enforce one
//! byte at a time, compiled into a tree of nodes.
//!
//! [`Schema::parse`] takes `type` (one name or a list of `object`, `array`, `string`,
//! `number`, `integer`, `boolean`, `null`), `enum` and `const`, `properties`, `required`,
//! `additionalProperties` (a key outside `properties` is allowed only when it is `true` or a
//! schema, or when the object lists no properties at all), `items`, `minItems` and `maxItems`.
//! Annotations (`title`, `description`, `default`, `examples`, `format`, ...) are ignored;
//! any other keyword is refused by name, so that a schema is never enforced only in part. A
//! document the recogniser completes always validates against the schema as written.
//!
//! Every node knows its shortest valid text, which is what the budget of a generation counts
//! to close a document in time.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::error::{ModelError, Result};

pub use dc_types::MAX_SCHEMA_BYTES;
/// Most properties one object may list (a written key is a bit of one integer).
pub const MAX_PROPERTIES: usize = 64;
/// Most nodes (subschemas) a schema may have.
const MAX_NODES: usize = 4096;
/// Deepest nesting of subschemas.
const MAX_NESTING: usize = 32;
/// Longest shortest text a node may have (a `minItems` inside a `minItems` multiplies).
const MAX_SHORTEST: usize = 4096;

/// Node index; [`ANY`] is the schema that takes every value.
pub(crate) type NodeId = u32;
/// The node that takes any JSON value.
pub(crate) const ANY: NodeId = 0;

/// The value types, as bits of [`Node::types`].
pub(crate) mod kind {
    pub const STRING: u8 = 1;
    pub const NUMBER: u8 = 2;
    pub const INTEGER: u8 = 4;
    pub const BOOLEAN: u8 = 8;
    pub const NULL: u8 = 16;
    pub const OBJECT: u8 = 32;
    pub const ARRAY: u8 = 64;
    pub const ALL: u8 = 127;
    pub const NAMES: [(&str, u8); 7] = [
        ("string", STRING),
        ("number", NUMBER),
        ("integer", INTEGER),
        ("boolean", BOOLEAN),
        ("null", NULL),
        ("object", OBJECT),
        ("array", ARRAY),
    ];
}

/// One listed property of an object.
#[derive(Clone, Debug)]
pub(crate) struct Property {
    /// The key as JSON writes it between its quotes (`serde_json`'s escapes).
    pub name: Box<[u8]>,
    pub node: NodeId,
    pub required: bool,
}

/// One subschema.
#[derive(Clone, Debug)]
pub(crate) struct Node {
    /// Which types a value may have (bits of [`kind`]).
    pub types: u8,
    /// With `enum` or `const`: the values allowed, as compact JSON, sorted bytewise (so the
    /// values sharing a written prefix are a range). Empty: any value of `types`.
    pub literals: Vec<Box<[u8]>>,
    /// The listed properties, sorted bytewise by name.
    pub properties: Vec<Property>,
    /// Bit i: whether `properties[i]` is required.
    pub required: u64,
    /// The schema of any other key's value; none: no other keys.
    pub extra: Option<NodeId>,
    /// The shortest key outside `properties` (`""`, else `"0"`, `"00"`, ...), which the
    /// closing of an object that must take one more key writes.
    pub free_key: Box<[u8]>,
    pub items: NodeId,
    pub min_items: u32,
    pub max_items: u32,
    /// The shortest text of a valid value.
    pub shortest: Box<[u8]>,
}

impl Node {
    fn any() -> Node {
        Node {
            types: kind::ALL,
            literals: Vec::new(),
            properties: Vec::new(),
            required: 0,
            extra: Some(ANY),
            free_key: Box::default(),
            items: ANY,
            min_items: 0,
            max_items: u32::MAX,
            shortest: Box::from(&b"0"[..]),
        }
    }

    /// The length of `"name":` and the shortest value of property `i`.
    pub fn entry_len(&self, i: usize, nodes: &[Node]) -> usize {
        let p = &self.properties[i];
        p.name.len() + 3 + nodes[p.node as usize].shortest.len()
    }
}

/// A compiled JSON schema.
#[derive(Clone, Debug)]
pub struct Schema {
    nodes: Vec<Node>,
    root: NodeId,
}

/// Keywords that only describe a value, and so constrain nothing.
const ANNOTATIONS: [&str; 11] = [
    "title",
    "description",
    "default",
    "examples",
    "format",
    "$schema",
    "$id",
    "$comment",
    "readOnly",
    "writeOnly",
    "deprecated",
];

impl Schema {
    /// Any JSON object (JSON mode without a schema).
    pub fn any_object() -> Schema {
        let mut root = Node::any();
        root.types = kind::OBJECT;
        root.shortest = Box::from(&b"{}"[..]);
        Schema {
            nodes: vec![Node::any(), root],
            root: 1,
        }
    }

    /// The schema `format` asks the output to follow (none: free text).
    pub fn for_format(format: &dc_types::OutputFormat) -> Result<Option<Schema>> {
        Ok(match format {
            dc_types::OutputFormat::Text => None,
            dc_types::OutputFormat::JsonObject => Some(Schema::any_object()),
            dc_types::OutputFormat::JsonSchema(text) => Some(Schema::from_text(text)?),
        })
    }

    /// Compiles the schema in `text` (JSON), which must describe an object or an array.
    pub fn from_text(text: &str) -> Result<Schema> {
        if text.len() > MAX_SCHEMA_BYTES {
            return Err(ModelError::Input(format!(
                "JSON schema: {} bytes, at most {MAX_SCHEMA_BYTES}",
                text.len()
            )));
        }
        let v: Value = serde_json::from_str(text)
            .map_err(|e| ModelError::Input(format!("JSON schema: not JSON: {e}")))?;
        Schema::parse(&v)
    }

    /// Compiles `schema`, which must describe an object or an array (so that a document ends
    /// with its last character).
    pub fn parse(schema: &Value) -> Result<Schema> {
        let mut nodes = vec![Node::any()];
        let root = compile(schema, "schema", 0, &mut nodes)
            .map_err(|e| ModelError::Input(format!("JSON schema: {e}")))?;
        let r = &nodes[root as usize];
        if r.types & !(kind::OBJECT | kind::ARRAY) != 0 || !r.literals.is_empty() {
            return Err(ModelError::Input(
                "JSON schema: the top level must be \"type\": \"object\" or \"array\"".into(),
            ));
        }
        Ok(Schema { nodes, root })
    }

    /// The length of the shortest document: a budget of fewer new tokens cannot hold one
    /// (the budget counts a token per character).
    pub fn shortest_document_len(&self) -> usize {
        self.node(self.root).shortest.len()
    }

    pub(crate) fn root(&self) -> NodeId {
        self.root
    }

    pub(crate) fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    pub(crate) fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Every character a shortest closing may have to write: the structural ones, the
    /// letters of `true`, `false` and `null`, and those of every key and literal.
    pub(crate) fn closing_chars(&self) -> BTreeSet<char> {
        let mut chars: BTreeSet<char> = "{}[]\":,0nrueals".chars().collect();
        for n in &self.nodes {
            let texts = n
                .literals
                .iter()
                .chain(n.properties.iter().map(|p| &p.name))
                .chain(std::iter::once(&n.shortest));
            for t in texts {
                chars.extend(String::from_utf8_lossy(t).chars());
            }
        }
        chars
    }
}

fn compact(v: &Value) -> Box<[u8]> {
    serde_json::to_vec(v).unwrap_or_default().into_boxed_slice()
}

/// Whether `v` has one of the types `types`.
fn has_type(v: &Value, types: u8) -> bool {
    let bit = match v {
        Value::Null => kind::NULL,
        Value::Bool(_) => kind::BOOLEAN,
        Value::Number(n) if n.is_i64() || n.is_u64() => kind::INTEGER | kind::NUMBER,
        Value::Number(_) => kind::NUMBER,
        Value::String(_) => kind::STRING,
        Value::Array(_) => kind::ARRAY,
        Value::Object(_) => kind::OBJECT,
    };
    types & bit != 0
}

fn count(v: &Value, at: &str) -> std::result::Result<u32, String> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| format!("{at} must be a non-negative integer, not {v}"))
}

/// Compiles the subschema `v` at `at` (a path for errors) into `nodes`, returning its id.
fn compile(
    v: &Value,
    at: &str,
    nesting: usize,
    nodes: &mut Vec<Node>,
) -> std::result::Result<NodeId, String> {
    if nesting > MAX_NESTING {
        return Err(format!("{at}: nested deeper than {MAX_NESTING}"));
    }
    if nodes.len() >= MAX_NODES {
        return Err(format!("more than {MAX_NODES} subschemas"));
    }
    let obj = match v {
        Value::Bool(true) => return Ok(ANY),
        Value::Bool(false) => return Err(format!("{at} is false: no value could match")),
        Value::Object(o) => o,
        other => return Err(format!("{at} must be an object or a boolean, not {other}")),
    };
    let mut node = Node::any();
    node.extra = None;
    let mut seen_properties = false;
    for (key, value) in obj {
        let here = format!("{at}.{key}");
        match key.as_str() {
            "type" => {
                let names: Vec<&Value> = match value {
                    Value::Array(a) => a.iter().collect(),
                    one => vec![one],
                };
                node.types = 0;
                for name in names {
                    let bit = kind::NAMES
                        .iter()
                        .find(|(n, _)| Some(*n) == name.as_str())
                        .map(|&(_, b)| b)
                        .ok_or_else(|| format!("{here}: unknown type {name}"))?;
                    node.types |= bit;
                }
                if node.types == 0 {
                    return Err(format!("{here} is empty"));
                }
            }
            "enum" | "const" => {
                let values = match (key.as_str(), value) {
                    ("enum", Value::Array(a)) if !a.is_empty() => a.clone(),
                    ("enum", _) => return Err(format!("{here} must be a non-empty array")),
                    _ => vec![value.clone()],
                };
                let mut lits: Vec<Box<[u8]>> = values.iter().map(compact).collect();
                if !node.literals.is_empty() {
                    // Both enum and const: only the values in both.
                    lits.retain(|l| node.literals.contains(l));
                }
                node.literals = lits;
            }
            "properties" => {
                let Value::Object(props) = value else {
                    return Err(format!("{here} must be an object"));
                };
                if props.len() > MAX_PROPERTIES {
                    return Err(format!(
                        "{here} lists {} properties, at most {MAX_PROPERTIES}",
                        props.len()
                    ));
                }
                seen_properties = true;
                for (name, sub) in props {
                    let child = compile(sub, &format!("{here}.{name}"), nesting + 1, nodes)?;
                    let quoted = compact(&Value::String(name.clone()));
                    node.properties.push(Property {
                        name: quoted[1..quoted.len() - 1].into(),
                        node: child,
                        required: false,
                    });
                }
                node.properties.sort_by(|a, b| a.name.cmp(&b.name));
            }
            "additionalProperties" => {
                node.extra = match value {
                    Value::Bool(false) => None,
                    sub => Some(compile(sub, &here, nesting + 1, nodes)?),
                };
            }
            "items" => node.items = compile(value, &here, nesting + 1, nodes)?,
            "minItems" => node.min_items = count(value, &here)?,
            "maxItems" => node.max_items = count(value, &here)?,
            "required" => {}
            k if ANNOTATIONS.contains(&k) => {}
            k => return Err(format!("{at}: the keyword {k:?} is not supported")),
        }
    }
    // Keys outside `properties` only where the schema says so, or lists no properties.
    if !seen_properties && !obj.contains_key("additionalProperties") {
        node.extra = Some(ANY);
    }
    if let Some(req) = obj.get("required") {
        let Value::Array(names) = req else {
            return Err(format!("{at}.required must be an array of names"));
        };
        for name in names {
            let quoted = name
                .as_str()
                .map(|s| compact(&Value::String(s.to_string())))
                .ok_or_else(|| format!("{at}.required: {name} is not a name"))?;
            let i = node
                .properties
                .iter()
                .position(|p| *p.name == quoted[1..quoted.len() - 1])
                .ok_or_else(|| format!("{at}.required: {name} is not in properties"))?;
            node.properties[i].required = true;
            node.required |= 1 << i;
        }
    }
    node.free_key = (0..=node.properties.len())
        .map(|n| vec![b'0'; n])
        .find(|k| node.properties.iter().all(|p| *p.name != k[..]))
        .unwrap_or_default()
        .into();
    if node.min_items > node.max_items {
        return Err(format!(
            "{at}: minItems {} is above maxItems {}",
            node.min_items, node.max_items
        ));
    }
    if !node.literals.is_empty() || obj.contains_key("enum") || obj.contains_key("const") {
        node.literals
            .retain(|l| serde_json::from_slice(l).is_ok_and(|v: Value| has_type(&v, node.types)));
        if node.literals.is_empty() {
            return Err(format!(
                "{at}: no value of enum or const has the schema's type"
            ));
        }
        node.literals.sort();
        node.literals.dedup();
    }
    node.shortest = shortest(&node, nodes);
    if node.shortest.len() > MAX_SHORTEST {
        return Err(format!(
            "{at}: its shortest value has {} characters, at most {MAX_SHORTEST}",
            node.shortest.len()
        ));
    }
    nodes.push(node);
    Ok(nodes.len() as NodeId - 1)
}

/// The shortest text of a value of `node` (its children compiled already).
fn shortest(node: &Node, nodes: &[Node]) -> Box<[u8]> {
    if let Some(l) = node.literals.iter().min_by_key(|l| l.len()) {
        return l.clone();
    }
    let mut options: Vec<Vec<u8>> = Vec::new();
    let t = node.types;
    if t & (kind::NUMBER | kind::INTEGER) != 0 {
        options.push(b"0".to_vec());
    }
    if t & kind::STRING != 0 {
        options.push(b"\"\"".to_vec());
    }
    if t & kind::NULL != 0 {
        options.push(b"null".to_vec());
    }
    if t & kind::BOOLEAN != 0 {
        options.push(b"true".to_vec());
    }
    if t & kind::OBJECT != 0 {
        let mut o = b"{".to_vec();
        for (i, p) in node.properties.iter().filter(|p| p.required).enumerate() {
            if i > 0 {
                o.push(b',');
            }
            o.push(b'"');
            o.extend_from_slice(&p.name);
            o.extend_from_slice(b"\":");
            o.extend_from_slice(&nodes[p.node as usize].shortest);
        }
        o.push(b'}');
        options.push(o);
    }
    if t & kind::ARRAY != 0 {
        let mut a = b"[".to_vec();
        let item = &nodes[node.items as usize].shortest;
        for i in 0..node.min_items.min(MAX_SHORTEST as u32) {
            if i > 0 {
                a.push(b',');
            }
            a.extend_from_slice(item);
            if a.len() > MAX_SHORTEST {
                break;
            }
        }
        a.push(b']');
        options.push(a);
    }
    options
        .into_iter()
        .min_by_key(Vec::len)
        .unwrap_or_default()
        .into_boxed_slice()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn refused(v: Value, what: &str) {
        let e = Schema::parse(&v).expect_err("refused").to_string();
        assert!(e.contains(what), "{e} should name {what}");
    }

    #[test]
    fn a_schema_compiles_with_its_shortest_texts() {
        let s = Schema::parse(&json!({
            "type": "object",
            "title": "a person",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "tags": {"type": "array", "items": {"enum": ["x", "yy"]}, "minItems": 2},
                "pet": {"type": ["object", "null"], "properties": {"kind": {"const": "cat"}}},
            },
            "required": ["name", "tags"],
        }))
        .expect("a schema");
        let root = s.node(s.root());
        let names: Vec<&[u8]> = root.properties.iter().map(|p| &p.name[..]).collect();
        assert_eq!(names, [&b"age"[..], b"name", b"pet", b"tags"]);
        assert_eq!(root.required, 0b1010);
        assert!(root.extra.is_none(), "listed properties only");
        assert_eq!(&*root.shortest, br#"{"name":"","tags":["x","x"]}"#);
        let pet = s.node(root.properties[2].node);
        assert_eq!(&*pet.shortest, b"{}");
        assert_eq!(pet.types, kind::OBJECT | kind::NULL);
    }

    #[test]
    fn what_cannot_be_enforced_is_refused_by_name() {
        refused(json!({"type": "string"}), "top level");
        refused(
            json!({"type": "object", "properties": {"a": {"pattern": "x+"}}}),
            "pattern",
        );
        refused(json!({"type": "object", "anyOf": []}), "anyOf");
        refused(
            json!({"type": "object", "required": ["b"]}),
            "not in properties",
        );
        refused(
            json!({"type": "array", "minItems": 3, "maxItems": 1}),
            "minItems",
        );
        refused(
            json!({"type": "array", "items": {"type": "date"}}),
            "unknown type",
        );
        refused(
            json!({"type": "array", "items": {"type": "string", "enum": [1]}}),
            "enum",
        );
        refused(json!({"type": "array", "items": false}), "false");
        refused(json!({"type": "array", "minItems": -1}), "minItems");
        let mut deep = json!({"type": "array"});
        for _ in 0..40 {
            deep = json!({"type": "array", "items": deep});
        }
        refused(deep, "nested");
        let props: serde_json::Map<String, Value> =
            (0..65).map(|i| (format!("k{i}"), json!({}))).collect();
        refused(json!({"type": "object", "properties": props}), "at most 64");
        refused(
            json!({"type": "array", "items": {"type": "array", "minItems": 100, "items": {"type": "array", "minItems": 100}}, "minItems": 100}),
            "shortest",
        );
        assert!(Schema::from_text("{").is_err());
    }

    #[test]
    fn objects_without_listed_properties_take_any_key() {
        let s = Schema::parse(&json!({"type": "object"})).unwrap();
        assert_eq!(s.node(s.root()).extra, Some(ANY));
        let s =
            Schema::parse(&json!({"type": "object", "additionalProperties": {"type": "number"}}))
                .unwrap();
        let extra = s.node(s.root()).extra.expect("other keys");
        assert_eq!(s.node(extra).types, kind::NUMBER);
        let s = Schema::parse(
            &json!({"type": "object", "properties": {}, "additionalProperties": false}),
        )
        .unwrap();
        assert_eq!(s.node(s.root()).extra, None);
    }
}
