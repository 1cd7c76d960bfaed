//! SSH connections to cluster hosts (russh: pure Rust, async, channel signals, many
//! concurrent channels on one connection). One connection per host: host keys checked
//! against `known_hosts` files by default (an unknown key fails with its fingerprint and
//! the command that trusts it; a changed key fails loudly; `accept_new` trusts hosts with no
//! known key at all, never a changed key or a host known under a key of another algorithm,
//! as OpenSSH's `StrictHostKeyChecking=accept-new`; the host key algorithms a host is known
//! under are asked for first, as OpenSSH does), authentication through ssh-agent then identity files, an optional
//! `ProxyJump` through one bastion, keepalives. Errors are classified (DNS, timeout,
//! refused, host key, auth) so preflight can say what class of fault each host has.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use russh::client::{self, Handle};
use russh::keys::{HashAlg, PrivateKeyWithHashAlg, PublicKey};

/// How long a TCP connect plus SSH handshake may take, per hop.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Keepalive interval; the connection is dropped after [`KEEPALIVE_MAX`] unanswered.
pub(crate) const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Unanswered keepalives before the connection is considered dead.
pub(crate) const KEEPALIVE_MAX: usize = 3;

/// Where and how to reach one host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SshTarget {
    /// Name used in messages (`node0`).
    pub name: String,
    /// What TCP connects to, and the name host keys are recorded under.
    pub address: String,
    /// TCP port of `sshd`.
    pub port: u16,
    /// Login user.
    pub user: String,
    /// Keys to try after the agent's, in order.
    pub identity_files: Vec<PathBuf>,
    /// Files of known host keys, searched in order; unknown keys are learned (with
    /// `accept_new`) into the first.
    pub known_hosts: Vec<PathBuf>,
    /// A bastion to go through (`ProxyJump`), itself reached directly.
    pub jump: Option<Box<SshTarget>>,
}

/// Connection settings shared by every host of a run.
#[derive(Clone, Copy, Debug, Default)]
pub struct SshOptions {
    /// Trust (and record) the key of a host that has no known key yet. Changed keys, and
    /// hosts known under a key of another algorithm, are still refused.
    pub accept_new: bool,
}

/// Why a host could not be reached, for preflight tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FaultClass {
    Dns,
    Timeout,
    Refused,
    HostKeyUnknown,
    HostKeyChanged,
    HostKeyOtherAlgorithm,
    Auth,
    Other,
}

impl FaultClass {
    /// The short name shown in tables.
    pub(crate) fn name(self) -> &'static str {
        match self {
            FaultClass::Dns => "dns",
            FaultClass::Timeout => "tcp timeout",
            FaultClass::Refused => "connection refused",
            FaultClass::HostKeyUnknown => "host key unknown",
            FaultClass::HostKeyChanged => "host key changed",
            FaultClass::HostKeyOtherAlgorithm => "host key algorithm",
            FaultClass::Auth => "auth refused",
            FaultClass::Other => "ssh",
        }
    }
}

