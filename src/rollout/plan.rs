//! How a rollout is asked for, starts, moves from step to step on its
//! gates' verdicts, holds, or ends (promoted, or rolled back). Each change
//! is a decision in the model's history, like a promote or a rollback.

use super::candidate::Candidate;
use super::gates::Verdict;
use super::state::{
    Action, Asker, Available, ConfigChange, ConfigRecord, Decision, Deployment, Deployments, RolloutError,
    keep_last, promote_config, record, versions_of,
};
use crate::config::serving::{ServingConfig, parse_change, sha256_of};
use crate::config::{OnInconclusive, RolloutMode, RolloutPolicy};

/// How a rollout is asked for.
#[derive(Debug, Clone)]
pub struct Plan {
    pub version: String,
    pub mode: RolloutMode,
    pub policy: RolloutPolicy,
    /// The version that served before the change that brought the
    /// candidate (a reload or a restart): pinned as stable when none is.
    /// Without it, the newest version other than the candidate.
    pub serving_before: Option<String>,
    /// A config rollout: the config on trial, on stable's version (then
    /// `version` is filled in when it starts).
    pub config: Option<ConfigPlan>,
}

/// A config candidate, worked out over the stable config.
#[derive(Debug, Clone)]
pub struct ConfigPlan {
    pub version: String,
    pub record: ConfigRecord,
    /// The stable config it was worked out over (`Deployment::stable_config`):
    /// if another is stable by the time it starts, it is refused.
    pub base: Option<String>,
    pub base_version: String,
}

impl ConfigPlan {
    /// `file` (a config candidate) over the stable config of `deployment`
    /// (the promoted one, else `node`'s): refused when it does not read,
    /// sets a value out of range, or changes nothing.
    pub fn new(
        file: &str,
        deployment: Option<&Deployment>,
        node: &ServingConfig,
        by: &str,
        now_s: u64,
    ) -> Result<ConfigPlan, RolloutError> {
        let change = parse_change(file).map_err(RolloutError::BadConfig)?;
        let stable = deployment.map_or_else(|| node.clone(), |d| d.serving_config(node));
        let candidate = stable.with_change(&change);
        if let Some((key, why)) = candidate.problems("config").into_iter().next() {
            return Err(RolloutError::BadConfig(format!("{key} = {why}")));
        }
        let text = candidate.text();
        let sha256 = sha256_of(&text);
        let (version, base_version) = (sha256[..12].to_string(), stable.version());
        if version == base_version {
            return Err(RolloutError::BadConfig(format!(
                "it changes nothing: the stable config (version {base_version}) already has these values"
            )));
        }
        let record = ConfigRecord { text, sha256, file: file.to_string(), at_s: now_s, by: by.to_string() };
        let base = deployment.and_then(|d| d.stable_config.clone());
        Ok(ConfigPlan { version, record, base, base_version })
    }
}

impl Deployment {
    /// The config serving this model: the promoted one, else `node`'s (also
    /// when the record lost its text: never the case for a state this
    /// code wrote).
    pub fn serving_config(&self, node: &ServingConfig) -> ServingConfig {
        self.stable_config
            .as_ref()
            .and_then(|v| self.configs.get(v))
            .and_then(|r| ServingConfig::from_text(&r.text).ok())
            .unwrap_or_else(|| node.clone())
    }
}

impl Plan {
    /// `models rollout`'s request: the version, the mode (default canary),
    /// and the model's `policy` with the command's `--steps` and `--gates`.
    pub fn new(
        version: Option<&str>,
        mode: Option<&str>,
        policy: &RolloutPolicy,
        (steps, gates): (Option<&str>, Option<&str>),
    ) -> Result<Plan, RolloutError> {
        use RolloutError::BadPolicy;
        let version = version
            .filter(|v| !v.is_empty())
            .ok_or_else(|| BadPolicy("version: name the version to roll out".into()))?;
        let mode = match mode.filter(|m| !m.is_empty()) {
            None => RolloutMode::Canary,
            Some(m) => RolloutMode::parse(m)
                .ok_or_else(|| BadPolicy(format!("mode {m:?}: use canary, shadow or ab")))?,
        };
        let policy = policy.with_overrides(steps, gates).map_err(BadPolicy)?;
        Ok(Plan { version: version.to_string(), mode, policy, serving_before: None, config: None })
    }

