//! The shared secret and the envelope MAC.
//!
//! The MAC is HMAC-SHA256 over a canonical byte string of the envelope's fields, not over the
//! msgpack bytes: two msgpack encoders may write the same envelope differently (map order, int
//! widths), and a Python peer must be able to compute the same MAC from the field values alone.
//! `docs/protocol.md` ("MAC input") is the normative definition; `mac_input` is its code.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::error::ProtocolError;

type HmacSha256 = Hmac<Sha256>;

/// Domain tag that starts every MAC input, so that a kvpush/1 MAC can never be confused with an
/// HMAC the same secret computes for anything else.
pub const MAC_DOMAIN: &[u8] = b"kvpush/1 envelope mac\0";

/// Bytes in a MAC (HMAC-SHA256 output).
pub const MAC_LEN: usize = 32;

/// A shared secret for HMAC authentication of control messages.
///
/// Every prefill and decode worker of one deployment is configured with the same secret.
/// `Debug` does not print it.
#[derive(Clone)]
pub struct Secret(HmacSha256);

impl Secret {
    /// Fewest bytes a secret may have (128 bits).
    pub const MIN_LEN: usize = 16;

    /// A secret from raw bytes (e.g. the bytes of a hex or base64 string from the config).
    ///
    /// # Errors
    ///
    /// [`ProtocolError::WeakSecret`] when `bytes` is shorter than [`Secret::MIN_LEN`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, ProtocolError> {
        if bytes.len() < Self::MIN_LEN {
            return Err(ProtocolError::WeakSecret { len: bytes.len(), min: Self::MIN_LEN });
        }
        // The key schedule (hashing the key into the inner and outer pads) is done once here;
        // each MAC then starts from a clone of this state.
        let keyed = HmacSha256::new_from_slice(bytes).map_err(|_| {
            // HMAC accepts keys of any length; kept as an error rather than a panic anyway.
            ProtocolError::WeakSecret { len: bytes.len(), min: Self::MIN_LEN }
        })?;
        Ok(Self(keyed))
    }

    /// The MAC of an envelope's fields.
    pub(crate) fn sign(&self, fields: &MacFields<'_>) -> [u8; MAC_LEN] {
        let mut mac = self.0.clone();
        mac_input(fields, |chunk| mac.update(chunk));
        mac.finalize().into_bytes().into()
    }

    /// Checks `tag` against the MAC of `fields` in constant time.
    pub(crate) fn verify(&self, fields: &MacFields<'_>, tag: &[u8]) -> Result<(), ProtocolError> {
        let mut mac = self.0.clone();
        mac_input(fields, |chunk| mac.update(chunk));
        mac.verify_slice(tag).map_err(|_| ProtocolError::BadSignature)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// The envelope fields a MAC covers: all of them except the MAC.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MacFields<'a> {
    pub version: u16,
    pub kind: &'a str,
    pub sender: &'a str,
    pub session: u64,
    pub seq: u64,
    pub ts_ms: u64,
    pub body: &'a [u8],
}

