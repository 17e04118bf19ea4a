//! `edgeinfer bench --cascade FILE`: the edge/cloud trade-off on a labelled
//! split. Each row goes to the node twice over MQTT, one request in flight:
//! `tier = fast` (the edge answer, its confidence and round trip) and
//! `tier = quality` (the cloud's answer and round trip through the node).
//! From those pairs, for each threshold: the share a `standard` request
//! would answer at the edge, the accuracy of the answers it would give,
//! and their mean round trip.

use super::BenchError;
use super::client::subscribed;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::PublishProperties;
use std::time::{Duration, Instant};

/// One labelled row as both tiers answered it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Pair {
    pub label: String,
    pub edge_label: String,
    pub confidence: f64,
    /// Top probability minus the second (`confidence = "margin"`).
    pub margin: f64,
    pub edge_us: u64,
    pub cloud_label: String,
    pub cloud_us: u64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Point {
    /// `max` or `margin`.
    pub measure: &'static str,
    pub threshold: f64,
    /// Share of rows the edge answers (confidence >= threshold).
    pub at_edge: f64,
    pub accuracy: f64,
    pub mean_ms: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct CascadeReport {
    pub rows: usize,
    pub edge_accuracy: f64,
    pub cloud_accuracy: f64,
    pub edge_mean_ms: f64,
    pub cloud_mean_ms: f64,
    pub points: Vec<Point>,
}

/// A labelled split as `models/produce.py` writes it: `label,x1,x2,...`
/// per line, `#` comments; each row becomes a one-row FP32 request for
/// the input named `input`.
pub fn read_split(path: &std::path::Path) -> Result<Vec<(String, serde_json::Value)>, BenchError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| BenchError::Cascade(format!("--cascade {}: {e}", path.display())))?;
    let mut rows = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.starts_with('#') && !l.trim().is_empty()) {
        let mut fields = line.split(',');
        let label = fields.next().unwrap_or("").trim().to_string();
        let data: Result<Vec<f64>, _> = fields.map(|x| x.trim().parse::<f64>()).collect();
        let data = data.map_err(|e| {
            BenchError::Cascade(format!(
                "--cascade {} line {}: {e}; expected label,x1,x2,...",
                path.display(),
                n + 1
            ))
        })?;
        let req = serde_json::json!({
            "id": format!("cascade-{n}"),
            "inputs": [{"name": "input", "shape": [1, data.len()], "datatype": "FP32", "data": data}]
        });
        rows.push((label, req));
    }
    Ok(rows)
}

/// Asks `topic` for every `(label, request)`; `request` is an OIP JSON
/// object whose `parameters` this fills in.
pub async fn run_cascade(
    url: &str,
    topic: &str,
    rows: Vec<(String, serde_json::Value)>,
    thresholds: &[f64],
) -> Result<CascadeReport, BenchError> {
    let id = format!("edgeinfer-bench-cascade-{}", std::process::id());
    let reply_topic = format!("edgeinfer-bench/{id}/replies");
    let (client, mut inbox) = subscribed(url, &id, &reply_topic, QoS::AtLeastOnce).await?;
    let mut ask =
        async |mut req: serde_json::Value, tier: &str| -> Result<(serde_json::Value, u64), BenchError> {
            req["parameters"] =
                serde_json::json!({"tier": tier, "cache": false, "deadline_ms": 10_000, "top_k": 2});
            let props = PublishProperties { response_topic: Some(reply_topic.clone()), ..Default::default() };
            let started = Instant::now();
            client
                .publish_with_properties(topic, QoS::AtLeastOnce, false, req.to_string(), props)
                .await
                .map_err(|e| BenchError::Connect { url: url.into(), message: e.to_string() })?;
            let reply = tokio::time::timeout(Duration::from_secs(15), inbox.recv())
                .await
                .ok()
                .flatten()
                .ok_or_else(|| BenchError::Cascade(format!("no reply on {reply_topic} within 15 s")))?;
            let us = started.elapsed().as_micros() as u64;
            let v: serde_json::Value = serde_json::from_slice(&reply.payload)
                .map_err(|e| BenchError::Cascade(format!("the reply is not JSON: {e}")))?;
            if let Some(error) = v.get("error") {
                return Err(BenchError::Cascade(format!("tier {tier}: {error}")));
            }
            Ok((v, us))
        };
    let mut pairs = Vec::with_capacity(rows.len());
    for (label, req) in rows {
        let (edge, edge_us) = ask(req.clone(), "fast").await?;
        let (cloud, cloud_us) = ask(req, "quality").await?;
        if cloud["parameters"]["served_by"] != "cloud" {
            return Err(BenchError::Cascade(format!(
                "a quality request was not answered by the cloud (is [cloud] enabled on the node, and the cloud up?): {cloud}"
            )));
        }
        let text = |v: &serde_json::Value, k: &str| v["parameters"][k].as_str().unwrap_or("").to_string();
        let top = |i: usize| edge["parameters"]["top_k"][i]["confidence"].as_f64().unwrap_or(0.0);
        pairs.push(Pair {
            label,
            edge_label: text(&edge, "label"),
            confidence: edge["parameters"]["confidence"].as_f64().unwrap_or(0.0),
            margin: top(0) - top(1),
            edge_us,
            cloud_label: text(&cloud, "label"),
            cloud_us,
        });
    }
    Ok(report(&pairs, thresholds))
}

