//! Which version of each model serves: the deployment state one thread
//! owns. Each file imports only those above it in this list: `candidate.rs`
//! (a version on trial), `gates.rs` (how its step is judged), `state.rs`
//! (the state, its file, promote and rollback), `plan.rs` (how a rollout
//! starts and steps), `site.rs` (one rollout per site). Commands reach it over
//! a channel, each with its own reply channel; it writes the new state to
//! disk, then publishes it, and only then answers. Requests read the
//! published snapshot (`Rollout::current`) to pick the version, so a
//! rollback applies to the next request, with nothing reloaded, and report
//! what each version answered (`Rollout::observe`); once a second the
//! thread judges each rollout's step on those figures.

pub mod ab_report;
pub mod candidate;
pub mod field;
pub mod gates;
pub mod plan;
pub mod site;
pub mod state;

pub use candidate::Candidate;
pub use field::FieldQuality;
pub use field::{FieldFigures, FieldSays, FieldSeen};
pub use gates::{Compared, Gate, GateResult, Seen, Trial, Verdict};
pub use plan::{ConfigPlan, Plan};
pub use site::{SiteIn, SiteOut, StepFigures};
pub use state::{
    Action, Asker, Available, ConfigChange, ConfigRecord, ConfigShown, Decision, Deployed, Deployment,
    Deployments, ModelReport, RolloutError, VersionRecord,
};

use gates::Window;
use site::Pooled;
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
        plan: Box<Plan>,
        available: Available,
        by: Asker,
        reply: Answer,
    },
    /// Pins the serving version as stable where none is.
    Pin {
        model: String,
        version: String,
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
    /// Something the site link heard (`site.rollout`).
    Site(SiteIn),
}

impl Command {
    fn asker(&mut self) -> Option<&mut Asker> {
        match self {
            Command::Promote { by, .. }
            | Command::Rollback { by, .. }
            | Command::Rollout { by, .. }
            | Command::Pin { by, .. }
            | Command::End { by, .. } => Some(by),
            Command::Site(_) => None,
        }
    }

    /// What it asks, in words a reused id is checked against.
    fn asked(&self) -> String {
        match self {
            Command::Promote { model, version, .. } => {
                format!("promote {model} {}", version.as_deref().map_or("newest".into(), |v| format!("v{v}")))
            }
            Command::Rollback { model, .. } => format!("rollback {model}"),
            Command::Rollout { model, plan, .. } => match &plan.config {
                Some(config) => format!("rollout {model} config {} {}", config.version, plan.mode.as_str()),
                None => format!("rollout {model} v{} {}", plan.version, plan.mode.as_str()),
            },
            Command::Pin { model, version, .. } => format!("pin {model} v{version}"),
            Command::End { model, version, .. } => format!("end the rollout of {model} v{version}"),
            Command::Site(_) => "the site's".into(),
        }
    }

    fn reply(self, outcome: Result<Decision, RolloutError>) {
        if let Command::Promote { reply, .. }
        | Command::Rollback { reply, .. }
        | Command::Rollout { reply, .. }
        | Command::Pin { reply, .. }
        | Command::End { reply, .. } = self
        {
            let _ = reply.send(outcome);
        }
    }
}

/// What wakes the owner thread besides its once-a-second judging.
enum Message {
    Seen(Seen),
    Field(FieldSeen),
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

