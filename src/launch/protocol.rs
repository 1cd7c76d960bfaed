//! The wire protocol between the launcher and `infer agent`, carried on the agent's SSH
//! exec channel: stdin one way, stdout the other. Each frame is a little-endian `u32`
//! length and a JSON body. Everything a run needs — the host's keys, rank environments, the
//! run id — travels here, never in a shell string or an
//! argv.

use std::io::{Read, Write};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

/// A secret carried in a frame (a host's keys): sent as a plain string, never shown by
/// `Debug`, so an error that prints a frame does not print it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub(crate) struct SecretText(pub String);

impl std::fmt::Debug for SecretText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretText(…)")
    }
}

/// Largest frame accepted, bytes (a pushed file travels in chunks well below it).
pub(crate) const MAX_FRAME_BYTES: u32 = 16 << 20;

/// Bytes of a file per [`ToAgent::FileChunk`].
pub(crate) const FILE_CHUNK_BYTES: usize = 4 << 20;

/// What the launcher tells an agent.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum ToAgent {
    /// The first frame: which run this is, the host's inventory name (its run directory is
    /// `~/.cache/infer/runs/RUN_ID/HOST`, apart even where hosts share a home directory),
    /// and how long the agent may go without hearing from the launcher before it stops
    /// every rank (the lease, seconds).
    Run {
        run_id: String,
        host: String,
        lease_secs: u64,
    },
    /// The launcher is alive (sent every second).
    Heartbeat,
    /// Host the rendezvous store on `bind` (`ip:0` picks a port) with the store's keys
    /// (`keys`: [`crate::keyring::Keyring::to_text`] of [`crate::keyring::Keyring::for_store`]);
    /// answered by [`FromAgent::StoreAt`].
    HostStore { bind: String, keys: SecretText },
    /// Watch the rendezvous store at `address` (on another host), proving this host's
    /// `keys`: if it cannot be reached for the lease, stop every rank (the store's host is
    /// gone, or this host is cut off from it).
    WatchStore { address: String, keys: SecretText },
    /// sha256 and size of a file on the host (the model); answered by
    /// [`FromAgent::FileInfo`].
    HashFile { path: String },
    /// Start writing `path` (created with its parent, replaced atomically at the end).
    FileStart { path: String, size_bytes: u64 },
    /// The next piece of the file being written, base64 (a JSON array of numbers would be
    /// four times the size).
    FileChunk {
        #[serde(with = "base64_bytes")]
        bytes: Vec<u8>,
    },
    /// The file is complete; answered by [`FromAgent::FileInfo`] of what was written.
    FileEnd,
    /// Start `infer rank` with exactly `env` (plus `PATH`, `HOME` and this host's `keys`); with
    /// `argv`, that program instead (another engine's process: `argv[0]` found on the
    /// agent's `PATH` unless it names a path), started directly, never through a shell.
    Spawn {
        rank: usize,
        env: Vec<(String, String)>,
        keys: SecretText,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        argv: Option<Vec<String>>,
    },
    /// Run `argv` (no shell; `argv[0]` found on the agent's `PATH` unless it names a path)
    /// with the agent's environment plus `env`, for at most `timeout_secs`, and answer with
    /// [`FromAgent::Executed`]: how `infer up --engine` finds an engine and reads its version.
    Exec {
        argv: Vec<String>,
        env: Vec<(String, String)>,
        timeout_secs: u64,
    },
    /// Try to bind each `(address, port)` and close it again; answered by
    /// [`FromAgent::PortsChecked`] with the ones already taken.
    CheckPorts { ports: Vec<(String, u16)> },
    /// Send `signal` (a number, `SIGTERM` = 15) to rank `rank`'s process group.
    Signal { rank: usize, signal: i32 },
    /// Stop every rank (SIGTERM, grace, SIGKILL) and exit.
    Shutdown,
    /// Run `infer doctor`'s live checks of this host; answered by [`FromAgent::Findings`].
    Doctor,
    /// Probe this host's CPU (cores, memory, bandwidth, compute) for the planner; answered by
    /// [`FromAgent::Cpu`].
    ProbeCpu,
    /// Listen on `bind` (`ip:0`) for the doctor's probes as host `host` of a survey whose
    /// probes prove `secret` ([`crate::launch::probes`]): a reachability probe gets back the
    /// source address it came from; a bandwidth probe may send at most `max_stream_bytes`.
    /// Answered by [`FromAgent::Listening`]. (The new fields default so that an older
    /// launcher's frame is answered with an error rather than ending the agent.)
    Listen {
        bind: String,
        #[serde(default)]
        secret: Option<ProbeSecret>,
        #[serde(default)]
        host: u64,
        #[serde(default)]
        max_stream_bytes: u64,
    },
    /// As host `host`, send `bytes` bytes from `from` (this host's data address) to host
    /// `to_host`'s probe listener at `to`, proving `secret`, and time it until the listener
    /// acknowledges; answered by [`FromAgent::Streamed`].
    Stream {
        from: String,
        to: String,
        bytes: u64,
        #[serde(default)]
        secret: Option<ProbeSecret>,
        #[serde(default)]
        host: u64,
        #[serde(default)]
        to_host: u64,
    },
    /// Only connect from `from` to `to` (a port that speaks another protocol, such as the
    /// rendezvous store's) and close; answered by [`FromAgent::Reached`] with one result.
    Connect { from: String, to: String },
    /// As host `host`, connect from `from` (this host's data address) to every target (the
    /// probe listener of host `target_hosts[i]` at `targets[i]`), prove `secret`, and report
    /// what happened; answered by [`FromAgent::Reached`].
    Reach {
        from: String,
        targets: Vec<String>,
        #[serde(default)]
        target_hosts: Vec<u64>,
        #[serde(default)]
        secret: Option<ProbeSecret>,
        #[serde(default)]
        host: u64,
    },
}

