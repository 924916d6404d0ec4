//! The rules the control APIs (the proxy's and the executor's) enforce on
//! what a caller sends, stated once for the handlers that check them and
//! for the OpenAPI documents that publish them: the syntax of run and owner
//! ids, the lease bounds, the enums of the list filters, and integers that
//! arrive spelled as whole floats (`5100.0` is an integer to JSON Schema, so
//! a body field of type `integer` takes it). The `*_schema` functions are
//! what `#[schema(schema_with = ..)]` and `#[param(schema_with = ..)]` call.

use serde::{Deserialize, Deserializer};
use utoipa::openapi::schema::{Object, ObjectBuilder, SchemaType, Type};

/// Run ids and owner names: 1–[`ID_MAX`] characters of these (safe in a
/// URL's userinfo, in logs and as a Basic-auth user).
pub const ID_PATTERN: &str = "^[A-Za-z0-9._~-]+$";
pub const ID_MAX: usize = 128;

/// Whether `id` is a valid run id or owner name ([`ID_PATTERN`], [`ID_MAX`]).
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= ID_MAX
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~'))
}

/// What [`valid_id`] refuses, as the error message says it.
pub const ID_RULE: &str = "1-128 characters of A-Z a-z 0-9 - _ . ~";

/// An owner's lease, in milliseconds (`PUT /v1/owners/{owner}`).
pub const LEASE_MS_MIN: u64 = 1000;
pub const LEASE_MS_MAX: u64 = 600_000;

/// Labels of a run, at most.
pub const MAX_LABELS: usize = 64;

/// The states of a run (`RunView::state`, `GET /v1/runs?state=`).
pub const RUN_STATES: [&str; 3] = ["created", "active", "ended"];
/// The states of an invocation (`GET /v1/invocations?state=`).
pub const INVOCATION_STATES: [&str; 2] = ["running", "done"];

/// A page size: any non-negative integer a `usize` holds; the handlers
/// count 0 as 1 and anything above 1000 as 1000.
pub const LIMIT_MAX: u64 = usize::MAX as u64;

fn typed(types: &[Type]) -> ObjectBuilder {
    let t = match types {
        [one] => SchemaType::Type(one.clone()),
        many => SchemaType::Array(many.to_vec()),
    };
    ObjectBuilder::new().schema_type(t)
}

fn nullable(t: Type, optional: bool) -> ObjectBuilder {
    if optional {
        typed(&[t, Type::Null])
    } else {
        typed(&[t])
    }
}

/// An optional run id or owner name, described by `what`.
fn optional_id(what: &str) -> Object {
    nullable(Type::String, true)
        .pattern(Some(ID_PATTERN))
        .min_length(Some(1))
        .max_length(Some(ID_MAX))
        .description(Some(format!("{what} ({ID_RULE}).")))
        .build()
}

/// `run_id` of `POST /v1/runs`.
pub fn run_id_schema() -> Object {
    optional_id("The kernel's own id for the run; a UUID when absent")
}

/// `owner` of `POST /v1/runs`.
pub fn owner_schema() -> Object {
    optional_id("Who creates the run; it must hold a lease (`PUT /v1/owners/{owner}`)")
}

/// `run_id` of `POST /v1/invocations`.
pub fn invocation_run_id_schema() -> Object {
    optional_id(
        "The run's id on the proxy, for a dedicated cold child (a warm child's run when absent); \
         an id the proxy has (live, or ended in the last five minutes) is refused",
    )
}

/// A string among `values` (a query parameter is absent, never `null`).
fn one_of(values: &[&str], description: &str) -> Object {
    typed(&[Type::String])
        .enum_values(Some(values.iter().copied()))
        .description(Some(description))
        .build()
}

/// `RunView::state`.
pub fn run_state_schema() -> Object {
    one_of(&RUN_STATES, "`created`, `active` or `ended`.")
}

/// `GET /v1/runs?state=`.
pub fn run_state_filter_schema() -> Object {
    one_of(&RUN_STATES, "Only runs in this state.")
}

/// `GET /v1/invocations?state=`.
pub fn invocation_state_filter_schema() -> Object {
    one_of(&INVOCATION_STATES, "Only running or only finished invocations.")
}

/// `labels` of `POST /v1/runs`.
pub fn labels_schema() -> Object {
    nullable(Type::Object, true)
        .max_properties(Some(MAX_LABELS))
        .description(Some(format!(
            "Up to {MAX_LABELS} labels (e.g. the kernel's id), returned in views and usable as a filter."
        )))
        .build()
}

