//! Which version of each model serves: the deployment state one thread
//! owns (`state.rs` holds the state and its file, `candidate.rs` a
//! rollout's steps, `gates.rs` how a step is judged). Commands reach it over
//! a channel, each with its own reply channel; it writes the new state to
//! disk, then publishes it, and only then answers. Requests read the
//! published snapshot (`Rollout::current`) to pick the version, so a
//! rollback applies to the next request, with nothing reloaded, and report
//! what each version answered (`Rollout::observe`); once a second the
//! thread judges each rollout's step on those figures.

pub mod candidate;
pub mod gates;
pub mod state;

pub use candidate::{Candidate, Plan};
pub use gates::{Compared, Gate, GateResult, Seen, Trial, Verdict};
pub use state::{
    Action, Asker, Available, Decision, Deployed, Deployment, Deployments, ModelReport, RolloutError,
    VersionRecord,
};

use gates::Window;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// The candidate's share of devices in percent, by model (0: no rollout).
pub const ROLLOUT_STEP: &str = "edgeinfer_rollout_step";
/// 1 for each gate's latest result, 0 for its other results.
pub const ROLLOUT_GATE: &str = "edgeinfer_rollout_gate";
/// Decisions taken, by model and action.
pub const ROLLOUT_DECISIONS: &str = "edgeinfer_rollout_decisions_total";

type Answer = oneshot::Sender<Result<Decision, RolloutError>>;

enum Command {
    Promote {
        model: String,
        version: Option<String>,
        available: Available,
        by: Asker,
        reply: Answer,
    },
    Rollback {
        model: String,
        available: Available,
        by: Asker,
        reply: Answer,
    },
    Rollout {
        model: String,
        plan: Plan,
        available: Available,
        by: Asker,
        reply: Answer,
    },
    /// Ends the rollout of `version`, only if it is the one running.
    End {
        model: String,
        version: String,
        by: Asker,
        reply: Answer,
    },
}

impl Command {
    fn id(&self) -> Option<&str> {
        let (Command::Promote { by, .. }
        | Command::Rollback { by, .. }
        | Command::Rollout { by, .. }
        | Command::End { by, .. }) = self;
        by.command_id.as_deref()
    }
}

/// What wakes the owner thread besides its once-a-second judging.
enum Message {
    Seen(Seen),
    /// A command waits in the command channel.
    Command,
}

/// Reports answers of the versions in a rollout to its owner thread.
#[derive(Clone)]
pub struct Observer(SyncSender<Message>);

impl Observer {
    /// Never waits: when the thread is behind, the answer is not counted.
    pub fn observe(&self, seen: Seen) {
        let _ = self.0.try_send(Message::Seen(seen));
    }
}

/// The handle requests and commands use.
pub struct Rollout {
    commands: mpsc::Sender<Command>,
    messages: SyncSender<Message>,
    current: Arc<RwLock<Arc<Deployments>>>,
    trials: Arc<RwLock<Arc<BTreeMap<String, Trial>>>>,
}

/// Decisions waiting for the MQTT service to publish them on the events
/// topic; beyond it (a broker away for long) they are logged only.
const EVENTS: usize = 64;
/// Answers reported and not yet counted; beyond it (the thread is behind)
/// they are dropped, which only makes a step wait longer for its samples.
const SEEN: usize = 4096;
/// How often each rollout's step is judged.
const JUDGE_EVERY: Duration = Duration::from_secs(1);

impl Rollout {
    /// Reads the state in `state_dir` and starts the thread that owns it;
    /// each decision taken from then on comes out of the receiver, once.
    pub fn start(state_dir: PathBuf) -> Result<(Rollout, mpsc::Receiver<Decision>), RolloutError> {
        // Held for the process's life, and taken before the state is read:
        // a command run without a node writes only while no node holds it.
        // A command holds it for milliseconds, so wait a little for it.
        let mut held = state::lock(&state_dir)?;
        for _ in 0..40 {
            if held.is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
            held = state::lock(&state_dir)?;
        }
        let Some(held) = held else {
            return Err(RolloutError::State {
                path: state_dir.join(state::LOCK_NAME),
                reason:
                    "held by another process: another node uses this node.state_dir; give each node its own"
                        .into(),
            });
        };
        let state = Deployments::load(&state_dir)?;
        let current = Arc::new(RwLock::new(Arc::new(state.clone())));
        let trials = Arc::new(RwLock::new(Arc::new(BTreeMap::new())));
        let (commands, inbox) = mpsc::channel(16);
        let (messages, received) = sync_channel(SEEN);
        let (events, decisions) = mpsc::channel(EVENTS);
        let owner = Owner {
            state_dir,
            state,
            published: current.clone(),
            trials: trials.clone(),
            events,
            windows: HashMap::new(),
        };
        std::thread::Builder::new()
            .name("rollout".into())
            .spawn(move || {
                let _held = held;
                owner.run(inbox, received)
            })
            .map_err(|e| RolloutError::State { path: PathBuf::from("(thread)"), reason: e.to_string() })?;
        Ok((Rollout { commands, messages, current, trials }, decisions))
    }

