//! Process-wide structured logging to stderr, the same in every binary so operators read one format.

use tracing_subscriber::EnvFilter;

/// The filter used when the requested one does not parse.
const FALLBACK_FILTER: &str = "info";

/// Installs the global tracing subscriber: stderr, filtered by `level`, JSON lines when `json` is true
/// (for log collectors), human-readable otherwise.
///
/// `level` is a plain level (`error`, `warn`, `info`, `debug`, `trace`), full `EnvFilter` directives
/// (`info,hyper=warn,daemon::probes=debug`), or Istio's `--log_output_level` form (`default:info,cni:debug`; see
/// [`translate_istio_levels`]). If it does not parse, logging falls back to `info` and says so in a warning, rather
/// than leaving the process silent. Istio scopes with no counterpart here are ignored with one warning. Only the
/// first call in a process installs anything; later calls (e.g. from tests) do nothing.
pub fn init(level: &str, json: bool) {
    let translated = translate_istio_levels(level);
    let (filter, rejected) = parse_filter(&translated.directives);
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let installed = if json { builder.json().try_init().is_ok() } else { builder.try_init().is_ok() };
    if !installed {
        return;
    }
    if let Some(error) = rejected {
        tracing::warn!(filter = level, %error, "invalid log filter; using {FALLBACK_FILTER}");
    }
    if !translated.ignored_scopes.is_empty() {
        tracing::warn!(
            filter = level,
            scopes = translated.ignored_scopes.join(","),
            "Istio log scopes with no counterpart here are ignored"
        );
    }
}

/// Istio's logging scopes of the CNI node agent that name a part of ours, and the tracing targets they map onto.
/// `default` is not here: it is the global level.
const ISTIO_SCOPES: &[(&str, &[&str])] = &[
    ("cni", &["installer", "install_cni", "node_agent", "daemon", "redirect", "zds", "netns"]),
    ("install", &["installer", "install_cni"]),
    ("ambient", &["node_agent", "redirect", "zds", "netns"]),
    ("cni-agent", &["node_agent", "daemon"]),
    ("repair", &["node_agent::repair"]),
    ("iptables", &["redirect"]),
    // The plugin's own level: install-cni writes it into the netconf (`plugin_log_level`), no target here.
    ("cni-plugin", &[]),
];

/// A log setting rewritten into `EnvFilter` directives.
#[derive(Debug, PartialEq, Eq)]
pub struct Translated {
    /// The `EnvFilter` directives.
    pub directives: String,
    /// Istio scopes that have no counterpart here, in the order given.
    pub ignored_scopes: Vec<String>,
}

/// Rewrites Istio's `--log_output_level` form into `EnvFilter` directives; anything else passes through.
///
/// Each comma-separated entry is either `scope:level` (Istio's form) or an `EnvFilter` directive / plain level
/// (ours). In Istio's form the `default` scope sets the global level, a known Istio scope (`cni`, `install`,
/// `ambient`, `cni-agent`, `repair`, `iptables`) sets the level of the matching targets, and any other scope is
/// ignored (reported in [`Translated::ignored_scopes`]). Istio's level names `none` and `fatal` become `off` and
/// `error`. When Istio's form is used without a `default` entry, the global level stays `info`, as in Istio.
pub fn translate_istio_levels(level: &str) -> Translated {
    let mut global = None;
    let mut directives = Vec::new();
    let mut ignored_scopes = Vec::new();
    let mut istio_form = false;
    for entry in level.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let scoped = (!entry.contains('=') && !entry.contains("::")).then(|| entry.split_once(':')).flatten();
        let Some((scope, scope_level)) = scoped else {
            directives.push(istio_level(entry).to_owned());
            continue;
        };
        istio_form = true;
        let scope_level = istio_level(scope_level.trim());
        match scope.trim() {
            "default" => global = Some(scope_level.to_owned()),
            scope => match ISTIO_SCOPES.iter().find(|(name, _)| *name == scope) {
                Some((_, targets)) => directives.extend(targets.iter().map(|t| format!("{t}={scope_level}"))),
                None => ignored_scopes.push(scope.to_owned()),
            },
        }
    }
    let global = global.or_else(|| istio_form.then(|| FALLBACK_FILTER.to_owned()));
    let directives = global.into_iter().chain(directives).collect::<Vec<_>>().join(",");
    let directives = if directives.is_empty() { FALLBACK_FILTER.to_owned() } else { directives };
    Translated { directives, ignored_scopes }
}

/// Istio's level names in tracing's words (`none` is off, `fatal` is error); others unchanged.
fn istio_level(level: &str) -> &str {
    match level {
        "none" => "off",
        "fatal" => "error",
        other => other,
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

    fn translated(level: &str) -> (String, Vec<String>) {
        let t = translate_istio_levels(level);
        (t.directives, t.ignored_scopes)
    }

    #[test]
    fn istio_levels_map_onto_the_filter() {
        // Plain levels and our own directives pass through.
        assert_eq!(translated("debug"), ("debug".into(), vec![]));
        assert_eq!(translated("info,daemon::probes=debug"), ("info,daemon::probes=debug".into(), vec![]));
        // Istio's chart default and the `default` scope set the global level.
        assert_eq!(translated("default:info"), ("info".into(), vec![]));
        assert_eq!(translated("default:debug"), ("debug".into(), vec![]));
        // A known scope sets its targets, the global level stays info as in Istio.
        let (directives, ignored) = translated("repair:debug");
        assert_eq!((directives.as_str(), ignored), ("info,node_agent::repair=debug", vec![]));
        let (directives, _) = translated("default:warn,install:debug");
        assert_eq!(directives, "warn,installer=debug,install_cni=debug");
        // Unknown scopes are ignored and reported; Istio's level names are translated.
        assert_eq!(translated("default:none,xds:debug,klog:fatal"), ("off".into(), vec!["xds".into(), "klog".into()]));
        assert_eq!(translated("fatal"), ("error".into(), vec![]));
        // The plugin's scope is install-cni's business (its netconf), not a filter target, and not ignored.
        assert_eq!(translated("default:info,cni-plugin:debug"), ("info".into(), vec![]));
        assert_eq!(translated(""), ("info".into(), vec![]));
        // Every translation is a valid filter.
        for level in ["default:info,cni:debug", "ambient:debug,iptables:warn", "cni-agent:none", "xds:debug"] {
            let (_, rejected) = parse_filter(&translate_istio_levels(level).directives);
            assert_eq!(rejected, None, "{level}");
        }
    }

    #[test]
    fn second_init_is_harmless() {
        init("debug", true);
        init("info", false);
        tracing::info!("still logging after two inits");
    }
}
