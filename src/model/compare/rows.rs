//! The rows candidates are judged on, from the files an operator has: CSV
//! (`models/heldout/digits.csv`), NumPy arrays, and a node's capture.

use serde::{Deserialize, Serialize};
use std::path::Path;

/// One request a node captured (`capture.enabled`), a line of its
/// `capture.jsonl`: the row as the device sent it, the answer it got, and
/// the cloud's label where the cloud tier answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Captured {
    /// Seconds since the Unix epoch.
    pub time_s: u64,
    /// The edge model and version the request went to.
    pub model: String,
    pub version: String,
    /// `edge` or `cloud`.
    pub served_by: String,
    /// The label in the reply.
    pub answer: Option<String>,
    /// The cloud tier's label, where it answered: the row's label for `models compare`.
    pub cloud_label: Option<String>,
    pub input: Vec<f32>,
}

/// Rows from a CSV file: the label first (empty when the row has none),
/// then the features, one row per line; lines starting with `#` and blank
/// lines are skipped (`models/heldout/digits.csv`).
#[derive(Debug, Clone, PartialEq)]
pub struct Rows {
    pub labels: Vec<Option<String>>,
    pub features: Vec<Vec<f32>>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DataError {
    #[error("cannot read {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("{path} line {line}: {reason}")]
    Row { path: String, line: usize, reason: String },
    #[error("{path} has no rows to compare on")]
    Empty { path: String },
}

impl Rows {
    /// Rows from `path` by its kind: `.npy` (features, with the labels from
    /// `labels`, another `.npy`, if given), `.jsonl` (a node's capture), or
    /// else CSV.
    pub fn read(path: &Path, labels: Option<&Path>) -> Result<Rows, DataError> {
        let kind = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        match (kind, labels) {
            ("npy", _) => Rows::read_npy(path, labels),
            (_, Some(labels)) => Err(DataError::Read {
                path: labels.display().to_string(),
                reason: "labels come from a file of their own only for .npy data".into(),
            }),
            ("jsonl", None) => Rows::read_capture(path),
            _ => Rows::read_csv(path),
        }
    }

    /// NumPy arrays: features of shape (rows, features), labels (integers)
    /// of shape (rows,), as `np.save` writes them.
    pub fn read_npy(path: &Path, labels: Option<&Path>) -> Result<Rows, DataError> {
        let (shape, values) = npy_numbers(path)?;
        let shown = path.display().to_string();
        let [rows, width] = shape[..] else {
            return Err(DataError::Read {
                path: shown,
                reason: format!("shape {shape:?}: use rows of features, shape (rows, features)"),
            });
        };
        if rows == 0 || width == 0 {
            return Err(DataError::Empty { path: shown });
        }
        let features: Vec<Vec<f32>> =
            values.chunks(width as usize).map(|row| row.iter().map(|&v| v as f32).collect()).collect();
        let labels = match labels {
            None => vec![None; features.len()],
            Some(file) => {
                let (shape, values) = npy_numbers(file)?;
                let bad = |reason: String| DataError::Read { path: file.display().to_string(), reason };
                if shape != [rows] {
                    return Err(bad(format!(
                        "shape {shape:?}: use one label per row of the data, shape ({rows},)"
                    )));
                }
                values
                    .iter()
                    .map(|&v| match v.fract() == 0.0 {
                        true => Ok(Some(format!("{}", v as i64))),
                        false => Err(bad(format!("label {v} is not a class number"))),
                    })
                    .collect::<Result<_, _>>()?
            }
        };
        Ok(Rows { labels, features })
    }

