//! The Redis value: an answer signed with the site's key
//! (`cache.redis.key_file`). Any client that can write to the site's Redis
//! could otherwise plant an answer that every node serves; without the key
//! it cannot make a value a node accepts.
//!
//! Layout: the format byte, then the HMAC-SHA256 tag (32 bytes), then the
//! payload (postcard: stored at, expires at, the reply's bytes). The tag
//! covers the format byte, the full Redis key name and the payload, so a
//! genuine value copied under another key (another input, model or site
//! prefix) fails too. A value is measured first, then its tag checked in
//! constant time, and only then is a byte of it parsed.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// The longest value a lookup reads, and the longest a node writes: an
/// answer bigger than this stays on the node. It bounds what a planted
/// value costs a lookup (memory, and time within `cache.redis.timeout_ms`).
pub const MAX_VALUE_BYTES: usize = 1024 * 1024;

/// The first byte of a value of this format. Redis format 1 (unsigned,
/// checksummed records under `PREFIX:v1:`) began with postcard's 0.
const FORMAT: u8 = 2;
const TAG_BYTES: usize = 32;

/// The shortest site key taken: HMAC-SHA256's own block of strength.
pub const MIN_KEY_BYTES: usize = 32;

/// The site's key, ready to sign: the keyed HMAC state, cloned per use
/// (cheaper than keying again). Never printed.
#[derive(Clone)]
pub struct SiteKey(Hmac<Sha256>);

impl std::fmt::Debug for SiteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SiteKey(..)")
    }
}

/// Why a key file's contents are not a site key; says what to write instead.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadKey {
    #[error("is empty: {FIX}")]
    Empty,
    #[error("is not hex (only 0-9, a-f and white space): {FIX}")]
    NotHex,
    #[error("holds {bytes} bytes; use at least {MIN_KEY_BYTES} (64 hex digits): {FIX}")]
    Short { bytes: usize },
}

const FIX: &str = "make one for the site with `head -c 32 /dev/urandom | xxd -p > /etc/edgeinfer/redis.key` \
                   and copy that file to every node";

impl SiteKey {
    /// The key written as hex in `text`; white space (the line breaks of
    /// `xxd -p`, a final newline) is ignored.
    pub fn from_hex(text: &str) -> Result<SiteKey, BadKey> {
        let digits: String = text.chars().filter(|c| !c.is_ascii_whitespace()).collect();
        if digits.is_empty() {
            return Err(BadKey::Empty);
        }
        let bytes = hex::decode(&digits).map_err(|_| BadKey::NotHex)?;
        if bytes.len() < MIN_KEY_BYTES {
            return Err(BadKey::Short { bytes: bytes.len() });
        }
        Ok(SiteKey(Hmac::new_from_slice(&bytes).expect("HMAC takes a key of any length")))
    }

    fn tag(&self, name: &str, payload: &[u8]) -> Hmac<Sha256> {
        let mut mac = self.0.clone();
        mac.update(&[FORMAT]);
        // Length-prefixed: no name and payload run into each other.
        mac.update(&(name.len() as u64).to_le_bytes());
        mac.update(name.as_bytes());
        mac.update(payload);
        mac
    }
}

/// One shared answer, as the payload of a signed value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedAnswer {
    pub stored_at_ms: u64,
    pub expires_at_ms: u64,
    /// The reply, postcard-encoded.
    pub body: Vec<u8>,
}

/// Why a value read from Redis is not served; each one a miss, counted
/// under its `reason` (`edgeinfer_cache_redis_rejected_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejected {
    /// Longer than `MAX_VALUE_BYTES`; not parsed.
    Oversized,
    /// Not a signed value of this format: an older format, another
    /// program's value, or one cut short.
    Unsigned,
    /// The tag does not verify: written without the site key (a forgery),
    /// with another site's key, or altered.
    Signature,
    /// Signed, yet its payload does not decode: a writer holding the key
    /// wrote something else.
    Undecodable,
}

impl Rejected {
    pub fn reason(self) -> &'static str {
        match self {
            Rejected::Oversized => "oversized",
            Rejected::Unsigned => "unsigned",
            Rejected::Signature => "signature",
            Rejected::Undecodable => "undecodable",
        }
    }

    /// What it means, for the operator reading the log.
    pub fn describe(self) -> &'static str {
        match self {
            Rejected::Oversized => "longer than the 1 MiB a node reads",
            Rejected::Unsigned => {
                "not a signed value of this format: an older release's, another program's, or cut short"
            }
            Rejected::Signature => {
                "its signature does not verify: written without this site's key (a forgery), or by a node \
                 with another cache.redis.key_file"
            }
            Rejected::Undecodable => "signed, yet not an answer",
        }
    }
}

/// The value to store under the Redis key `name`; `None` when it would be
/// longer than `MAX_VALUE_BYTES` (no reader would take it).
pub fn seal(key: &SiteKey, name: &str, answer: &SharedAnswer) -> Option<Vec<u8>> {
    let payload = postcard::to_stdvec(answer).expect("an answer always encodes");
    let mut value = Vec::with_capacity(1 + TAG_BYTES + payload.len());
    value.push(FORMAT);
    value.extend_from_slice(&key.tag(name, &payload).finalize().into_bytes());
    value.extend_from_slice(&payload);
    (value.len() <= MAX_VALUE_BYTES).then_some(value)
}

