//! The session's deadlines in one table: the driver sleeps until the
//! earliest and calls `Session::handle_timeout`; an early or extra call
//! fires nothing.

use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timer {
    /// CONNECT written, CONNACK not yet heard.
    ConnAck,
    /// Nothing written for the keep alive: a PINGREQ is due.
    Ping,
    /// PINGREQ written, PINGRESP not yet heard.
    PingResp,
}

const ALL: [Timer; 3] = [Timer::ConnAck, Timer::Ping, Timer::PingResp];

#[derive(Debug, Default)]
pub struct Timers {
    at: [Option<Instant>; 3],
}

impl Timers {
    pub fn set(&mut self, timer: Timer, at: Instant) {
        self.at[timer as usize] = Some(at);
    }

    pub fn is_set(&self, timer: Timer) -> bool {
        self.at[timer as usize].is_some()
    }

    pub fn stop(&mut self, timer: Timer) {
        self.at[timer as usize] = None;
    }

    pub fn stop_all(&mut self) {
        self.at = [None; 3];
    }

    pub fn next(&self) -> Option<Instant> {
        self.at.iter().flatten().min().copied()
    }

    /// The timers due at `now`, stopped.
    pub fn expired(&mut self, now: Instant) -> Vec<Timer> {
        let due: Vec<Timer> =
            ALL.into_iter().filter(|t| self.at[*t as usize].is_some_and(|at| at <= now)).collect();
        for timer in &due {
            self.stop(*timer);
        }
        due
    }
}