/// Executables of a run, at most ([`valid_executables`]).
pub const MAX_EXECUTABLES: usize = 16;

/// Whether `e` is a valid `executables` map: at most [`MAX_EXECUTABLES`]
/// absolute paths of at most 4096 bytes, each to 64 lowercase hex digits.
pub fn valid_executables(e: &std::collections::BTreeMap<String, String>) -> bool {
    e.len() <= MAX_EXECUTABLES
        && e.iter().all(|(path, digest)| {
            path.starts_with('/')
                && path.len() <= 4096
                && digest.len() == 64
                && digest.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        })
}

/// `executables` of `POST /v1/runs`.
pub fn executables_schema() -> Object {
    nullable(Type::Object, true)
        .max_properties(Some(MAX_EXECUTABLES))
        .property_names(Some(
            typed(&[Type::String])
                .pattern(Some("^/"))
                .max_length(Some(4096))
                .build(),
        ))
        .additional_properties(Some(utoipa::openapi::schema::AdditionalProperties::RefOr(
            utoipa::openapi::RefOr::T(utoipa::openapi::Schema::Object(
                typed(&[Type::String]).pattern(Some("^[0-9a-f]{64}$")).build(),
            )),
        )))
        .description(Some(format!(
            "What the run's child executes: up to {MAX_EXECUTABLES} absolute paths, each to its lowercase hex SHA-256."
        )))
        .build()
}

/// Integers of request bodies that also take a whole float (`5100.0`): JSON
/// Schema's `integer` includes them, and clients that compute a value in
/// floating point (Python's `5.1 * 1000`) send them.
pub mod whole {
    use super::*;

    struct U64;

    impl serde::de::Visitor<'_> for U64 {
        type Value = u64;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a non-negative integer")
        }

        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }

        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<u64, E> {
            u64::try_from(v).map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
        }

        fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<u64, E> {
            // 2^64 is the first float past u64::MAX.
            if v.fract() == 0.0 && (0.0..18_446_744_073_709_551_616.0).contains(&v) {
                Ok(v as u64)
            } else {
                Err(E::invalid_value(serde::de::Unexpected::Float(v), &self))
            }
        }
    }

    /// A `u64` field (`#[serde(deserialize_with = "whole::u64")]`).
    pub fn u64<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        d.deserialize_any(U64)
    }

    /// An optional `u64` field (with `#[serde(default)]`): absent or `null`
    /// is `None`.
    pub fn option_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        #[derive(Deserialize)]
        struct Whole(#[serde(deserialize_with = "u64")] u64);
        Ok(Option::<Whole>::deserialize(d)?.map(|w| w.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_1_to_128_safe_characters() {
        assert!(valid_id("run-1.A_b~"));
        for bad in ["", "a b", "a/b", "a:b", "a@b", "é", "a\n"] {
            assert!(!valid_id(bad), "{bad:?}");
        }
        assert!(valid_id(&"a".repeat(128)));
        assert!(!valid_id(&"a".repeat(129)));
    }

    #[derive(Debug, Deserialize)]
    struct Body {
        #[serde(deserialize_with = "whole::u64")]
        n: u64,
        #[serde(default, deserialize_with = "whole::option_u64")]
        o: Option<u64>,
    }

    fn parse(s: &str) -> Result<Body, String> {
        serde_json::from_str(s).map_err(|e| e.to_string())
    }

    #[test]
    fn integers_take_whole_floats_and_nothing_else() {
        let b = parse(r#"{"n": 5100.0, "o": 7}"#).unwrap();
        assert_eq!((b.n, b.o), (5100, Some(7)));
        let b = parse(r#"{"n": 18446744073709551615}"#).unwrap();
        assert_eq!((b.n, b.o), (u64::MAX, None));
        assert_eq!(parse(r#"{"n": 1, "o": null}"#).unwrap().o, None);
        assert_eq!(parse(r#"{"n": 1, "o": 2.0}"#).unwrap().o, Some(2));
        for bad in [
            r#"{"n": 5100.5}"#,
            r#"{"n": -1}"#,
            r#"{"n": -1.0}"#,
            r#"{"n": 1e30}"#,
            r#"{"n": "5"}"#,
            r#"{"n": null}"#,
            r#"{"n": 1, "o": 0.5}"#,
        ] {
            let e = parse(bad).unwrap_err();
            assert!(
                e.contains("non-negative integer") || e.contains("invalid type"),
                "{bad}: {e}"
            );
        }
    }
}
