//! A request's time limit: the earlier of `parameters.deadline_ms` and the
//! transport's (MQTT 5 Message Expiry), counted from when the pipeline
//! took the request. The whole answer runs inside it.

use crate::protocol::InferError;
use std::future::Future;
use std::time::{Duration, Instant};

pub struct Deadline {
    start: Instant,
    limit: Option<Duration>,
    /// `parameters.deadline_ms`, for the error's wording.
    deadline_ms: Option<u64>,
}

impl Deadline {
    pub fn new(deadline_ms: Option<u64>, transport: Option<Duration>) -> Deadline {
        let limit = match (deadline_ms.map(Duration::from_millis), transport) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        Deadline { start: Instant::now(), limit, deadline_ms }
    }

    /// When the answer is due, if ever.
    pub fn at(&self) -> Option<Instant> {
        self.limit.map(|limit| self.start + limit)
    }

    /// `work`'s result, or `deadline_exceeded` naming the limit that ran out.
    pub async fn bound<T>(&self, work: impl Future<Output = Result<T, InferError>>) -> Result<T, InferError> {
        let Some(limit) = self.limit else { return work.await };
        let what = || match self.deadline_ms {
            Some(ms) => format!("parameters.deadline_ms = {ms}"),
            None => "the message expiry interval".to_string(),
        };
        let Some(left) = limit.checked_sub(self.start.elapsed()).filter(|left| !left.is_zero()) else {
            return Err(InferError::deadline_exceeded(format!(
                "{} passed before the model could run; allow more time",
                what()
            )));
        };
        tokio::time::timeout(left, work).await.map_err(|_| {
            InferError::deadline_exceeded(format!(
                "{}: no answer in time; allow more time or send fewer rows",
                what()
            ))
        })?
    }
}
