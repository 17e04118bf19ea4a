//! The rows candidates are judged on, from the files an operator has: CSV
//! (`models/heldout/digits.csv`), NumPy arrays, and a node's capture.

use std::path::Path;

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
    #[error(
        "{path} has no rows; it needs one per line: the label (or nothing), then the features, comma-separated"
    )]
    Empty { path: String },
}

impl Rows {
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

    /// Features per row.
    pub fn width(&self) -> usize {
        self.features[0].len()
    }

    /// Rows that carry a label.
    pub fn labelled(&self) -> usize {
        self.labels.iter().flatten().count()
    }
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
}
