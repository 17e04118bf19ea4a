use serde::{Deserialize, Serialize};

/// The error codes of the wire contract; every failed request gets exactly one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    InvalidPayload,
    InvalidInput,
    UnknownModel,
    TooLarge,
    Overloaded,
    DeadlineExceeded,
    CloudUnavailable,
    Internal,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 8] = [
        ErrorCode::InvalidPayload,
        ErrorCode::InvalidInput,
        ErrorCode::UnknownModel,
        ErrorCode::TooLarge,
        ErrorCode::Overloaded,
        ErrorCode::DeadlineExceeded,
        ErrorCode::CloudUnavailable,
        ErrorCode::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidPayload => "invalid_payload",
            ErrorCode::InvalidInput => "invalid_input",
            ErrorCode::UnknownModel => "unknown_model",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::DeadlineExceeded => "deadline_exceeded",
            ErrorCode::CloudUnavailable => "cloud_unavailable",
            ErrorCode::Internal => "internal",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// The HTTP status an OIP client expects for this code.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidPayload | ErrorCode::InvalidInput => 400,
            ErrorCode::UnknownModel => 404,
            ErrorCode::TooLarge => 413,
            ErrorCode::Overloaded => 503,
            ErrorCode::DeadlineExceeded => 504,
            ErrorCode::CloudUnavailable => 502,
            ErrorCode::Internal => 500,
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why one request failed: a code for machines and a sentence for people that
/// names the field and the fix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct InferError {
    pub code: ErrorCode,
    pub message: String,
}

impl InferError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        InferError { code, message: message.into() }
    }
}

macro_rules! constructors {
    ($($name:ident => $code:ident),* $(,)?) => {
        impl InferError {
            $(pub fn $name(message: impl Into<String>) -> Self {
                InferError::new(ErrorCode::$code, message)
            })*
        }
    };
}

constructors! {
    invalid_payload => InvalidPayload,
    invalid_input => InvalidInput,
    unknown_model => UnknownModel,
    too_large => TooLarge,
    overloaded => Overloaded,
    deadline_exceeded => DeadlineExceeded,
    cloud_unavailable => CloudUnavailable,
    internal => Internal,
}

/// The JSON error reply: `{"id": ..., "error": ..., "parameters": {"code": ...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorReply {
    pub id: String,
    pub error: String,
    pub parameters: ErrorParameters,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorParameters {
    pub code: ErrorCode,
}

impl ErrorReply {
    pub fn new(id: impl Into<String>, err: &InferError) -> Self {
        ErrorReply {
            id: id.into(),
            error: err.message.clone(),
            parameters: ErrorParameters { code: err.code },
        }
    }
}