    /// Field feedback joined with a version's answer; never waits either.
    pub fn observe_field(&self, field: FieldSeen) {
        let _ = self.0.try_send(Message::Field(field));
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
/// What waits for the site link (decisions and figures); beyond it figures
/// are dropped (the next second sends them again) and a decision waits
/// for the next one of its model.
const SITE_OUT: usize = 256;
/// How often each rollout's step is judged (and a decision not yet on disk
/// saved again).
const JUDGE_EVERY: Duration = Duration::from_secs(1);
/// The longest a command waits for the owner thread: one stuck on a hung
/// state disk must not hold a control command's place in the in-order
/// MQTT acknowledgements, or an HTTP client, without limit.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

impl Rollout {
    /// Reads the state in `state_dir` and starts the thread that owns it;
    /// each decision taken from then on comes out of the receiver, once.
    /// With `site` (`site.rollout`), the state of each model is the site's:
    /// what the node decides goes out of the third receiver to the site
    /// link, and what the site link hears comes in through `site_in`.
    #[allow(clippy::type_complexity)]
    pub fn start(
        state_dir: PathBuf,
        site: bool,
    ) -> Result<(Rollout, mpsc::Receiver<Decision>, Option<mpsc::Receiver<SiteOut>>), RolloutError> {
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
        let (site, to_site) = match site {
            true => {
                let (out, to_site) = mpsc::channel(SITE_OUT);
                let link = SiteLink {
                    out,
                    judge: false,
                    synced: false,
                    pooled: Pooled::default(),
                    site_seq: HashMap::new(),
                };
                (Some(link), Some(to_site))
            }
            false => (None, None),
        };
        let owner = Owner {
            state_dir,
            state,
            published: current.clone(),
            trials: trials.clone(),
            events,
            windows: HashMap::new(),
            site,
        };
        // A node of a site serves stable alone until it reads the site's state.
        owner.publish();
        std::thread::Builder::new()
            .name("rollout".into())
            .spawn(move || {
                let _held = held;
                owner.run(inbox, received)
            })
            .map_err(|e| RolloutError::State { path: PathBuf::from("(thread)"), reason: e.to_string() })?;
        Ok((Rollout { commands, messages, current, trials }, decisions, to_site))
    }

    /// What the site link heard, for the owner thread.
    pub async fn site_in(&self, heard: SiteIn) {
        if self.commands.send(Command::Site(heard)).await.is_ok() {
            let _ = self.messages.try_send(Message::Command);
        }
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
        self.ask_blocking(
            Command::Rollout { model: model.into(), plan: Box::new(plan), available, by, reply },
            answer,
        )
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
        self.ask(Command::Rollout { model: model.into(), plan: Box::new(plan), available, by, reply }, answer)
            .await
    }

    /// Pins `version`, the one serving, as `model`'s stable where none is.
    pub async fn pin(&self, model: &str, version: &str, by: Asker) -> Result<Decision, RolloutError> {
        let (reply, answer) = oneshot::channel();
        self.ask(Command::Pin { model: model.into(), version: version.into(), by, reply }, answer).await
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
        let asked = async {
            self.commands.send(command).await.map_err(|_| RolloutError::Stopped)?;
            // If the wake-up does not fit, the thread is busy counting
            // answers and reads the command channel after each.
            let _ = self.messages.try_send(Message::Command);
            answer.await.map_err(|_| RolloutError::Stopped)?
        };
        tokio::time::timeout(ANSWER_WITHIN, asked)
            .await
            .unwrap_or(Err(RolloutError::Slow { waited_s: ANSWER_WITHIN.as_secs() }))
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
    /// With `site.rollout`: the way to the site, and what it said.
    site: Option<SiteLink>,
}

struct SiteLink {
    out: mpsc::Sender<SiteOut>,
    /// This node judges the site's rollouts.
    judge: bool,
    /// This node reads the site's state (else it serves stable alone).
    synced: bool,
    /// The other nodes' figures.
    pooled: Pooled,
    /// The `seq` of each model's deployment the site holds, as last heard.
    site_seq: HashMap<String, u64>,
}

impl Owner {
    fn run(mut self, mut inbox: mpsc::Receiver<Command>, received: Receiver<Message>) {
        let mut judged = Instant::now();
        loop {
            // With no rollout to judge and nothing to save again, nothing
            // happens until a command comes: sleep until then, not a second.
            let idle = self.state.candidates().next().is_none() && !self.state.has_unsaved();
            let message = match idle {
                true => received.recv().map_err(|_| RecvTimeoutError::Disconnected),
                false => received.recv_timeout(JUDGE_EVERY.saturating_sub(judged.elapsed())),
            };
            match message {
                Ok(Message::Seen(seen)) => self.count(&seen),
                Ok(Message::Field(field)) => self.count_field(&field),
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
                self.save_again();
                self.judge();
            }
        }
    }

    /// `seen` into its model's window, if it was routed in the step that
    /// runs now and is an answer of the candidate or of stable.
    fn count(&mut self, seen: &Seen) {
        let Some(deployment) = self.state.models.get(&seen.model) else { return };
        let Some(candidate) = &deployment.candidate else { return };
        let is_candidate = candidate.answered(&seen.version, &seen.config);
        if seen.step_id != candidate.step_id || (!is_candidate && seen.version != deployment.stable) {
            return;
        }
        self.window(&seen.model, candidate.step_id).record(seen, is_candidate);
    }

    /// `field` into its model's window when it is about the candidate or
    /// stable: in the step running now, whenever the answer was given.
    fn count_field(&mut self, field: &FieldSeen) {
        let Some(deployment) = self.state.models.get(&field.model) else { return };
        let Some(candidate) = &deployment.candidate else { return };
        let is_candidate = candidate.answered(&field.version, &field.config);
        if !is_candidate && field.version != deployment.stable {
            return;
        }
        let step_id = candidate.step_id;
        self.window(&field.model, step_id).record_field(field, is_candidate);
    }

    /// The figures of `model`'s step `step_id`: empty when that step is new.
    fn window(&mut self, model: &str, step_id: u64) -> &mut Window {
        let (for_step, window) = self.windows.entry(model.to_string()).or_default();
        if *for_step != step_id {
            (*for_step, *window) = (step_id, Window::default());
        }
        window
    }

    fn command(&mut self, mut command: Command) {
        let asked = command.asked();
        let Some(asker) = command.asker() else {
            if let Command::Site(heard) = command {
                self.heard(heard);
            }
            return;
        };
        asker.asked = Some(asked.clone());
        // A command that came again (redelivered after a restart) gets the
        // decision it already took, and changes nothing; an id reused for
        // another command is refused (older decisions did not keep what
        // they were asked: taken as the same).
        let id = asker.command_id.clone();
        if let Some(taken) = id.as_deref().and_then(|id| self.state.taken(id)).cloned() {
            let outcome = match taken.command {
                Some(was) if was != asked => {
                    Err(RolloutError::IdReused { id: id.unwrap_or_default(), was, now: asked })
                }
                _ => Ok(taken),
            };
            return command.reply(outcome);
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
                (next.start_rollout(&model, *plan, &available, &by, now_s), reply)
            }
            Command::Pin { model, version, by, reply } => (next.pin(&model, &version, &by, now_s), reply),
            Command::End { model, version, by, reply } => {
                let running = next.models.get(&model).and_then(|d| d.candidate.as_ref());
                // A config rollout runs on stable's version: not the one asked about.
                let running = running.filter(|c| c.config.is_none()).map(|c| &c.version);
                let ended =
                    if running == Some(&version) { next.abandon(&model, &by, now_s, None) } else { None };
                let why = format!("no rollout of v{version} runs");
                (ended.ok_or(RolloutError::NothingToRollBack { model, why }), reply)
            }
            Command::Site(_) => return,
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
            self.window(model, candidate.step_id);
            let own = &self.windows[model].1;
            let trial = match &self.site {
                Some(site) => {
                    // This node's figures to the site; the others' pooled in.
                    let figures = StepFigures { step_id: candidate.step_id, window: own.to_wire() };
                    let trial =
                        site.pooled.pooled(model, candidate.step_id, &figures.window).trial(model, candidate);
                    let _ = site
                        .out
                        .try_send(SiteOut::Figures { model: model.clone(), figures: Box::new(figures) });
                    trial
                }
                None => own.trial(model, candidate),
            };
            for gate in &trial.gates {
                show_gate(model, &gate.gate, Some(gate.result));
            }
            metrics::gauge!(ROLLOUT_STEP, "model" => model.clone()).set(f64::from(candidate.share()));
            verdicts.push((model.clone(), gates::verdict(candidate, trial.gates.clone(), now_s)));
            trials.insert(model.clone(), trial);
        }
        *self.trials.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(trials);
        // In a site, one node decides: the others show the same figures.
        if self.site.as_ref().is_some_and(|site| !(site.judge && site.synced)) {
            return;
        }
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
    /// sent to the events topic. A decision that sends traffic back to
    /// stable (a rollback, a failed gate) or holds a step takes effect even
    /// when the disk refuses it, marked unsaved until a later save works;
    /// one that widens a candidate's share waits for the disk.
    fn apply(&mut self, mut next: Deployments, decision: Decision) -> Result<Decision, RolloutError> {
        if let Some(deployment) = next.models.get_mut(&decision.model) {
            deployment.seq += 1;
        }
        match next.save(&self.state_dir) {
            Ok(()) => next.models.values_mut().for_each(|d| d.unsaved = None),
            Err(e) if matches!(decision.action, Action::RolledBack | Action::Held) => {
                tracing::error!(
                    "rollout of {}: {} in service but not on disk ({e}); saving it again every second",
                    decision.model,
                    decision.action.as_str()
                );
                if let Some(d) = next.models.get_mut(&decision.model) {
                    d.unsaved = Some(format!(
                        "{} at {} s not on disk yet: {e}",
                        decision.action.label(),
                        decision.at_s
                    ));
                }
            }
            Err(e) => return Err(e),
        }
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
        self.publish();
        if let (Some(site), Some(deployment)) = (&self.site, self.state.models.get(&d.model)) {
            let out = SiteOut::State { model: d.model.clone(), deployment: Box::new(deployment.clone()) };
            if site.out.try_send(out).is_err() {
                tracing::warn!(
                    "rollout: the site link lags; {}'s decision reaches the site with its next",
                    d.model
                );
            }
        }
        if self.events.try_send(decision.clone()).is_err() {
            tracing::warn!("rollout: the events topic lags; this decision is in the log and the status only");
        }
        Ok(decision)
    }
}

impl Owner {
    /// The state in service for requests: in a site, candidates only while
    /// this node reads the site's state (one that cannot serves stable
    /// alone, so it never routes a device against the site's step).
    fn publish(&self) {
        let mut serving = self.state.clone();
        if self.site.as_ref().is_some_and(|site| !site.synced) {
            serving.models.values_mut().for_each(|d| d.candidate = None);
        }
        *self.published.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(serving);
    }

    /// What the site link heard.
    fn heard(&mut self, heard: SiteIn) {
        let Some(site) = &mut self.site else { return };
        match heard {
            SiteIn::Figures { node, model, figures } => site.pooled.insert(node, model, *figures),
            SiteIn::Judge(judge) => {
                if site.judge != judge {
                    tracing::info!(
                        "rollout: this node {} the site's rollouts",
                        if judge { "judges" } else { "no longer judges" }
                    );
                }
                site.judge = judge;
            }
            SiteIn::Synced(synced) => {
                site.synced = synced;
                if synced {
                    // What this node decided while the site could not hear
                    // it (or kept on disk across a broker restart that lost
                    // the retained state) goes out, if newer than the site's.
                    for (model, deployment) in &self.state.models {
                        if deployment.seq > site.site_seq.get(model).copied().unwrap_or(0) {
                            let deployment = Box::new(deployment.clone());
                            let _ = site.out.try_send(SiteOut::State { model: model.clone(), deployment });
                        }
                    }
                }
                self.publish();
            }
            SiteIn::State { model, deployment } => {
                site.site_seq.insert(model.clone(), deployment.seq);
                self.adopt(model, *deployment);
            }
        }
    }

    /// The site's deployment of `model`, when newer than this node's: saved,
    /// then in service (a decision taken elsewhere, published there).
    fn adopt(&mut self, model: String, mut deployment: Deployment) {
        if !site::newer(&deployment, self.state.models.get(&model)) {
            return;
        }
        deployment.unsaved = None;
        let mut next = self.state.clone();
        let before = next.models.insert(model.clone(), deployment);
        let step = |d: Option<&Deployment>| d.and_then(|d| d.candidate.as_ref()).map(|c| c.step_id);
        if let Err(e) = next.save(&self.state_dir) {
            tracing::error!(
                "rollout of {model}: the site's state is in service but not on disk ({e}); saving it again every second"
            );
            if let Some(d) = next.models.get_mut(&model) {
                d.unsaved = Some(format!("the site's state not on disk yet: {e}"));
            }
        }
        if step(before.as_ref()) != step(next.models.get(&model)) {
            let mut trials = (**self.trials.read().unwrap_or_else(|e| e.into_inner())).clone();
            trials.remove(&model);
            *self.trials.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(trials);
            if step(next.models.get(&model)).is_none() {
                metrics::gauge!(ROLLOUT_STEP, "model" => model.clone()).set(0.0);
                for gate in gates::GATES {
                    show_gate(&model, gate, None);
                }
            }
        }
        if let Some(last) = next.models.get(&model).and_then(|d| d.history.last()) {
            tracing::info!(
                "rollout: {model}: the site's state: {} v{} (by {}: {})",
                last.action.as_str(),
                last.version,
                last.by,
                last.reason
            );
        }
        self.state = next;
        self.publish();
    }

    /// A state in service but not on disk, saved again; once saved, no
    /// longer marked.
    fn save_again(&mut self) {
        if !self.state.has_unsaved() {
            return;
        }
        let mut saved = self.state.clone();
        saved.models.values_mut().for_each(|d| d.unsaved = None);
        match saved.save(&self.state_dir) {
            Ok(()) => {
                tracing::info!("rollout: the deployment state is on disk again");
                self.state = saved;
                self.publish();
            }
            Err(e) => tracing::warn!("rollout: the deployment state is still not on disk: {e}"),
        }
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