/// One reachability probe: `to` from `from`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReachResult {
    /// The listener connected to (`ip:port`).
    pub to: String,
    /// The address the socket was bound to.
    pub from: String,
    /// One byte's round trip once the connection has proved itself, microseconds (for a
    /// connection-only probe: the time to connect).
    pub rtt_us: Option<u64>,
    /// The source address the listener saw.
    pub seen_as: Option<String>,
    /// Why the probe failed.
    pub error: Option<String>,
}

/// The secret one survey's doctor probes prove (a fresh [`crate::rendezvous::random_token`]
/// per survey, never the run token): it travels only in frames over SSH and never appears in
/// a `Debug` print.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub(crate) struct ProbeSecret(String);

impl ProbeSecret {
    /// A fresh random secret for one survey.
    pub(crate) fn random() -> Self {
        Self(crate::rendezvous::random_token())
    }

    /// The secret itself, to key the handshake.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for ProbeSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProbeSecret(…)")
    }
}

/// What an agent tells the launcher.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum FromAgent {
    /// The first frame: who is answering.
    Hello(Box<AgentHello>),
    /// The store listens at `address`.
    StoreAt { address: String },
    /// A file's sha256 (hex) and size; `None` when it does not exist.
    FileInfo {
        path: String,
        sha256: Option<String>,
        size_bytes: u64,
    },
    /// Rank `rank` started as process `pid` (the leader of its own process group).
    Spawned { rank: usize, pid: u32 },
    /// A line rank `rank` wrote on stdout or stderr.
    Line { rank: usize, line: String },
    /// Rank `rank` exited: its code, or the signal that killed it.
    Exited {
        rank: usize,
        code: Option<i32>,
        signal: Option<i32>,
    },
    /// The agent is alive (sent every second, so the launcher notices a partition).
    Alive,
    /// This host's live doctor findings.
    Findings {
        findings: Vec<crate::doctor::WireFinding>,
    },
    /// This host's CPU, probed there.
    Cpu {
        profile: crate::topology::CpuProfile,
    },
    /// The reachability listener's address.
    Listening { address: String },
    /// The results of a [`ToAgent::Reach`], in target order.
    Reached { results: Vec<ReachResult> },
    /// The result of a [`ToAgent::Stream`]: seconds until acknowledged, or why it failed.
    Streamed {
        secs: Option<f64>,
        error: Option<String>,
    },
    /// The result of a [`ToAgent::Exec`]: the program's path as found, its exit code
    /// (`None`: not found, killed or timed out, with `error` saying which), and its output
    /// (each stream's first 64 KiB, lossy UTF-8).
    Executed {
        program: Option<String>,
        code: Option<i32>,
        stdout: String,
        stderr: String,
        error: Option<String>,
    },
    /// The result of a [`ToAgent::CheckPorts`]: each port that could not be bound, with why.
    PortsChecked { taken: Vec<(String, u16, String)> },
    /// A request failed (`rank` when it concerned one).
    Error {
        rank: Option<usize>,
        message: String,
    },
}

