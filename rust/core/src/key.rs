//! Transfer keys: what P and D both know a request by.
//!
//! The router's `transfer_id`, when it sent one, is the key. Otherwise the key is the request id
//! with what differs between P and D taken off, computed once when the entry is inserted:
//!
//! * vLLM's OpenAI front end names a request `cmpl-<x-request-id>-<i>` or `chatcmpl-<x-request-id>`;
//!   the prefix is the same on both legs of one request only when both legs use the same endpoint,
//!   so it is dropped;
//! * each engine then appends `-<8 random lowercase hex>` (`InputProcessor.assign_request_id`),
//!   which always differs between P and D, so it is dropped too.
//!
//! Lookups are then exact hash lookups: no table scan ever compares ids by suffix.

use std::borrow::Borrow;
use std::fmt;
use std::sync::Arc;

/// The key under which P's ready KV and D's registration meet in the rendezvous table.
///
/// Cheap to clone (a shared string), compared and hashed by value.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferKey(Arc<str>);

impl TransferKey {
    /// The key for a request: the router's `transfer_id` when non-empty, else the canonical form
    /// of `request_id` (see [`canonical_request_id`]).
    pub fn for_request(transfer_id: Option<&str>, request_id: &str) -> Self {
        match transfer_id {
            Some(id) if !id.is_empty() => Self(Arc::from(id)),
            _ => Self(Arc::from(canonical_request_id(request_id))),
        }
    }

    /// A key taken verbatim (already canonical, e.g. decoded from a peer's message).
    pub fn from_canonical(key: &str) -> Self {
        Self(Arc::from(key))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key of share `slot` of this transfer, when one P rank writes it into several D
    /// ranks (D runs the larger tensor parallel size): each D rank registers, and is written,
    /// under its own slot key.
    pub fn slot(&self, slot: u32) -> Self {
        Self(Arc::from(format!("{}{SLOT_SEPARATOR}{slot}", self.0)))
    }

    /// The transfer and slot of a [`slot`](Self::slot) key; `None` for a key without a slot.
    pub fn split_slot(&self) -> Option<(Self, u32)> {
        let (base, slot) = self.0.rsplit_once(SLOT_SEPARATOR)?;
        let slot = slot.parse().ok().filter(|_| !base.is_empty())?;
        Some((Self(Arc::from(base)), slot))
    }
}

/// Between a transfer key and its slot: a control character, which no router's transfer id or
/// vLLM request id contains.
const SLOT_SEPARATOR: char = '\u{1f}';

impl fmt::Debug for TransferKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TransferKey({:?})", &*self.0)
    }
}

impl fmt::Display for TransferKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Borrow<str> for TransferKey {
    fn borrow(&self) -> &str {
        &self.0
    }
}

const ENGINE_SUFFIX_HEX_DIGITS: usize = 8;
const FRONTEND_PREFIXES: [&str; 2] = ["chatcmpl-", "cmpl-"];

/// The part of a vLLM request id that P and D share.
///
/// Drops one `cmpl-`/`chatcmpl-` prefix and one trailing `-` + 8 lowercase hex digits (the
/// per-engine random suffix). Ids without them are returned unchanged, so a router that sets
/// identical ids on both legs (or `VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`) still matches.
///
/// The completions endpoint also appends `-<choice index>` before the engine suffix
/// (`cmpl-<id>-0-<hex>`); that index is kept, since both legs of one choice carry the same one.
pub fn canonical_request_id(request_id: &str) -> &str {
    let without_prefix = FRONTEND_PREFIXES
        .iter()
        .find_map(|prefix| request_id.strip_prefix(prefix))
        .filter(|rest| !rest.is_empty())
        .unwrap_or(request_id);
    strip_engine_suffix(without_prefix)
}

fn strip_engine_suffix(id: &str) -> &str {
    let bytes = id.as_bytes();
    let suffix_len = ENGINE_SUFFIX_HEX_DIGITS + 1;
    if bytes.len() <= suffix_len {
        return id;
    }
    let (head, tail) = bytes.split_at(bytes.len() - suffix_len);
    let is_engine_suffix = tail[0] == b'-'
        && tail[1..].iter().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b));
    if is_engine_suffix {
        // The split point is an ASCII '-', so it is a char boundary.
        &id[..head.len()]
    } else {
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_frontend_prefix_and_engine_suffix() {
        assert_eq!(canonical_request_id("cmpl-abc123-0-1a2b3c4d"), "abc123-0");
        assert_eq!(canonical_request_id("chatcmpl-abc123-deadbeef"), "abc123");
        assert_eq!(canonical_request_id("abc123-0123abcd"), "abc123");
    }

    #[test]
    fn p_and_d_ids_of_one_request_meet() {
        let p = TransferKey::for_request(None, "cmpl-7f3e-0-0badf00d");
        let d = TransferKey::for_request(None, "cmpl-7f3e-0-c0ffee11");
        assert_eq!(p, d);
    }

    #[test]
    fn leaves_ids_without_suffix_alone() {
        assert_eq!(canonical_request_id("req-42"), "req-42");
        assert_eq!(canonical_request_id("abc-DEADBEEF"), "abc-DEADBEEF", "uppercase is not vLLM's");
        assert_eq!(canonical_request_id("abc-0123abc"), "abc-0123abc", "7 digits is not a suffix");
        assert_eq!(canonical_request_id("-0123abcd"), "-0123abcd", "nothing would be left");
        assert_eq!(canonical_request_id("cmpl-"), "cmpl-");
    }

    #[test]
    fn transfer_id_wins_over_request_id() {
        let key = TransferKey::for_request(Some("xfer-1"), "cmpl-abc-0-12345678");
        assert_eq!(key.as_str(), "xfer-1");
        let key = TransferKey::for_request(Some(""), "cmpl-abc-0-12345678");
        assert_eq!(key.as_str(), "abc-0");
    }

    #[test]
    fn slot_keys_are_distinct_and_name_their_transfer() {
        let key = TransferKey::for_request(Some("xfer-1"), "r");
        let (one, two) = (key.slot(1), key.slot(2));
        assert_ne!(one, two);
        assert_ne!(one, key);
        assert_eq!(one.split_slot(), Some((key.clone(), 1)));
        assert_eq!(key.split_slot(), None);
        assert_eq!(TransferKey::from_canonical("\u{1f}3").split_slot(), None);
        assert_eq!(TransferKey::from_canonical("a\u{1f}x").split_slot(), None);
    }

    #[test]
    fn multibyte_ids_do_not_panic() {
        assert_eq!(canonical_request_id("ünïcødé-12345678"), "ünïcødé");
        assert_eq!(canonical_request_id("日本語"), "日本語");
    }
}
