//! Small typed accessors over `serde_json` objects that turn a missing or mistyped field into an
//! error naming that field. Used by every config-like file we read.

use serde_json::{Map, Value};

/// Why a field could not be read; the caller adds the file path.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldError {
    pub field: String,
    pub problem: String,
}

impl FieldError {
    pub fn new(field: &str, problem: impl Into<String>) -> Self {
        FieldError { field: field.to_string(), problem: problem.into() }
    }
}

pub type FieldResult<T> = Result<T, FieldError>;

/// The largest value a size-like field of a file may hold, checked (by `check_bounds`) before
/// anything is sized from the file. Every table of these is listed in `docs/limits.md`.
#[derive(Debug, Clone, Copy)]
pub struct Bound {
    pub field: &'static str,
    pub max: u64,
}

/// Checks each field of `bounds` that `obj` holds: an integer at most `max`, a list of integers
/// each at most `max`, or a list of anything at most `max` long when the bound's field ends in
/// `[]`. `prefix` names where `obj` sits in the file (`""` at the top, `"rope_scaling."` inside).
/// Values of other types are left to the typed getters, which name what they expected.
pub fn check_bounds(obj: &Map<String, Value>, bounds: &[Bound], prefix: &str) -> FieldResult<()> {
    let over = |field: &str, found: &dyn std::fmt::Display, max: u64| {
        FieldError::new(&format!("{prefix}{field}"), format!("{found} is over the limit of {max} this field may hold (docs/limits.md)"))
    };
    for b in bounds {
        if let Some(list_field) = b.field.strip_suffix("[]") {
            if let Some(Value::Array(items)) = obj.get(list_field) {
                if items.len() as u64 > b.max {
                    return Err(FieldError::new(
                        &format!("{prefix}{list_field}"),
                        format!("{} entries is over the limit of {} (docs/limits.md)", items.len(), b.max),
                    ));
                }
            }
            continue;
        }
        let too_big = |v: &Value| match v {
            Value::Number(n) => n.as_u64().is_some_and(|x| x > b.max) || n.as_f64().is_some_and(|x| x > b.max as f64),
            _ => false,
        };
        match obj.get(b.field) {
            Some(v @ Value::Number(_)) if too_big(v) => return Err(over(b.field, v, b.max)),
            Some(Value::Array(items)) => {
                if let Some(v) = items.iter().find(|v| too_big(v)) {
                    return Err(over(b.field, v, b.max));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// A JSON object with typed getters. `null` counts as absent, as transformers treats it.
pub struct Obj<'a>(pub &'a Map<String, Value>);

impl<'a> Obj<'a> {
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        match self.0.get(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    pub fn usize_opt(&self, key: &str) -> FieldResult<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n <= u32::MAX as u64 => Ok(Some(n as usize)),
                _ => Err(FieldError::new(key, format!("expected a non-negative integer, got {v}"))),
            },
        }
    }

    pub fn usize(&self, key: &str) -> FieldResult<usize> {
        self.usize_opt(key)?.ok_or_else(|| FieldError::new(key, "missing"))
    }

    pub fn positive(&self, key: &str) -> FieldResult<usize> {
        let n = self.usize(key)?;
        if n == 0 {
            return Err(FieldError::new(key, "must be greater than zero"));
        }
        Ok(n)
    }

    pub fn f64_opt(&self, key: &str) -> FieldResult<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().filter(|x| x.is_finite()).map(Some).ok_or_else(|| FieldError::new(key, format!("expected a finite number, got {v}"))),
        }
    }

    pub fn f64_or(&self, key: &str, default: f64) -> FieldResult<f64> {
        Ok(self.f64_opt(key)?.unwrap_or(default))
    }

    pub fn bool_or(&self, key: &str, default: bool) -> FieldResult<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(FieldError::new(key, format!("expected true or false, got {v}"))),
        }
    }

    pub fn str_opt(&self, key: &str) -> FieldResult<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(FieldError::new(key, format!("expected a string, got {v}"))),
        }
    }

    pub fn obj_opt(&self, key: &str) -> FieldResult<Option<Obj<'a>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(Obj(m))),
            Some(v) => Err(FieldError::new(key, format!("expected an object, got {v}"))),
        }
    }

    pub fn usize_list_or_empty(&self, key: &str) -> FieldResult<Vec<usize>> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => {
                items.iter().map(|v| v.as_u64().map(|n| n as usize).ok_or_else(|| FieldError::new(key, format!("expected integers, got {v}")))).collect()
            }
            Some(v) => Err(FieldError::new(key, format!("expected a list, got {v}"))),
        }
    }

    /// An id or a list of ids (`eos_token_id` is either on the hub).
    pub fn ids(&self, key: &str) -> FieldResult<Vec<u32>> {
        let one = |v: &Value| {
            v.as_u64().filter(|n| *n <= u32::MAX as u64).map(|n| n as u32).ok_or_else(|| FieldError::new(key, format!("expected a token id, got {v}")))
        };
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items.iter().map(one).collect(),
            Some(v) => Ok(vec![one(v)?]),
        }
    }
}