/// A connection failure with its class; the message says what to do.
#[derive(Debug)]
pub(crate) struct ConnectError {
    /// What kind of fault, for preflight tables.
    pub class: FaultClass,
    /// What happened and what to do about it.
    pub message: String,
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConnectError {}

/// An authenticated connection to one host.
pub(crate) struct Connection {
    /// russh's handle: channels are opened through it.
    pub handle: Handle<Client>,
    /// Where it goes.
    pub target: SshTarget,
    /// Keeps the bastion's connection open for as long as this one lives.
    _jump: Option<Box<Connection>>,
}

/// The client side of russh's callbacks: host key checking.
pub(crate) struct Client {
    host: String,
    port: u16,
    known_hosts: Vec<PathBuf>,
    accept_new: bool,
    /// What was wrong with the host key, read after a failed handshake.
    problem: Arc<Mutex<Option<ConnectError>>>,
}

impl client::Handler for Client {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        key: &russh::keys::PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        let russh::keys::PublicKeyOrCertificate::PublicKey { key, .. } = key else {
            self.refuse(
                FaultClass::HostKeyUnknown,
                "the host presented a certificate; `infer` checks plain host keys only".into(),
            );
            return Ok(false);
        };
        let verdict = check_host_key(&self.host, self.port, key, &self.known_hosts);
        match verdict {
            KeyVerdict::Known => Ok(true),
            KeyVerdict::Changed { file, line } => {
                self.refuse(
                    FaultClass::HostKeyChanged,
                    format!(
                        "the host key of `{}` CHANGED: {} does not match line {line} of `{}`; \
                         this may be an attack, or the host was reinstalled\n\
                         hint: if the change is expected, remove the old key with `ssh-keygen -R {} -f {}`",
                        self.host_port(),
                        key.fingerprint(HashAlg::Sha256),
                        file.display(),
                        self.host_port(),
                        file.display()
                    ),
                );
                Ok(false)
            }
            KeyVerdict::OtherAlgorithm {
                algorithm,
                file,
                line,
            } => {
                self.refuse(
                    FaultClass::HostKeyOtherAlgorithm,
                    format!(
                        "`{}` presented an {} key ({}), but line {line} of `{}` knows it by an {algorithm} key; \
                         a known host is not new, so `--ssh-accept-new` does not record another key for it\n\
                         hint: if the host's keys really changed, remove the old one with `ssh-keygen -R {} -f {}`, then rerun",
                        self.host_port(),
                        key.algorithm().as_str(),
                        key.fingerprint(HashAlg::Sha256),
                        file.display(),
                        self.host_port(),
                        file.display()
                    ),
                );
                Ok(false)
            }
            KeyVerdict::Unreadable { file, error } => {
                self.refuse(
                    FaultClass::Other,
                    format!(
                        "cannot read the known keys of `{}` in `{}`: {error}\n\
                         hint: fix or remove that host's lines (`ssh-keygen -R {} -f {}`), then rerun",
                        self.host_port(),
                        file.display(),
                        self.host_port(),
                        file.display()
                    ),
                );
                Ok(false)
            }
            KeyVerdict::Unknown if self.accept_new => {
                if let Some(file) = self.known_hosts.first()
                    && let Err(error) = russh::keys::known_hosts::learn_known_hosts_path(
                        &self.host, self.port, key, file,
                    )
                {
                    self.refuse(
                        FaultClass::Other,
                        format!(
                            "cannot record the host key in `{}`: {error}",
                            file.display()
                        ),
                    );
                    return Ok(false);
                }
                Ok(true)
            }
            KeyVerdict::Unknown => {
                let file = self
                    .known_hosts
                    .first()
                    .map_or_else(|| "~/.ssh/known_hosts".into(), |f| f.display().to_string());
                self.refuse(
                    FaultClass::HostKeyUnknown,
                    format!(
                        "the host key of `{}` is not known ({} {})\n\
                         hint: check the fingerprint, then trust it with `ssh-keyscan -p {} {} >> {file}`, or rerun with `--ssh-accept-new`",
                        self.host_port(),
                        key.algorithm().as_str(),
                        key.fingerprint(HashAlg::Sha256),
                        self.port,
                        self.host
                    ),
                );
                Ok(false)
            }
        }
    }
}

impl Client {
    fn host_port(&self) -> String {
        if self.port == 22 {
            self.host.clone()
        } else {
            format!("[{}]:{}", self.host, self.port)
        }
    }

    fn refuse(&self, class: FaultClass, message: String) {
        if let Ok(mut problem) = self.problem.lock() {
            *problem = Some(ConnectError { class, message });
        }
    }
}

