//! The array, as the controller reaches it: its remote API (the same verbs, arguments and
//! answers as `ferrosan ctl`), each call on the blocking pool, each refusal typed by the
//! answer's `kind` and turned into the gRPC status CSI asks for in one place ([`status`]).

use std::sync::Arc;

use serde_json::{Map, Value};
use tonic::{Code, Status};

/// Why the array did not do what it was asked.
#[derive(Debug, thiserror::Error)]
pub enum ArrayError {
    /// No answer: the API is unreachable, or its reply was not one.
    #[error("the array did not answer: {0}")]
    Unreachable(String),
    /// The array's answer: `kind` says why (docs/OPERATIONS.md).
    #[error("the array refused: {message} ({kind})")]
    Refused { kind: String, message: String },
}

impl ArrayError {
    pub fn kind(&self) -> &str {
        match self {
            ArrayError::Unreachable(_) => "unreachable",
            ArrayError::Refused { kind, .. } => kind,
        }
    }
}

/// The gRPC status for `error`; `conflict` is the code this call gives a `conflict` (CSI
/// wants ALREADY_EXISTS from CreateVolume, FAILED_PRECONDITION from DeleteVolume).
pub fn status(error: &ArrayError, conflict: Code) -> Status {
    let code = match error.kind() {
        "not_found" => Code::NotFound,
        "conflict" | "busy" => conflict,
        // An exclusive export refused: another node has the volume.
        "in_use" => Code::FailedPrecondition,
        "bad_request" | "invalid_config" | "too_large" => Code::InvalidArgument,
        "unauthorized" => Code::Unauthenticated,
        "forbidden" => Code::PermissionDenied,
        "rate_limited" => Code::ResourceExhausted,
        "unreachable" | "unavailable" => Code::Unavailable,
        _ => Code::Internal,
    };
    Status::new(code, error.to_string())
}

/// Where the array's answers come from: its remote API, or in tests anything that answers
/// the same JSON.
pub trait Api: Send + Sync + 'static {
    fn call(&self, verb: &str, args: Map<String, Value>) -> Result<Value, String>;
}

impl Api for client::Remote {
    fn call(&self, verb: &str, args: Map<String, Value>) -> Result<Value, String> {
        client::Remote::call(self, verb, args).map_err(|e| e.to_string())
    }
}

#[derive(Clone)]
pub struct Array {
    api: Arc<dyn Api>,
}

impl Array {
    pub fn new(api: Arc<dyn Api>) -> Array {
        Array { api }
    }

    /// Asks `verb` with `args` (a JSON object); the answer when it is `"ok": true`.
    pub async fn call(&self, verb: &'static str, args: Value) -> Result<Value, ArrayError> {
        let api = self.api.clone();
        let args = match args {
            Value::Object(fields) => fields,
            _ => Map::new(),
        };
        let answer = tokio::task::spawn_blocking(move || api.call(verb, args))
            .await
            .map_err(|e| ArrayError::Unreachable(e.to_string()))?
            .map_err(ArrayError::Unreachable)?;
        if answer.get("ok") == Some(&Value::Bool(true)) {
            return Ok(answer);
        }
        let text = |key: &str| {
            answer
                .get(key)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        Err(ArrayError::Refused {
            kind: text("kind"),
            message: text("error"),
        })
    }
}
