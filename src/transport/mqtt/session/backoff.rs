//! How long the driver waits before it connects again.

use std::time::Duration;

/// Exponential backoff with full jitter, so a fleet does not reconnect in step.
pub struct Backoff {
    base: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(base: Duration, max: Duration) -> Backoff {
        Backoff { base, max, attempt: 0 }
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    pub fn next_wait(&mut self) -> Duration {
        let ceiling = self.base.saturating_mul(1 << self.attempt.min(16)).min(self.max);
        self.attempt += 1;
        let jitter = fastrand::f64();
        ceiling.mul_f64(0.5 + 0.5 * jitter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_its_ceiling_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let first = b.next_wait();
        assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100), "{first:?}");
        for _ in 0..20 {
            assert!(b.next_wait() <= Duration::from_secs(5));
        }
        assert!(b.next_wait() >= Duration::from_millis(2500));
        b.reset();
        assert!(b.next_wait() <= Duration::from_millis(100));
    }
}