/// What the known-hosts files say about a key.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum KeyVerdict {
    /// This very key is recorded for the host.
    Known,
    /// A key of the same algorithm is recorded for the host, and it is another.
    Changed { file: PathBuf, line: usize },
    /// The host is known, but only under keys of other algorithms (`algorithm`, the first
    /// at `file`:`line`): not a new host.
    OtherAlgorithm {
        algorithm: String,
        file: PathBuf,
        line: usize,
    },
    /// `file` has lines for the host that cannot be read (`error`): what it knows is unknown.
    Unreadable { file: PathBuf, error: String },
    /// No key at all is recorded for the host.
    Unknown,
}

/// One known-hosts file and what it records for a host: (line, key) pairs, or why its lines
/// for that host cannot be read.
type RecordedKeys = (PathBuf, Result<Vec<(usize, PublicKey)>, String>);

/// The keys recorded for `host:port` in each of `files` that has any (a missing file knows
/// nothing), or why a file's lines for it cannot be read.
fn recorded_host_keys(host: &str, port: u16, files: &[PathBuf]) -> Vec<RecordedKeys> {
    files
        .iter()
        .map(|file| {
            let keys = russh::keys::known_hosts::known_host_keys_path(host, port, file)
                .map_err(|error| error.to_string())
                .map(|keys| {
                    // russh numbers the lines that are not comments: number them all.
                    let text = std::fs::read_to_string(file).unwrap_or_default();
                    keys.into_iter()
                        .map(|(line, key)| (file_line(&text, line), key))
                        .collect::<Vec<_>>()
                });
            (file.clone(), keys)
        })
        .filter(|(_, keys)| keys.as_ref().map_or(true, |keys| !keys.is_empty()))
        .collect()
}

/// The line number in `text` (from 1) of its `counted`-th line that is not a `#` comment.
fn file_line(text: &str, counted: usize) -> usize {
    text.split_inclusive('\n')
        .enumerate()
        .filter(|(_, line)| !line.starts_with('#'))
        .nth(counted.saturating_sub(1))
        .map_or(counted, |(index, _)| index + 1)
}

/// Checks `key` for `host:port` against every file (a missing file knows nothing).
pub(crate) fn check_host_key(
    host: &str,
    port: u16,
    key: &PublicKey,
    files: &[PathBuf],
) -> KeyVerdict {
    host_key_verdict(key, recorded_host_keys(host, port, files))
}

/// The verdict on `key` given what each file records for its host: the key itself anywhere
/// wins; then another key of its algorithm; then a file that cannot be read; then a key of
/// another algorithm; nothing recorded at all is unknown.
fn host_key_verdict(key: &PublicKey, recorded: Vec<RecordedKeys>) -> KeyVerdict {
    let (mut changed, mut unreadable, mut other) = (None, None, None);
    for (file, keys) in recorded {
        let keys = match keys {
            Ok(keys) => keys,
            Err(error) => {
                unreadable.get_or_insert(KeyVerdict::Unreadable { file, error });
                continue;
            }
        };
        for (line, recorded) in keys {
            if recorded == *key {
                return KeyVerdict::Known;
            }
            if recorded.algorithm() == key.algorithm() {
                changed.get_or_insert(KeyVerdict::Changed {
                    file: file.clone(),
                    line,
                });
            } else {
                other.get_or_insert(KeyVerdict::OtherAlgorithm {
                    algorithm: recorded.algorithm().as_str().to_string(),
                    file: file.clone(),
                    line,
                });
            }
        }
    }
    changed
        .or(unreadable)
        .or(other)
        .unwrap_or(KeyVerdict::Unknown)
}

/// russh's host key algorithms with those of `known` (the algorithms of the keys recorded
/// for a host) first, in russh's order, so a host known under an ECDSA key that also has an
/// Ed25519 one presents the key that is known (OpenSSH orders them so too).
fn host_key_preference(known: &[russh::keys::Algorithm]) -> Vec<russh::keys::Algorithm> {
    let defaults = russh::Preferred::DEFAULT.key;
    let is_known = |algorithm: &russh::keys::Algorithm| {
        known
            .iter()
            .any(|k| k == algorithm || (k.clone().is_rsa() && algorithm.clone().is_rsa()))
    };
    let (mut first, rest): (Vec<_>, Vec<_>) = defaults.iter().cloned().partition(is_known);
    first.extend(rest);
    first
}

