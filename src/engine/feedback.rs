//! Field feedback (issue 40): a device, or the system behind it, learns
//! later what the right answer was (`label`) or how the answer turned out
//! (`outcome`: 1 accepted, 0 rejected, or any value), and tells the node
//! by the request's id. The node keeps each answer it gave for
//! `feedback.window_s`, so late feedback still joins the model, version,
//! label and config that produced it.
//!
//! One thread owns the answers. The engine records each answer with
//! `try_send` (a full channel drops the record, counted, never delays a
//! reply); feedback asks over the same channel with its own reply channel.
//! The store is bounded by entries and bytes: past either bound the oldest
//! answer goes (counted). Each version's figures are published for the
//! status as a copy the owner replaces.

use crate::protocol::InferError;
pub use crate::rollout::FieldQuality;
use crate::rollout::{FieldFigures, FieldSays, FieldSeen, Observer};
use crate::telemetry::{
    FEEDBACK, FEEDBACK_ACCURACY, FEEDBACK_ANSWERS_DROPPED, FEEDBACK_ANSWERS_KEPT, FEEDBACK_CORRECT,
    FEEDBACK_OUTCOME_MEAN, FEEDBACK_UNJOINED,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Messages waiting for the owner; past this, answers are dropped
/// (counted) and feedback is answered `overloaded`.
const QUEUE: usize = 4096;
/// The longest id, label or outcome text a feedback message may carry.
pub const MAX_FIELD_BYTES: usize = 256;
/// The largest feedback message read (the fields above and some JSON).
pub const MAX_MESSAGE_BYTES: usize = 4096;
/// How long the owner lets answers gather after a batch; also the most a
/// feedback message waits to be taken.
const BATCH: Duration = Duration::from_millis(20);
/// How much later than its expiry an answer may go, so that answers kept
/// within one second expire in one wake-up of the owner.
const EXPIRY_SLACK: Duration = Duration::from_secs(1);
/// What each kept answer costs beyond its strings: the map and queue
/// entries, the figures.
const ENTRY_OVERHEAD: usize = 160;

/// The bounds, from `[feedback]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    pub window: Duration,
    pub max_entries: usize,
    pub max_bytes: usize,
}

/// The answer the node gave to one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub model: String,
    pub version: String,
    /// The top class, for a classifier.
    pub label: Option<String>,
    pub confidence: Option<f32>,
    /// `edge` or `cloud`.
    pub served_by: &'static str,
    /// The config version it was answered with (`parameters.config_version`).
    pub config: Option<String>,
}

impl Answer {
    fn bytes(&self, id: &str) -> usize {
        let text = [Some(&self.model), Some(&self.version), self.label.as_ref(), self.config.as_ref()];
        // The id twice: the map's key and the queue's.
        ENTRY_OVERHEAD + 2 * id.len() + text.iter().flatten().map(|s| s.len()).sum::<usize>()
    }
}

/// One feedback message, as the wire contract has it: the request's `id`
/// and either the true `label` or a numeric `outcome`, with an optional
/// `weight` (default 1).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Feedback {
    pub id: String,
    #[serde(default)]
    pub label: Option<String>,
    #[serde(default)]
    pub outcome: Option<f64>,
    #[serde(default)]
    pub weight: Option<f64>,
    /// Where an MQTT 3.1.1 sender wants the reply (MQTT 5: the Response
    /// Topic); HTTP answers on the connection.
    #[serde(default)]
    pub reply_to: Option<String>,
}

/// Why a feedback message is refused: the field and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

/// What feedback says, checked.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Says<'a> {
    Label(&'a str),
    Outcome(f64),
}

impl Feedback {
    /// Parses and checks one message: JSON, the fields the contract names,
    /// each within its bounds.
    pub fn parse(payload: &[u8]) -> Result<Feedback, Invalid> {
        if payload.len() > MAX_MESSAGE_BYTES {
            return Err(Invalid(format!(
                "feedback of {} bytes: a message holds at most {MAX_MESSAGE_BYTES} (id, label or outcome, \
                 weight)",
                payload.len()
            )));
        }
        let feedback: Feedback = serde_json::from_slice(payload).map_err(|e| {
            Invalid(format!(
                "feedback is a JSON object {{\"id\": \"...\", \"label\": \"...\"}} or {{\"id\": \"...\", \
                 \"outcome\": 1.0}}, optional \"weight\" and \"reply_to\": {e}"
            ))
        })?;
        feedback.says()?;
        Ok(feedback)
    }

