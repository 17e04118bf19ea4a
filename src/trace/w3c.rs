//! W3C Trace Context, version 00: the `traceparent` a caller sends
//! (`00-TRACE_ID-PARENT_ID-FLAGS`, lowercase hex) and the one the node
//! sends on to the cloud tier and back in its reply (`traceresponse`).

/// A caller's trace: the span this request's spans nest under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parent {
    pub trace_id: u128,
    pub span_id: u64,
    /// The caller exported its side (flag 01): parent-based sampling
    /// exports this side too.
    pub sampled: bool,
}

/// The longest `tracestate` passed on, as the W3C spec bounds it (32
/// members); a longer one is dropped rather than cut mid-member.
pub const MAX_TRACESTATE_BYTES: usize = 512;

/// A `traceparent` header, or `None` when it is not one. The spec says a
/// receiver that cannot read it starts a new trace, so a device with a
/// broken header still gets its answer, in a trace of its own.
pub fn parse(header: &str) -> Option<Parent> {
    let mut parts = header.trim().split('-');
    let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex =
        |s: &str, len: usize| s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if !(hex(version, 2) && hex(trace, 32) && hex(span, 16) && hex(flags, 2)) || version == "ff" {
        return None;
    }
    // Version 00 has exactly four fields; a later version may add some.
    if version == "00" && parts.next().is_some() {
        return None;
    }
    let trace_id = u128::from_str_radix(trace, 16).ok()?;
    let span_id = u64::from_str_radix(span, 16).ok()?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    (trace_id != 0 && span_id != 0).then_some(Parent { trace_id, span_id, sampled: flags & 1 == 1 })
}

/// The header naming `span_id` of trace `trace_id`. Written digit by digit:
/// every reply carries one, and `format!`'s padded hex costs several times more.
pub fn format(trace_id: u128, span_id: u64, sampled: bool) -> String {
    let mut header = String::with_capacity(55);
    header.push_str("00-");
    push_hex(&mut header, &trace_id.to_be_bytes());
    header.push('-');
    push_hex(&mut header, &span_id.to_be_bytes());
    header.push_str(if sampled { "-01" } else { "-00" });
    header
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 15) as usize] as char);
    }
}

/// A `tracestate` worth passing on: bounded, printable ASCII.
pub fn tracestate(header: &str) -> Option<String> {
    let header = header.trim();
    let printable = header.bytes().all(|b| (0x20..0x7f).contains(&b));
    (!header.is_empty() && header.len() <= MAX_TRACESTATE_BYTES && printable).then(|| header.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_reads_back_and_a_broken_one_is_refused() {
        let header = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let parent = parse(header).unwrap();
        assert_eq!(parent.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(parent.span_id, 0x00f067aa0ba902b7);
        assert!(parent.sampled);
        assert_eq!(format(parent.trace_id, parent.span_id, true), header);
        assert_eq!(format(1, 2, false), format!("00-{:032x}-{:016x}-00", 1, 2));
        assert!(!parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap().sampled);
        for broken in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
        ] {
            assert_eq!(parse(broken), None, "{broken:?}");
        }
        // A later version may carry more fields.
        assert!(parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz").is_some());
        assert_eq!(tracestate("congo=t61rcWkgMzE").as_deref(), Some("congo=t61rcWkgMzE"));
        assert_eq!(tracestate(&"a=b,".repeat(200)), None);
    }
}