    /// `models rollout`'s request as a node or the state file takes it: a
    /// version (`new`), or a config candidate `file` over the stable config
    /// of `deployment` (`node`, the node config's, where none was promoted)
    /// on stable's version, by `by`.
    #[allow(clippy::too_many_arguments)]
    pub fn asked(
        (version, file): (Option<&str>, Option<&str>),
        mode: Option<&str>,
        policy: &RolloutPolicy,
        overrides: (Option<&str>, Option<&str>),
        (deployment, node): (Option<&Deployment>, &ServingConfig),
        by: &str,
        now_s: u64,
    ) -> Result<Plan, RolloutError> {
        let Some(file) = file else { return Plan::new(version, mode, policy, overrides) };
        if let Some(v) = version.filter(|v| !v.is_empty()) {
            return Err(RolloutError::BadConfig(format!(
                "it runs on stable's model version; name no version (v{v} was named)"
            )));
        }
        let config = ConfigPlan::new(file, deployment, node, by, now_s)?;
        Plan::for_config(config, mode, policy, overrides)
    }

    /// `config` on stable's version, with the mode and policy as `new`
    /// takes them.
    fn for_config(
        config: ConfigPlan,
        mode: Option<&str>,
        policy: &RolloutPolicy,
        overrides: (Option<&str>, Option<&str>),
    ) -> Result<Plan, RolloutError> {
        let plan = Plan::new(Some("stable"), mode, policy, overrides)?;
        Ok(Plan { version: String::new(), config: Some(config), ..plan })
    }
}

impl Deployments {
    /// Starts trying `plan.version` against the version that serves without
    /// it, which is pinned as stable: the pinned stable; without one, the
    /// version that served before the change (`Plan::serving_before`), so a
    /// second new version found at the same time never becomes stable
    /// untried; without that, the newest other version.
    pub fn start_rollout(
        &mut self,
        model: &str,
        mut plan: Plan,
        available: &Available,
        asker: &Asker,
        now_s: u64,
    ) -> Result<Decision, RolloutError> {
        let versions = versions_of(model, available)?;
        if let Some(config) = plan.config.take() {
            return self.start_config_rollout(model, plan, config, available, asker, now_s);
        }
        if !versions.contains(&plan.version) {
            return Err(RolloutError::UnknownVersion {
                model: model.into(),
                version: plan.version,
                known: versions.join(", "),
            });
        }
        self.may_start(model, &plan.policy)?;
        // What serves once the candidate is set aside.
        let mut others = available.clone();
        others.entry(model.to_string()).or_default().retain(|v| *v != plan.version);
        let before = plan.serving_before.as_ref().filter(|v| **v != plan.version && versions.contains(v));
        let newest_other = self.serving(model, &others).unwrap_or_default().to_string();
        let stable = match (self.stable(model).filter(|s| versions.iter().any(|v| v == s)), before) {
            (Some(pinned), _) => pinned.to_string(),
            (None, Some(before)) => before.clone(),
            (None, None) => newest_other,
        };
        if self.stable(model).is_some_and(|s| s == plan.version) {
            return Err(RolloutError::AlreadyStable { model: model.into(), version: plan.version });
        }
        if stable.is_empty() {
            return Err(RolloutError::NothingToRollBack {
                model: model.into(),
                why: format!("v{} is its only version; a rollout needs a stable one beside it", plan.version),
            });
        }
        let deployment = self.models.entry(model.to_string()).or_default();
        let mut decision = Decision::new(model, Action::Started, &plan.version, &stable, asker, now_s);
        deployment.stable = stable;
        let candidate = Candidate::starting((plan.version, None), (plan.mode, plan.policy), &asker.by, now_s);
        decision.reason = format!("{} started: {}", candidate.mode.as_str(), candidate.describe_step());
        deployment.candidate = Some(candidate);
        Ok(record(deployment, decision))
    }

    /// Refuses a rollout whose policy does not hold, or while another runs.
    fn may_start(&self, model: &str, policy: &RolloutPolicy) -> Result<(), RolloutError> {
        policy.check().map_err(|(key, why)| RolloutError::BadPolicy(format!("{key}: {why}")))?;
        match self.models.get(model).and_then(|d| d.candidate.as_ref()) {
            Some(c) => Err(RolloutError::InRollout {
                model: model.into(),
                version: c.version.clone(),
                mode: c.mode.as_str(),
            }),
            None => Ok(()),
        }
    }