/// Connects and authenticates to `target` (through its jump host if any).
///
/// Errors: a [`ConnectError`] naming the class of fault and how to fix it.
pub(crate) async fn connect(
    target: &SshTarget,
    options: SshOptions,
) -> Result<Connection, ConnectError> {
    if target.address.starts_with('-') || target.user.starts_with('-') {
        return Err(ConnectError {
            class: FaultClass::Other,
            message: format!(
                "host `{}`: an address or user starting with `-` is refused",
                target.name
            ),
        });
    }
    let known: Vec<russh::keys::Algorithm> =
        recorded_host_keys(&target.address, target.port, &target.known_hosts)
            .into_iter()
            .filter_map(|(_, keys)| keys.ok())
            .flatten()
            .map(|(_, key)| key.algorithm())
            .collect();
    let config = Arc::new(client::Config {
        keepalive_interval: Some(KEEPALIVE_INTERVAL),
        keepalive_max: KEEPALIVE_MAX,
        nodelay: true,
        preferred: russh::Preferred {
            key: host_key_preference(&known).into(),
            ..Default::default()
        },
        ..Default::default()
    });
    let problem = Arc::new(Mutex::new(None));
    let handler = Client {
        host: target.address.clone(),
        port: target.port,
        known_hosts: target.known_hosts.clone(),
        accept_new: options.accept_new,
        problem: Arc::clone(&problem),
    };
    let where_ = format!("`{}` ({}:{})", target.name, target.address, target.port);
    let (handle, jump) = match &target.jump {
        None => {
            let socket = connect_tcp(target, &where_).await?;
            (
                handshake(config, socket, handler, &problem, &where_).await?,
                None,
            )
        }
        Some(jump) => {
            let (bastion, channel) = open_through_jump(jump, target, options, &where_).await?;
            (
                handshake(config, channel.into_stream(), handler, &problem, &where_).await?,
                Some(Box::new(bastion)),
            )
        }
    };
    let mut connection = Connection {
        handle,
        target: target.clone(),
        _jump: jump,
    };
    authenticate(&mut connection).await?;
    Ok(connection)
}

/// Resolves `target`'s address and opens a TCP connection to it (no delay on), each step
/// within [`CONNECT_TIMEOUT`]; `where_` names the target in messages.
///
/// Errors: a [`ConnectError`] of class DNS (cannot resolve, or too slow), refused, or
/// timeout (unreachable, or too slow).
async fn connect_tcp(
    target: &SshTarget,
    where_: &str,
) -> Result<tokio::net::TcpStream, ConnectError> {
    let addresses: Vec<std::net::SocketAddr> = match tokio::time::timeout(
        CONNECT_TIMEOUT,
        tokio::net::lookup_host((target.address.as_str(), target.port)),
    )
    .await
    {
        Ok(Ok(addresses)) => addresses.collect(),
        Ok(Err(error)) => {
            return Err(ConnectError {
                class: FaultClass::Dns,
                message: format!("cannot resolve {where_}: {error}"),
            });
        }
        Err(_) => {
            return Err(ConnectError {
                class: FaultClass::Dns,
                message: format!("resolving {where_} timed out"),
            });
        }
    };
    let socket = match tokio::time::timeout(
        CONNECT_TIMEOUT,
        tokio::net::TcpStream::connect(&addresses[..]),
    )
    .await
    {
        Ok(Ok(socket)) => socket,
        Ok(Err(error)) if error.kind() == std::io::ErrorKind::ConnectionRefused => {
            return Err(ConnectError {
                class: FaultClass::Refused,
                message: format!("{where_} refused the connection: is `sshd` running there?"),
            });
        }
        Ok(Err(error)) => {
            return Err(ConnectError {
                class: FaultClass::Timeout,
                message: format!("cannot reach {where_}: {error}"),
            });
        }
        Err(_) => {
            return Err(ConnectError {
                class: FaultClass::Timeout,
                message: format!(
                    "connecting to {where_} timed out after {} s",
                    CONNECT_TIMEOUT.as_secs()
                ),
            });
        }
    };
    let _ = socket.set_nodelay(true);
    Ok(socket)
}

