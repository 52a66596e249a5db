//! Request validation: every field that comes off the wire is checked here before it reaches the state
//! machine, and a failure names the field, the value and what was expected.

use crate::RdzvError;

/// Limits that bound what one request, one job and the whole service may hold.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest store value in bytes.
    pub max_value_bytes: usize,
    /// Most keys one job may hold (job-scoped plus round-scoped).
    pub max_keys_per_job: usize,
    /// Most store bytes (keys plus values) one job may hold.
    pub max_store_bytes_per_job: usize,
    /// Most jobs alive at once.
    pub max_jobs: usize,
    /// Largest `max_nodes` a job may ask for.
    pub max_nodes_per_job: u32,
    /// Longest wait a blocking call may ask for, in ms.
    pub max_timeout_ms: u64,
    /// How long a completed or failed job (or one without nodes) is kept before it is forgotten, in ms.
    pub retention_ms: u64,
    /// Most node records over all jobs.
    pub max_total_nodes: usize,
    /// Most barrier arrivals waiting over all jobs.
    pub max_total_barrier_arrivals: usize,
}

impl Limits {
    /// No limits: journal replay re-applies what was acknowledged under whatever limits were in
    /// force then, so lowering a limit never makes acknowledged state disappear on restart.
    pub fn unbounded() -> Self {
        Limits {
            max_value_bytes: usize::MAX,
            max_keys_per_job: usize::MAX,
            max_store_bytes_per_job: usize::MAX,
            max_jobs: usize::MAX,
            max_nodes_per_job: u32::MAX,
            max_timeout_ms: u64::MAX,
            retention_ms: u64::MAX,
            max_total_nodes: usize::MAX,
            max_total_barrier_arrivals: usize::MAX,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_value_bytes: 1 << 20,
            max_keys_per_job: 100_000,
            max_store_bytes_per_job: 256 << 20,
            max_jobs: 10_000,
            max_nodes_per_job: 100_000,
            max_timeout_ms: 24 * 3600 * 1000,
            retention_ms: 3600 * 1000,
            max_total_nodes: 1_000_000,
            max_total_barrier_arrivals: 2_000_000,
        }
    }
}

/// Longest job, node, barrier or unique-id name.
pub const MAX_ID_LEN: usize = 128;
/// Longest store key in bytes.
pub const MAX_KEY_LEN: usize = 1024;
/// Most addresses a node may advertise.
pub const MAX_ADDRS: usize = 16;
/// Longest address or host name.
pub const MAX_ADDR_LEN: usize = 256;
/// Most workers on one node.
pub const MAX_LOCAL_WORLD_SIZE: u32 = 4_096;
/// Most keys in one multi-get, multi-set or wait.
pub const MAX_BATCH: usize = 10_000;
/// Size of an NCCL unique id.
pub const UNIQUE_ID_LEN: usize = 128;
/// Longest free-form text (reasons, failure messages) kept; longer text is cut, not rejected.
pub const MAX_TEXT_LEN: usize = 8192;

/// An id: 1 to 128 characters of `[A-Za-z0-9._:@-]`.
pub fn id(field: &'static str, value: &str) -> Result<(), RdzvError> {
    if value.is_empty() {
        return Err(RdzvError::invalid(field, "must not be empty"));
    }
    if value.len() > MAX_ID_LEN {
        return Err(RdzvError::invalid(
            field,
            format!("{} characters long, at most {MAX_ID_LEN} allowed", value.len()),
        ));
    }
    if let Some(bad) = value.chars().find(|c| !(c.is_ascii_alphanumeric() || "._:@-".contains(*c))) {
        return Err(RdzvError::invalid(
            field,
            format!("{value:?} contains {bad:?}; allowed are letters, digits and . _ : @ -"),
        ));
    }
    Ok(())
}

/// A name that may be empty (the default one) or else an id.
pub fn optional_id(field: &'static str, value: &str) -> Result<(), RdzvError> {
    if value.is_empty() { Ok(()) } else { id(field, value) }
}