    /// Starts trying `config` on the version serving now, pinned as stable.
    fn start_config_rollout(
        &mut self,
        model: &str,
        plan: Plan,
        config: ConfigPlan,
        available: &Available,
        asker: &Asker,
        now_s: u64,
    ) -> Result<Decision, RolloutError> {
        self.may_start(model, &plan.policy)?;
        let stable = self.serving(model, available).unwrap_or_default().to_string();
        let deployment = self.models.entry(model.to_string()).or_default();
        if deployment.stable_config != config.base {
            return Err(RolloutError::BadConfig(format!(
                "the stable config changed while it was worked out (now {}); send it again",
                deployment.stable_config.as_deref().unwrap_or("the node config's")
            )));
        }
        deployment.stable = stable.clone();
        deployment.configs.insert(config.version.clone(), config.record);
        let trying = (stable.clone(), Some(config.version.clone()));
        let candidate = Candidate::starting(trying, (plan.mode, plan.policy), &asker.by, now_s);
        let mut decision = Decision::new(model, Action::Started, &stable, &stable, asker, now_s);
        decision.reason = format!(
            "{} of config {} (over {}) started: {}",
            candidate.mode.as_str(),
            config.version,
            config.base_version,
            candidate.describe_step()
        );
        decision.config =
            Some(ConfigChange { to: Some(config.version), from: deployment.stable_config.clone() });
        deployment.candidate = Some(candidate);
        Ok(record(deployment, decision))
    }

    /// Acts on the gates' verdict on `model`'s step: the next step, the
    /// promotion, a rollback or a hold. `None`: nothing to decide yet.
    pub fn judged(&mut self, model: &str, verdict: Verdict, now_s: u64) -> Option<Decision> {
        let gates_asker = Asker::named("rollout gates");
        let deployment = self.models.get_mut(model)?;
        let candidate = deployment.candidate.as_mut()?;
        let (version, stable) = (candidate.version.clone(), deployment.stable.clone());
        match verdict {
            Verdict::Wait => None,
            Verdict::Fail { reason, gates } => {
                self.abandon(model, &gates_asker, now_s, Some((reason, gates)))
            }
            Verdict::Inconclusive { reason, gates } => match candidate.policy.on_inconclusive {
                OnInconclusive::Rollback => self.abandon(model, &gates_asker, now_s, Some((reason, gates))),
                OnInconclusive::Hold if candidate.held.is_some() => None,
                OnInconclusive::Hold => {
                    candidate.held = Some(reason.clone());
                    let mut decision =
                        Decision::new(model, Action::Held, &version, &stable, &gates_asker, now_s);
                    (decision.reason, decision.gates) = (format!("{reason}; promote or roll back"), gates);
                    Some(record(deployment, decision))
                }
            },
            Verdict::Pass { gates } => {
                let last = candidate.mode != RolloutMode::Canary
                    || candidate.step + 1 >= candidate.policy.steps.len();
                if !last {
                    candidate.step += 1;
                    candidate.step_started_s = now_s;
                    candidate.step_id = fastrand::u64(1..);
                    let mut decision =
                        Decision::new(model, Action::Stepped, &version, &stable, &gates_asker, now_s);
                    (decision.reason, decision.gates) =
                        (format!("gates passed; now {}", candidate.describe_step()), gates);
                    return Some(record(deployment, decision));
                }
                let mode = candidate.mode.as_str();
                if candidate.config.is_some() {
                    let reason = format!("{mode}: every gate passed at the last step");
                    return Some(promote_config(deployment, model, &gates_asker, now_s, (reason, gates)));
                }
                deployment.candidate = None;
                deployment.previous.push(stable.clone());
                keep_last(&mut deployment.previous);
                let mut decision =
                    Decision::new(model, Action::Promoted, &version, &stable, &gates_asker, now_s);
                (decision.reason, decision.gates) =
                    (format!("{mode}: every gate passed at the last step"), gates);
                Some(record(deployment, decision))
            }
        }
    }

