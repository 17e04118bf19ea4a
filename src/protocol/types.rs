use serde::{Deserialize, Serialize};

/// Tensor element types of the Open Inference Protocol that edgeinfer serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Datatype {
    #[serde(rename = "FP32")]
    Fp32,
    #[serde(rename = "FP64")]
    Fp64,
    #[serde(rename = "INT8")]
    Int8,
    #[serde(rename = "UINT8")]
    Uint8,
    #[serde(rename = "INT32")]
    Int32,
    #[serde(rename = "INT64")]
    Int64,
}

impl Datatype {
    pub const ALL: [Datatype; 6] =
        [Datatype::Fp32, Datatype::Fp64, Datatype::Int8, Datatype::Uint8, Datatype::Int32, Datatype::Int64];

    pub fn as_str(self) -> &'static str {
        match self {
            Datatype::Fp32 => "FP32",
            Datatype::Fp64 => "FP64",
            Datatype::Int8 => "INT8",
            Datatype::Uint8 => "UINT8",
            Datatype::Int32 => "INT32",
            Datatype::Int64 => "INT64",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.as_str() == s)
    }

    pub fn size_of(self) -> usize {
        match self {
            Datatype::Int8 | Datatype::Uint8 => 1,
            Datatype::Fp32 | Datatype::Int32 => 4,
            Datatype::Fp64 | Datatype::Int64 => 8,
        }
    }
}

impl std::fmt::Display for Datatype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Flat, row-major tensor elements.
///
/// JSON carries untyped numbers, which decode as `Number` until validation
/// knows the model's datatype; postcard carries typed variants, so a
/// microcontroller sends one byte per INT8 element.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TensorData {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I8(Vec<i8>),
    U8(Vec<u8>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    /// JSON numbers not yet checked against a datatype.
    Number(Vec<f64>),
}

impl TensorData {
    pub fn len(&self) -> usize {
        match self {
            TensorData::F32(v) => v.len(),
            TensorData::F64(v) | TensorData::Number(v) => v.len(),
            TensorData::I8(v) => v.len(),
            TensorData::U8(v) => v.len(),
            TensorData::I32(v) => v.len(),
            TensorData::I64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The datatype the elements already have (`None` for untyped JSON numbers).
    pub fn datatype(&self) -> Option<Datatype> {
        Some(match self {
            TensorData::F32(_) => Datatype::Fp32,
            TensorData::F64(_) => Datatype::Fp64,
            TensorData::I8(_) => Datatype::Int8,
            TensorData::U8(_) => Datatype::Uint8,
            TensorData::I32(_) => Datatype::Int32,
            TensorData::I64(_) => Datatype::Int64,
            TensorData::Number(_) => return None,
        })
    }

    /// Every element as f64 (exact for every supported type but large INT64).
    pub fn to_f64(&self) -> Vec<f64> {
        match self {
            TensorData::F32(v) => v.iter().map(|&x| x as f64).collect(),
            TensorData::F64(v) | TensorData::Number(v) => v.clone(),
            TensorData::I8(v) => v.iter().map(|&x| x as f64).collect(),
            TensorData::U8(v) => v.iter().map(|&x| x as f64).collect(),
            TensorData::I32(v) => v.iter().map(|&x| x as f64).collect(),
            TensorData::I64(v) => v.iter().map(|&x| x as f64).collect(),
        }
    }
}

/// `parameters.tier`: which tiers may answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// The edge model only.
    Fast,
    /// The edge model, escalating to the cloud tier when confidence is low.
    #[default]
    Standard,
    /// The cloud tier first, the edge model as fallback.
    Quality,
}

/// `parameters.enrich`: whether an escalated request waits for the cloud.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Enrich {
    /// One reply: the cloud's answer, or the edge's when the cloud fails.
    #[default]
    Sync,
    /// The edge answer at once (`final: false`), the cloud's after it
    /// (`final: true`) on the same reply topic. MQTT only.
    Async,
}

/// How a model's confidence is measured against its threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Confidence {
    /// The top class probability.
    #[default]
    Max,
    /// The top probability minus the second.
    Margin,
}

/// An inference request (OIP v2 with edgeinfer's optional `reply_to`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InferRequest {
    #[serde(default)]
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_to: Option<String>,
    pub inputs: Vec<InputTensor>,
    /// Requested outputs; empty means all of them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<RequestedOutput>,
    #[serde(default)]
    pub parameters: RequestParameters,
}

