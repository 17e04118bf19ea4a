//! Stage 8b: capture of real inputs (`capture.enabled`, off by default).
//! A sampled share of the requests a node answers, each with the answer it
//! gave and, where the cloud tier answered, the cloud's label, appended as
//! JSON lines to `capture.jsonl` in `node.state_dir`, which `models compare
//! --data` reads. One thread owns the file; the request path hands it a
//! record over a bounded channel and never waits for the disk: a full
//! channel drops the sample and counts it.

use crate::model::LoadedModel;
use crate::model::compare::Captured;
use crate::protocol::{InferRequest, InferResponse, ServedBy};
use crate::telemetry;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

/// Records, and bytes of their inputs, waiting for the writer; a burst
/// larger than either loses samples, never requests. The bytes bound what
/// a model with large inputs (an image a row) can hold in the queue.
const QUEUE: usize = 1024;
const QUEUE_BYTES: usize = 8 << 20;

/// The input bytes queued for the writer, shared by the request path
/// (which admits) and the writer (which releases).
#[derive(Default)]
struct Queued(std::sync::atomic::AtomicUsize);

impl Queued {
    /// Whether `bytes` more fit under `QUEUE_BYTES`; if so they are counted.
    fn admit(&self, bytes: usize) -> bool {
        let before = self.0.fetch_add(bytes, Ordering::Relaxed);
        if before + bytes > QUEUE_BYTES {
            self.release(bytes);
            return false;
        }
        true
    }

    fn release(&self, bytes: usize) {
        self.0.fetch_sub(bytes, Ordering::Relaxed);
    }
}

fn input_bytes(record: &Captured) -> usize {
    record.input.len() * std::mem::size_of::<f32>()
}

/// The file's name in `node.state_dir`.
pub const FILE_NAME: &str = "capture.jsonl";

#[derive(Debug, Clone, PartialEq)]
pub struct CaptureOptions {
    pub path: PathBuf,
    /// The share of answered requests kept, 0 to 1.
    pub rate: f64,
    /// The file holds at most this many records and bytes; then capture stops.
    pub max_records: u64,
    pub max_bytes: u64,
}

impl CaptureOptions {
    /// `None` unless `capture.enabled`.
    pub fn from_config(config: &crate::config::Config) -> Option<CaptureOptions> {
        let c = &config.capture;
        c.enabled.then(|| CaptureOptions {
            path: config.node.state_dir.join(FILE_NAME),
            rate: c.rate,
            max_records: c.max_records,
            max_bytes: c.max_bytes,
        })
    }
}

#[derive(Debug, thiserror::Error)]
#[error("cannot open the capture file {path}: {source}")]
pub struct CaptureError {
    path: String,
    source: std::io::Error,
}

/// The request path's handle on the capture thread.
pub struct Capture {
    records: SyncSender<Captured>,
    rate: f64,
    /// Set by the writer once the file reached a bound: nothing more is built.
    full: Arc<AtomicBool>,
    queued: Arc<Queued>,
    /// The tests wait on it; a node's writer ends with the process, having
    /// flushed after every record or burst.
    #[cfg_attr(not(test), allow(dead_code))]
    writer: std::thread::JoinHandle<()>,
}

impl Capture {
    /// Opens (or goes on with) the file and starts its writer thread.
    pub fn start(options: CaptureOptions) -> Result<Capture, CaptureError> {
        let error = |source| CaptureError { path: options.path.display().to_string(), source };
        if let Some(dir) = options.path.parent() {
            std::fs::create_dir_all(dir).map_err(error)?;
        }
        let mut file =
            OpenOptions::new().create(true).read(true).append(true).open(&options.path).map_err(error)?;
        // A restart goes on counting towards the same bounds.
        let (records, bytes) = count(&mut file).map_err(error)?;
        // A line torn by a crash is cut off, so the next record starts on
        // a line of its own and the file stays readable.
        let whole = complete_lines(&mut file).map_err(error)?;
        let bytes = bytes.min(whole);
        let full = Arc::new(AtomicBool::new(false));
        let queued = Arc::new(Queued::default());
        let (tx, rx) = sync_channel(QUEUE);
        let writer = Writer {
            out: BufWriter::new(file),
            records,
            bytes,
            options: options.clone(),
            full: full.clone(),
            queued: queued.clone(),
        };
        let writer = std::thread::Builder::new()
            .name("capture".into())
            .spawn(move || writer.run(rx))
            .map_err(error)?;
        tracing::info!(
            "capture on: {} of the answered requests to {} ({records} records there already)",
            options.rate,
            options.path.display()
        );
        Ok(Capture { records: tx, rate: options.rate, full, queued, writer })
    }

