//! What a node tells its fleet: Prometheus metrics (names in one place, so
//! dashboards and code agree) and the retained status message.

mod status;

pub use status::{
    CacheHealth, EngineSnapshot, ModelStatus, RedisState, ShareGroupStatus, State, Status, unix_now,
    unix_now_ms,
};

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Requests answered, by `model`, `version`, `transport` (`mqtt`, `http`,
/// `cli`) and `outcome` (`ok` or an error code).
pub const REQUESTS: &str = "edgeinfer_requests_total";
/// Seconds per pipeline stage, by `model` and `stage` (see `Stage`).
pub const STAGE_SECONDS: &str = "edgeinfer_stage_duration_seconds";
/// Rows per batch run, by `model`.
pub const BATCH_ROWS: &str = "edgeinfer_batch_rows";
/// Requests waiting in a model's queue, by `model`.
pub const QUEUE_DEPTH: &str = "edgeinfer_queue_depth";
/// Publishes that will never reach the broker, by `reason`: `broker` (its
/// PUBACK refused it, e.g. an ACL) or `too_large` (over the broker's
/// Maximum Packet Size).
pub const MQTT_REPLIES_REFUSED: &str = "edgeinfer_mqtt_replies_refused_total";
/// Panics while handling a request, by `model` (it got `internal`).
pub const REQUEST_PANICS: &str = "edgeinfer_request_panics_total";
/// Panics in an inference thread, by `model` (its batch got `internal`).
pub const INFERENCE_PANICS: &str = "edgeinfer_inference_panics_total";
/// The share of the last interval (5 s) a model's inference threads spent
/// running batches, by `model`: 1 is saturated, the signal to add nodes.
pub const INFERENCE_BUSY: &str = "edgeinfer_inference_busy_ratio";
/// Requests between arrival and reply, by `model`.
pub const IN_FLIGHT: &str = "edgeinfer_in_flight_requests";
pub const MQTT_CONNECTED: &str = "edgeinfer_mqtt_connected";
pub const MQTT_RECONNECTS: &str = "edgeinfer_mqtt_reconnects_total";
/// 1 while the share group's connection is up with its subscription in
/// place (`transport/mqtt/share.rs`).
pub const MQTT_SHARE_CONNECTED: &str = "edgeinfer_mqtt_share_connected";
/// Requests the broker handed this node through the share group.
pub const MQTT_SHARE_REQUESTS: &str = "edgeinfer_mqtt_share_requests_total";
/// Requests dropped because they named nowhere to reply.
pub const MQTT_NO_REPLY_TOPIC: &str = "edgeinfer_mqtt_no_reply_topic_total";
/// Requests whose acknowledgement has not left (bounded by `mqtt.max_in_flight`).
pub const MQTT_UNACKNOWLEDGED: &str = "edgeinfer_mqtt_unacknowledged_requests";
/// Replies, follow-ups, acknowledgements and the status the outbox holds
/// until the broker acknowledged them.
pub const MQTT_OUTBOX: &str = "edgeinfer_mqtt_outbox_publishes";
/// The request journal's files (`mqtt.journal.max_bytes` bounds them).
pub const JOURNAL_BYTES: &str = "edgeinfer_journal_bytes";
/// Requests not journaled, by `reason`: `full` (no room within
/// `mqtt.journal.max_bytes`) or `error` (the disk failed); each was
/// acknowledged after its reply instead.
pub const JOURNAL_NOT_KEPT: &str = "edgeinfer_journal_not_kept_total";
/// Re-deliveries of a journaled request, acknowledged and not run again.
pub const JOURNAL_DUPLICATES: &str = "edgeinfer_journal_duplicates_total";
/// Journaled requests run again at a start (the node stopped before their
/// reply was confirmed).
pub const JOURNAL_REPLAYED: &str = "edgeinfer_journal_replayed_total";
/// Requests dropped unanswered for their reply topic, by `reason`: `system`
/// (`$` topics), `reserved` (under `mqtt.topic_prefix`), `not_allowed`
/// (outside `mqtt.reply_prefixes`).
pub const MQTT_REPLY_TOPICS_REFUSED: &str = "edgeinfer_mqtt_reply_topics_refused_total";
pub const BUILD_INFO: &str = "edgeinfer_build_info";
/// HTTP connections that had to wait for `http.max_connections`.
pub const HTTP_CONNECTIONS_WAITED: &str = "edgeinfer_http_connections_waited_total";
/// Model versions found in the models directory but refused at the last
/// load or reload (a bad sha256, golden outputs, manifest).
pub const MODEL_VERSIONS_REFUSED: &str = "edgeinfer_model_versions_refused";
pub const MODEL_INFO: &str = "edgeinfer_model_info";
pub const RESIDENT_MEMORY: &str = "edgeinfer_process_resident_memory_bytes";
/// Cache lookups, by `model` and `result` (`miss`, `memory`, `disk`, `redis`, or
/// `coalesced`: answered by an identical request already running).
pub const CACHE_LOOKUPS: &str = "edgeinfer_cache_lookups_total";
/// 1 while the shared Redis layer answers (`cache.redis.enabled`).
pub const CACHE_REDIS_UP: &str = "edgeinfer_cache_redis_up";
/// Redis lookups and stores that did not help, by `reason`: `timeout`
/// (over `cache.redis.timeout_ms`), `error`, `busy` (the writer's queue
/// was full), `skipped` (a store while the layer rested after failures),
/// `full` (a write Redis refused), `oversized` (an answer over the 1 MiB
/// a node reads, kept on the node).
pub const CACHE_REDIS_ERRORS: &str = "edgeinfer_cache_redis_errors_total";
/// Values Redis gave that were not served (each a miss), by `reason`:
/// `signature` (not signed with the site key: forged, or another key),
/// `unsigned` (not a signed value of this format), `oversized` (over
/// 1 MiB, not read whole), `undecodable` (signed, yet not an answer).
pub const CACHE_REDIS_REJECTED: &str = "edgeinfer_cache_redis_rejected_total";
/// Entries and bytes held, by `layer` (`memory`, `disk`).
pub const CACHE_ENTRIES: &str = "edgeinfer_cache_entries";
pub const CACHE_BYTES: &str = "edgeinfer_cache_bytes";
/// Entries dropped to stay within the byte bound, by `layer`.
pub const CACHE_EVICTIONS: &str = "edgeinfer_cache_evictions_total";
/// Disk entries that failed their checksum (and were deleted).
pub const CACHE_CORRUPT: &str = "edgeinfer_cache_corrupt_entries_total";
/// Stores that could not be opened and were moved aside.
pub const CACHE_QUARANTINED: &str = "edgeinfer_cache_quarantined_stores_total";
/// 1 while the disk layer works; an I/O error turns it to 0.
pub const CACHE_DISK_ENABLED: &str = "edgeinfer_cache_disk_enabled";
pub const CACHE_DISK_ERRORS: &str = "edgeinfer_cache_disk_errors_total";
/// Rebuilds of a sled store whose files outgrew their bound, by `store`
/// (`cache`, `spool`).
pub const STORE_REBUILDS: &str = "edgeinfer_store_rebuilds_total";
/// Answers not written to disk because the writer was too far behind.
pub const CACHE_WRITES_DROPPED: &str = "edgeinfer_cache_writes_dropped_total";
/// Disk lookups counted as misses without the disk's answer, by `reason`
/// (`slow`: over `cache.disk_read_timeout_ms`; `busy`: the reader's queue was full).
pub const CACHE_DISK_READS_SKIPPED: &str = "edgeinfer_cache_disk_reads_skipped_total";
/// Escalations to the cloud tier, by `model` and `mode` (`sync`, `async`,
/// `quality`); the escalation rate is this over `edgeinfer_requests_total`.
pub const CLOUD_ESCALATIONS: &str = "edgeinfer_cloud_escalations_total";
/// Calls to the cloud tier, by `model` and `outcome` (`ok`, `timeout`,
/// `unreachable`, `http_error`, `breaker_open`, `busy`, `no_time`, `invalid`).
pub const CLOUD_REQUESTS: &str = "edgeinfer_cloud_requests_total";
/// Seconds per cloud call attempt, by `model`.
pub const CLOUD_LATENCY: &str = "edgeinfer_cloud_latency_seconds";
/// 0 closed, 1 open, 2 half-open.
pub const CLOUD_BREAKER: &str = "edgeinfer_cloud_breaker_state";
/// Async escalations waiting in the spool, and their bytes.
pub const CLOUD_SPOOL_DEPTH: &str = "edgeinfer_cloud_spool_entries";
pub const CLOUD_SPOOL_BYTES: &str = "edgeinfer_cloud_spool_bytes";
/// Spooled escalations that ended with the edge answer, by `reason`: `room`
/// (the oldest, to stay within the bounds), `refused`, `attempts`, `age`.
pub const CLOUD_SPOOL_DROPPED: &str = "edgeinfer_cloud_spool_dropped_total";
/// Escalations the cloud answered, by `model` and `agree` (`true` when the
/// cloud's label is the edge's): the agreement rate.
pub const CLOUD_AGREEMENT: &str = "edgeinfer_cloud_agreement_total";
/// Requests written to the capture file (`capture.enabled`).
pub const CAPTURE_RECORDS: &str = "edgeinfer_capture_records_total";
/// Sampled requests not captured, by `reason`: `busy` (the writer lagged).
pub const CAPTURE_DROPPED: &str = "edgeinfer_capture_dropped_total";
/// Answers marked `degraded` (the cloud was wanted but not used), by `model`.
pub const CLOUD_DEGRADED: &str = "edgeinfer_cloud_degraded_total";
/// Field feedback joined with the answer given, by `model`, `version` and
/// `kind` (`label` or `outcome`).
pub const FEEDBACK: &str = "edgeinfer_feedback_total";
/// Label feedback the answer had right, by `model` and `version`: over
/// `FEEDBACK{kind="label"}`, the accuracy over any window (unweighted; the
/// `FEEDBACK_ACCURACY` gauge is weighted, since start).
pub const FEEDBACK_CORRECT: &str = "edgeinfer_feedback_correct_total";
/// Feedback not counted, by `reason`: `unknown_id` (no answer with that id
/// within `feedback.window_s`), `not_here` (on the site's topic: another
/// node's answer, or none), `duplicate` (that answer had feedback of that
/// kind), `answer_has_no_label`, `invalid`, `busy`.
pub const FEEDBACK_UNJOINED: &str = "edgeinfer_feedback_unjoined_total";
/// The weighted share of label feedback the answer had right, by `model`
/// and `version`, since the node started.
pub const FEEDBACK_ACCURACY: &str = "edgeinfer_feedback_accuracy";
/// The weighted mean outcome devices reported, by `model` and `version`,
/// since the node started.
pub const FEEDBACK_OUTCOME_MEAN: &str = "edgeinfer_feedback_outcome_mean";
/// Answers kept for feedback (`feedback.window_s`).
pub const FEEDBACK_ANSWERS_KEPT: &str = "edgeinfer_feedback_answers_kept";
/// Answers no longer kept for feedback before the window ended, by
/// `reason`: `evicted` (the store's bounds), `queue_full`.
pub const FEEDBACK_ANSWERS_DROPPED: &str = "edgeinfer_feedback_answers_dropped_total";

/// The timed stages of the request path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Looking the answer up in the cache (memory, then disk), hit or miss.
    CacheLookup,
    /// Waiting in the model's queue and batch window.
    Queue,
    Preprocess,
    /// The batch's model run (each request in it observes the whole run).
    Inference,
    Postprocess,
    /// Bytes in to reply bytes out.
    EndToEnd,
}