/// A confidence measure's name and how to read it off a pair.
type Measure = (&'static str, fn(&Pair) -> f64);

/// The trade-off a `standard` request makes at each threshold: the edge
/// answers rows at or above it (one edge round trip), the cloud the rest
/// (an edge run, then the cloud's round trip).
pub fn report(pairs: &[Pair], thresholds: &[f64]) -> CascadeReport {
    let n = pairs.len().max(1) as f64;
    let share = |f: &dyn Fn(&Pair) -> bool| pairs.iter().filter(|p| f(p)).count() as f64 / n;
    let mean = |f: &dyn Fn(&Pair) -> u64| pairs.iter().map(f).sum::<u64>() as f64 / n / 1e3;
    let measures: [Measure; 2] = [("max", |p| p.confidence), ("margin", |p| p.margin)];
    let points = measures
        .iter()
        .flat_map(|&(measure, of)| thresholds.iter().map(move |&t| (measure, of, t)))
        .map(|(measure, of, t)| {
            let local = |p: &Pair| of(p) >= t;
            Point {
                measure,
                threshold: t,
                at_edge: share(&local),
                accuracy: share(&|p| {
                    if local(p) { p.edge_label == p.label } else { p.cloud_label == p.label }
                }),
                mean_ms: mean(&|p| if local(p) { p.edge_us } else { p.edge_us + p.cloud_us }),
            }
        })
        .collect();
    CascadeReport {
        rows: pairs.len(),
        edge_accuracy: share(&|p| p.edge_label == p.label),
        cloud_accuracy: share(&|p| p.cloud_label == p.label),
        edge_mean_ms: mean(&|p| p.edge_us),
        cloud_mean_ms: mean(&|p| p.cloud_us),
        points,
    }
}

impl std::fmt::Display for CascadeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} rows: edge only {:.4} accuracy, {:.3} ms mean; cloud only {:.4}, {:.3} ms",
            self.rows, self.edge_accuracy, self.edge_mean_ms, self.cloud_accuracy, self.cloud_mean_ms
        )?;
        writeln!(f, "| confidence | threshold | answered at the edge | accuracy | mean round trip |")?;
        writeln!(f, "| --- | --- | --- | --- | --- |")?;
        for p in &self.points {
            writeln!(
                f,
                "| {} | {:.3} | {:.1}% | {:.4} | {:.3} ms |",
                p.measure,
                p.threshold,
                p.at_edge * 100.0,
                p.accuracy,
                p.mean_ms
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(label: &str, edge: &str, confidence: f64, cloud: &str) -> Pair {
        Pair {
            label: label.into(),
            edge_label: edge.into(),
            confidence,
            margin: confidence / 2.0,
            edge_us: 100,
            cloud_label: cloud.into(),
            cloud_us: 900,
        }
    }

    #[test]
    fn each_threshold_takes_the_edge_answer_at_or_above_it_and_the_cloud_one_below() {
        let pairs = [pair("1", "1", 0.99, "1"), pair("2", "3", 0.6, "2"), pair("4", "4", 0.7, "9")];
        let r = report(&pairs, &[0.5, 0.65, 1.0]);
        assert_eq!(r.points[0].at_edge, 1.0);
        assert!((r.points[0].accuracy - 2.0 / 3.0).abs() < 1e-9);
        assert!((r.points[1].at_edge - 2.0 / 3.0).abs() < 1e-9);
        assert_eq!(r.points[1].accuracy, 1.0, "the unsure wrong one goes to the cloud");
        assert!((r.points[1].mean_ms - (100.0 + 100.0 + 1000.0) / 3.0 / 1e3).abs() < 1e-9);
        assert_eq!(r.points[2].at_edge, 0.0);
        assert!((r.cloud_accuracy - 2.0 / 3.0).abs() < 1e-9);
        // The same thresholds over the margin: 0.495, 0.3 and 0.35 here.
        assert_eq!(r.points[3].measure, "margin");
        assert!((r.points[3].at_edge - 0.0).abs() < 1e-9, "no margin reaches 0.5");
    }
}