    pub fn read_csv(path: &Path) -> Result<Rows, DataError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| DataError::Read { path: shown.clone(), reason: e.to_string() })?;
        Rows::parse_csv(&text, &shown)
    }

    pub fn parse_csv(text: &str, path: &str) -> Result<Rows, DataError> {
        let mut data = Rows { labels: Vec::new(), features: Vec::new() };
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |reason: String| DataError::Row { path: path.to_string(), line: i + 1, reason };
            let mut fields = line.split(',').map(str::trim);
            let label = fields.next().filter(|l| !l.is_empty());
            let row = fields
                .enumerate()
                .map(|(j, f)| {
                    f.parse::<f32>().map_err(|_| bad(format!("feature {} is {f:?}, not a number", j + 1)))
                })
                .collect::<Result<Vec<f32>, _>>()?;
            if let Some(first) = data.features.first()
                && first.len() != row.len()
            {
                return Err(bad(format!("{} features where the first row has {}", row.len(), first.len())));
            }
            if row.is_empty() {
                return Err(bad("no features after the label".into()));
            }
            data.labels.push(label.map(str::to_string));
            data.features.push(row);
        }
        if data.labels.is_empty() {
            return Err(DataError::Empty { path: path.to_string() });
        }
        Ok(data)
    }

    /// A node's capture: each record's input, labelled with the cloud's
    /// answer where the cloud tier gave one. A torn last line (the node was
    /// killed while writing it) is left out.
    pub fn read_capture(path: &Path) -> Result<Rows, DataError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| DataError::Read { path: shown.clone(), reason: e.to_string() })?;
        let mut data = Rows { labels: Vec::new(), features: Vec::new() };
        let torn = !text.ends_with('\n');
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let bad = |reason: String| DataError::Row { path: shown.clone(), line: i + 1, reason };
            let record: Captured = match serde_json::from_str(line) {
                Ok(record) => record,
                Err(_) if torn && i + 1 == lines.len() => break,
                Err(e) => return Err(bad(format!("not a capture record: {e}"))),
            };
            if let Some(first) = data.features.first()
                && first.len() != record.input.len()
            {
                return Err(bad(format!(
                    "{} features ({}:{}) where the first record has {}; compare models of one input at a time",
                    record.input.len(),
                    record.model,
                    record.version,
                    first.len()
                )));
            }
            data.labels.push(record.cloud_label);
            data.features.push(record.input);
        }
        if data.labels.is_empty() {
            return Err(DataError::Empty { path: shown });
        }
        Ok(data)
    }

    /// Features per row.
    pub fn width(&self) -> usize {
        self.features[0].len()
    }

    /// Rows that carry a label.
    pub fn labelled(&self) -> usize {
        self.labels.iter().flatten().count()
    }
}