impl InferRequest {
    /// A request with one input tensor and default parameters.
    pub fn single(
        id: &str,
        name: &str,
        shape: Vec<i64>,
        datatype: Datatype,
        data: TensorData,
    ) -> InferRequest {
        InferRequest {
            id: id.into(),
            reply_to: None,
            inputs: vec![InputTensor { name: name.into(), shape, datatype: datatype.as_str().into(), data }],
            outputs: vec![],
            parameters: RequestParameters::default(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputTensor {
    pub name: String,
    pub shape: Vec<i64>,
    /// Kept as text so that an unknown datatype gets an error naming the field.
    pub datatype: String,
    #[serde(with = "super::json::flat_numbers")]
    pub data: TensorData,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestedOutput {
    pub name: String,
}

/// `parameters` of a request: all optional. Unknown keys are ignored, as OIP
/// lets clients and proxies add their own.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RequestParameters {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<Tier>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enrich: Option<Enrich>,
}

/// A successful reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InferResponse {
    #[serde(default)]
    pub id: String,
    pub model_name: String,
    #[serde(default)]
    pub model_version: String,
    pub outputs: Vec<OutputTensor>,
    #[serde(default)]
    pub parameters: ResponseParameters,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputTensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub datatype: Datatype,
    #[serde(with = "super::json::flat_numbers")]
    pub data: TensorData,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServedBy {
    #[default]
    Edge,
    Cloud,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheStatus {
    #[default]
    Miss,
    Memory,
    Disk,
    /// The site's shared tier (`[cache.redis]`).
    Redis,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ResponseParameters {
    pub node: String,
    pub served_by: ServedBy,
    pub cache: CacheStatus,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confidence: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<Vec<TopK>>,
    /// The cloud tier was wanted but did not answer: this is the edge's answer.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub degraded: bool,
    /// Only for async enrichment: false on the provisional edge answer, true
    /// on the reply that ends the request.
    #[serde(rename = "final", skip_serializing_if = "Option::is_none")]
    pub is_final: Option<bool>,
    /// The config version the model served with (beside `model_version`):
    /// a config rollout's candidate or stable's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_version: Option<String>,
}

/// One entry of the `top_k` list: a label and its probability, best first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopK {
    pub label: String,
    pub confidence: f32,
}

impl TensorData {
    /// Types untyped JSON numbers as `datatype`, checking that each fits; typed
    /// data must already have that datatype. The error names the element index.
    pub fn into_typed(self, datatype: Datatype) -> Result<TensorData, String> {
        let numbers = match self {
            TensorData::Number(v) => v,
            typed if typed.datatype() == Some(datatype) => return Ok(typed),
            typed => {
                return Err(format!(
                    "holds {} elements but the datatype is {datatype}",
                    typed.datatype().map(|d| d.as_str()).unwrap_or("untyped")
                ));
            }
        };
        fn ints<T: TryFrom<i64>>(v: &[f64], what: &str) -> Result<Vec<T>, String> {
            v.iter()
                .enumerate()
                .map(|(i, &x)| {
                    if x.fract() != 0.0 {
                        return Err(format!("element {i} = {x} is not an integer, as {what} requires"));
                    }
                    T::try_from(x as i64).map_err(|_| format!("element {i} = {x} is out of range for {what}"))
                })
                .collect()
        }
        Ok(match datatype {
            Datatype::Fp32 => {
                let mut out = Vec::with_capacity(numbers.len());
                for (i, &x) in numbers.iter().enumerate() {
                    let y = x as f32;
                    if !y.is_finite() {
                        return Err(format!("element {i} = {x} does not fit in FP32"));
                    }
                    out.push(y);
                }
                TensorData::F32(out)
            }
            Datatype::Fp64 => TensorData::F64(numbers),
            Datatype::Int8 => TensorData::I8(ints(&numbers, "INT8")?),
            Datatype::Uint8 => TensorData::U8(ints(&numbers, "UINT8")?),
            Datatype::Int32 => TensorData::I32(ints(&numbers, "INT32")?),
            Datatype::Int64 => TensorData::I64(ints(&numbers, "INT64")?),
        })
    }
}

impl TensorData {
    /// Appends `other`, which must hold the same element type.
    pub fn extend(&mut self, other: TensorData) -> Result<(), String> {
        match (self, other) {
            (TensorData::F32(a), TensorData::F32(b)) => a.extend(b),
            (TensorData::F64(a), TensorData::F64(b)) => a.extend(b),
            (TensorData::Number(a), TensorData::Number(b)) => a.extend(b),
            (TensorData::I8(a), TensorData::I8(b)) => a.extend(b),
            (TensorData::U8(a), TensorData::U8(b)) => a.extend(b),
            (TensorData::I32(a), TensorData::I32(b)) => a.extend(b),
            (TensorData::I64(a), TensorData::I64(b)) => a.extend(b),
            (a, b) => {
                return Err(format!(
                    "cannot append {:?} elements to {:?} elements",
                    b.datatype(),
                    a.datatype()
                ));
            }
        }
        Ok(())
    }
}

impl TensorData {
    /// Elements `range` as a new tensor of the same type.
    pub fn slice(&self, range: std::ops::Range<usize>) -> TensorData {
        match self {
            TensorData::F32(v) => TensorData::F32(v[range].to_vec()),
            TensorData::F64(v) => TensorData::F64(v[range].to_vec()),
            TensorData::Number(v) => TensorData::Number(v[range].to_vec()),
            TensorData::I8(v) => TensorData::I8(v[range].to_vec()),
            TensorData::U8(v) => TensorData::U8(v[range].to_vec()),
            TensorData::I32(v) => TensorData::I32(v[range].to_vec()),
            TensorData::I64(v) => TensorData::I64(v[range].to_vec()),
        }
    }
}