/// The answer in `value`, read under the Redis key `name`, if it is signed
/// with `key` for that name.
pub fn open(key: &SiteKey, name: &str, value: &[u8]) -> Result<SharedAnswer, Rejected> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(Rejected::Oversized);
    }
    let Some((&FORMAT, rest)) = value.split_first() else { return Err(Rejected::Unsigned) };
    let Some((tag, payload)) = rest.split_at_checked(TAG_BYTES) else { return Err(Rejected::Unsigned) };
    key.tag(name, payload).verify_slice(tag).map_err(|_| Rejected::Signature)?;
    match postcard::take_from_bytes::<SharedAnswer>(payload) {
        Ok((answer, [])) => Ok(answer),
        _ => Err(Rejected::Undecodable),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
    const NAME: &str = "edgeinfer:v2:digits:0a0b";

    fn key(hex: &str) -> SiteKey {
        SiteKey::from_hex(hex).unwrap()
    }

    fn answer() -> SharedAnswer {
        SharedAnswer { stored_at_ms: 1_000, expires_at_ms: 2_000, body: b"label 7".to_vec() }
    }

    #[test]
    fn finding_8_a_signed_value_opens_under_its_name_with_its_key_only() {
        let value = seal(&key(HEX), NAME, &answer()).unwrap();
        assert_eq!(open(&key(HEX), NAME, &value), Ok(answer()));
        // Another site's key: its values are not ours.
        let other = HEX.replace("ff", "fe");
        assert_eq!(open(&key(&other), NAME, &value), Err(Rejected::Signature));
        // A genuine value moved under another key (another input's).
        assert_eq!(open(&key(HEX), "edgeinfer:v2:digits:0a0c", &value), Err(Rejected::Signature));
    }

    #[test]
    fn finding_8_a_tampered_value_is_rejected_whichever_byte_changed() {
        let value = seal(&key(HEX), NAME, &answer()).unwrap();
        for i in 1..value.len() {
            let mut tampered = value.clone();
            tampered[i] ^= 0x01;
            assert_eq!(open(&key(HEX), NAME, &tampered), Err(Rejected::Signature), "byte {i}");
        }
        let mut longer = value.clone();
        longer.push(0);
        assert_eq!(open(&key(HEX), NAME, &longer), Err(Rejected::Signature), "a byte appended");
        assert_eq!(open(&key(HEX), NAME, &value[..value.len() - 1]), Err(Rejected::Signature));
    }

    #[test]
    fn finding_8_an_unsigned_or_old_format_value_is_rejected() {
        // What Redis format 1 stored: a postcard record starting with seq 0.
        let old = postcard::to_stdvec(&(0u64, 1_000u64, 2_000u64, 42u64, b"label 7".to_vec())).unwrap();
        assert_eq!(open(&key(HEX), NAME, &old), Err(Rejected::Unsigned));
        assert_eq!(open(&key(HEX), NAME, b""), Err(Rejected::Unsigned));
        // The format byte and a tag cut short.
        assert_eq!(open(&key(HEX), NAME, &[FORMAT; TAG_BYTES]), Err(Rejected::Unsigned));
        // The payload alone, as a forger without the key might write it.
        let payload = postcard::to_stdvec(&answer()).unwrap();
        let bare = [&[FORMAT][..], &[0; TAG_BYTES], &payload].concat();
        assert_eq!(open(&key(HEX), NAME, &bare), Err(Rejected::Signature));
    }

    #[test]
    fn finding_8_an_oversized_value_is_rejected_before_it_is_looked_at() {
        let big = SharedAnswer { body: vec![7; MAX_VALUE_BYTES], ..answer() };
        assert_eq!(seal(&key(HEX), NAME, &big), None, "not written either");
        let value = vec![FORMAT; MAX_VALUE_BYTES + 1];
        assert_eq!(open(&key(HEX), NAME, &value), Err(Rejected::Oversized));
        // Just under the cap: signed and opened.
        // Room for the format byte, the tag and the payload's three numbers.
        let room = MAX_VALUE_BYTES - 64;
        let fits = SharedAnswer { body: vec![7; room], ..answer() };
        let value = seal(&key(HEX), NAME, &fits).unwrap();
        assert_eq!(open(&key(HEX), NAME, &value), Ok(fits));
    }

    #[test]
    fn finding_8_a_signed_payload_that_does_not_decode_is_rejected() {
        let garbage = [0xff; 12];
        let tag = key(HEX).tag(NAME, &garbage).finalize().into_bytes();
        let value = [&[FORMAT][..], &tag, &garbage].concat();
        assert_eq!(open(&key(HEX), NAME, &value), Err(Rejected::Undecodable));
    }

    #[test]
    fn finding_8_a_key_is_hex_of_at_least_32_bytes_in_any_layout() {
        // `head -c 32 /dev/urandom | xxd -p` breaks the line after 30 bytes.
        let xxd = format!("{}\n{}\n", &HEX[..60], &HEX[60..]);
        let value = seal(&key(HEX), NAME, &answer()).unwrap();
        assert_eq!(open(&key(&xxd), NAME, &value), Ok(answer()), "the same key");
        assert!(SiteKey::from_hex(&HEX.to_uppercase()).is_ok());
        assert_eq!(SiteKey::from_hex(&HEX[..62]).unwrap_err(), BadKey::Short { bytes: 31 });
        assert_eq!(SiteKey::from_hex(" \n").unwrap_err(), BadKey::Empty);
        assert_eq!(SiteKey::from_hex("correct horse battery staple").unwrap_err(), BadKey::NotHex);
        assert_eq!(SiteKey::from_hex(&HEX[..63]).unwrap_err(), BadKey::NotHex, "an odd digit");
        let why = BadKey::Short { bytes: 16 }.to_string();
        assert!(why.contains("16 bytes") && why.contains("head -c 32 /dev/urandom | xxd -p"), "{why}");
        assert_eq!(format!("{:?}", key(HEX)), "SiteKey(..)", "never printed");
    }
}
