//! Reading one TOML table key by key while collecting problems: a value of
//! the wrong type, a number out of range, a missing required key and every
//! key nobody asked for each become one [`Problem`] named by its key path, and
//! reading goes on with the default, so one pass reports everything.

use crate::Problem;
use serde::de::DeserializeOwned;
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::time::Duration;

/// The problems of one file, in the order they were found.
#[derive(Default)]
pub(crate) struct Problems(pub(crate) Vec<Problem>);

impl Problems {
    pub(crate) fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(Problem {
            path: path.into(),
            message: message.into(),
        });
    }

    /// `v` as `T`, or a problem at `path`.
    pub(crate) fn typed<T: DeserializeOwned>(&mut self, path: &str, v: toml::Value) -> Option<T> {
        match serde_path_to_error::deserialize::<_, T>(v) {
            Ok(t) => Some(t),
            Err(e) => {
                let inner = e.path().to_string();
                let at = if inner == "." {
                    path.to_owned()
                } else if inner.starts_with('[') {
                    format!("{path}{inner}")
                } else {
                    format!("{path}.{inner}")
                };
                self.push(at, e.into_inner().message().to_owned());
                None
            }
        }
    }

    /// `v` parsed as an `ip:port` (never a name: nothing is resolved here).
    pub(crate) fn addr(&mut self, path: &str, v: &str) -> Option<SocketAddr> {
        match v.parse() {
            Ok(a) => Some(a),
            Err(_) => {
                self.push(
                    path,
                    format!("{v:?} is not an ip:port socket address (names are not resolved here)"),
                );
                None
            }
        }
    }
}

/// One table being read; [`Section::finish`] reports the keys left over.
pub(crate) struct Section<'p> {
    path: String,
    table: toml::Table,
    known: Vec<&'static str>,
    pub(crate) problems: &'p mut Problems,
}

impl<'p> Section<'p> {
    /// The table at `path`; anything else is a problem and reads as empty.
    pub(crate) fn new(path: impl Into<String>, value: Option<toml::Value>, problems: &'p mut Problems) -> Self {
        let path = path.into();
        let table = match value {
            None => toml::Table::new(),
            Some(toml::Value::Table(t)) => t,
            Some(other) => {
                problems.push(&path, format!("must be a table, not {}", other.type_str()));
                toml::Table::new()
            }
        };
        Section {
            path,
            table,
            known: vec![],
            problems,
        }
    }