    /// Keeps this request (a sampled share of them) with its answer. Only
    /// one-row requests are kept: a row is what `models compare` judges.
    pub fn offer(&self, model: &LoadedModel, req: &InferRequest, response: &InferResponse) {
        if self.full.load(Ordering::Relaxed) || self.rate <= 0.0 || fastrand::f64() >= self.rate {
            return;
        }
        let [input] = &req.inputs[..] else { return };
        if input.shape.first().is_some_and(|&rows| rows != 1) && input.shape.len() > 1 {
            return;
        }
        let cloud = response.parameters.served_by == ServedBy::Cloud;
        let record = Captured {
            time_s: telemetry::unix_now(),
            model: model.name().to_string(),
            version: model.version().to_string(),
            served_by: if cloud { "cloud" } else { "edge" }.to_string(),
            answer: response.parameters.label.clone(),
            cloud_label: if cloud { response.parameters.label.clone() } else { None },
            input: input.data.to_f64().into_iter().map(|v| v as f32).collect(),
        };
        let bytes = input_bytes(&record);
        if !self.queued.admit(bytes) {
            metrics::counter!(telemetry::CAPTURE_DROPPED, "reason" => "busy").increment(1);
            return;
        }
        if self.records.try_send(record).is_err() {
            self.queued.release(bytes);
            metrics::counter!(telemetry::CAPTURE_DROPPED, "reason" => "busy").increment(1);
        }
    }
}

/// Records and bytes already in the file. A torn last line (a kill during
/// a write) is counted in the bytes; the reader skips it.
fn count(file: &mut File) -> std::io::Result<(u64, u64)> {
    let mut text = Vec::new();
    file.read_to_end(&mut text)?;
    Ok((text.iter().filter(|&&b| b == b'\n').count() as u64, text.len() as u64))
}

/// Truncates the file after its last newline; the length it keeps.
fn complete_lines(file: &mut File) -> std::io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let mut text = Vec::new();
    file.seek(SeekFrom::Start(0))?;
    file.read_to_end(&mut text)?;
    let keep = text.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1) as u64;
    if keep < text.len() as u64 {
        file.set_len(keep)?;
    }
    Ok(keep)
}

struct Writer {
    out: BufWriter<File>,
    records: u64,
    bytes: u64,
    options: CaptureOptions,
    full: Arc<AtomicBool>,
    queued: Arc<Queued>,
}

impl Writer {
    /// Ends when the engine (the last sender) is dropped.
    fn run(mut self, rx: Receiver<Captured>) {
        while let Ok(first) = rx.recv() {
            self.write(first);
            // What queued meanwhile goes out with one flush.
            while let Ok(next) = rx.try_recv() {
                self.write(next);
            }
            if let Err(e) = self.out.flush() {
                self.stop(&format!("writing {}: {e}", self.options.path.display()));
            }
        }
    }

    fn write(&mut self, record: Captured) {
        self.queued.release(input_bytes(&record));
        if self.full.load(Ordering::Relaxed) {
            return;
        }
        let mut line = serde_json::to_vec(&record).expect("a capture record is plain data");
        line.push(b'\n');
        if self.records >= self.options.max_records || self.bytes + line.len() as u64 > self.options.max_bytes
        {
            let (records, bytes) = (self.records, self.bytes);
            self.stop(&format!(
                "{} holds {records} records, {bytes} bytes: capture.max_records or capture.max_bytes reached; \
                 move the file away (or raise them) and restart to capture more",
                path_text(&self.options.path)
            ));
            return;
        }
        match self.out.write_all(&line) {
            Ok(()) => {
                self.records += 1;
                self.bytes += line.len() as u64;
                metrics::counter!(telemetry::CAPTURE_RECORDS).increment(1);
            }
            Err(e) => self.stop(&format!("writing {}: {e}", path_text(&self.options.path))),
        }
    }