/// A store key: 1 to 1024 bytes of UTF-8 without control characters.
pub fn key(value: &str) -> Result<(), RdzvError> {
    if value.is_empty() {
        return Err(RdzvError::invalid("key", "must not be empty"));
    }
    if value.len() > MAX_KEY_LEN {
        return Err(RdzvError::invalid(
            "key",
            format!("{} bytes long, at most {MAX_KEY_LEN} allowed", value.len()),
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(RdzvError::invalid("key", format!("{value:?} contains a control character")));
    }
    Ok(())
}

/// A batch of keys (multi-get, wait).
pub fn keys(values: &[String]) -> Result<(), RdzvError> {
    if values.is_empty() {
        return Err(RdzvError::invalid("keys", "at least one key is required"));
    }
    if values.len() > MAX_BATCH {
        return Err(RdzvError::invalid("keys", format!("{} keys, at most {MAX_BATCH} allowed", values.len())));
    }
    values.iter().try_for_each(|k| key(k))
}

/// A store value against the configured cap.
pub fn value(limits: &Limits, value: &[u8]) -> Result<(), RdzvError> {
    if value.len() > limits.max_value_bytes {
        return Err(RdzvError::ResourceExhausted(format!(
            "value of {} bytes exceeds the limit of {} bytes",
            value.len(),
            limits.max_value_bytes
        )));
    }
    Ok(())
}

/// Advertised addresses.
pub fn addrs(values: &[String]) -> Result<(), RdzvError> {
    if values.len() > MAX_ADDRS {
        return Err(RdzvError::invalid("addrs", format!("{} addresses, at most {MAX_ADDRS} allowed", values.len())));
    }
    for a in values {
        if a.is_empty() || a.len() > MAX_ADDR_LEN || a.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return Err(RdzvError::invalid(
                "addrs",
                format!("{} is not an address (1 to {MAX_ADDR_LEN} printable characters, no spaces)", shown(a)),
            ));
        }
    }
    Ok(())
}

/// A host name shown by `status` (may be empty).
pub fn hostname(value: &str) -> Result<(), RdzvError> {
    if value.len() > MAX_ADDR_LEN || value.chars().any(|c| c.is_control()) {
        return Err(RdzvError::invalid("hostname", format!("{} is not a printable name of at most {MAX_ADDR_LEN} bytes", shown(value))));
    }
    Ok(())
}

/// A requested wait, capped by the limit.
pub fn timeout(limits: &Limits, ms: u64) -> Result<u64, RdzvError> {
    if ms > limits.max_timeout_ms {
        return Err(RdzvError::invalid(
            "timeout_ms",
            format!("{ms} ms exceeds the longest wait of {} ms", limits.max_timeout_ms),
        ));
    }
    Ok(ms)
}

/// Cuts free-form text to [`MAX_TEXT_LEN`] bytes at a character boundary, with control characters
/// other than newline and tab replaced by U+FFFD: the text reaches operators' terminals (`status`)
/// and log lines, where an escape sequence from a caller must not act.
pub fn text(value: &str) -> String {
    let clean = |s: &str| s.chars().map(|c| if c.is_control() && c != '\n' && c != '\t' { '\u{fffd}' } else { c }).collect::<String>();
    if value.len() <= MAX_TEXT_LEN {
        return clean(value);
    }
    let mut end = MAX_TEXT_LEN;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", clean(&value[..end]))
}

/// At most this many characters of a refused value go into its error (a refused value may be
/// megabytes, past what a client takes in a status message).
const SHOWN_CHARS: usize = 64;

/// `value` for an error message: debug-quoted, cut to [`SHOWN_CHARS`] characters with its length.
fn shown(value: &str) -> String {
    if value.chars().count() <= SHOWN_CHARS {
        return format!("{value:?}");
    }
    let head: String = value.chars().take(SHOWN_CHARS).collect();
    format!("{head:?}... ({} bytes)", value.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client's longest wait is what a default daemon accepts, so "forever" is never refused.
    #[test]
    fn the_clients_longest_wait_is_the_default_limit() {
        assert_eq!(u128::from(Limits::default().max_timeout_ms), crate::client::MAX_WAIT.as_millis());
    }

    #[test]
    fn ids() {
        assert!(id("job_id", "job-7.a:b@c_d").is_ok());
        let e = id("job_id", "").unwrap_err().to_string();
        assert_eq!(e, "invalid job_id: must not be empty");
        let e = id("job_id", "a b").unwrap_err().to_string();
        assert!(e.contains("\"a b\" contains ' '"), "{e}");
        let e = id("node_id", &"x".repeat(129)).unwrap_err().to_string();
        assert!(e.contains("129 characters long"), "{e}");
    }

    #[test]
    fn keys_and_values() {
        assert!(key("a/b/c").is_ok());
        assert!(key("a\nb").is_err());
        assert!(key(&"k".repeat(1025)).is_err());
        assert!(keys(&[]).is_err());
        let limits = Limits { max_value_bytes: 4, ..Limits::default() };
        assert!(value(&limits, b"1234").is_ok());
        let e = value(&limits, b"12345").unwrap_err().to_string();
        assert_eq!(e, "value of 5 bytes exceeds the limit of 4 bytes");
    }

    /// Text reaches terminals and log lines: no escape sequence survives, lines and tabs do; a
    /// refused value shows its head and length, not megabytes.
    #[test]
    fn text_loses_control_characters_and_refusals_show_a_head() {
        assert_eq!(text("a\x1b[2Jb\nc\td\r"), "a\u{fffd}[2Jb\nc\td\u{fffd}");
        let e = hostname(&format!("{}\u{7}", "h".repeat(100_000))).unwrap_err().to_string();
        assert!(e.len() < 300 && e.contains("... (100001 bytes)"), "{e}");
        let e = addrs(&["a b".repeat(50_000)]).unwrap_err().to_string();
        assert!(e.len() < 300 && e.contains("(150000 bytes)"), "{e}");
    }

    #[test]
    fn text_is_cut_at_char_boundary() {
        let long = "é".repeat(MAX_TEXT_LEN);
        let cut = text(&long);
        assert!(cut.len() <= MAX_TEXT_LEN + "…".len());
    }
}