    /// The candidate of each model with a rollout.
    pub fn candidates(&self) -> impl Iterator<Item = (&String, &Candidate)> {
        self.models.iter().filter_map(|(m, d)| Some((m, d.candidate.as_ref()?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn two() -> Available {
        BTreeMap::from([("digits".to_string(), vec!["1".to_string(), "2".to_string()])])
    }

    fn plan(mode: RolloutMode) -> Plan {
        let policy = RolloutPolicy { steps: vec![10, 50, 100], ..RolloutPolicy::default() };
        Plan { version: "2".into(), mode, policy, serving_before: None, config: None }
    }

    #[test]
    fn a_canary_steps_on_passing_gates_then_is_promoted_and_the_stable_before_is_pinned() {
        let mut state = Deployments::default();
        let start =
            state.start_rollout("digits", plan(RolloutMode::Canary), &two(), &Asker::named("t"), 10).unwrap();
        // No state and the candidate the newest: v1 is pinned stable beside it.
        assert_eq!((start.action, start.version.as_str(), start.from.as_str()), (Action::Started, "2", "1"));
        assert_eq!(state.stable("digits"), Some("1"));
        let again = state.start_rollout("digits", plan(RolloutMode::Canary), &two(), &Asker::named("t"), 11);
        assert!(matches!(again, Err(RolloutError::InRollout { .. })), "{again:?}");
        let pass = || Verdict::Pass { gates: Vec::new() };
        let shares: Vec<u8> = (0..2)
            .map(|i| {
                let d = state.judged("digits", pass(), 20 + i).unwrap();
                assert_eq!(d.action, Action::Stepped);
                state.models["digits"].candidate.as_ref().unwrap().share()
            })
            .collect();
        assert_eq!(shares, [50, 100]);
        assert_eq!(state.judged("digits", Verdict::Wait, 30), None);
        let done = state.judged("digits", pass(), 40).unwrap();
        assert_eq!((done.action, done.version.as_str()), (Action::Promoted, "2"));
        assert_eq!((state.stable("digits"), state.models["digits"].candidate.is_none()), (Some("2"), true));
        assert_eq!(state.models["digits"].previous, ["1"]);
    }

    #[test]
    fn auto_rollout_with_two_new_versions_pins_the_one_that_served_before_not_an_untried_one() {
        let three = BTreeMap::from([("digits".to_string(), vec!["1".into(), "2".into(), "3".into()])]);
        let mut state = Deployments::default();
        let plan =
            Plan { version: "3".into(), serving_before: Some("1".into()), ..plan(RolloutMode::Canary) };
        let start = state.start_rollout("digits", plan, &three, &Asker::named("auto"), 10).unwrap();
        assert_eq!((start.version.as_str(), start.from.as_str()), ("3", "1"), "v2 never served: not stable");
        assert_eq!(state.stable("digits"), Some("1"));
        // A rollback returns to v1, never to the untried v2.
        let back = state.rollback("digits", &three, &Asker::named("t"), 11).unwrap();
        assert_eq!((back.version.as_str(), state.serving("digits", &three)), ("1", Some("1")));
    }

    #[test]
    fn a_failed_gate_or_a_rollback_ends_it_on_stable_and_a_hold_waits_once() {
        let mut state = Deployments::default();
        state.start_rollout("digits", plan(RolloutMode::Shadow), &two(), &Asker::named("t"), 10).unwrap();
        let held = Verdict::Inconclusive { reason: "inconclusive after 9 s".into(), gates: Vec::new() };
        assert_eq!(state.judged("digits", held.clone(), 20).unwrap().action, Action::Held);
        assert_eq!(state.judged("digits", held, 21), None, "held once");
        let back = state.rollback("digits", &two(), &Asker::named("t"), 22).unwrap();
        assert_eq!((back.action, back.version.as_str(), back.from.as_str()), (Action::RolledBack, "1", "2"));
        assert_eq!(state.stable("digits"), Some("1"));
        state.start_rollout("digits", plan(RolloutMode::Canary), &two(), &Asker::named("t"), 30).unwrap();
        let fail = Verdict::Fail { reason: "gate latency failed".into(), gates: Vec::new() };
        let d = state.judged("digits", fail, 31).unwrap();
        assert_eq!((d.action, d.reason.as_str()), (Action::RolledBack, "gate latency failed"));
        assert!(state.models["digits"].candidate.is_none());
        let stable = state.start_rollout(
            "digits",
            Plan { version: "1".into(), ..plan(RolloutMode::Ab) },
            &two(),
            &Asker::named("t"),
            40,
        );
        // Short of samples, set to roll back rather than hold.
        let mut strict = plan(RolloutMode::Canary);
        strict.policy.on_inconclusive = OnInconclusive::Rollback;
        state.start_rollout("digits", strict, &two(), &Asker::named("t"), 50).unwrap();
        let short = Verdict::Inconclusive { reason: "inconclusive after 9 s".into(), gates: Vec::new() };
        let d = state.judged("digits", short, 60).unwrap();
        assert_eq!((d.action, d.version.as_str(), d.from.as_str()), (Action::RolledBack, "1", "2"));
        assert!(matches!(stable, Err(RolloutError::AlreadyStable { .. })), "{stable:?}");
    }

    fn config_plan(state: &Deployments, file: &str) -> Result<Plan, RolloutError> {
        let node = crate::config::Config::default().serving("digits");
        let config = ConfigPlan::new(file, state.models.get("digits"), &node, "t", 5)?;
        let policy = RolloutPolicy { steps: vec![50, 100], ..RolloutPolicy::default() };
        Plan::for_config(config, None, &policy, (None, None))
    }

    #[test]
    fn a_config_rollout_runs_on_stable_and_rollback_or_promotion_set_exactly_the_right_config() {
        let node_text = crate::config::Config::default().serving("digits").text();
        let mut state = Deployments::default();
        let plan = config_plan(&state, "threshold = 1.0\n").unwrap();
        let version = plan.config.as_ref().unwrap().version.clone();
        let start = state.start_rollout("digits", plan, &two(), &Asker::named("t"), 10).unwrap();
        // On the serving version (the newest, pinned), with the file kept.
        assert_eq!((start.version.as_str(), start.from.as_str()), ("2", "2"));
        let d = &state.models["digits"];
        let c = d.candidate.as_ref().unwrap();
        assert_eq!((c.version.as_str(), c.config.as_deref()), ("2", Some(version.as_str())));
        assert_eq!(d.configs[&version].file, "threshold = 1.0\n");
        assert!(d.configs[&version].text.contains("threshold = 1.0"), "{}", d.configs[&version].text);
        assert!(c.answered("2", &version) && !c.answered("2", "another"), "stable's answers are not its");
        // Another rollout waits; a rollback leaves the node's config serving.
        assert!(matches!(
            config_plan(&state, "top_k = 2").map(|p| state.clone().start_rollout(
                "digits",
                p,
                &two(),
                &Asker::named("t"),
                11
            )),
            Ok(Err(RolloutError::InRollout { .. }))
        ));
        let fail = Verdict::Fail { reason: "gate escalation failed".into(), gates: Vec::new() };
        let back = state.judged("digits", fail, 12).unwrap();
        assert_eq!(back.config, Some(ConfigChange { to: None, from: Some(version.clone()) }));
        let d = &state.models["digits"];
        assert_eq!((d.stable.as_str(), d.stable_config.as_ref(), d.candidate.is_none()), ("2", None, true));
        // The same change again, passing: its config becomes stable's.
        let plan = config_plan(&state, "threshold = 1.0\n").unwrap();
        state.start_rollout("digits", plan, &two(), &Asker::named("t"), 20).unwrap();
        state.judged("digits", Verdict::Pass { gates: Vec::new() }, 21).unwrap();
        let up = state.judged("digits", Verdict::Pass { gates: Vec::new() }, 22).unwrap();
        assert_eq!((up.action, up.config.as_ref().unwrap().to.as_ref()), (Action::Promoted, Some(&version)));
        assert_eq!(state.models["digits"].stable_config.as_ref(), Some(&version));
        // A change to what is stable now changes nothing: refused.
        let same = config_plan(&state, "threshold = 1.0").unwrap_err().to_string();
        assert!(same.contains("changes nothing"), "{same}");
        // The report shows the deployment's config, and after a rollback the
        // node's, byte for byte.
        let node = |_: &str| crate::config::Config::default().serving("digits");
        let shown = |s: &Deployments| {
            s.report(&two(), &Default::default(), Some("digits"), &node).unwrap()[0].config.clone().unwrap()
        };
        assert_eq!((shown(&state).version, shown(&state).source.as_str()), (version.clone(), "deployment"));
        let back = state.rollback("digits", &two(), &Asker::named("t"), 30).unwrap();
        assert_eq!((back.action, back.config.unwrap().from), (Action::RolledBack, Some(version.clone())));
        assert_eq!((shown(&state).text, shown(&state).source.as_str()), (node_text, "node config"));
        assert_eq!(state.stable("digits"), Some("2"), "a config rollback keeps the model version");
        // With no config promotion left to undo, a rollback is a version's.
        assert_eq!(state.rollback("digits", &two(), &Asker::named("t"), 31).unwrap().version, "1");
    }
}
