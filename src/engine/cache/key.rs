//! The cache key: sha256 over everything that decides an answer, and nothing
//! that does not (never `id`, `reply_to`, `deadline_ms` or `cache`; `tier`
//! only where the model escalates to the cloud, see `for_tier`).

use crate::model::LoadedModel;
use crate::protocol::{InferRequest, TensorData};
use sha2::{Digest, Sha256};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(pub [u8; 32]);

impl Key {
    /// The key of `req` answered by `model`, whose single input the model
    /// receives as `input` (typed and scaled by preprocessing, so a JSON and a
    /// postcard request with the same values share one entry).
    pub fn new(model: &LoadedModel, req: &InferRequest, input: &TensorData) -> Key {
        let mut h = Sha256::new();
        // Every variable-length part is length-prefixed, so no two different
        // requests can hash the same bytes.
        let text = |h: &mut Sha256, s: &str| {
            h.update((s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        };
        // v2: replies gained `degraded` and `final`, so v1 records are not read.
        // v3: the version's contents are in it (below), so v2 records are not read.
        text(&mut h, "edgeinfer-cache-v3");
        text(&mut h, model.name());
        text(&mut h, model.version());
        // What the version's directory holds, not just its name: nodes (or
        // one node after a reload) with other files under the same version
        // name give other answers, and must never share them. The model
        // file's sha256 (checked at load) and the manifest's (labels,
        // preprocessing and thresholds).
        text(&mut h, &model.manifest.sha256);
        text(&mut h, &model.manifest_sha256);
        // Parameters that change the reply.
        match req.parameters.top_k.filter(|&k| k > 0) {
            Some(k) => h.update([1].iter().chain(&k.to_le_bytes()).copied().collect::<Vec<u8>>()),
            None => h.update([0]),
        }
        let mut outputs: Vec<&str> = req.outputs.iter().map(|o| o.name.as_str()).collect();
        outputs.sort_unstable();
        outputs.dedup();
        h.update((outputs.len() as u64).to_le_bytes());
        for o in outputs {
            text(&mut h, o);
        }
        let spec = &model.manifest.input;
        h.update((req.inputs.len() as u64).to_le_bytes());
        for tensor in &req.inputs {
            text(&mut h, &tensor.name);
            text(&mut h, spec.datatype.as_str());
            h.update((tensor.shape.len() as u64).to_le_bytes());
            for d in &tensor.shape {
                h.update(d.to_le_bytes());
            }
        }
        h.update((input.len() as u64).to_le_bytes());
        hash_elements(&mut h, input);
        Key(h.finalize().into())
    }

    /// The key for a model that escalates: each tier caches its own
    /// answers (a `fast` edge answer must not stand in for a `quality` one).
    pub fn for_tier(self, tier: crate::protocol::Tier) -> Key {
        let mut h = Sha256::new();
        h.update(b"tier");
        h.update(self.0);
        h.update([tier as u8]);
        Key(h.finalize().into())
    }

    /// The key under config version `config`: each config caches its own
    /// answers.
    pub fn for_config(self, config: &str) -> Key {
        let mut h = Sha256::new();
        h.update(b"config");
        h.update(self.0);
        h.update(config.as_bytes());
        Key(h.finalize().into())
    }

    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }
}

fn hash_elements(h: &mut Sha256, data: &TensorData) {
    // Little-endian bytes of each element: the same on every target.
    match data {
        TensorData::F32(v) => v.iter().for_each(|x| h.update(x.to_le_bytes())),
        TensorData::F64(v) | TensorData::Number(v) => v.iter().for_each(|x| h.update(x.to_le_bytes())),
        TensorData::I8(v) => v.iter().for_each(|x| h.update(x.to_le_bytes())),
        TensorData::U8(v) => h.update(v),
        TensorData::I32(v) => v.iter().for_each(|x| h.update(x.to_le_bytes())),
        TensorData::I64(v) => v.iter().for_each(|x| h.update(x.to_le_bytes())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RuntimeOptions;
    use crate::protocol::{Datatype, RequestedOutput};

    fn digits() -> LoadedModel {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/digits/1");
        LoadedModel::load(&dir, &RuntimeOptions::default()).unwrap()
    }

    fn request() -> InferRequest {
        InferRequest::single("a", "input", vec![1, 64], Datatype::Fp32, TensorData::Number(vec![1.0; 64]))
    }

    #[test]
    fn the_key_covers_what_decides_the_answer_and_nothing_else() {
        let model = digits();
        let input = TensorData::F32(vec![0.0625; 64]);
        let base = Key::new(&model, &request(), &input);

        let mut same = request();
        same.id = "b".into();
        same.reply_to = Some("x/y".into());
        same.parameters.deadline_ms = Some(10);
        same.parameters.cache = Some(true);
        same.parameters.tier = Some(crate::protocol::Tier::Fast);
        assert_eq!(
            Key::new(&model, &same, &input),
            base,
            "id, reply_to, deadline, cache and tier are not in it"
        );

        let mut top = request();
        top.parameters.top_k = Some(3);
        assert_ne!(Key::new(&model, &top, &input), base, "top_k changes the reply");
        top.parameters.top_k = Some(0);
        assert_eq!(Key::new(&model, &top, &input), base, "top_k 0 asks for no list, like none");

        let mut outputs = request();
        outputs.outputs = vec![RequestedOutput { name: "probabilities".into() }];
        assert_ne!(Key::new(&model, &outputs, &input), base, "requested outputs change the reply");

        let mut other = input.clone();
        if let TensorData::F32(v) = &mut other {
            v[63] = 0.125;
        }
        assert_ne!(Key::new(&model, &request(), &other), base, "one element differs");

        let mut renamed = request();
        renamed.inputs[0].shape = vec![64, 1];
        assert_ne!(Key::new(&model, &renamed, &input), base, "shape is in it");
    }

    #[test]
    fn the_version_is_in_the_key() {
        let v1 = digits();
        let mut v2 = digits();
        v2.manifest.version = "2".into();
        let input = TensorData::F32(vec![0.0; 64]);
        assert_ne!(Key::new(&v1, &request(), &input), Key::new(&v2, &request(), &input));
    }

    /// Issue 35, finding 8: one version name with other contents (another
    /// node's directory, or this one's replaced in place and reloaded).
    #[test]
    fn finding_8_the_model_and_manifest_sha256_are_in_the_key() {
        let stock = digits();
        let input = TensorData::F32(vec![0.0; 64]);
        let base = Key::new(&stock, &request(), &input);
        let mut other_file = digits();
        other_file.manifest.sha256 =
            "35d60f1edd1277316aa197b02188f0cc874de5f65010790cf1c7c8b55c60696d".into();
        assert_ne!(Key::new(&other_file, &request(), &input), base, "another model file");
        let mut other_manifest = digits();
        other_manifest.manifest_sha256 = hex::encode([7; 32]);
        assert_ne!(Key::new(&other_manifest, &request(), &input), base, "another manifest (labels, say)");
        assert_eq!(Key::new(&digits(), &request(), &input), base, "the same contents: the same key");
    }
}