    /// `start_rollout` for a thread outside the async runtime (a reload).
    pub fn start_rollout_blocking(
        &self,
        model: &str,
        plan: Plan,
        available: Available,
        by: Asker,
    ) -> Result<Decision, RolloutError> {
        let (reply, answer) = oneshot::channel();
        self.ask_blocking(Command::Rollout { model: model.into(), plan, available, by, reply }, answer)
    }

    /// Ends the rollout of `model` v`version`, only if it is the one
    /// running (nothing else rolls back), from a thread outside the async
    /// runtime (a reload that started it, then failed).
    pub fn end_rollout_blocking(
        &self,
        model: &str,
        version: &str,
        by: Asker,
    ) -> Result<Decision, RolloutError> {
        let (reply, answer) = oneshot::channel();
        self.ask_blocking(Command::End { model: model.into(), version: version.into(), by, reply }, answer)
    }

    fn ask_blocking(
        &self,
        command: Command,
        answer: oneshot::Receiver<Result<Decision, RolloutError>>,
    ) -> Result<Decision, RolloutError> {
        self.commands.blocking_send(command).map_err(|_| RolloutError::Stopped)?;
        let _ = self.messages.try_send(Message::Command);
        answer.blocking_recv().map_err(|_| RolloutError::Stopped)?
    }