/// The agent's first frame.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AgentHello {
    /// `infer`'s version.
    pub version: String,
    /// sha256 of the agent's own executable, hex.
    pub sha256: String,
    /// Where that executable is on the host.
    pub exe: String,
    /// `std::env::consts::ARCH` (`x86_64`, `aarch64`).
    pub arch: String,
    /// The host's own name (`/proc/sys/kernel/hostname`).
    pub hostname: String,
    /// Logical CPUs of the host.
    pub n_cpus: usize,
    /// Network interfaces with IPv4 addresses.
    pub interfaces: Vec<crate::topology::Interface>,
    /// The agent's run directory on the host (logs, process-group ids).
    pub run_dir: String,
    /// The host as `infer topo --json` sees it there (GPUs, NVLink, NICs, HCAs).
    pub topology: crate::topology::Host,
    /// The host's clock when it said hello, milliseconds since the Unix epoch.
    pub unix_time_ms: u64,
    /// The NCCL library a process there would load, if any.
    pub nccl: Option<crate::topology::nccl::NcclLibrary>,
}

/// Bytes as a base64 string in JSON.
mod base64_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&data_encoding::BASE64.encode(bytes))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(deserializer)?;
        data_encoding::BASE64
            .decode(text.as_bytes())
            .map_err(serde::de::Error::custom)
    }
}

/// Writes one frame. Errors: the peer is gone.
pub(crate) fn write_frame<T: Serialize>(out: &mut impl Write, message: &T) -> Result<()> {
    let body = serde_json::to_vec(message)?;
    let length = u32::try_from(body.len()).context("frame too large")?;
    out.write_all(&length.to_le_bytes())?;
    out.write_all(&body)?;
    out.flush()?;
    Ok(())
}

/// Reads one frame; `Ok(None)` at a clean end of stream. Errors: a truncated or malformed
/// frame, one over [`MAX_FRAME_BYTES`].
pub(crate) fn read_frame<T: for<'de> Deserialize<'de>>(input: &mut impl Read) -> Result<Option<T>> {
    let mut length = [0u8; 4];
    match input.read_exact(&mut length) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(error) => return Err(error.into()),
    }
    let length = u32::from_le_bytes(length);
    if length > MAX_FRAME_BYTES {
        bail!("a frame of {length} bytes exceeds the limit of {MAX_FRAME_BYTES}");
    }
    let mut body = vec![0u8; length as usize];
    input.read_exact(&mut body)?;
    serde_json::from_slice(&body)
        .map(Some)
        .context("malformed agent frame")
}

/// Whether `run_id` is one the launcher makes (`run-` and lowercase letters, digits, dashes):
/// it names a directory, so nothing else is accepted.
pub(crate) fn valid_run_id(run_id: &str) -> bool {
    run_id.len() <= 64
        && run_id.starts_with("run-")
        && run_id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// Whether `name` can name a directory as it is (letters, digits, `.`, `_`, `-`, not
/// starting with `.` or `-`).
pub(crate) fn valid_host_dir(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with(['.', '-'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_end_cleanly() {
        let mut buffer = Vec::new();
        write_frame(
            &mut buffer,
            &ToAgent::Spawn {
                rank: 3,
                env: vec![("RANK".into(), "3".into())],
                keys: SecretText("secret".into()),
                argv: None,
            },
        )
        .expect("write");
        write_frame(&mut buffer, &ToAgent::Heartbeat).expect("write");
        write_frame(
            &mut buffer,
            &ToAgent::FileChunk {
                bytes: vec![0, 1, 254, 255],
            },
        )
        .expect("write");
        let mut reader = &buffer[..];
        match read_frame::<ToAgent>(&mut reader).expect("read") {
            Some(ToAgent::Spawn {
                rank, env, keys, ..
            }) => {
                assert_eq!((rank, keys.0.as_str()), (3, "secret"));
                assert_eq!(format!("{keys:?}"), "SecretText(…)");
                assert_eq!(env, vec![("RANK".to_string(), "3".to_string())]);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(
            read_frame::<ToAgent>(&mut reader).expect("read"),
            Some(ToAgent::Heartbeat)
        ));
        match read_frame::<ToAgent>(&mut reader).expect("read") {
            Some(ToAgent::FileChunk { bytes }) => assert_eq!(bytes, vec![0, 1, 254, 255]),
            other => panic!("unexpected {other:?}"),
        }
        assert!(read_frame::<ToAgent>(&mut reader).expect("eof").is_none());
        // A length past the limit is refused before anything is allocated.
        let huge = (MAX_FRAME_BYTES + 1).to_le_bytes();
        assert!(read_frame::<ToAgent>(&mut &huge[..]).is_err());
    }

    #[test]
    fn run_ids_are_only_ours() {
        assert!(valid_run_id("run-1a2b3c4d5e6f"));
        for bad in [
            "", "../etc", "run-../x", "run-A", "run-1;rm", "-run-1", "run-1 2",
        ] {
            assert!(!valid_run_id(bad), "{bad}");
        }
    }
}