/// Connects to the jump host `jump` and opens a direct TCP channel from it to `target`:
/// the bastion's connection (kept open as long as the channel) and the channel.
///
/// Errors: the bastion's own [`ConnectError`] (its message prefixed with the jump host), or
/// a timeout-class error when the bastion cannot reach `target`.
async fn open_through_jump(
    jump: &SshTarget,
    target: &SshTarget,
    options: SshOptions,
    where_: &str,
) -> Result<(Connection, russh::Channel<client::Msg>), ConnectError> {
    let bastion = Box::pin(connect(jump, options))
        .await
        .map_err(|error| ConnectError {
            class: error.class,
            message: format!("through the jump host `{}`: {}", jump.name, error.message),
        })?;
    let channel = bastion
        .handle
        .channel_open_direct_tcpip(
            target.address.clone(),
            u32::from(target.port),
            "127.0.0.1",
            0,
        )
        .await
        .map_err(|error| ConnectError {
            class: FaultClass::Timeout,
            message: format!(
                "the jump host `{}` cannot reach {where_}: {error}",
                jump.name
            ),
        })?;
    Ok((bastion, channel))
}

async fn handshake<S>(
    config: Arc<client::Config>,
    stream: S,
    handler: Client,
    problem: &Arc<Mutex<Option<ConnectError>>>,
    where_: &str,
) -> Result<Handle<Client>, ConnectError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    match tokio::time::timeout(
        CONNECT_TIMEOUT,
        client::connect_stream(config, stream, handler),
    )
    .await
    {
        Ok(Ok(handle)) => Ok(handle),
        Ok(Err(error)) => {
            Err(problem
                .lock()
                .ok()
                .and_then(|mut p| p.take())
                .unwrap_or(ConnectError {
                    class: FaultClass::Other,
                    message: format!("SSH handshake with {where_} failed: {error}"),
                }))
        }
        Err(_) => Err(ConnectError {
            class: FaultClass::Timeout,
            message: format!(
                "SSH handshake with {where_} timed out after {} s",
                CONNECT_TIMEOUT.as_secs()
            ),
        }),
    }
}

/// ssh-agent's keys first (when `SSH_AUTH_SOCK` is set), then the identity files.
async fn authenticate(connection: &mut Connection) -> Result<(), ConnectError> {
    let target = connection.target.clone();
    let user = target.user.clone();
    let mut tried = Vec::new();
    if std::env::var_os("SSH_AUTH_SOCK").is_some()
        && let Ok(mut agent) = russh::keys::agent::client::AgentClient::connect_env().await
        && let Ok(identities) = agent.request_identities().await
    {
        for identity in identities {
            let russh::keys::agent::AgentIdentity::PublicKey { key, .. } = identity else {
                continue;
            };
            let hash = rsa_hash(&connection.handle, &key).await;
            tried.push(format!("agent key {}", key.fingerprint(HashAlg::Sha256)));
            if let Ok(result) = connection
                .handle
                .authenticate_publickey_with(&user, key, hash, &mut agent)
                .await
                && result.success()
            {
                return Ok(());
            }
        }
    }
    for file in &target.identity_files {
        let key = match russh::keys::load_secret_key(file, None) {
            Ok(key) => key,
            Err(russh::keys::Error::KeyIsEncrypted) => {
                tried.push(format!(
                    "`{}` (encrypted: add it to ssh-agent)",
                    file.display()
                ));
                continue;
            }
            Err(_) => continue,
        };
        let hash = rsa_hash(&connection.handle, key.public_key()).await;
        tried.push(format!("`{}`", file.display()));
        let key = PrivateKeyWithHashAlg::new(Arc::new(key), hash);
        match connection.handle.authenticate_publickey(&user, key).await {
            Ok(result) if result.success() => return Ok(()),
            Ok(_) => {}
            Err(error) => {
                return Err(ConnectError {
                    class: FaultClass::Auth,
                    message: format!("authentication with `{}` failed: {error}", target.name),
                });
            }
        }
    }
    Err(ConnectError {
        class: FaultClass::Auth,
        message: format!(
            "`{}` refused authentication as `{user}` (tried {})\n\
             hint: add your key to `~{user}/.ssh/authorized_keys` there, or name one with `identity-file` in the inventory",
            target.name,
            if tried.is_empty() {
                "no key: none in ssh-agent or the identity files".into()
            } else {
                tried.join(", ")
            }
        ),
    })
}