    fn says(&self) -> Result<Says<'_>, Invalid> {
        let long =
            |field: &str, len: usize| Invalid(format!("{field}: {len} bytes; use at most {MAX_FIELD_BYTES}"));
        if self.id.is_empty() {
            return Err(Invalid("id: empty; use the id of the request the feedback is about".into()));
        }
        if self.id.len() > MAX_FIELD_BYTES {
            return Err(long("id", self.id.len()));
        }
        if let Some(w) = self.weight
            && !(1e-6..=1e6).contains(&w)
        {
            return Err(Invalid(format!("weight: {w}; use a number from 0.000001 to 1000000 (default 1)")));
        }
        match (&self.label, self.outcome) {
            (Some(label), None) if label.len() > MAX_FIELD_BYTES => Err(long("label", label.len())),
            (Some(label), None) => Ok(Says::Label(label)),
            (None, Some(outcome)) if outcome.abs() <= 1e6 => Ok(Says::Outcome(outcome)),
            (None, Some(outcome)) => {
                Err(Invalid(format!("outcome: {outcome}; use a number from -1000000 to 1000000")))
            }
            (Some(_), Some(_)) => {
                Err(Invalid("label and outcome: give one of them per message (send two messages)".into()))
            }
            (None, None) => Err(Invalid(
                "label or outcome: give the true label (\"label\": \"cat\") or a number (\"outcome\": 1.0)"
                    .into(),
            )),
        }
    }

    fn weight(&self) -> f64 {
        self.weight.unwrap_or(1.0)
    }
}

/// What became of one feedback message.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "status")]
pub enum Joined {
    /// Joined with the answer given: counted for its version.
    Joined {
        model: String,
        version: String,
        kind: &'static str,
        /// For a label: whether the answer had it.
        #[serde(skip_serializing_if = "Option::is_none")]
        correct: Option<bool>,
    },
    /// Not counted; why (the metric's `reason`).
    Unjoined { reason: &'static str },
}

enum Message {
    Record(String, Answer),
    Join(Feedback, oneshot::Sender<Joined>),
}

/// The handle the engine and transports hold.
#[derive(Clone)]
pub struct FeedbackStore {
    tx: SyncSender<Message>,
    quality: Arc<Mutex<Arc<Vec<FieldQuality>>>>,
}

impl FeedbackStore {
    /// Starts the owner thread.
    /// What joins also goes to `rollout`, for the field gates.
    pub fn start(bounds: Bounds, rollout: Option<Observer>) -> std::io::Result<FeedbackStore> {
        let (tx, rx) = sync_channel(QUEUE);
        let quality = Arc::new(Mutex::new(Arc::new(Vec::new())));
        let mut owner = Owner::new(bounds, quality.clone());
        owner.rollout = rollout;
        std::thread::Builder::new().name("edgeinfer-feedback".into()).spawn(move || owner.run(rx))?;
        Ok(FeedbackStore { tx, quality })
    }

    /// Keeps the answer to request `id` for the window; never waits.
    pub fn record(&self, id: &str, answer: Answer) {
        if id.is_empty() {
            return;
        }
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) =
            self.tx.try_send(Message::Record(id.to_string(), answer))
        {
            metrics::counter!(FEEDBACK_ANSWERS_DROPPED, "reason" => "queue_full").increment(1);
        }
    }

    /// Joins checked feedback with the answer it is about.
    pub async fn join(&self, feedback: Feedback) -> Result<Joined, Busy> {
        let (reply, answer) = oneshot::channel();
        self.tx.try_send(Message::Join(feedback, reply)).map_err(|_| Busy)?;
        answer.await.map_err(|_| Busy)
    }

