//! One environment scheme for every binary: each flag's variable is `GPUSHARE_<FLAG>`. The
//! plugins' variables had no prefix until 2026-11 (`NODE_NAME`, `LOG_FORMAT`…); a
//! deployment that still sets an old name keeps working, with a warning to rename it.
//!
//! Why as flags: clap reads one variable per flag, and setting the new variable from the old
//! one would need `std::env::set_var`, unsafe in a multi-threaded process. So the value of
//! an old name is handed to the parser as the flag it configures, unless the flag or its new
//! variable is given.

use std::ffi::OsString;

/// `args` with `--<flag>=<value>` added for each of `old_names` that is set (read through
/// `lookup`) while the flag whose variable is `GPUSHARE_<old name>` is neither on the command
/// line nor set under its new name; and one warning per old name so read, to be logged once
/// logging is up.
pub fn with_legacy_env(
    command: &clap::Command,
    args: impl IntoIterator<Item = OsString>,
    old_names: &[&str],
    lookup: impl Fn(&str) -> Option<OsString>,
) -> (Vec<OsString>, Vec<String>) {
    let mut args: Vec<OsString> = args.into_iter().collect();
    let mut warnings = Vec::new();
    for old in old_names {
        let new = format!("GPUSHARE_{old}");
        let Some(long) = command.get_arguments().find_map(|arg| {
            (arg.get_env().is_some_and(|env| *env == *new))
                .then(|| arg.get_long())
                .flatten()
        }) else {
            continue;
        };
        let flag = format!("--{long}");
        let given = args.iter().skip(1).any(|arg| {
            arg.to_str().is_some_and(|arg| {
                arg == flag
                    || arg
                        .strip_prefix(&flag)
                        .is_some_and(|rest| rest.starts_with('='))
            })
        });
        if given || lookup(&new).is_some() {
            continue;
        }
        if let Some(value) = lookup(old) {
            let mut arg = OsString::from(format!("{flag}="));
            arg.push(&value);
            args.push(arg);
            warnings.push(format!(
                "environment variable {old} is read as {new}; rename it (the old name will stop working)"
            ));
        }
    }
    (args, warnings)
}

/// Parses the process's arguments into `C`, the old environment names read as
/// [`with_legacy_env`] says; exits with clap's message on bad arguments. Returns the warnings
/// to log once logging is up.
pub fn parse<C: clap::CommandFactory + clap::FromArgMatches>(
    old_names: &[&str],
) -> (C, Vec<String>) {
    let (args, warnings) = with_legacy_env(&C::command(), std::env::args_os(), old_names, |name| {
        std::env::var_os(name)
    });
    let parsed = C::command()
        .try_get_matches_from(args)
        .and_then(|matches| C::from_arg_matches(&matches));
    match parsed {
        Ok(config) => (config, warnings),
        Err(error) => error.exit(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Debug, Parser)]
    struct Config {
        #[arg(long, env = "GPUSHARE_NODE_NAME")]
        node_name: String,
        #[arg(long, env = "GPUSHARE_LOG_FORMAT", default_value = "text")]
        log_format: String,
    }

    fn parse(argv: &[&str], env: &[(&str, &str)]) -> (Config, Vec<String>) {
        let lookup = |name: &str| {
            env.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| OsString::from(v))
        };
        let (args, warnings) = with_legacy_env(
            &Config::command(),
            argv.iter().map(OsString::from),
            &["NODE_NAME", "LOG_FORMAT", "NOT_A_FLAG"],
            lookup,
        );
        // The test's own variables stand in for the process environment: only what the
        // old names added reaches the parser, plus the new names passed as flags here.
        (Config::try_parse_from(args).unwrap(), warnings)
    }

    #[test]
    fn an_old_name_configures_its_flag_with_a_warning() {
        let (config, warnings) = parse(&["x"], &[("NODE_NAME", "n1"), ("LOG_FORMAT", "json")]);
        assert_eq!(
            (config.node_name.as_str(), config.log_format.as_str()),
            ("n1", "json")
        );
        assert_eq!(warnings.len(), 2);
        assert!(warnings[0].contains("NODE_NAME is read as GPUSHARE_NODE_NAME"));
    }

    #[test]
    fn the_flag_or_the_new_name_wins_over_an_old_name() {
        let (config, warnings) = parse(
            &["x", "--node-name=from-flag"],
            &[
                ("NODE_NAME", "old"),
                ("LOG_FORMAT", "json"),
                ("GPUSHARE_LOG_FORMAT", "text"),
            ],
        );
        assert_eq!(config.node_name, "from-flag");
        // GPUSHARE_LOG_FORMAT is set (clap would read it from the real environment), so the
        // old name is not turned into a flag.
        assert_eq!(config.log_format, "text");
        assert!(warnings.is_empty(), "{warnings:?}");
    }
}
