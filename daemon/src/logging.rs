//! Process-wide structured logging to stderr, the same in every binary so operators read one format.

use tracing_subscriber::EnvFilter;

/// The filter used when the requested one does not parse.
const FALLBACK_FILTER: &str = "info";

/// Installs the global tracing subscriber: stderr, filtered by `level`, JSON lines when `json` is true
/// (for log collectors), human-readable otherwise.
///
/// `level` is a plain level (`error`, `warn`, `info`, `debug`, `trace`) or full `EnvFilter` directives
/// (`info,hyper=warn,daemon::probes=debug`). If it does not parse, logging falls back to `info` and
/// says so in a warning, rather than leaving the process silent. Only the first call in a process
/// installs anything; later calls (e.g. from tests) do nothing.
pub fn init(level: &str, json: bool) {
    let (filter, rejected) = parse_filter(level);
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let installed = if json { builder.json().try_init().is_ok() } else { builder.try_init().is_ok() };
    if let (true, Some(error)) = (installed, rejected) {
        tracing::warn!(filter = level, %error, "invalid log filter; using {FALLBACK_FILTER}");
    }
}

/// Parses `level` into a filter, or the fallback filter plus the parse error.
fn parse_filter(level: &str) -> (EnvFilter, Option<String>) {
    match EnvFilter::try_new(level) {
        Ok(filter) => (filter, None),
        Err(error) => (EnvFilter::new(FALLBACK_FILTER), Some(error.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_levels_and_directives() {
        for level in ["error", "warn", "info", "debug", "trace", "info,hyper=warn,daemon::probes=debug"] {
            let (filter, rejected) = parse_filter(level);
            assert_eq!(rejected, None, "{level} rejected");
            // EnvFilter orders directives by specificity; compare them as a set.
            let mut shown: Vec<String> = filter.to_string().split(',').map(str::to_owned).collect();
            let mut asked: Vec<&str> = level.split(',').collect();
            shown.sort();
            asked.sort();
            assert_eq!(shown, asked);
        }
    }

    #[test]
    fn falls_back_to_info_on_garbage() {
        let (filter, rejected) = parse_filter("daemon=loud");
        assert!(rejected.is_some());
        assert_eq!(filter.to_string(), FALLBACK_FILTER);
    }

    #[test]
    fn second_init_is_harmless() {
        init("debug", true);
        init("info", false);
        tracing::info!("still logging after two inits");
    }
}
