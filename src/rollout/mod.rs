//! Which version of each model serves: the deployment state one thread
//! owns (`state.rs` holds the state and its file). Commands reach it over
//! a channel, each with its own reply channel; it writes the new state to
//! disk, then publishes it, and only then answers. Requests read the
//! published snapshot (`Rollout::current`) to pick the version, so a
//! rollback applies to the next request, with nothing reloaded.

pub mod state;

pub use state::{
    Action, Asker, Available, Decision, Deployed, Deployment, Deployments, ModelReport, RolloutError,
    VersionRecord,
};

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use tokio::sync::{mpsc, oneshot};

type Answer = oneshot::Sender<Result<Decision, RolloutError>>;

enum Command {
    Promote { model: String, version: Option<String>, available: Available, by: Asker, reply: Answer },
    Rollback { model: String, available: Available, by: Asker, reply: Answer },
}

impl Command {
    fn id(&self) -> Option<&str> {
        let (Command::Promote { by, .. } | Command::Rollback { by, .. }) = self;
        by.command_id.as_deref()
    }
}

/// The handle requests and commands use.
pub struct Rollout {
    commands: mpsc::Sender<Command>,
    current: Arc<RwLock<Arc<Deployments>>>,
}

/// Decisions waiting for the MQTT service to publish them on the events
/// topic; beyond it (a broker away for long) they are logged only.
const EVENTS: usize = 64;

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
        let (commands, inbox) = mpsc::channel(16);
        let (events, decisions) = mpsc::channel(EVENTS);
        let published = current.clone();
        std::thread::Builder::new()
            .name("rollout".into())
            .spawn(move || {
                let _held = held;
                own(state_dir, state, published, events, inbox)
            })
            .map_err(|e| RolloutError::State { path: PathBuf::from("(thread)"), reason: e.to_string() })?;
        Ok((Rollout { commands, current }, decisions))
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
        answer.await.map_err(|_| RolloutError::Stopped)?
    }
}

/// The owner: each command on a copy of the state, which replaces the
/// state only once it is on disk.
fn own(
    state_dir: PathBuf,
    mut state: Deployments,
    published: Arc<RwLock<Arc<Deployments>>>,
    events: mpsc::Sender<Decision>,
    mut inbox: mpsc::Receiver<Command>,
) {
    while let Some(command) = inbox.blocking_recv() {
        let mut next = state.clone();
        let now_s =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        // A command that came again (redelivered after a restart) gets the
        // decision it already took, and changes nothing.
        if let Some(taken) = command.id().and_then(|id| state.taken(id)).cloned() {
            let (Command::Promote { reply, .. } | Command::Rollback { reply, .. }) = command;
            let _ = reply.send(Ok(taken));
            continue;
        }
        let (outcome, reply) = match command {
            Command::Promote { model, version, available, by, reply } => {
                (next.promote(&model, version.as_deref(), &available, &by, now_s), reply)
            }
            Command::Rollback { model, available, by, reply } => {
                (next.rollback(&model, &available, &by, now_s), reply)
            }
        };
        let outcome = outcome.and_then(|decision| {
            next.save(&state_dir)?;
            Ok(decision)
        });
        if let Ok(d) = &outcome {
            tracing::info!(
                "rollout: {} {}: v{} -> v{} (by {}: {})",
                d.model,
                d.action.as_str(),
                d.from,
                d.version,
                d.by,
                d.reason
            );
            state = next;
            *published.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(state.clone());
            if events.try_send(d.clone()).is_err() {
                tracing::warn!(
                    "rollout: the events topic lags; this decision is in the log and the status only"
                );
            }
        }
        let _ = reply.send(outcome);
    }
}