/// Feeds the canonical MAC input of `fields` to `sink`, chunk by chunk (no allocation):
///
/// ```text
/// MAC_DOMAIN || u16be(version)
///   || u32be(len kind)   || kind
///   || u32be(len sender) || sender
///   || u64be(session) || u64be(seq) || u64be(ts_ms)
///   || u32be(len body)   || body
/// ```
///
/// Every variable-length field is length-prefixed, so no two field tuples share an input.
/// Lengths fit in u32 because a whole frame does (its prefix is a u32); an envelope whose
/// fields did not fit would be refused as oversized before it is verified.
pub(crate) fn mac_input(fields: &MacFields<'_>, mut sink: impl FnMut(&[u8])) {
    let len32 = |bytes: &[u8]| u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_be_bytes();
    sink(MAC_DOMAIN);
    sink(&fields.version.to_be_bytes());
    sink(&len32(fields.kind.as_bytes()));
    sink(fields.kind.as_bytes());
    sink(&len32(fields.sender.as_bytes()));
    sink(fields.sender.as_bytes());
    sink(&fields.session.to_be_bytes());
    sink(&fields.seq.to_be_bytes());
    sink(&fields.ts_ms.to_be_bytes());
    sink(&len32(fields.body));
    sink(fields.body);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields() -> MacFields<'static> {
        MacFields {
            version: 1,
            kind: "done",
            sender: "p-agent-0",
            session: 0x0102_0304_0506_0708,
            seq: 7,
            ts_ms: 1_700_000_000_000,
            body: b"\x80",
        }
    }

    #[test]
    fn short_secret_is_refused() {
        let err = Secret::from_bytes(b"too short").unwrap_err();
        assert_eq!(err, ProtocolError::WeakSecret { len: 9, min: 16 });
        assert_eq!(err.code(), "weak_secret");
        assert!(Secret::from_bytes(&[7; 16]).is_ok());
    }

    #[test]
    fn debug_does_not_print_the_secret() {
        let secret = Secret::from_bytes(b"sixteen-byte-key-abc").unwrap();
        let shown = format!("{secret:?}");
        assert!(!shown.contains("sixteen"), "{shown}");
    }

    #[test]
    fn mac_input_is_the_documented_byte_string() {
        let mut input = Vec::new();
        mac_input(&fields(), |chunk| input.extend_from_slice(chunk));
        let mut expected = b"kvpush/1 envelope mac\0".to_vec();
        expected.extend_from_slice(&[0, 1]);
        expected.extend_from_slice(&[0, 0, 0, 4]);
        expected.extend_from_slice(b"done");
        expected.extend_from_slice(&[0, 0, 0, 9]);
        expected.extend_from_slice(b"p-agent-0");
        expected.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        expected.extend_from_slice(&7u64.to_be_bytes());
        expected.extend_from_slice(&1_700_000_000_000u64.to_be_bytes());
        expected.extend_from_slice(&[0, 0, 0, 1, 0x80]);
        assert_eq!(input, expected);
    }

    #[test]
    fn mac_matches_the_documented_test_vector() {
        // The test vector in docs/protocol.md, computed independently with Python's
        // hmac.new(b"k" * 32, mac_input, "sha256"), so a reimplementation can check itself.
        let secret = Secret::from_bytes(&[b'k'; 32]).unwrap();
        let tag = secret.sign(&fields());
        let hex: String = tag.iter().map(|byte| format!("{byte:02x}")).collect();
        assert_eq!(hex, "8c61d8c0b227be7512084ce5cc97b9ef0c1488e2fc5fc876453eb657473f4f4c");
        assert!(secret.verify(&fields(), &tag).is_ok());
    }

    #[test]
    fn any_field_change_breaks_the_mac() {
        let secret = Secret::from_bytes(&[3; 32]).unwrap();
        let tag = secret.sign(&fields());
        let changed = [
            MacFields { version: 2, ..fields() },
            MacFields { kind: "fail", ..fields() },
            MacFields { sender: "p-agent-1", ..fields() },
            MacFields { session: 1, ..fields() },
            MacFields { seq: 8, ..fields() },
            MacFields { ts_ms: 1, ..fields() },
            MacFields { body: b"\x81", ..fields() },
            // Moving a byte between adjacent fields must change the input too.
            MacFields { kind: "donep", sender: "-agent-0", ..fields() },
        ];
        for fields in changed {
            assert_eq!(
                secret.verify(&fields, &tag),
                Err(ProtocolError::BadSignature),
                "{fields:?}"
            );
        }
        assert_eq!(secret.verify(&fields(), &tag[..31]), Err(ProtocolError::BadSignature));
        let other = Secret::from_bytes(&[4; 32]).unwrap();
        assert_eq!(other.verify(&fields(), &tag), Err(ProtocolError::BadSignature));
    }
}