    /// Each version's figures, as of the last change.
    pub fn quality(&self) -> Arc<Vec<FieldQuality>> {
        self.quality.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Where feedback arrived: a node's own topic (or HTTP), or the site's
/// topic, which every node reads: there an id this node did not answer is
/// another node's (`not_here`, and no reply), not an unknown one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Addressed {
    Node,
    Site,
}

/// One feedback message as both transports take it: its id and what
/// became of it, or the error reply naming the field and the fix.
pub async fn take(
    store: Option<&FeedbackStore>,
    payload: &[u8],
    addressed: Addressed,
) -> Result<(String, Joined), (String, InferError)> {
    let Some(store) = store else {
        refused("invalid");
        let off = "feedback.enabled = false on this node: set it to true to take feedback";
        return Err((String::new(), InferError::invalid_payload(off)));
    };
    let feedback = match Feedback::parse(payload) {
        Ok(feedback) => feedback,
        Err(Invalid(message)) => {
            refused("invalid");
            let too_large = payload.len() > MAX_MESSAGE_BYTES;
            let err =
                if too_large { InferError::too_large(message) } else { InferError::invalid_payload(message) };
            return Err((String::new(), err));
        }
    };
    let id = feedback.id.clone();
    match store.join(feedback).await {
        Ok(Joined::Unjoined { reason: "unknown_id" }) if addressed == Addressed::Site => {
            refused("not_here");
            Ok((id, Joined::Unjoined { reason: "not_here" }))
        }
        Ok(Joined::Unjoined { reason }) => {
            refused(reason);
            Ok((id, Joined::Unjoined { reason }))
        }
        Ok(joined) => Ok((id, joined)),
        Err(Busy) => {
            refused("busy");
            Err((id, InferError::overloaded(Busy.to_string())))
        }
    }
}

/// Counts feedback not counted for a version, by `reason`; a transport
/// that refuses a message before `take` (an HTTP body over the bound) too.
pub fn refused(reason: &'static str) {
    metrics::counter!(FEEDBACK_UNJOINED, "reason" => reason).increment(1);
}

/// The body of the reply to feedback that joined or did not: `{"id",
/// "status": "joined", "model", "version", "kind", "correct"}` or `{"id",
/// "status": "unjoined", "reason"}`.
pub fn reply_body(id: &str, joined: &Joined) -> serde_json::Value {
    let mut body = serde_json::to_value(joined).unwrap_or_default();
    body["id"] = id.into();
    body
}

/// The owner's queue is full (or it stopped): feedback is refused, to
/// send again later.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the feedback store is busy; send the feedback again later")]
pub struct Busy;

struct Kept {
    answer: Answer,
    at: Instant,
    seq: u64,
    bytes: usize,
    /// Which kinds of feedback it had: each counts once per answer.
    had_label: bool,
    had_outcome: bool,
}

/// The thread that owns the answers and the figures.
struct Owner {
    bounds: Bounds,
    kept: HashMap<String, Kept>,
    /// Ids in the order recorded, with the sequence number of the record
    /// (an id answered again leaves a stale entry behind).
    order: VecDeque<(String, u64)>,
    seq: u64,
    bytes: usize,
    /// By model, version and config version.
    figures: BTreeMap<(String, String, Option<String>), FieldQuality>,
    published: Arc<Mutex<Arc<Vec<FieldQuality>>>>,
    /// The rollout's thread, told of each feedback joined.
    rollout: Option<Observer>,
}

impl Owner {
    fn new(bounds: Bounds, published: Arc<Mutex<Arc<Vec<FieldQuality>>>>) -> Owner {
        Owner {
            bounds,
            kept: HashMap::new(),
            order: VecDeque::new(),
            seq: 0,
            bytes: 0,
            figures: BTreeMap::new(),
            published,
            rollout: None,
        }
    }

