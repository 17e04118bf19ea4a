//! JSON specifics: tensor data as a flat array of numbers.

pub(super) mod flat_numbers {
    use super::super::TensorData;
    use serde::de::{Error, SeqAccess, Visitor};
    use serde::ser::SerializeSeq;
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(data: &TensorData, s: S) -> Result<S::Ok, S::Error> {
        fn all<S: Serializer, T: serde::Serialize>(s: S, v: &[T]) -> Result<S::Ok, S::Error> {
            let mut seq = s.serialize_seq(Some(v.len()))?;
            for x in v {
                seq.serialize_element(x)?;
            }
            seq.end()
        }
        match data {
            TensorData::F32(v) => all(s, v),
            TensorData::F64(v) | TensorData::Number(v) => all(s, v),
            TensorData::I8(v) => all(s, v),
            TensorData::U8(v) => all(s, v),
            TensorData::I32(v) => all(s, v),
            TensorData::I64(v) => all(s, v),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<TensorData, D::Error> {
        struct Numbers;
        impl<'de> Visitor<'de> for Numbers {
            type Value = TensorData;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a flat array of numbers (row-major)")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TensorData, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(x) = seq.next_element::<Number>()? {
                    out.push(x.0);
                }
                Ok(TensorData::Number(out))
            }
        }
        d.deserialize_seq(Numbers)
    }

    /// One element; the error names what was found, so `data: ["a"]` says why.
    struct Number(f64);
    impl<'de> serde::Deserialize<'de> for Number {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl Visitor<'_> for V {
                type Value = Number;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("a number")
                }
                fn visit_f64<E: Error>(self, v: f64) -> Result<Number, E> {
                    Ok(Number(v))
                }
                fn visit_i64<E: Error>(self, v: i64) -> Result<Number, E> {
                    Ok(Number(v as f64))
                }
                fn visit_u64<E: Error>(self, v: u64) -> Result<Number, E> {
                    Ok(Number(v as f64))
                }
            }
            d.deserialize_f64(V)
        }
    }
}
