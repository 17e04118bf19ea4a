//! The circuit breaker in front of the cloud tier: after `failures` calls in
//! a row fail, calls are refused at once for `open_for` (so a dead uplink
//! costs a request nothing), then one probe is let through; its outcome
//! closes the breaker or opens it again.

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Closed,
    Open,
    HalfOpen,
}

impl State {
    /// The value of `edgeinfer_cloud_breaker_state`.
    pub fn gauge(self) -> f64 {
        match self {
            State::Closed => 0.0,
            State::Open => 1.0,
            State::HalfOpen => 2.0,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open => "open",
            State::HalfOpen => "half_open",
        }
    }
}

#[derive(Debug)]
enum Inner {
    Closed {
        failures: u32,
    },
    Open {
        until: Instant,
    },
    /// A probe is out; everyone else is refused until it reports.
    HalfOpen,
}

#[derive(Debug)]
pub struct Breaker {
    failures: u32,
    open_for: Duration,
    inner: Mutex<Inner>,
}

/// Permission to call the cloud; report how the call went.
#[derive(Debug, PartialEq, Eq)]
pub enum Admit {
    Call,
    /// The call is the half-open probe.
    Probe,
    Refused,
}

impl Breaker {
    pub fn new(failures: u32, open_for: Duration) -> Breaker {
        Breaker { failures: failures.max(1), open_for, inner: Mutex::new(Inner::Closed { failures: 0 }) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn admit(&self, now: Instant) -> Admit {
        let mut inner = self.lock();
        match *inner {
            Inner::Closed { .. } => Admit::Call,
            Inner::Open { until } if now >= until => {
                *inner = Inner::HalfOpen;
                Admit::Probe
            }
            Inner::Open { .. } | Inner::HalfOpen => Admit::Refused,
        }
    }

    /// `admit`, as a guard: dropped before `Permit::report` (its caller
    /// gave up mid-call, a request's deadline dropping the future), a probe
    /// is abandoned, so the breaker cannot stay half-open for good.
    pub fn permit(&self, now: Instant) -> Permit<'_> {
        Permit { breaker: self, admitted: self.admit(now), reported: false }
    }

    /// The outcome of an admitted call. Returns the new state when it changed.
    pub fn report(&self, admitted: &Admit, ok: bool, now: Instant) -> Option<State> {
        let mut inner = self.lock();
        let before = state_of(&inner);
        match (&mut *inner, ok) {
            (Inner::Closed { failures }, true) => *failures = 0,
            (Inner::Closed { failures }, false) => {
                *failures += 1;
                if *failures >= self.failures {
                    *inner = Inner::Open { until: now + self.open_for };
                }
            }
            (Inner::HalfOpen, true) if *admitted == Admit::Probe => *inner = Inner::Closed { failures: 0 },
            (Inner::HalfOpen, false) if *admitted == Admit::Probe => {
                *inner = Inner::Open { until: now + self.open_for }
            }
            // A call admitted before the breaker opened, reporting late.
            _ => {}
        }
        let after = state_of(&inner);
        (after != before).then_some(after)
    }

    /// A probe that never reported (its caller gave up): let the next one go.
    pub fn abandon(&self, admitted: &Admit) {
        let mut inner = self.lock();
        if *admitted == Admit::Probe && matches!(*inner, Inner::HalfOpen) {
            *inner = Inner::Open { until: Instant::now() };
        }
    }

    pub fn state(&self) -> State {
        state_of(&self.lock())
    }

    /// How long until a probe may go, when open.
    pub fn retry_in(&self, now: Instant) -> Duration {
        match *self.lock() {
            Inner::Open { until } => until.saturating_duration_since(now),
            _ => Duration::ZERO,
        }
    }
}

/// An admitted (or refused) call that reports its outcome or, dropped
/// without one, abandons itself.
pub struct Permit<'a> {
    breaker: &'a Breaker,
    admitted: Admit,
    reported: bool,
}

impl Permit<'_> {
    pub fn refused(&self) -> bool {
        self.admitted == Admit::Refused
    }

    /// The call's outcome; the new state when it changed.
    pub fn report(mut self, ok: bool, now: Instant) -> Option<State> {
        self.reported = true;
        self.breaker.report(&self.admitted, ok, now)
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if !self.reported {
            self.breaker.abandon(&self.admitted);
        }
    }
}

fn state_of(inner: &Inner) -> State {
    match inner {
        Inner::Closed { .. } => State::Closed,
        Inner::Open { .. } => State::Open,
        Inner::HalfOpen => State::HalfOpen,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_consecutive_failures_then_probes_once_and_closes() {
        let b = Breaker::new(3, Duration::from_secs(10));
        let t0 = Instant::now();
        for _ in 0..2 {
            let a = b.admit(t0);
            assert_eq!(b.report(&a, false, t0), None);
        }
        // A success in between resets the count.
        let a = b.admit(t0);
        b.report(&a, true, t0);
        for _ in 0..2 {
            let a = b.admit(t0);
            b.report(&a, false, t0);
        }
        assert_eq!(b.state(), State::Closed);
        let a = b.admit(t0);
        assert_eq!(b.report(&a, false, t0), Some(State::Open));
        assert_eq!(b.admit(t0 + Duration::from_secs(9)), Admit::Refused);
        assert_eq!(b.retry_in(t0 + Duration::from_secs(4)), Duration::from_secs(6));
        let later = t0 + Duration::from_secs(10);
        let probe = b.admit(later);
        assert_eq!(probe, Admit::Probe);
        assert_eq!(b.admit(later), Admit::Refused, "one probe at a time");
        assert_eq!(b.report(&probe, true, later), Some(State::Closed));
        assert_eq!(b.admit(later), Admit::Call);
    }

    #[test]
    fn a_failed_probe_opens_it_again_and_an_abandoned_one_frees_the_slot() {
        let b = Breaker::new(1, Duration::from_secs(5));
        let t0 = Instant::now();
        let a = b.admit(t0);
        b.report(&a, false, t0);
        let t1 = t0 + Duration::from_secs(5);
        let probe = b.admit(t1);
        assert_eq!(b.report(&probe, false, t1), Some(State::Open));
        assert_eq!(b.admit(t1 + Duration::from_secs(4)), Admit::Refused);
        let t2 = t1 + Duration::from_secs(5);
        let probe = b.admit(t2);
        assert_eq!(probe, Admit::Probe);
        b.abandon(&probe);
        assert_eq!(b.admit(Instant::now()), Admit::Probe);
    }

    #[test]
    fn a_probe_dropped_without_a_report_frees_the_slot() {
        let b = Breaker::new(1, Duration::from_secs(5));
        let t0 = Instant::now();
        assert_eq!(b.permit(t0).report(false, t0), Some(State::Open));
        let t1 = t0 + Duration::from_secs(5);
        let probe = b.permit(t1);
        assert!(!probe.refused());
        assert!(b.permit(t1).refused(), "one probe at a time");
        // Its future was dropped mid-call: no report.
        drop(probe);
        let next = b.permit(Instant::now());
        assert!(!next.refused(), "the next call probes again instead of waiting for a restart");
        assert_eq!(next.report(true, Instant::now()), Some(State::Closed));
    }
}