/// An `.npy` file's shape and its numbers, whatever their plain type.
fn npy_numbers(path: &Path) -> Result<(Vec<u64>, Vec<f64>), DataError> {
    let bad = |reason: String| DataError::Read { path: path.display().to_string(), reason };
    let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    let file = npyz::NpyFile::new(&bytes[..]).map_err(|e| bad(format!("not a NumPy .npy file: {e}")))?;
    let shape = file.shape().to_vec();
    // Values come in stored order: a Fortran-ordered array would be read
    // as scrambled rows.
    if shape.len() > 1 && file.order() == npyz::Order::Fortran {
        return Err(bad("saved in Fortran order: save np.ascontiguousarray(x) instead".into()));
    }
    let npyz::DType::Plain(t) = file.dtype() else {
        return Err(bad("a structured array: save plain numbers".into()));
    };
    let numbers = |e: std::io::Error| bad(e.to_string());
    let values: Vec<f64> = match (t.type_char(), t.size_field()) {
        (npyz::TypeChar::Float, 4) => {
            file.into_vec::<f32>().map_err(numbers)?.into_iter().map(f64::from).collect()
        }
        (npyz::TypeChar::Float, 8) => file.into_vec::<f64>().map_err(numbers)?,
        (npyz::TypeChar::Int, 1) => {
            file.into_vec::<i8>().map_err(numbers)?.into_iter().map(f64::from).collect()
        }
        (npyz::TypeChar::Int, 2) => {
            file.into_vec::<i16>().map_err(numbers)?.into_iter().map(f64::from).collect()
        }
        (npyz::TypeChar::Int, 4) => {
            file.into_vec::<i32>().map_err(numbers)?.into_iter().map(f64::from).collect()
        }
        (npyz::TypeChar::Int, 8) => {
            file.into_vec::<i64>().map_err(numbers)?.into_iter().map(|v| v as f64).collect()
        }
        (npyz::TypeChar::Uint, 1) => {
            file.into_vec::<u8>().map_err(numbers)?.into_iter().map(f64::from).collect()
        }
        (npyz::TypeChar::Uint, 2) => {
            file.into_vec::<u16>().map_err(numbers)?.into_iter().map(f64::from).collect()
        }
        (npyz::TypeChar::Uint, 4) => {
            file.into_vec::<u32>().map_err(numbers)?.into_iter().map(f64::from).collect()
        }
        (npyz::TypeChar::Uint, 8) => {
            file.into_vec::<u64>().map_err(numbers)?.into_iter().map(|v| v as f64).collect()
        }
        (c, n) => return Err(bad(format!("numbers of type {c:?}{n}: save floats or integers"))),
    };
    Ok((shape, values))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_csv_row_out_of_shape_is_named_by_its_line() {
        let ok = Rows::parse_csv("# comment\n7,1,2,3\n\n, 4 ,5,6\n", "d.csv").unwrap();
        assert_eq!(ok.labels, [Some("7".to_string()), None]);
        assert_eq!(ok.features[1], [4.0, 5.0, 6.0]);
        assert_eq!((ok.width(), ok.labelled()), (3, 1));
        let e = Rows::parse_csv("7,1,2,3\n1,4,5\n", "d.csv").unwrap_err();
        assert_eq!(e.to_string(), "d.csv line 2: 2 features where the first row has 3");
        let e = Rows::parse_csv("7,1,x\n", "d.csv").unwrap_err();
        assert_eq!(e.to_string(), "d.csv line 1: feature 2 is \"x\", not a number");
        let e = Rows::parse_csv("7\n", "d.csv").unwrap_err();
        assert_eq!(e.to_string(), "d.csv line 1: no features after the label");
        assert!(matches!(Rows::parse_csv("# only\n", "d.csv"), Err(DataError::Empty { .. })));
    }

    trait Fortran {
        fn replace_fortran(self) -> Vec<u8>;
    }

    impl Fortran for Vec<u8> {
        /// The same header saying Fortran order (the same length).
        fn replace_fortran(self) -> Vec<u8> {
            let at = self.windows(5).position(|w| w == b"False").unwrap();
            let mut out = self;
            out.splice(at..at + 5, b"True ".iter().copied());
            out
        }
    }

    /// A version 1.0 `.npy` file as NumPy writes it.
    fn npy(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
        let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn npy_pairs_are_rows_and_their_labels() {
        let dir = tempfile::tempdir().unwrap();
        let (x, y) = (dir.path().join("x.npy"), dir.path().join("y.npy"));
        let features: Vec<u8> =
            [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(&x, npy("<f4", "(2, 3)", &features)).unwrap();
        std::fs::write(&y, npy("<i8", "(2,)", &[7i64.to_le_bytes(), 1i64.to_le_bytes()].concat())).unwrap();
        let rows = Rows::read(&x, Some(&y)).unwrap();
        assert_eq!(rows.features, [vec![1.0, 2.0, 3.0], vec![4.0, 5.0, 6.0]]);
        assert_eq!(rows.labels, [Some("7".to_string()), Some("1".to_string())]);
        assert_eq!(Rows::read(&x, None).unwrap().labelled(), 0);
        std::fs::write(&y, npy("<i8", "(3,)", &[0u8; 24])).unwrap();
        let e = Rows::read(&x, Some(&y)).unwrap_err().to_string();
        assert!(e.contains("shape [3]: use one label per row of the data, shape (2,)"), "{e}");
        std::fs::write(&x, npy("<f4", "(2, 3)", &features).replace_fortran()).unwrap();
        let e = Rows::read(&x, None).unwrap_err().to_string();
        assert!(e.contains("Fortran order"), "{e}");
        std::fs::write(&x, npy("<f4", "(6,)", &features)).unwrap();
        let e = Rows::read(&x, None).unwrap_err().to_string();
        assert!(e.contains("use rows of features"), "{e}");
        let csv = dir.path().join("d.csv");
        std::fs::write(&csv, "1,2\n").unwrap();
        assert!(Rows::read(&csv, Some(&y)).unwrap_err().to_string().contains("only for .npy data"));
    }
}