impl Stage {
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::CacheLookup => "cache_lookup",
            Stage::Queue => "queue",
            Stage::Preprocess => "preprocess",
            Stage::Inference => "inference",
            Stage::Postprocess => "postprocess",
            Stage::EndToEnd => "end_to_end",
        }
    }
}

pub fn observe_stage(model: &str, stage: Stage, seconds: f64) {
    metrics::histogram!(STAGE_SECONDS, "model" => model.to_string(), "stage" => stage.as_str())
        .record(seconds);
}

/// Buckets from 10 us to 10 s, three per decade: stages of a few tens of
/// microseconds and a slow cloud call both land in a bucket of their own.
const SECONDS_BUCKETS: [f64; 19] = [
    0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
    1.0, 2.0, 5.0, 10.0,
];
const ROW_BUCKETS: [f64; 10] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// Installs the process-wide recorder; `None` if one is installed already.
pub fn install() -> Option<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)
        .ok()?
        .set_buckets_for_metric(Matcher::Full(BATCH_ROWS.into()), &ROW_BUCKETS)
        .ok()?
        .install_recorder()
        .ok()?;
    metrics::describe_counter!(REQUESTS, "Requests answered, by model, version, transport and outcome");
    metrics::describe_gauge!(
        crate::rollout::ROLLOUT_STEP,
        "The rollout candidate's share of devices in percent (0: no rollout)"
    );
    metrics::describe_gauge!(
        crate::rollout::ROLLOUT_GATE,
        "1 for each rollout gate's latest result (pass, fail, inconclusive, off), 0 for the others"
    );
    metrics::describe_counter!(crate::rollout::ROLLOUT_DECISIONS, "Rollout decisions, by model and action");
    metrics::describe_histogram!(STAGE_SECONDS, metrics::Unit::Seconds, "Time per pipeline stage");
    metrics::describe_histogram!(BATCH_ROWS, "Rows per batch run");
    metrics::describe_gauge!(QUEUE_DEPTH, "Requests waiting in the model's queue");
    metrics::describe_counter!(
        MQTT_REPLIES_REFUSED,
        "Replies the broker refused (reason broker) or that exceed its Maximum Packet Size (too_large)"
    );
    metrics::describe_gauge!(
        MODEL_VERSIONS_REFUSED,
        "Model versions refused at the last load or reload (the status and the log name them)"
    );
    metrics::describe_counter!(REQUEST_PANICS, "Panics while handling a request; it was answered internal");
    metrics::describe_counter!(
        crate::trace::SPANS_DROPPED,
        "Trace spans not exported, by reason: queue_full (the exporter is behind), export_failed or span_limit"
    );
    metrics::describe_counter!(crate::trace::SPANS_EXPORTED, "Trace spans the OTLP collector took");
    metrics::describe_counter!(
        INFERENCE_PANICS,
        "Panics in an inference thread; its batch was answered internal and the thread went on"
    );
    metrics::describe_gauge!(IN_FLIGHT, "Requests being processed");
    metrics::describe_gauge!(MQTT_CONNECTED, "1 while the MQTT session is up with subscriptions in place");
    metrics::describe_counter!(MQTT_RECONNECTS, "MQTT connection losses");
    metrics::describe_gauge!(
        MQTT_SHARE_CONNECTED,
        "1 while the share group's connection is up with its subscription in place"
    );
    metrics::describe_counter!(MQTT_SHARE_REQUESTS, "Requests received through the share group");
    metrics::describe_counter!(MQTT_NO_REPLY_TOPIC, "Requests dropped for naming no reply topic");
    metrics::describe_gauge!(
        MQTT_UNACKNOWLEDGED,
        "Requests whose acknowledgement has not left yet (at most mqtt.max_in_flight)"
    );
    metrics::describe_gauge!(
        MQTT_OUTBOX,
        "Publishes and acknowledgements the MQTT outbox holds until the broker acknowledged them"
    );
    metrics::describe_gauge!(
        JOURNAL_BYTES,
        "Bytes of the request journal's files (at most mqtt.journal.max_bytes)"
    );
    metrics::describe_counter!(
        JOURNAL_NOT_KEPT,
        "Requests not journaled (reason full or error), acknowledged after their reply instead"
    );
    metrics::describe_counter!(
        JOURNAL_DUPLICATES,
        "Re-deliveries of a journaled request, acknowledged and not run again"
    );
    metrics::describe_counter!(JOURNAL_REPLAYED, "Journaled requests run again at a start");
    metrics::describe_counter!(
        MQTT_REPLY_TOPICS_REFUSED,
        "Requests dropped unanswered for their reply topic, by reason: system ($ topics), reserved (under mqtt.topic_prefix), not_allowed (outside mqtt.reply_prefixes)"
    );
    metrics::describe_gauge!(BUILD_INFO, "Always 1; labels say what runs");
    metrics::describe_counter!(
        HTTP_CONNECTIONS_WAITED,
        "HTTP connections that waited because http.max_connections were open"
    );
    metrics::describe_gauge!(MODEL_INFO, "Always 1 per loaded model version");
    metrics::describe_gauge!(RESIDENT_MEMORY, metrics::Unit::Bytes, "Resident set size of the process");
    metrics::describe_counter!(CACHE_LOOKUPS, "Cache lookups, by model and result");
    metrics::describe_gauge!(CACHE_ENTRIES, "Entries in the cache, by layer");
    metrics::describe_gauge!(CACHE_BYTES, metrics::Unit::Bytes, "Bytes held by the cache, by layer");
    metrics::describe_counter!(CACHE_EVICTIONS, "Entries evicted to stay within the byte bound, by layer");
    metrics::describe_counter!(
        CACHE_CORRUPT,
        "Disk cache entries that failed their checksum and were deleted"
    );
    metrics::describe_counter!(
        CACHE_QUARANTINED,
        "Disk cache stores moved aside because they could not be opened"
    );
    metrics::describe_gauge!(CACHE_DISK_ENABLED, "1 while the disk cache layer works");
    metrics::describe_gauge!(
        INFERENCE_BUSY,
        "Share of the last 5 s the model's inference threads spent running batches (1: saturated)"
    );
    metrics::describe_gauge!(CACHE_REDIS_UP, "1 while the shared Redis cache layer answers");
    metrics::describe_counter!(
        CACHE_REDIS_ERRORS,
        "Redis cache lookups and stores that did not help, by reason: timeout, error, busy, skipped, full, oversized"
    );
    metrics::describe_counter!(
        CACHE_REDIS_REJECTED,
        "Values read from the shared Redis layer and not served (a miss), by reason: signature, unsigned, oversized, undecodable"
    );
    metrics::describe_counter!(CACHE_DISK_ERRORS, "I/O errors that turned the disk cache layer off");
    metrics::describe_counter!(
        STORE_REBUILDS,
        "Rebuilds of a sled store (cache, spool) because its files outgrew twice its byte bound"
    );
    metrics::describe_counter!(
        CACHE_WRITES_DROPPED,
        "Answers not written to the disk cache because its writer lagged"
    );
    metrics::describe_counter!(
        CACHE_DISK_READS_SKIPPED,
        "Disk cache lookups counted as misses without the disk's answer, by reason: slow (over cache.disk_read_timeout_ms), busy (the reader's queue was full)"
    );
    metrics::describe_counter!(CLOUD_ESCALATIONS, "Escalations to the cloud tier, by model and mode");
    metrics::describe_counter!(CLOUD_REQUESTS, "Calls to the cloud tier, by model and outcome");
    metrics::describe_histogram!(CLOUD_LATENCY, metrics::Unit::Seconds, "Time per cloud call attempt");
    metrics::describe_gauge!(CLOUD_BREAKER, "Cloud circuit breaker: 0 closed, 1 open, 2 half-open");
    metrics::describe_gauge!(CLOUD_SPOOL_DEPTH, "Async escalations waiting for the cloud");
    metrics::describe_gauge!(CLOUD_SPOOL_BYTES, metrics::Unit::Bytes, "Bytes of the waiting escalations");
    metrics::describe_counter!(
        CLOUD_SPOOL_DROPPED,
        "Spooled escalations that ended without the cloud's answer, by reason: room (dropped to stay within the bounds), refused (4xx), attempts (cloud.spool_max_attempts error answers), age (cloud.spool_max_age_s)"
    );
    metrics::describe_counter!(
        CLOUD_AGREEMENT,
        "Escalations answered by the cloud, by edge/cloud label agreement"
    );
    metrics::describe_counter!(CAPTURE_RECORDS, "Requests written to the capture file");
    metrics::describe_counter!(
        CAPTURE_DROPPED,
        "Sampled requests not captured, by reason: busy (the capture writer lagged)"
    );
    metrics::describe_counter!(CLOUD_DEGRADED, "Answers from the edge although the cloud was wanted");
    metrics::describe_counter!(
        FEEDBACK,
        "Field feedback joined with the answer given, by kind: label or outcome"
    );
    metrics::describe_counter!(
        FEEDBACK_UNJOINED,
        "Feedback not counted, by reason: unknown_id, not_here, duplicate, answer_has_no_label, invalid, busy"
    );
    metrics::describe_counter!(FEEDBACK_CORRECT, "Label feedback the answer had right");
    metrics::describe_gauge!(FEEDBACK_ACCURACY, "Weighted share of label feedback the answer had right");
    metrics::describe_gauge!(FEEDBACK_OUTCOME_MEAN, "Weighted mean outcome reported by devices");
    metrics::describe_gauge!(FEEDBACK_ANSWERS_KEPT, "Answers kept for feedback within feedback.window_s");
    metrics::describe_counter!(
        FEEDBACK_ANSWERS_DROPPED,
        "Answers dropped before the feedback window ended, by reason: evicted (bounds), queue_full"
    );
    metrics::gauge!(
        BUILD_INFO,
        "version" => env!("CARGO_PKG_VERSION"),
        "git_sha" => env!("BUILD_GIT_SHA"),
        "target" => env!("BUILD_TARGET")
    )
    .set(1.0);
    Some(handle)
}

