//! SSH connections to cluster hosts (russh: pure Rust, async, channel signals, many
//! concurrent channels on one connection). One connection per host: host keys checked
//! against `known_hosts` files by default (an unknown key fails with its fingerprint and
//! the command that trusts it; a changed key fails loudly; `accept_new` trusts unknown keys,
//! never changed ones), authentication through ssh-agent then identity files, an optional
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
    /// Trust (and record) host keys that are not known yet. Changed keys are still refused.
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
    Known,
    /// A key of the same algorithm is recorded for the host, and it is another.
    Changed {
        file: PathBuf,
        line: usize,
    },
    Unknown,
}

/// Checks `key` for `host:port` against every file (a missing file knows nothing).
pub(crate) fn check_host_key(
    host: &str,
    port: u16,
    key: &PublicKey,
    files: &[PathBuf],
) -> KeyVerdict {
    let mut changed = None;
    for file in files {
        let Ok(recorded) = russh::keys::known_hosts::known_host_keys_path(host, port, file) else {
            continue;
        };
        for (line, recorded) in recorded {
            if recorded == *key {
                return KeyVerdict::Known;
            }
            if recorded.algorithm() == key.algorithm() && changed.is_none() {
                changed = Some(KeyVerdict::Changed {
                    file: file.clone(),
                    line,
                });
            }
        }
    }
    changed.unwrap_or(KeyVerdict::Unknown)
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
    let config = Arc::new(client::Config {
        keepalive_interval: Some(KEEPALIVE_INTERVAL),
        keepalive_max: KEEPALIVE_MAX,
        nodelay: true,
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
