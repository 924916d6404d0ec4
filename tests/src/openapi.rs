//! Checks requests and answers against an OpenAPI 3.1 document: finds the
//! operation of a method and concrete path, and validates JSON bodies and
//! path and query parameters against its schemas. A validator for the
//! subset of JSON Schema the generated documents use (`$ref`, `type`
//! including type arrays with `null`, `properties`, `required`, `items`,
//! `allOf`, `oneOf`, `additionalProperties`, `enum`, `pattern`,
//! `minLength`/`maxLength`, `minimum`/`maximum`, `maxProperties`,
//! `maxItems`), strict about what it checks.

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
    /// document must describe everything the API sends), unless the schema
    /// says `additionalProperties: true` (an object described only in part,
    /// such as an OCSF event).
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
        out.extend(bounds(schema, value, at));
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
                    None if props.is_some()
                        && !allow_extra
                        && schema.get("allOf").is_none()
                        && schema.get("additionalProperties") != Some(&Value::Bool(true)) =>
                    {
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

/// Problems of `value` with the bounds of `schema` (lengths, pattern,
/// minimum and maximum, properties and items at most).
fn bounds(schema: &Value, value: &Value, at: &str) -> Vec<String> {
    let mut out = vec![];
    let num = |k: &str| schema.get(k).filter(|v| v.is_number());
    match value {
        Value::String(s) => {
            let chars = s.chars().count() as u64;
            if schema["minLength"].as_u64().is_some_and(|m| chars < m) {
                out.push(format!(
                    "{at}: {value} is shorter than minLength {}",
                    schema["minLength"]
                ));
            }
            if schema["maxLength"].as_u64().is_some_and(|m| chars > m) {
                out.push(format!(
                    "{at}: {value} is longer than maxLength {}",
                    schema["maxLength"]
                ));
            }
            if let Some(p) = schema["pattern"].as_str() {
                let re = regex::Regex::new(p).unwrap_or_else(|e| panic!("{at}: pattern {p:?}: {e}"));
                if !re.is_match(s) {
                    out.push(format!("{at}: {value} does not match pattern {p:?}"));
                }
            }
        }
        Value::Number(n) => {
            if let Some(m) = num("minimum") {
                if compare(n, m.as_number().unwrap_or(n)).is_lt() {
                    out.push(format!("{at}: {value} is below minimum {m}"));
                }
            }
            if let Some(m) = num("maximum") {
                if compare(n, m.as_number().unwrap_or(n)).is_gt() {
                    out.push(format!("{at}: {value} is above maximum {m}"));
                }
            }
        }
        Value::Array(a) if schema["maxItems"].as_u64().is_some_and(|m| a.len() as u64 > m) => {
            out.push(format!("{at}: more than maxItems {} items", schema["maxItems"]));
        }
        Value::Object(o) if schema["maxProperties"].as_u64().is_some_and(|m| o.len() as u64 > m) => {
            out.push(format!(
                "{at}: more than maxProperties {} members",
                schema["maxProperties"]
            ));
        }
        _ => {}
    }
    out
}

/// Two JSON numbers in order, exactly for integers of either sign.
fn compare(a: &serde_json::Number, b: &serde_json::Number) -> std::cmp::Ordering {
    let int = |n: &serde_json::Number| n.as_i64().map(i128::from).or_else(|| n.as_u64().map(i128::from));
    match (int(a), int(b)) {
        (Some(x), Some(y)) => x.cmp(&y),
        _ => {
            let f = |n: &serde_json::Number| n.as_f64().unwrap_or(f64::NAN);
            f(a).partial_cmp(&f(b)).unwrap_or(std::cmp::Ordering::Equal)
        }
    }
}

fn type_matches(t: &str, v: &Value) -> bool {
    match t {
        "null" => v.is_null(),
        "boolean" => v.is_boolean(),
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        // JSON Schema counts a whole float (`2.0`) as an integer.
        "integer" => v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0),
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

/// `%XX` escapes and `+` of a query string decoded (invalid ones kept).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A parameter's text as the JSON value its schema describes: a number
/// for `integer`, else the string.
fn param_value(schema: &Value, text: &str) -> Value {
    let integer = match &schema["type"] {
        Value::String(t) => t == "integer",
        Value::Array(a) => a.iter().any(|t| t == "integer"),
        _ => false,
    };
    if integer {
        if let Ok(n) = text.parse::<serde_json::Number>() {
            return Value::Number(n);
        }
    }
    Value::String(text.to_owned())
}

impl Operation<'_> {
    /// Problems of the path and query parameters of `path` (a concrete
    /// path with its query string): each against its schema, required ones
    /// present, none the document does not list.
    pub fn check_params(&self, path: &str) -> Vec<String> {
        let (path, query) = path.split_once('?').unwrap_or((path, ""));
        let params: Vec<&Value> = self.op["parameters"].as_array().into_iter().flatten().collect();
        let find = |name: &str, place: &str| params.iter().find(|p| p["name"] == name && p["in"] == place);
        let mut out = vec![];
        for (t, v) in self.template.split('/').zip(path.split('/')) {
            if let Some(name) = t.strip_prefix('{').and_then(|t| t.strip_suffix('}')) {
                match find(name, "path") {
                    Some(p) => {
                        let v = param_value(&p["schema"], &percent_decode(v));
                        out.extend(self.spec.check(&p["schema"], &v, &format!("path {name}")));
                    }
                    None => out.push(format!("{}: path parameter {name} is not documented", self.template)),
                }
            }
        }
        let mut seen = vec![];
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let (k, v) = (percent_decode(k), percent_decode(v));
            match find(&k, "query") {
                Some(p) => {
                    let v = param_value(&p["schema"], &v);
                    out.extend(self.spec.check(&p["schema"], &v, &format!("query {k}")));
                }
                None => out.push(format!("{}: query parameter {k} is not documented", self.template)),
            }
            seen.push(k);
        }
        for p in &params {
            let name = p["name"].as_str().unwrap_or_default();
            if p["in"] == "query" && p["required"] == true && !seen.iter().any(|k| k == name) {
                out.push(format!("{}: required query parameter {name} is missing", self.template));
            }
        }
        out
    }

    /// Whether the operation requires a body.
    pub fn requires_body(&self) -> bool {
        self.op["requestBody"]["required"] == true
    }

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