/// One gauge per loaded model version.
/// 1 for every version in `registry`, 0 for those of `previous` (the
/// registry a reload replaced) that it no longer has.
pub fn describe_models(previous: Option<&crate::model::Registry>, registry: &crate::model::Registry) {
    metrics::gauge!(MODEL_VERSIONS_REFUSED).set(registry.refused.len() as f64);
    let info = |m: &crate::model::LoadedModel| {
        metrics::gauge!(
            MODEL_INFO,
            "model" => m.name().to_string(),
            "version" => m.version().to_string(),
            "sha256" => m.manifest.sha256.clone(),
            "quantization" => m.manifest.quantization.as_str()
        )
    };
    let kept = |m: &crate::model::LoadedModel| {
        registry.get(m.name(), Some(m.version())).is_ok_and(|k| k.manifest.sha256 == m.manifest.sha256)
    };
    for gone in previous.into_iter().flat_map(|p| p.all()).filter(|m| !kept(m)) {
        info(gone).set(0.0);
    }
    for m in registry.all() {
        info(m).set(1.0);
    }
}

/// Drains the histograms' recorded samples into their buckets every few
/// seconds. The recorder keeps every sample until then; a scrape does it
/// too, but a node nobody scrapes (HTTP off, or no Prometheus yet) grew by
/// about 115 bytes per request, 14 MB a minute at 2,000 req/s (heaptrack).
pub async fn upkeep(handle: PrometheusHandle) {
    let mut every = tokio::time::interval(UPKEEP_PERIOD);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        handle.run_upkeep();
    }
}

/// What `metrics-exporter-prometheus` uses when it runs its own upkeep.
const UPKEEP_PERIOD: std::time::Duration = std::time::Duration::from_secs(5);

/// The scrape: refreshes what is read at scrape time, then renders.
pub fn render(handle: &PrometheusHandle) -> String {
    if let Some(rss) = resident_bytes() {
        metrics::gauge!(RESIDENT_MEMORY).set(rss as f64);
    }
    handle.run_upkeep();
    handle.render()
}

/// VmRSS from /proc (in kB there, whatever the page size).
pub fn resident_bytes() -> Option<u64> {
    proc_status_bytes("VmRSS:")
}

/// The most the process has had resident (VmHWM).
pub fn peak_resident_bytes() -> Option<u64> {
    proc_status_bytes("VmHWM:")
}

/// Starts `peak_resident_bytes` again from what is resident now (Linux
/// 4.0 and later); false where the kernel refused.
pub fn reset_peak_resident() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn proc_status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