async fn rsa_hash(handle: &Handle<Client>, key: &PublicKey) -> Option<HashAlg> {
    if key.algorithm().is_rsa() {
        handle
            .best_supported_rsa_hash()
            .await
            .ok()
            .flatten()
            .flatten()
    } else {
        None
    }
}

impl Connection {
    /// Runs the fixed command `command` on an exec channel. `command` must never contain a
    /// user-supplied string: everything else travels on the channel.
    ///
    /// Errors: the channel cannot be opened or the request is refused.
    pub(crate) async fn exec(&self, command: &str) -> Result<russh::Channel<client::Msg>> {
        let channel = self
            .handle
            .channel_open_session()
            .await
            .with_context(|| format!("cannot open a channel to `{}`", self.target.name))?;
        channel
            .exec(true, command)
            .await
            .with_context(|| format!("`{}` refused to run `{command}`", self.target.name))?;
        Ok(channel)
    }

    /// Runs a fixed command and collects its stdout and exit status.
    ///
    /// Errors: the channel fails.
    pub(crate) async fn output(
        &self,
        command: &str,
        stdin: &[u8],
    ) -> Result<(Vec<u8>, Option<u32>)> {
        let mut channel = self.exec(command).await?;
        if !stdin.is_empty() {
            channel
                .data_bytes(stdin.to_vec())
                .await
                .context("cannot send to the remote command")?;
        }
        channel
            .eof()
            .await
            .context("cannot send to the remote command")?;
        let (mut stdout, mut status) = (Vec::new(), None);
        while let Some(message) = channel.wait().await {
            match message {
                russh::ChannelMsg::Data { data } => stdout.extend_from_slice(&data),
                russh::ChannelMsg::ExitStatus { exit_status } => status = Some(exit_status),
                _ => {}
            }
        }
        Ok((stdout, status))
    }
}

/// The default identity files OpenSSH tries, under `home`.
pub(crate) fn default_identity_files(home: &Path) -> Vec<PathBuf> {
    ["id_ed25519", "id_ecdsa", "id_rsa"]
        .iter()
        .map(|n| home.join(".ssh").join(n))
        .collect()
}

/// `~/.ssh/known_hosts`.
pub(crate) fn default_known_hosts(home: &Path) -> PathBuf {
    home.join(".ssh/known_hosts")
}

#[cfg(test)]
mod tests {
    use super::*;

    const ED25519_A: &str = "AAAAC3NzaC1lZDI1NTE5AAAAIH+wCvIbqS54tB8sI5pamx76xeld5XVyAvtYscqbGXg2";
    const ED25519_B: &str = "AAAAC3NzaC1lZDI1NTE5AAAAIFzDKVzrjXsrjAu/Qshnhna50QCT5ABVYfwwsahsPRLv";
    const ECDSA: &str = "AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBMWR9czn5KfoMiMDixBkHYZXclFh+GOx9D8vrxZU1EwSVNuFJNZ4/F39uXBL+t8MfF87Hgf0deRvz7mBIOueydw=";

