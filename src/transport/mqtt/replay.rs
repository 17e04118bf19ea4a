//! The node's memory of the signed control commands it answered within
//! `control.max_skew_s`. The same signed bytes again (a broker redelivering
//! after a restart, or someone replaying what they overheard on the topic)
//! get the answer they got the first time, never a new effect: a command
//! refused because the state did not allow it ("already stable", a version
//! not loaded) cannot be replayed into effect once the state changes. Past
//! the window its `issued_at_s` refuses it, so the memory is forgotten then.

use serde_json::Value;
use std::collections::HashMap;
use std::sync::Mutex;

/// A command's answer: its result, or an error code and message.
pub type Answer = Result<Value, (&'static str, String)>;

/// How many signed commands the window remembers at most. A fleet manager
/// sends a few a day; beyond this within `control.max_skew_s` something is
/// wrong, and refusing is safer than forgetting (which would let a replay
/// through).
pub const MAX_REMEMBERED: usize = 4096;

/// The window was full: the command is refused, not forgotten later.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Full;

pub struct ReplayWindow {
    max_skew_s: u64,
    capacity: usize,
    /// By signature (it covers every field, the id and `issued_at_s`).
    remembered: Mutex<HashMap<String, Remembered>>,
}

struct Remembered {
    /// After this its `issued_at_s` is refused anyway.
    forget_after_s: u64,
    /// `None` while it runs.
    answer: Option<Answer>,
}

impl ReplayWindow {
    pub fn new(max_skew_s: u64) -> ReplayWindow {
        ReplayWindow::with_capacity(max_skew_s, MAX_REMEMBERED)
    }

    pub fn with_capacity(max_skew_s: u64, capacity: usize) -> ReplayWindow {
        ReplayWindow { max_skew_s, capacity, remembered: Mutex::new(HashMap::new()) }
    }

    pub fn max_skew_s(&self) -> u64 {
        self.max_skew_s
    }

    /// `Ok(Some(answer))`: this exact command was answered before, answer it
    /// so again. `Ok(None)`: run it (a copy still running is run too: the
    /// rollout thread applies an id once). `Err(Full)`: refuse it.
    pub fn admit(&self, signature: &str, issued_at_s: u64, now_s: u64) -> Result<Option<Answer>, Full> {
        let mut remembered = self.remembered.lock().unwrap_or_else(|e| e.into_inner());
        // A linear sweep: at most `capacity` entries, and commands are rare.
        remembered.retain(|_, r| r.forget_after_s >= now_s);
        if let Some(r) = remembered.get(signature) {
            return Ok(r.answer.clone());
        }
        if remembered.len() >= self.capacity {
            return Err(Full);
        }
        let forget_after_s = issued_at_s.saturating_add(self.max_skew_s);
        remembered.insert(signature.to_string(), Remembered { forget_after_s, answer: None });
        Ok(None)
    }

    /// Keeps a final answer for repeats. One that said "try again"
    /// (`overloaded`, `internal`: a busy node, a failing disk) is forgotten,
    /// so the same bytes sent again are run again, as the sender meant.
    pub fn settle(&self, signature: &str, answer: &Answer) {
        let mut remembered = self.remembered.lock().unwrap_or_else(|e| e.into_inner());
        let retry = matches!(answer, Err(("overloaded" | "internal", _)));
        match remembered.get_mut(signature) {
            Some(_) if retry => {
                remembered.remove(signature);
            }
            Some(r) => r.answer = Some(answer.clone()),
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn finding_2_the_same_signed_command_gets_its_first_answer_and_no_new_effect() {
        let window = ReplayWindow::new(300);
        assert_eq!(window.admit("sig-a", 1000, 1000), Ok(None));
        // A copy while the first runs goes on to the rollout thread.
        assert_eq!(window.admit("sig-a", 1000, 1001), Ok(None));
        let refused: Answer = Err(("conflict", "v2 is already stable".into()));
        window.settle("sig-a", &refused);
        assert_eq!(window.admit("sig-a", 1000, 1200), Ok(Some(refused)));
        // Another signature (another command, or the same re-signed) runs.
        assert_eq!(window.admit("sig-b", 1100, 1200), Ok(None));
        window.settle("sig-b", &Ok(json!({"action": "promoted"})));
        assert_eq!(window.admit("sig-b", 1100, 1300), Ok(Some(Ok(json!({"action": "promoted"})))));
    }

    #[test]
    fn an_answer_that_says_try_again_is_not_kept() {
        let window = ReplayWindow::new(300);
        assert_eq!(window.admit("sig", 1000, 1000), Ok(None));
        window.settle("sig", &Err(("overloaded", "the state disk may be hung".into())));
        assert_eq!(window.admit("sig", 1000, 1001), Ok(None));
        window.settle("sig", &Err(("internal", "cannot write deployments.json".into())));
        assert_eq!(window.admit("sig", 1000, 1002), Ok(None));
    }

    #[test]
    fn the_window_forgets_after_max_skew_and_refuses_beyond_its_capacity() {
        let window = ReplayWindow::with_capacity(300, 2);
        assert_eq!(window.admit("a", 1000, 1000), Ok(None));
        assert_eq!(window.admit("b", 1100, 1100), Ok(None));
        assert_eq!(window.admit("c", 1100, 1100), Err(Full));
        // "a" is past 1000 + 300: its issued_at_s is refused now, so it goes.
        assert_eq!(window.admit("c", 1301, 1301), Ok(None));
        assert_eq!(window.remembered.lock().unwrap().len(), 2);
    }
}