    fn stop(&mut self, why: &str) {
        if !self.full.swap(true, Ordering::Relaxed) {
            tracing::warn!("capture stopped: {why}");
        }
    }
}

fn path_text(path: &Path) -> String {
    path.display().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::compare::Rows;

    #[test]
    fn the_queue_admits_inputs_up_to_its_byte_bound_and_frees_what_the_writer_took() {
        let queued = Queued::default();
        let image = 96 * 96 * 3 * 4;
        let fit = QUEUE_BYTES / image;
        assert!((0..fit).all(|_| queued.admit(image)));
        assert!(!queued.admit(image), "one image more than the bound");
        assert_eq!(queued.0.load(Ordering::Relaxed), fit * image, "a refused one is not counted");
        queued.release(image);
        assert!(queued.admit(image));
    }

    fn options(dir: &Path, max_records: u64, max_bytes: u64) -> CaptureOptions {
        CaptureOptions { path: dir.join(FILE_NAME), rate: 1.0, max_records, max_bytes }
    }

    fn record(i: usize, cloud: bool) -> Captured {
        Captured {
            time_s: 1,
            model: "digits".into(),
            version: "1".into(),
            served_by: if cloud { "cloud" } else { "edge" }.into(),
            answer: Some((i % 10).to_string()),
            cloud_label: cloud.then(|| (i % 10).to_string()),
            input: vec![i as f32, 1.0, 2.0],
        }
    }

    /// Sends `n` records straight to a capture's writer and waits for it.
    fn capture(options: CaptureOptions, n: usize) {
        let c = Capture::start(options).unwrap();
        for i in 0..n {
            c.records.send(record(i, i % 2 == 0)).unwrap();
        }
        // The writer ends once every record is written and the sender gone.
        let Capture { records, writer, .. } = c;
        drop(records);
        writer.join().unwrap();
    }

    #[test]
    fn capture_stops_at_its_bounds_and_a_restart_counts_what_is_there() {
        let dir = tempfile::tempdir().unwrap();
        capture(options(dir.path(), 5, 1 << 20), 8);
        let rows = Rows::read_capture(&dir.path().join(FILE_NAME)).unwrap();
        assert_eq!(rows.features.len(), 5, "max_records");
        // The cloud's label is the row's label; the edge's answer is none.
        assert_eq!(rows.labels[..3], [Some("0".to_string()), None, Some("2".to_string())]);
        assert_eq!(rows.features[1], [1.0, 1.0, 2.0]);
        // A restart with the same bound adds nothing; a larger one goes on.
        capture(options(dir.path(), 5, 1 << 20), 3);
        assert_eq!(Rows::read_capture(&dir.path().join(FILE_NAME)).unwrap().features.len(), 5);
        // A record torn by a crash is cut off at the next start.
        let mut file = OpenOptions::new().append(true).open(dir.path().join(FILE_NAME)).unwrap();
        file.write_all(b"{\"time_s\":1,\"mod").unwrap();
        drop(file);
        capture(options(dir.path(), 7, 1 << 20), 3);
        assert_eq!(Rows::read_capture(&dir.path().join(FILE_NAME)).unwrap().features.len(), 7);

        let dir = tempfile::tempdir().unwrap();
        let line = serde_json::to_vec(&record(0, true)).unwrap().len() as u64 + 1;
        capture(options(dir.path(), 100, line * 3 + 5), 10);
        let bytes = std::fs::metadata(dir.path().join(FILE_NAME)).unwrap().len();
        assert!(bytes <= line * 3 + 5, "max_bytes: {bytes}");
        assert_eq!(Rows::read_capture(&dir.path().join(FILE_NAME)).unwrap().features.len(), 3);
    }
}
