//! Checks requests and answers against an OpenAPI 3.1 document: finds the
//! operation of a method and concrete path, and validates JSON bodies
//! against its schemas. A validator for the subset of JSON Schema the
//! proxy's generated document uses (`$ref`, `type` including type arrays
//! with `null`, `properties`, `required`, `items`, `allOf`, `oneOf`,
//! `additionalProperties`, `enum`), strict about what it checks.

use serde_json::Value;

/// An OpenAPI document.
pub struct Spec {
    doc: Value,
}

/// The operation for one request.
pub struct Operation<'a> {
    spec: &'a Spec,
    pub template: String,
    op: &'a Value,
}

impl Spec {
    pub fn new(doc: Value) -> Spec {
        Spec { doc }
    }

    pub fn doc(&self) -> &Value {
        &self.doc
    }

    /// Every `(METHOD, path template)` the document has, by path.
    pub fn operations(&self) -> Vec<(String, String)> {
        let mut v = vec![];
        for (path, item) in self.doc["paths"].as_object().into_iter().flatten() {
            for method in item.as_object().into_iter().flatten().map(|(m, _)| m) {
                v.push((method.to_uppercase(), path.clone()));
            }
        }
        v.sort_by(|a, b| (&a.1, &a.0).cmp(&(&b.1, &b.0)));
        v
    }

    /// The operation `method` on a concrete `path` (query string ignored).
    pub fn operation(&self, method: &str, path: &str) -> Option<Operation<'_>> {
        let path = path.split('?').next().unwrap_or(path);
        let paths = self.doc["paths"].as_object()?;
        for (template, item) in paths {
            if matches_template(template, path) {
                let op = item.get(method.to_lowercase())?;
                return Some(Operation {
                    spec: self,
                    template: template.clone(),
                    op,
                });
            }
        }
        None
    }

    fn resolve<'a>(&'a self, schema: &'a Value) -> &'a Value {
        match schema.get("$ref").and_then(Value::as_str) {
            Some(r) => {
                let name = r.trim_start_matches("#/components/schemas/");
                &self.doc["components"]["schemas"][name]
            }
            None => schema,
        }
    }

    /// Problems of `value` against `schema`; empty when it validates. An
    /// object member the schema does not declare is a problem too (the
    /// document must describe everything the API sends).
    pub fn check(&self, schema: &Value, value: &Value, at: &str) -> Vec<String> {
        self.check_inner(schema, value, at, false)
    }

    /// Properties `schema` declares, through `allOf`.
    fn declared(&self, schema: &Value) -> Vec<String> {
        let schema = self.resolve(schema);
        let mut v: Vec<String> = schema
            .get("properties")
            .and_then(Value::as_object)
            .map(|p| p.keys().cloned().collect())
            .unwrap_or_default();
        for s in schema.get("allOf").and_then(Value::as_array).into_iter().flatten() {
            v.extend(self.declared(s));
        }
        v
    }

    fn check_inner(&self, schema: &Value, value: &Value, at: &str, allow_extra: bool) -> Vec<String> {
        let schema = self.resolve(schema);
        let mut out = vec![];
        if let Some(all) = schema.get("allOf").and_then(Value::as_array) {
            for s in all {
                out.extend(self.check_inner(s, value, at, true));
            }
            if let (Value::Object(obj), false) = (value, allow_extra) {
                let known = self.declared(schema);
                for k in obj.keys().filter(|k| !known.contains(k)) {
                    out.push(format!("{at}: `{k}` is not in the schema"));
                }
            }
        }
        if let Some(any) = schema
            .get("oneOf")
            .or_else(|| schema.get("anyOf"))
            .and_then(Value::as_array)
        {
            if !any
                .iter()
                .any(|s| self.check_inner(s, value, at, allow_extra).is_empty())
            {
                out.push(format!("{at}: matches none of oneOf/anyOf"));
            }
        }
        if let Some(t) = schema.get("type") {
            let types: Vec<&str> = match t {
                Value::String(s) => vec![s.as_str()],
                Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
                _ => vec![],
            };
            if !types.iter().any(|t| type_matches(t, value)) {
                out.push(format!("{at}: {value} is not of type {types:?}"));
                return out;
            }
        }
        if let Some(e) = schema.get("enum").and_then(Value::as_array) {
            if !e.contains(value) {
                out.push(format!("{at}: {value} is not one of {e:?}"));
            }
        }
        if let Value::Object(obj) = value {
            let props = schema.get("properties").and_then(Value::as_object);
            for req in schema.get("required").and_then(Value::as_array).into_iter().flatten() {
                if let Some(k) = req.as_str() {
                    if !obj.contains_key(k) {
                        out.push(format!("{at}: missing required `{k}`"));
                    }
                }
            }
            for (k, v) in obj {
                match props.and_then(|p| p.get(k)) {
                    Some(s) => out.extend(self.check(s, v, &format!("{at}.{k}"))),
                    None if props.is_some() && !allow_extra && schema.get("allOf").is_none() => {
                        out.push(format!("{at}: `{k}` is not in the schema"));
                    }
                    None => {}
                }
            }
        }
        if let (Value::Array(items), Some(s)) = (value, schema.get("items")) {
            for (i, v) in items.iter().enumerate() {
                out.extend(self.check(s, v, &format!("{at}[{i}]")));
            }
        }
        out
    }
}

fn type_matches(t: &str, v: &Value) -> bool {
    match t {
        "null" => v.is_null(),
        "boolean" => v.is_boolean(),
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        _ => false,
    }
}

fn matches_template(template: &str, path: &str) -> bool {
    let t: Vec<&str> = template.split('/').collect();
    let p: Vec<&str> = path.split('/').collect();
    t.len() == p.len()
        && t.iter()
            .zip(&p)
            .all(|(a, b)| (a.starts_with('{') && a.ends_with('}') && !b.is_empty()) || a == b)
}

impl Operation<'_> {
    /// Problems of a request body against the operation's request schema.
    pub fn check_request(&self, body: &Value) -> Vec<String> {
        match self.op["requestBody"]["content"]["application/json"].get("schema") {
            Some(s) => self.spec.check(s, body, "request"),
            None => vec![format!("{} takes no JSON body", self.template)],
        }
    }

    /// Whether the operation documents `status`.
    pub fn documents(&self, status: u16) -> bool {
        self.op["responses"].get(status.to_string()).is_some()
    }

    /// Problems of an answer against the schema documented for its status.
    pub fn check_response(&self, status: u16, body: &Value) -> Vec<String> {
        let r = &self.op["responses"][status.to_string()];
        if r.is_null() {
            return vec![format!("{} does not document status {status}", self.template)];
        }
        match r["content"]["application/json"].get("schema") {
            Some(s) => self.spec.check(s, body, &format!("response {status}")),
            None => vec![],
        }
    }
}