    /// Each running rollout's step as last judged, by model. Read it after
    /// `current`: a decision removes its model's figures before it
    /// publishes the state.
    pub fn trials(&self) -> Arc<BTreeMap<String, Trial>> {
        self.trials.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Where requests report what the versions in a rollout answered.
    pub fn observer(&self) -> Observer {
        Observer(self.messages.clone())
    }

    pub async fn start_rollout(
        &self,
        model: &str,
        plan: Plan,
        available: Available,
        by: Asker,
    ) -> Result<Decision, RolloutError> {
        let (reply, answer) = oneshot::channel();
        self.ask(Command::Rollout { model: model.into(), plan, available, by, reply }, answer).await
    }

    /// The state in service now.
    pub fn current(&self) -> Arc<Deployments> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub async fn promote(
        &self,
        model: &str,
        version: Option<&str>,
        available: Available,
        by: Asker,
    ) -> Result<Decision, RolloutError> {
        let (reply, answer) = oneshot::channel();
        let (model, version) = (model.to_string(), version.map(str::to_string));
        self.ask(Command::Promote { model, version, available, by, reply }, answer).await
    }

    pub async fn rollback(
        &self,
        model: &str,
        available: Available,
        by: Asker,
    ) -> Result<Decision, RolloutError> {
        let (reply, answer) = oneshot::channel();
        let model = model.to_string();
        self.ask(Command::Rollback { model, available, by, reply }, answer).await
    }

    async fn ask(
        &self,
        command: Command,
        answer: oneshot::Receiver<Result<Decision, RolloutError>>,
    ) -> Result<Decision, RolloutError> {
        self.commands.send(command).await.map_err(|_| RolloutError::Stopped)?;
        // If the wake-up does not fit, the thread is busy counting answers
        // and reads the command channel after each.
        let _ = self.messages.try_send(Message::Command);
        answer.await.map_err(|_| RolloutError::Stopped)?
    }
}

/// The thread that owns the state and the figures of each rollout's step.
struct Owner {
    state_dir: PathBuf,
    state: Deployments,
    published: Arc<RwLock<Arc<Deployments>>>,
    trials: Arc<RwLock<Arc<BTreeMap<String, Trial>>>>,
    events: mpsc::Sender<Decision>,
    /// The figures of each model's step, with the step (`step_id`) they are for.
    windows: HashMap<String, (u64, Window)>,
}

impl Owner {
    fn run(mut self, mut inbox: mpsc::Receiver<Command>, received: Receiver<Message>) {
        let mut judged = Instant::now();
        loop {
            match received.recv_timeout(JUDGE_EVERY.saturating_sub(judged.elapsed())) {
                Ok(Message::Seen(seen)) => self.count(&seen),
                Ok(Message::Command) | Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            loop {
                match inbox.try_recv() {
                    Ok(command) => self.command(command),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => return,
                }
            }
            if judged.elapsed() >= JUDGE_EVERY {
                judged = Instant::now();
                self.judge();
            }
        }
    }

    /// `seen` into its model's window, if it was routed in the step that
    /// runs now and is an answer of the candidate or of stable.
    fn count(&mut self, seen: &Seen) {
        let Some(deployment) = self.state.models.get(&seen.model) else { return };
        let Some(candidate) = &deployment.candidate else { return };
        let is_candidate = seen.version == candidate.version;
        if seen.step_id != candidate.step_id || (!is_candidate && seen.version != deployment.stable) {
            return;
        }
        self.window(&seen.model, candidate.step_id).record(seen, is_candidate);
    }

    /// The figures of `model`'s step `step_id`: empty when that step is new.
    fn window(&mut self, model: &str, step_id: u64) -> &mut Window {
        let (for_step, window) = self.windows.entry(model.to_string()).or_default();
        if *for_step != step_id {
            (*for_step, *window) = (step_id, Window::default());
        }
        window
    }

    fn command(&mut self, command: Command) {
        // A command that came again (redelivered after a restart) gets the
        // decision it already took, and changes nothing.
        if let Some(taken) = command.id().and_then(|id| self.state.taken(id)).cloned() {
            let (Command::Promote { reply, .. }
            | Command::Rollback { reply, .. }
            | Command::Rollout { reply, .. }
            | Command::End { reply, .. }) = command;
            let _ = reply.send(Ok(taken));
            return;
        }
        let now_s = unix_now();
        let mut next = self.state.clone();
        let (outcome, reply) = match command {
            Command::Promote { model, version, available, by, reply } => {
                (next.promote(&model, version.as_deref(), &available, &by, now_s), reply)
            }
            Command::Rollback { model, available, by, reply } => {
                (next.rollback(&model, &available, &by, now_s), reply)
            }
            Command::Rollout { model, plan, available, by, reply } => {
                (next.start_rollout(&model, plan, &available, &by, now_s), reply)
            }
            Command::End { model, version, by, reply } => {
                let running = next.models.get(&model).and_then(|d| d.candidate.as_ref()).map(|c| &c.version);
                let ended =
                    if running == Some(&version) { next.abandon(&model, &by, now_s, None) } else { None };
                let why = format!("no rollout of v{version} runs");
                (ended.ok_or(RolloutError::NothingToRollBack { model, why }), reply)
            }
        };
        let outcome = outcome.and_then(|decision| self.apply(next, decision));
        let _ = reply.send(outcome);
    }

    /// Judges each rollout's step, publishes the figures, and takes the
    /// decision the gates call for.
    fn judge(&mut self) {
        let now_s = unix_now();
        let mut trials = BTreeMap::new();
        let mut verdicts = Vec::new();
        let running: Vec<(String, Candidate)> =
            self.state.candidates().map(|(m, c)| (m.clone(), c.clone())).collect();
        for (model, candidate) in &running {
            let trial = self.window(model, candidate.step_id).trial(model, candidate);
            for gate in &trial.gates {
                show_gate(model, &gate.gate, Some(gate.result));
            }
            metrics::gauge!(ROLLOUT_STEP, "model" => model.clone()).set(f64::from(candidate.share()));
            verdicts.push((model.clone(), gates::verdict(candidate, trial.gates.clone(), now_s)));
            trials.insert(model.clone(), trial);
        }
        *self.trials.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(trials);
        for (model, verdict) in verdicts {
            let mut next = self.state.clone();
            if let Some(decision) = next.judged(&model, verdict, now_s)
                && let Err(e) = self.apply(next, decision)
            {
                tracing::error!("rollout of {model}: the decision could not be saved ({e}); it is retried");
            }
        }
    }

    /// `next` on disk, then in service; the decision logged, counted and
    /// sent to the events topic.
    fn apply(&mut self, next: Deployments, decision: Decision) -> Result<Decision, RolloutError> {
        next.save(&self.state_dir)?;
        let d = &decision;
        tracing::info!(
            "rollout: {} {}: v{} -> v{} (by {}: {})",
            d.model,
            d.action.as_str(),
            d.from,
            d.version,
            d.by,
            d.reason
        );
        metrics::counter!(ROLLOUT_DECISIONS, "model" => d.model.clone(), "action" => d.action.label())
            .increment(1);
        if next.models.get(&d.model).is_none_or(|m| m.candidate.is_none()) {
            // No rollout runs: no step, no gate results (the decision has them).
            metrics::gauge!(ROLLOUT_STEP, "model" => d.model.clone()).set(0.0);
            for gate in gates::GATES {
                show_gate(&d.model, gate, None);
            }
        }
        // Figures of a step this decision ends (a hold does not) are gone
        // before the new state is published (readers take the state, then
        // the figures), until the next judging fills them for the step now
        // running.
        let step_id = |state: &Deployments| Some(state.models.get(&d.model)?.candidate.as_ref()?.step_id);
        let mut published = self.trials.write().unwrap_or_else(|e| e.into_inner());
        if step_id(&self.state) != step_id(&next) && published.contains_key(&d.model) {
            let mut trials = (**published).clone();
            trials.remove(&d.model);
            *published = Arc::new(trials);
        }
        drop(published);
        self.state = next;
        *self.published.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(self.state.clone());
        if self.events.try_send(decision.clone()).is_err() {
            tracing::warn!("rollout: the events topic lags; this decision is in the log and the status only");
        }
        Ok(decision)
    }
}

/// Gate `gate` of `model`'s rollout as the metrics show it: 1 for its
/// `current` result, 0 for the others (all 0 with none running).
fn show_gate(model: &str, gate: &str, current: Option<GateResult>) {
    for result in GateResult::ALL {
        let labels =
            [("model", model.to_string()), ("gate", gate.to_string()), ("result", result.as_str().into())];
        metrics::gauge!(ROLLOUT_GATE, &labels).set(if current == Some(result) { 1.0 } else { 0.0 });
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