    /// The key path of this table.
    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// The key path of `key` in this table.
    pub(crate) fn at(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_owned()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// Whether `key` is present (not yet taken).
    pub(crate) fn has(&self, key: &str) -> bool {
        self.table.contains_key(key)
    }

    /// Takes `key` out of the table, raw.
    pub(crate) fn take(&mut self, key: &'static str) -> Option<toml::Value> {
        self.known.push(key);
        self.table.remove(key)
    }

    /// The sub-table `key` (empty when absent).
    pub(crate) fn table(&mut self, key: &'static str) -> Section<'_> {
        let at = self.at(key);
        let v = self.take(key);
        Section::new(at, v, self.problems)
    }

    /// The sub-table `key`, if present.
    pub(crate) fn optional_table(&mut self, key: &'static str) -> Option<Section<'_>> {
        let at = self.at(key);
        let v = self.take(key)?;
        Some(Section::new(at, Some(v), self.problems))
    }

    /// Every entry of this table, for tables whose keys are names (tools, env).
    pub(crate) fn entries(&mut self) -> Vec<(String, toml::Value)> {
        std::mem::take(&mut self.table).into_iter().collect()
    }

    /// `key` as `T`, if present and of the right type.
    pub(crate) fn get<T: DeserializeOwned>(&mut self, key: &'static str) -> Option<T> {
        let v = self.take(key)?;
        let at = self.at(key);
        self.problems.typed(&at, v)
    }

    pub(crate) fn or<T: DeserializeOwned>(&mut self, key: &'static str, default: T) -> T {
        self.get(key).unwrap_or(default)
    }

    /// `key`, which must be present.
    pub(crate) fn required<T: DeserializeOwned>(&mut self, key: &'static str, what: &str) -> Option<T> {
        if !self.table.contains_key(key) {
            self.known.push(key);
            let at = self.at(key);
            self.problems.push(at, format!("is required ({what})"));
            return None;
        }
        self.get(key)
    }

    /// An array under `key`: each element as `T` with its path, elements of
    /// another type reported one by one.
    pub(crate) fn list<T: DeserializeOwned>(&mut self, key: &'static str) -> Option<Vec<(String, T)>> {
        let at = self.at(key);
        let items: Vec<toml::Value> = self.get(key)?;
        let mut out = Vec::with_capacity(items.len());
        for (i, v) in items.into_iter().enumerate() {
            let path = format!("{at}[{i}]");
            if let Some(t) = self.problems.typed(&path, v) {
                out.push((path, t));
            }
        }
        Some(out)
    }

    /// An integer under `key` within `range`; out of range is a problem and
    /// reads as the nearest bound.
    pub(crate) fn int(&mut self, key: &'static str, range: RangeInclusive<u64>, default: u64) -> u64 {
        let v = self.or(key, default);
        if !range.contains(&v) {
            let at = self.at(key);
            let (lo, hi) = (*range.start(), *range.end());
            if hi == u64::MAX {
                self.problems.push(at, format!("must be at least {lo}"));
            } else {
                self.problems.push(at, format!("{v} is out of range {lo}..={hi}"));
            }
        }
        v.clamp(*range.start(), *range.end())
    }

    /// A count under `key` within `range`.
    pub(crate) fn count(&mut self, key: &'static str, range: RangeInclusive<u64>, default: usize) -> usize {
        let v = self.int(key, range, default as u64);
        usize::try_from(v).unwrap_or(usize::MAX)
    }

    /// A duration in milliseconds under `key` within `range` (milliseconds).
    pub(crate) fn millis(&mut self, key: &'static str, range: RangeInclusive<u64>, default: Duration) -> Duration {
        let default = u64::try_from(default.as_millis()).unwrap_or(u64::MAX);
        Duration::from_millis(self.int(key, range, default))
    }

    /// A socket address under `key`.
    pub(crate) fn addr(&mut self, key: &'static str, default: SocketAddr) -> SocketAddr {
        let Some(s) = self.get::<String>(key) else {
            return default;
        };
        let at = self.at(key);
        self.problems.addr(&at, &s).unwrap_or(default)
    }

    /// One of `choices` by its name under `key`.
    pub(crate) fn choice<T: Copy>(&mut self, key: &'static str, choices: &[(&str, T)], default: T) -> T {
        let Some(s) = self.get::<String>(key) else {
            return default;
        };
        if let Some((_, v)) = choices.iter().find(|(name, _)| *name == s) {
            return *v;
        }
        let names: Vec<String> = choices.iter().map(|(n, _)| format!("{n:?}")).collect();
        let at = self.at(key);
        self.problems
            .push(at, format!("{s:?} is not one of {}", names.join(", ")));
        default
    }

    /// Reports every key no reader asked for.
    pub(crate) fn finish(self) {
        let mut known = self.known;
        known.sort_unstable();
        known.dedup();
        for key in self.table.keys() {
            let at = if self.path.is_empty() {
                key.clone()
            } else {
                format!("{}.{key}", self.path)
            };
            self.problems
                .push(at, format!("unknown key (expected one of: {})", known.join(", ")));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(text: &str, p: &mut Problems, f: impl FnOnce(&mut Section)) {
        let t: toml::Table = toml::from_str(text).unwrap();
        let mut s = Section::new("s", Some(toml::Value::Table(t)), p);
        f(&mut s);
        s.finish();
    }

    #[test]
    fn wrong_types_ranges_and_unknown_keys_are_all_reported() {
        let mut p = Problems::default();
        section("a = \"x\"\nb = 0\nc = [1, \"y\", 2]\nd = 1\n", &mut p, |s| {
            assert_eq!(s.int("a", 0..=9, 5), 5);
            assert_eq!(s.int("b", 1..=9, 5), 1);
            let c: Vec<(String, u64)> = s.list("c").unwrap();
            assert_eq!(c, [("s.c[0]".to_owned(), 1), ("s.c[2]".to_owned(), 2)]);
            assert_eq!(s.required::<u64>("e", "a number"), None);
        });
        let got: Vec<(&str, &str)> = p.0.iter().map(|p| (p.path.as_str(), p.message.as_str())).collect();
        assert_eq!(
            got,
            [
                ("s.a", "invalid type: string \"x\", expected u64"),
                ("s.b", "0 is out of range 1..=9"),
                ("s.c[1]", "invalid type: string \"y\", expected u64"),
                ("s.e", "is required (a number)"),
                ("s.d", "unknown key (expected one of: a, b, c, e)"),
            ]
        );
    }

    #[test]
    fn a_section_that_is_not_a_table_reads_as_empty() {
        let mut p = Problems::default();
        let mut s = Section::new("proxy", Some(toml::Value::Integer(3)), &mut p);
        assert_eq!(s.int("x", 0..=9, 7), 7);
        s.finish();
        assert_eq!(p.0[0].path, "proxy");
        assert_eq!(p.0[0].message, "must be a table, not integer");
    }
}
