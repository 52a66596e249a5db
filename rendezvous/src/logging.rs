//! The log filter of rsrun's binaries: `RSRUN_LOG`, else `RUST_LOG`, else the binary's default.
//!
//! `RSRUN_LOG` is ours: a value that is no filter is an error naming it. `RUST_LOG` may be set for
//! other programs in other dialects (env_logger's `debug/regex`): one that is no filter here is
//! named in a note and the default is used.

use tracing_subscriber::EnvFilter;

/// The filter to install, and a note to print when `RUST_LOG` was set but unusable.
#[derive(Debug)]
pub struct LogFilter {
    /// What to install.
    pub filter: EnvFilter,
    /// Why `RUST_LOG` was ignored, when it was.
    pub note: Option<String>,
}

/// The filter from this process's environment; see [`from_values`].
///
/// # Errors
/// As [`from_values`].
pub fn from_env(default: &str) -> Result<LogFilter, String> {
    from_values(std::env::var("RSRUN_LOG").ok(), std::env::var("RUST_LOG").ok(), default)
}

/// The filter from the values of `RSRUN_LOG` and `RUST_LOG` (`None`: unset).
///
/// # Errors
/// `RSRUN_LOG` is set but is no filter: the message names the variable, the value and the syntax.
pub fn from_values(rsrun_log: Option<String>, rust_log: Option<String>, default: &str) -> Result<LogFilter, String> {
    let fallback = || EnvFilter::try_new(default).unwrap_or_else(|_| EnvFilter::new("warn"));
    if let Some(v) = rsrun_log.filter(|v| !v.trim().is_empty()) {
        return EnvFilter::try_new(&v).map(|filter| LogFilter { filter, note: None }).map_err(|e| {
            format!("RSRUN_LOG={v:?} is not a log filter ({e}); expected LEVEL or TARGET=LEVEL[,...], e.g. info or warn,rsrun_launcher=debug")
        });
    }
    if let Some(v) = rust_log.filter(|v| !v.trim().is_empty()) {
        return Ok(match EnvFilter::try_new(&v) {
            Ok(filter) => LogFilter { filter, note: None },
            Err(e) => LogFilter {
                filter: fallback(),
                note: Some(format!("RUST_LOG={v:?} is not a log filter here ({e}); logging at {default:?} (RSRUN_LOG takes precedence)")),
            },
        });
    }
    Ok(LogFilter { filter: fallback(), note: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rsrun_log_must_be_a_filter_and_rust_log_falls_back() {
        let s = |v: &str| Some(v.to_owned());
        assert!(from_values(s("warn,rsrun_launcher=debug"), None, "info").is_ok());
        let e = from_values(s("garbage==="), s("info"), "info").unwrap_err();
        assert!(e.starts_with("RSRUN_LOG=\"garbage===\" is not a log filter"), "{e}");
        // RSRUN_LOG wins over a bad RUST_LOG.
        let f = from_values(s("debug"), s("foo["), "info").unwrap();
        assert!(f.note.is_none());
        let f = from_values(None, s("foo[="), "info").unwrap();
        assert!(f.note.as_deref().is_some_and(|n| n.contains("RUST_LOG=\"foo[=\"")), "{:?}", f.note);
        assert!(from_values(None, None, "info").unwrap().note.is_none());
        assert!(from_values(s(" "), None, "info").is_ok(), "an empty RSRUN_LOG is unset");
    }
}
