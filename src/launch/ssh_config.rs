//! The subset of `ssh_config(5)` users describe their clusters with: `Host` patterns (`*`,
//! `?`, `!negation`, several per line), `HostName`, `User`, `Port`, `IdentityFile` (`~`
//! expanded) and `ProxyJump`. As OpenSSH does, the first value found for a key wins and
//! every matching `Host` block contributes; `Match`, `Include` and other keys are ignored.
//! Pure: the caller reads the file.

use std::path::{Path, PathBuf};

/// What `~/.ssh/config` says about one host alias. `None`: not set there.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct HostConfig {
    pub hostname: Option<String>,
    pub user: Option<String>,
    pub port: Option<u16>,
    /// Every `IdentityFile` of every matching block, in order (OpenSSH tries them all).
    pub identity_files: Vec<PathBuf>,
    /// `ProxyJump` as written: `[user@]host[:port]`; `none` is returned as `None`.
    pub proxy_jump: Option<String>,
}

/// Looks `alias` up in the text of an ssh config file. `home` expands `~/`.
pub(crate) fn lookup(text: &str, alias: &str, home: &Path) -> HostConfig {
    let mut config = HostConfig::default();
    let mut proxy_jump_seen = false;
    let mut active = true; // Lines before the first `Host` apply to every host.
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (key, value) = split_key_value(line);
        let key = key.to_ascii_lowercase();
        if key == "host" {
            active = host_matches(value, alias);
            continue;
        }
        if key == "match" {
            // `Match` blocks need evaluation we do not do: ignore their contents.
            active = false;
            continue;
        }
        if !active {
            continue;
        }
        let value = unquote(value);
        match key.as_str() {
            "hostname" if config.hostname.is_none() => config.hostname = Some(value.into()),
            "user" if config.user.is_none() => config.user = Some(value.into()),
            "port" if config.port.is_none() => config.port = value.parse().ok(),
            "identityfile" => config.identity_files.push(expand_home(value, home)),
            "proxyjump" if !proxy_jump_seen => {
                proxy_jump_seen = true;
                if !value.eq_ignore_ascii_case("none") {
                    config.proxy_jump = Some(value.into());
                }
            }
            _ => {}
        }
    }
    if let Some(hostname) = &mut config.hostname {
        // `%h` in HostName is the alias itself.
        *hostname = hostname.replace("%h", alias);
    }
    config
}

/// `[user@]host[:port]` of a `ProxyJump` entry (the first hop of a comma list).
pub(crate) fn parse_jump(spec: &str) -> (Option<String>, String, Option<u16>) {
    let first = spec.split(',').next().unwrap_or(spec).trim();
    let (user, rest) = match first.rsplit_once('@') {
        Some((user, rest)) => (Some(user.to_string()), rest),
        None => (None, first),
    };
    match rest.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => match port.parse() {
            Ok(port) => (user, host.to_string(), Some(port)),
            Err(_) => (user, rest.to_string(), None),
        },
        _ => (user, rest.to_string(), None),
    }
}

fn split_key_value(line: &str) -> (&str, &str) {
    // `Key value`, `Key=value` and `Key = value` are all allowed.
    let split_at = line
        .find(|c: char| c.is_whitespace() || c == '=')
        .unwrap_or(line.len());
    let (key, rest) = line.split_at(split_at);
    let rest = rest.trim_start();
    let rest = rest.strip_prefix('=').unwrap_or(rest).trim();
    (key, rest)
}

fn unquote(value: &str) -> &str {
    value
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(value)
}

fn expand_home(value: &str, home: &Path) -> PathBuf {
    match value.strip_prefix("~/") {
        Some(rest) => home.join(rest),
        None => PathBuf::from(value),
    }
}

/// Whether a `Host` line's patterns select `alias`: some positive pattern matches and no
/// negated one does.
fn host_matches(patterns: &str, alias: &str) -> bool {
    let mut matched = false;
    for pattern in patterns.split_whitespace().map(unquote) {
        if let Some(negated) = pattern.strip_prefix('!') {
            if glob(negated.as_bytes(), alias.as_bytes()) {
                return false;
            }
        } else if glob(pattern.as_bytes(), alias.as_bytes()) {
            matched = true;
        }
    }
    matched
}

/// `*` and `?` globbing, as `ssh_config(5)` PATTERNS.
fn glob(pattern: &[u8], text: &[u8]) -> bool {
    match (pattern.first(), text.first()) {
        (None, None) => true,
        (Some(b'*'), _) => {
            glob(&pattern[1..], text) || (!text.is_empty() && glob(pattern, &text[1..]))
        }
        (Some(b'?'), Some(_)) => glob(&pattern[1..], &text[1..]),
        (Some(p), Some(t)) if p.eq_ignore_ascii_case(t) => glob(&pattern[1..], &text[1..]),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = "\
# the cluster
Host bastion
    HostName 203.0.113.5
    User jump

Host gpu-* !gpu-9
    User ubuntu
    Port=2222
    IdentityFile ~/.ssh/cluster_ed25519
    ProxyJump bastion

Host gpu-1
    HostName 10.0.0.11
    User ignored-first-wins

Host *
    IdentityFile ~/.ssh/id_ed25519
    User fallback
";

    #[test]
    fn first_value_wins_and_every_matching_block_contributes() {
        let home = Path::new("/home/me");
        let config = lookup(CONFIG, "gpu-1", home);
        assert_eq!(config.hostname.as_deref(), Some("10.0.0.11"));
        assert_eq!(config.user.as_deref(), Some("ubuntu"));
        assert_eq!(config.port, Some(2222));
        assert_eq!(config.proxy_jump.as_deref(), Some("bastion"));
        assert_eq!(
            config.identity_files,
            vec![
                PathBuf::from("/home/me/.ssh/cluster_ed25519"),
                PathBuf::from("/home/me/.ssh/id_ed25519")
            ]
        );
        // Negation removes a host from a block.
        let config = lookup(CONFIG, "gpu-9", home);
        assert_eq!(config.user.as_deref(), Some("fallback"));
        assert_eq!((config.port, config.proxy_jump), (None, None));
        let config = lookup(CONFIG, "bastion", home);
        assert_eq!(config.hostname.as_deref(), Some("203.0.113.5"));
        assert_eq!(config.user.as_deref(), Some("jump"));
    }

    #[test]
    fn jump_specs_parse() {
        assert_eq!(parse_jump("bastion"), (None, "bastion".into(), None));
        assert_eq!(
            parse_jump("ops@10.0.0.1:2200,other"),
            (Some("ops".into()), "10.0.0.1".into(), Some(2200))
        );
    }

    #[test]
    fn globs() {
        assert!(glob(b"gpu-?", b"gpu-1"));
        assert!(!glob(b"gpu-?", b"gpu-10"));
        assert!(glob(b"*.example.com", b"a.b.example.com"));
        assert!(host_matches("a b *", "zzz"));
        assert!(!host_matches("* !zzz", "zzz"));
    }
}
