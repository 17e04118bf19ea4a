//! A request's time limit: the earlier of `parameters.deadline_ms` and the
//! transport's (MQTT 5 Message Expiry), counted from when the pipeline
//! took the request. The whole answer runs inside it.

use crate::protocol::InferError;
use std::future::Future;
use std::time::{Duration, Instant};

pub struct Deadline {
    start: Instant,
    limit: Option<Duration>,
    /// `parameters.deadline_ms` when it is the limit (the earlier one), for
    /// the error's wording; otherwise the transport's limit is.
    deadline_ms: Option<u64>,
}

impl Deadline {
    pub fn new(deadline_ms: Option<u64>, transport: Option<Duration>) -> Deadline {
        let parameters = deadline_ms.map(Duration::from_millis);
        let limit = match (parameters, transport) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let deadline_ms = deadline_ms.filter(|_| limit == parameters);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::ErrorCode;

    #[tokio::test]
    async fn a_spent_or_short_deadline_is_an_error_reply_never_a_panic() {
        // What is left is computed once (checked_sub): a deadline running
        // out between a check and a subtraction cannot underflow.
        let spent = Deadline::new(Some(0), None);
        let err = spent.bound(async { Ok::<_, InferError>(()) }).await.unwrap_err();
        assert_eq!(err.code, ErrorCode::DeadlineExceeded);
        assert!(
            err.message.contains("parameters.deadline_ms = 0 passed before the model could run"),
            "{}",
            err.message
        );
        let short = Deadline::new(Some(60_000), Some(Duration::from_millis(5)));
        let slow = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            Ok::<_, InferError>(())
        };
        let err = short.bound(slow).await.unwrap_err();
        assert!(err.message.starts_with("the message expiry interval: no answer in time"), "{}", err.message);
        let open = Deadline::new(None, None);
        assert_eq!(open.at(), None);
        assert!(open.bound(async { Ok::<_, InferError>(7) }).await.is_ok());
    }
}