    fn run(mut self, rx: Receiver<Message>) {
        let mut changed = false;
        loop {
            // Asleep until a message or the oldest answer's expiry (to the
            // second, so a burst of answers expires in one wake-up): an idle
            // node with nothing kept does not wake at all.
            let message = match self.next_expiry(Instant::now()) {
                None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(wait) => rx.recv_timeout(wait + EXPIRY_SLACK),
            };
            match message {
                Ok(message) => {
                    self.handle(message, Instant::now());
                    // Publish after a burst (a bounded one), not after each message.
                    for message in rx.try_iter().take(QUEUE) {
                        self.handle(message, Instant::now());
                    }
                    changed = true;
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            self.expire(Instant::now());
            if std::mem::take(&mut changed) {
                self.publish();
                // Under load, woken for each answer the thread cost the node
                // a fifth of its throughput (a futex wake and a context
                // switch a request): it takes what came in batches instead,
                // and a sender finds it not waiting, so wakes no one.
                std::thread::sleep(BATCH);
            }
        }
    }

    /// How long until the oldest kept answer expires; none kept: `None`.
    fn next_expiry(&self, now: Instant) -> Option<Duration> {
        let live = self.order.iter().find_map(|(id, seq)| self.kept.get(id).filter(|k| k.seq == *seq))?;
        Some((live.at + self.bounds.window).saturating_duration_since(now))
    }

    fn handle(&mut self, message: Message, now: Instant) {
        match message {
            Message::Record(id, answer) => self.record(id, answer, now),
            Message::Join(feedback, reply) => {
                self.expire(now);
                let _ = reply.send(self.join(&feedback));
            }
        }
    }

    fn record(&mut self, id: String, answer: Answer, now: Instant) {
        let key = (answer.model.clone(), answer.version.clone(), answer.config.clone());
        let figures = self.figures.entry(key.clone()).or_insert_with(|| FieldQuality {
            model: key.0,
            version: key.1,
            config: key.2,
            ..Default::default()
        });
        figures.answers += 1;
        self.seq += 1;
        let bytes = answer.bytes(&id);
        let mut kept = Kept { answer, at: now, seq: self.seq, bytes, had_label: false, had_outcome: false };
        if let Some(old) = self.kept.get(&id) {
            // The same id answered again (a retry, an async escalation's
            // final answer): its latest answer counts, and feedback it had
            // is not counted twice.
            (kept.had_label, kept.had_outcome) = (old.had_label, old.had_outcome);
            self.bytes -= old.bytes;
        }
        self.kept.insert(id.clone(), kept);
        self.bytes += bytes;
        self.order.push_back((id, self.seq));
        // An id answered again leaves a stale entry behind: a device that
        // reuses one id must not grow the queue past the answers kept.
        if self.order.len() > 2 * self.kept.len() + 1024 {
            let kept = &self.kept;
            self.order.retain(|(id, seq)| kept.get(id).is_some_and(|k| k.seq == *seq));
        }
        while self.kept.len() > self.bounds.max_entries || self.bytes > self.bounds.max_bytes {
            if !self.pop_oldest() {
                break;
            }
            metrics::counter!(FEEDBACK_ANSWERS_DROPPED, "reason" => "evicted").increment(1);
        }
    }

    /// Drops the oldest live answer; false when none is left.
    fn pop_oldest(&mut self) -> bool {
        while let Some((id, seq)) = self.order.pop_front() {
            if self.kept.get(&id).is_some_and(|k| k.seq == seq) {
                let kept = self.kept.remove(&id).expect("just seen");
                self.bytes -= kept.bytes;
                return true;
            }
        }
        false
    }

    fn expire(&mut self, now: Instant) {
        while let Some((id, seq)) = self.order.front() {
            let live = self.kept.get(id).filter(|k| k.seq == *seq);
            match live {
                Some(k) if now.duration_since(k.at) < self.bounds.window => break,
                // A stale entry: its id was answered again, later.
                None => {
                    self.order.pop_front();
                }
                Some(_) => {
                    self.pop_oldest();
                }
            }
        }
        metrics::gauge!(FEEDBACK_ANSWERS_KEPT).set(self.kept.len() as f64);
    }

    fn join(&mut self, feedback: &Feedback) -> Joined {
        let unjoined = |reason: &'static str| Joined::Unjoined { reason };
        let Ok(says) = feedback.says() else { return unjoined("invalid") };
        let Some(kept) = self.kept.get_mut(&feedback.id) else { return unjoined("unknown_id") };
        let weight = feedback.weight();
        let answer = &kept.answer;
        let key = (answer.model.clone(), answer.version.clone(), answer.config.clone());
        let figures = self.figures.get_mut(&key).expect("every kept answer has figures");
        let (kind, field) = match says {
            Says::Label(_) if kept.had_label => return unjoined("duplicate"),
            Says::Outcome(_) if kept.had_outcome => return unjoined("duplicate"),
            Says::Label(_) if answer.label.is_none() => return unjoined("answer_has_no_label"),
            Says::Label(label) => {
                kept.had_label = true;
                ("label", FieldSays::Label { correct: answer.label.as_deref() == Some(label) })
            }
            Says::Outcome(outcome) => {
                kept.had_outcome = true;
                ("outcome", FieldSays::Outcome(outcome))
            }
        };
        let config = answer.config.clone().unwrap_or_default();
        let seen = FieldSeen { model: key.0.clone(), version: key.1.clone(), config, weight, says: field };
        figures.figures.record(&seen);
        if let Some(rollout) = &self.rollout {
            rollout.observe_field(seen);
        }
        let correct = match field {
            FieldSays::Label { correct } => Some(correct),
            FieldSays::Outcome(_) => None,
        };
        let labels = [("model", key.0.clone()), ("version", key.1.clone())];
        let by_kind = [labels[0].clone(), labels[1].clone(), ("kind", kind.to_string())];
        metrics::counter!(FEEDBACK, &by_kind).increment(1);
        if let Some(correct) = correct {
            // Also at 0: all wrong is when the accuracy alert must see it.
            metrics::counter!(FEEDBACK_CORRECT, &labels).increment(u64::from(correct));
        }
        // The gauges are per version: its configs' figures together.
        let mut version = FieldFigures::default();
        let configs = self.figures.iter().filter(|((m, v, _), _)| *m == key.0 && *v == key.1);
        configs.for_each(|(_, q)| version.add(&q.figures));
        if let Some((accuracy, ..)) = version.accuracy() {
            metrics::gauge!(FEEDBACK_ACCURACY, &labels).set(accuracy);
        }
        if let Some((mean, ..)) = version.outcome() {
            metrics::gauge!(FEEDBACK_OUTCOME_MEAN, &labels).set(mean);
        }
        Joined::Joined { model: key.0, version: key.1, kind, correct }
    }

    fn publish(&self) {
        let figures: Vec<FieldQuality> = self.figures.values().cloned().collect();
        *self.published.lock().unwrap_or_else(|e| e.into_inner()) = Arc::new(figures);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(version: &str, label: Option<&str>) -> Answer {
        Answer {
            model: "digits".into(),
            version: version.into(),
            label: label.map(Into::into),
            confidence: Some(0.9),
            served_by: "edge",
            config: None,
        }
    }

    fn owner(max_entries: usize, max_bytes: usize, window: Duration) -> Owner {
        let bounds = Bounds { window, max_entries, max_bytes };
        Owner::new(bounds, Arc::new(Mutex::new(Arc::new(Vec::new()))))
    }

    fn feedback(json: &str) -> Feedback {
        Feedback::parse(json.as_bytes()).unwrap()
    }

    #[test]
    fn labels_and_outcomes_join_the_answer_given_once_each_and_weighted() {
        let mut o = owner(100, 1 << 20, Duration::from_secs(60));
        let now = Instant::now();
        o.record("a".into(), answer("1", Some("7")), now);
        o.record("b".into(), answer("1", Some("3")), now);
        o.record("c".into(), answer("2", Some("3")), now);
        let joined = o.join(&feedback(r#"{"id": "a", "label": "7"}"#));
        assert_eq!(
            joined,
            Joined::Joined {
                model: "digits".into(),
                version: "1".into(),
                kind: "label",
                correct: Some(true)
            }
        );
        let wrong = o.join(&feedback(r#"{"id": "b", "label": "8", "weight": 3}"#));
        assert!(matches!(wrong, Joined::Joined { correct: Some(false), .. }), "{wrong:?}");
        // Once per answer and kind: a device's retry does not count twice.
        assert_eq!(
            o.join(&feedback(r#"{"id": "a", "label": "7"}"#)),
            Joined::Unjoined { reason: "duplicate" }
        );
        assert!(matches!(
            o.join(&feedback(r#"{"id": "a", "outcome": 1}"#)),
            Joined::Joined { kind: "outcome", .. }
        ));
        assert!(matches!(o.join(&feedback(r#"{"id": "c", "outcome": 0.25}"#)), Joined::Joined { .. }));
        assert_eq!(
            o.join(&feedback(r#"{"id": "zz", "label": "7"}"#)),
            Joined::Unjoined { reason: "unknown_id" }
        );
        let v1 = &o.figures[&("digits".to_string(), "1".to_string(), None)];
        assert_eq!((v1.answers, v1.figures.labels, v1.figures.outcomes), (2, 2, 1));
        // Weighted: one right of weight 1, one wrong of weight 3.
        assert_eq!(v1.accuracy(), Some(0.25));
        assert_eq!(v1.mean_outcome(), Some(1.0));
        let v2 = &o.figures[&("digits".to_string(), "2".to_string(), None)];
        assert_eq!((v2.accuracy(), v2.mean_outcome()), (None, Some(0.25)));
    }

    #[test]
    fn the_store_keeps_its_bounds_and_the_window() {
        // Entries: the oldest goes first.
        let mut o = owner(3, 1 << 20, Duration::from_secs(60));
        let now = Instant::now();
        for i in 0..5 {
            o.record(format!("id-{i}"), answer("1", Some("1")), now);
        }
        assert_eq!(o.kept.len(), 3);
        assert_eq!(
            o.join(&feedback(r#"{"id": "id-1", "label": "1"}"#)),
            Joined::Unjoined { reason: "unknown_id" }
        );
        assert!(matches!(o.join(&feedback(r#"{"id": "id-4", "label": "1"}"#)), Joined::Joined { .. }));
        // An id answered again replaces its answer and counts its bytes once.
        o.record("id-4".into(), answer("2", Some("1")), now);
        assert_eq!(o.kept.len(), 3);
        assert_eq!(o.bytes, o.kept.iter().map(|(id, k)| k.answer.bytes(id)).sum::<usize>());
        // One id answered 100,000 times: one answer, and a bounded queue.
        for _ in 0..100_000 {
            o.record("same".into(), answer("1", Some("1")), now);
        }
        assert_eq!(o.kept.len(), 3);
        assert!(o.order.len() <= 2 * o.kept.len() + 1025, "{} entries queued", o.order.len());
        // Bytes: 100,000 distinct ids in a store of 64 KiB.
        let mut o = owner(usize::MAX, 64 * 1024, Duration::from_secs(60));
        for i in 0..100_000 {
            o.record(format!("flood-{i}"), answer("1", Some("1")), now);
        }
        assert!(o.bytes <= 64 * 1024 && !o.kept.is_empty(), "{} bytes", o.bytes);
        assert!(o.order.len() <= o.kept.len() + 1, "the order queue is bounded too: {}", o.order.len());
        // An id answered again leaves its old queue entry first in line:
        // expiry skips it without taking a live answer along.
        let mut o = owner(100, 1 << 20, Duration::from_secs(60));
        for id in ["a", "b", "a"] {
            o.record(id.into(), answer("1", Some("1")), now);
        }
        o.expire(now + Duration::from_secs(1));
        assert_eq!(o.kept.len(), 2, "{:?}", o.kept.keys().collect::<Vec<_>>());
        // Feedback before an answer's replacement counts once for the id.
        assert!(matches!(o.join(&feedback(r#"{"id": "b", "label": "1"}"#)), Joined::Joined { .. }));
        o.record("b".into(), answer("2", Some("1")), now);
        assert_eq!(
            o.join(&feedback(r#"{"id": "b", "label": "1"}"#)),
            Joined::Unjoined { reason: "duplicate" }
        );
        // The window: an answer older than it is gone.
        let mut o = owner(100, 1 << 20, Duration::from_secs(60));
        o.record("old".into(), answer("1", Some("1")), now);
        o.record("new".into(), answer("1", Some("1")), now + Duration::from_secs(30));
        o.expire(now + Duration::from_secs(61));
        assert_eq!(o.kept.keys().collect::<Vec<_>>(), vec!["new"]);
    }

    #[test]
    fn bad_feedback_names_the_field_and_the_fix() {
        let cases = [
            (r#"{"id": "", "label": "1"}"#, "id: empty"),
            (r#"{"id": "a"}"#, "label or outcome"),
            (r#"{"id": "a", "label": "1", "outcome": 1}"#, "one of them"),
            (r#"{"id": "a", "outcome": 1, "weight": 0}"#, "weight: 0"),
            (r#"{"id": "a", "outcome": 1, "weight": 1e-200}"#, "from 0.000001"),
            (r#"{"id": "a", "outcome": 1, "weight": -2}"#, "weight: -2"),
            (r#"{"id": "a", "lable": "1"}"#, "unknown field `lable`"),
            (r#"{"id": "a", "outcome": "yes"}"#, "invalid type"),
            (r#"{"id": "a", "outcome": 1e200}"#, "from -1000000 to 1000000"),
            ("not json", "JSON object"),
        ];
        for (payload, want) in cases {
            let err = Feedback::parse(payload.as_bytes()).unwrap_err().to_string();
            assert!(err.contains(want), "{payload}: {err}");
        }
        let long = format!(r#"{{"id": "{}", "label": "1"}}"#, "x".repeat(MAX_FIELD_BYTES + 1));
        assert!(Feedback::parse(long.as_bytes()).unwrap_err().to_string().contains("id: 257 bytes"));
        let huge = vec![b' '; MAX_MESSAGE_BYTES + 1];
        assert!(Feedback::parse(&huge).unwrap_err().to_string().contains("at most 4096"));
    }
}
