//! The one error type for loading a model: every variant names the file (or config field) at
//! fault, so a user reading one line knows what to fix.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is there but is not valid JSON / not the expected shape.
    #[error("{path}: {problem}")]
    Malformed { path: PathBuf, problem: String },
    /// A config field is missing, of the wrong type, or inconsistent with another.
    #[error("{path}: field `{field}`: {problem}")]
    Field { path: PathBuf, field: String, problem: String },
    /// `field` is where the name was read (`architectures`, or `model_type` without it).
    #[error("{path}: field `{field}`: unsupported architecture `{found}` (supported: {supported})")]
    Unsupported { path: PathBuf, field: &'static str, found: String, supported: String },
    /// A tensor is missing, or its dtype/shape disagrees with the spec.
    #[error("{path}: tensor `{tensor}`: {problem}")]
    Tensor { path: PathBuf, tensor: String, problem: String },
}

impl LoadError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        LoadError::Io { path: path.into(), source }
    }
    pub fn malformed(path: impl Into<PathBuf>, problem: impl Into<String>) -> Self {
        LoadError::Malformed { path: path.into(), problem: problem.into() }
    }
}