    fn key(base64: &str) -> PublicKey {
        russh::keys::parse_public_key_base64(base64).expect("a public key")
    }

    /// A known_hosts file of `lines` in a fresh directory (kept alive by the first value).
    fn known_hosts(lines: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("known_hosts");
        std::fs::write(&file, lines).expect("write");
        (dir, file)
    }

    #[test]
    fn a_host_known_under_another_algorithm_is_not_unknown() {
        let (_dir, file) = known_hosts(&format!(
            "# hosts\nother.example ssh-ed25519 {ED25519_B}\n#\n[h0]:2222 ecdsa-sha2-nistp256 {ECDSA}\n"
        ));
        let files = [file.clone()];
        assert_eq!(
            check_host_key("h0", 2222, &key(ED25519_A), &files),
            KeyVerdict::OtherAlgorithm {
                algorithm: "ecdsa-sha2-nistp256".into(),
                file: file.clone(),
                line: 4
            }
        );
        // The same host on another port, or another host, has no key: unknown.
        assert_eq!(
            check_host_key("h0", 22, &key(ED25519_A), &files),
            KeyVerdict::Unknown
        );
        // The key itself recorded: known; another key of its algorithm: changed.
        assert_eq!(
            check_host_key("h0", 2222, &key(ECDSA), &files),
            KeyVerdict::Known
        );
        assert_eq!(
            check_host_key("other.example", 22, &key(ED25519_A), &files),
            KeyVerdict::Changed { file, line: 2 }
        );
    }

    #[test]
    fn the_key_itself_anywhere_wins_then_a_changed_key_then_another_algorithm() {
        let (_one, first) = known_hosts(&format!("h0 ecdsa-sha2-nistp256 {ECDSA}\n"));
        let (_two, second) = known_hosts(&format!(
            "h0 ssh-ed25519 {ED25519_B}\nh0 ssh-ed25519 {ED25519_A}\n"
        ));
        let (_three, missing) = known_hosts("");
        let missing = missing.with_file_name("absent");
        let files = [missing, first.clone(), second.clone()];
        assert_eq!(
            check_host_key("h0", 22, &key(ED25519_A), &files),
            KeyVerdict::Known
        );
        // Without the key itself, the other Ed25519 key is what matters.
        let (_four, only_b) = known_hosts(&format!("h0 ssh-ed25519 {ED25519_B}\n"));
        assert_eq!(
            check_host_key("h0", 22, &key(ED25519_A), &[first.clone(), only_b.clone()]),
            KeyVerdict::Changed {
                file: only_b,
                line: 1
            }
        );
    }

    #[test]
    fn an_unreadable_line_for_the_host_is_not_taken_for_no_key() {
        let (_dir, file) = known_hosts("h0 ssh-ed25519 not-base64!\n");
        let verdict = check_host_key("h0", 22, &key(ED25519_A), std::slice::from_ref(&file));
        assert!(
            matches!(&verdict, KeyVerdict::Unreadable { file: f, .. } if *f == file),
            "{verdict:?}"
        );
        // Lines for other hosts are not read.
        assert_eq!(
            check_host_key("h1", 22, &key(ED25519_A), &[file]),
            KeyVerdict::Unknown
        );
    }

    #[test]
    fn known_algorithms_are_asked_for_first() {
        let ecdsa = key(ECDSA).algorithm();
        let order = host_key_preference(std::slice::from_ref(&ecdsa));
        assert_eq!(order[0], ecdsa);
        assert_eq!(order.len(), russh::Preferred::DEFAULT.key.len());
        assert_eq!(
            host_key_preference(&[]),
            russh::Preferred::DEFAULT.key.to_vec()
        );
        // Any RSA key brings every RSA signature algorithm forward.
        let rsa = host_key_preference(&[russh::keys::Algorithm::Rsa { hash: None }]);
        assert!(rsa[..3].iter().all(|a| a.clone().is_rsa()), "{rsa:?}");
    }
}
