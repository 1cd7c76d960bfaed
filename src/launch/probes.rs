//! The doctor's probes between the hosts' data addresses, run by `infer agent` for
//! `infer doctor --cluster`: a listener on each host, reachability probes (one round trip;
//! the listener answers with the source address it saw) and bandwidth probes (a stream of
//! bytes, acknowledged).
//!
//! Every probe connection first proves itself with [`crate::handshake`] on channel
//! [`CHANNEL`], keyed by a secret the launcher draws for each survey ([`ProbeSecret`]) and
//! hands each agent over SSH; identities are the hosts' positions in the survey, and a prober
//! claims the host it means to reach, so another host's listener does not answer for it. A
//! listener serves at most [`MAX_CONNECTIONS`] connections at once (more are closed at
//! once), reads at most a hello from a connection that has not proved itself, and takes a
//! bandwidth probe of at most the length the launcher allowed. A stranger learns no address
//! and makes the agent read nothing beyond a hello.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::protocol::{ProbeSecret, ReachResult};
use crate::handshake;

/// The handshake channel of every probe connection.
pub(crate) const CHANNEL: &str = "probe";

/// The most bytes a bandwidth probe may send, whatever a launcher asks (1 GiB).
pub(crate) const MAX_STREAM_BYTES: u64 = 1 << 30;

/// Connections a probe listener serves at once, handshakes included; more are closed at once
/// (a stranger's is dropped after [`handshake::HELLO_TIMEOUT`]).
pub(crate) const MAX_CONNECTIONS: usize = 16;

/// How long a reachability probe waits to connect, and then for its answer.
const REACH_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a bandwidth probe may take, on each side.
const STREAM_TIMEOUT: Duration = Duration::from_secs(60);

/// The listener's side of a probe's handshake, as host `host` of the survey keyed by
/// `secret`: any other host of the survey may probe it. Returns the prober's host.
///
/// Errors: the connection does not prove `secret`, or claims another listener.
fn prove_listener(stream: &mut TcpStream, secret: &ProbeSecret, host: u64) -> Result<u64> {
    let key = crate::keyring::Key::shared(secret.expose(), CHANNEL);
    handshake::server(stream, CHANNEL, host, &|prober| {
        (prober != host).then(|| key.clone())
    })
    .map(|(prober, _)| prober)
}

/// The prober's side of a probe's handshake: host `host` proves `secret` and checks that the
/// listener is host `to_host` of the same survey.
///
/// Errors: the listener closes the connection (busy, or not of this survey) or does not
/// prove `secret` as `to_host`.
fn prove_prober(
    stream: &mut TcpStream,
    secret: &ProbeSecret,
    host: u64,
    to_host: u64,
) -> Result<()> {
    handshake::client(
        stream,
        &crate::keyring::Key::shared(secret.expose(), CHANNEL),
        handshake::Claim {
            channel: CHANNEL,
            client: host,
            server: to_host,
        },
    )
    .map(|_| ())
}

/// Binds `bind` (`ip:port`, port 0 for any) and answers probes there on a thread of its own,
/// as host `host` of the survey keyed by `secret`, taking bandwidth probes of at most
/// `max_stream_bytes`. Returns the bound address.
///
/// Errors: `max_stream_bytes` over [`MAX_STREAM_BYTES`]; `bind` cannot be bound.
pub(crate) fn listen(
    bind: &str,
    secret: ProbeSecret,
    host: u64,
    max_stream_bytes: u64,
) -> Result<SocketAddr> {
    if max_stream_bytes > MAX_STREAM_BYTES {
        bail!(
            "a bandwidth probe of {max_stream_bytes} bytes is over the limit of {MAX_STREAM_BYTES}"
        );
    }
    let listener = TcpListener::bind(bind).with_context(|| format!("cannot listen on `{bind}`"))?;
    let address = listener
        .local_addr()
        .with_context(|| format!("cannot listen on `{bind}`"))?;
    std::thread::Builder::new()
        .name("probe-listener".into())
        .spawn(move || answer(&listener, &Arc::new(secret), host, max_stream_bytes))
        .context("cannot start the probe listener's thread")?;
    Ok(address)
}

/// One of a listener's [`MAX_CONNECTIONS`] slots, given back when dropped.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Accepts probe connections for ever, each on a thread of its own while a slot is free.
fn answer(listener: &TcpListener, secret: &Arc<ProbeSecret>, host: u64, max_stream_bytes: u64) {
    let busy = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        let Ok(stream) = stream else {
            // Out of descriptors, say: do not spin.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        if busy.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            busy.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        let slot = Slot(Arc::clone(&busy));
        let secret = Arc::clone(secret);
        // A thread that cannot start drops its closure, the slot with it.
        let _ = std::thread::Builder::new()
            .name("probe".into())
            .spawn(move || {
                let _slot = slot;
                let _ = serve(stream, &secret, host, max_stream_bytes);
            });
    }
}

/// One probe connection: the handshake, then a reachability probe (`?`: the source address
/// is written back, one line) or a bandwidth probe (`B`, a little-endian `u64` length of at
/// most `max_stream_bytes`, that many bytes; `ok` is written back).
///
/// Errors (the connection is closed, nothing written): no proof of `secret`, an unknown
/// probe, a length over the bound, a stream that stops or takes over [`STREAM_TIMEOUT`].
fn serve(
    mut stream: TcpStream,
    secret: &ProbeSecret,
    host: u64,
    max_stream_bytes: u64,
) -> Result<()> {
    prove_listener(&mut stream, secret, host)?;
    stream.set_read_timeout(Some(handshake::HELLO_TIMEOUT))?;
    let mut kind = [0u8; 1];
    stream.read_exact(&mut kind)?;
    match kind[0] {
        b'?' => {
            let peer = stream.peer_addr()?;
            stream.write_all(format!("{}\n", peer.ip()).as_bytes())?;
        }
        b'B' => {
            let mut length = [0u8; 8];
            stream.read_exact(&mut length)?;
            let length = u64::from_le_bytes(length);
            if length > max_stream_bytes {
                bail!("a bandwidth probe of {length} bytes, over the {max_stream_bytes} allowed");
            }
            let deadline = Instant::now() + STREAM_TIMEOUT;
            stream.set_read_timeout(Some(STREAM_TIMEOUT))?;
            let mut buffer = vec![0u8; usize::try_from(length).unwrap_or(usize::MAX).min(1 << 20)];
            let mut left = length;
            while left > 0 {
                if Instant::now() > deadline {
                    bail!("a bandwidth probe took over {STREAM_TIMEOUT:?}");
                }
                let want = buffer
                    .len()
                    .min(usize::try_from(left).unwrap_or(usize::MAX));
                match stream.read(&mut buffer[..want])? {
                    0 => bail!("the prober stopped {left} bytes short"),
                    n => left -= n as u64,
                }
            }
            stream.write_all(b"ok\n")?;
        }
        other => bail!("an unknown probe {other:#04x}"),
    }
    Ok(())
}

/// A TCP connection to `to` (`ip:port`) from a socket bound to `from` (an IP), as NCCL binds
/// to its interface's address; [`REACH_TIMEOUT`] to connect.
///
/// Errors (as text, for a probe's result): a malformed address, `from` cannot be bound, the
/// connection is refused or times out.
pub(crate) fn connect_from(from: &str, to: &str) -> std::result::Result<TcpStream, String> {
    let local: SocketAddr = format!("{from}:0").parse().map_err(|e| format!("{e}"))?;
    let remote: SocketAddr = to.parse().map_err(|e| format!("{e}"))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().map_err(|e| e.to_string())?;
        socket
            .bind(local)
            .map_err(|e| format!("cannot bind {from}: {e}"))?;
        let stream = tokio::time::timeout(REACH_TIMEOUT, socket.connect(remote))
            .await
            .map_err(|_| format!("connection timed out after {REACH_TIMEOUT:?}"))?
            .map_err(|e| e.to_string())?;
        let stream = stream.into_std().map_err(|e| e.to_string())?;
        stream.set_nonblocking(false).map_err(|e| e.to_string())?;
        Ok(stream)
    })
}

/// Connects from `from` to host `to_host`'s probe listener at `to` and proves `secret` as
/// host `host`. A handshake that fails is tried again (a listener busy with strangers closes
/// new connections at once, and frees a slot within [`handshake::HELLO_TIMEOUT`]) for that
/// and a second more; a connection that fails is not.
///
/// Errors (as text): the connection fails, or the listener never proves itself.
fn open(
    from: &str,
    to: &str,
    to_host: u64,
    secret: &ProbeSecret,
    host: u64,
) -> std::result::Result<TcpStream, String> {
    let deadline = Instant::now() + handshake::HELLO_TIMEOUT + Duration::from_secs(1);
    loop {
        let mut stream = connect_from(from, to)?;
        match prove_prober(&mut stream, secret, host, to_host) {
            Ok(()) => return Ok(stream),
            Err(error) if Instant::now() >= deadline => {
                return Err(format!(
                    "the listener at {to} did not prove itself as host {to_host} of this survey: {error:#}"
                ));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Probes each of `targets` (host `target_hosts[i]`'s listener at `targets[i]`) in turn from
/// `from`, as host `host` proving `secret` ([`reach`]); results in target order. Without a
/// secret or a host for a target (a launcher of an older build), those results are errors.
pub(crate) fn reach_each(
    from: &str,
    targets: &[String],
    target_hosts: &[u64],
    secret: Option<&ProbeSecret>,
    host: u64,
) -> Vec<ReachResult> {
    targets
        .iter()
        .enumerate()
        .map(
            |(position, to)| match (secret, target_hosts.get(position)) {
                (Some(secret), Some(to_host)) => reach(from, to, *to_host, secret, host),
                _ => ReachResult {
                    to: to.clone(),
                    from: from.into(),
                    rtt_us: None,
                    seen_as: None,
                    error: Some(OLDER_LAUNCHER.into()),
                },
            },
        )
        .collect()
}

/// Why a probe without a secret is not run.
pub(crate) const OLDER_LAUNCHER: &str =
    "the launcher sent no probe secret (an older `infer` build): probes must prove themselves";

/// One reachability probe from `from` to host `to_host`'s listener at `to`, as host `host`
/// proving `secret`: after the handshake, one byte's round trip, and the source address the
/// listener saw. Failures are the result's `error`.
pub(crate) fn reach(
    from: &str,
    to: &str,
    to_host: u64,
    secret: &ProbeSecret,
    host: u64,
) -> ReachResult {
    let mut result = ReachResult {
        to: to.into(),
        from: from.into(),
        rtt_us: None,
        seen_as: None,
        error: None,
    };
    let attempt = || -> std::result::Result<(u64, String), String> {
        let mut stream = open(from, to, to_host, secret, host)?;
        let _ = stream.set_nodelay(true);
        stream
            .set_read_timeout(Some(REACH_TIMEOUT))
            .map_err(|e| e.to_string())?;
        let started = Instant::now();
        stream.write_all(b"?").map_err(|e| e.to_string())?;
        let mut line = String::new();
        BufReader::new((&stream).take(64))
            .read_line(&mut line)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    format!("no answer within {REACH_TIMEOUT:?}")
                }
                _ => e.to_string(),
            })?;
        let rtt_us = started.elapsed().as_micros() as u64;
        let seen_as = line.trim();
        if seen_as.parse::<std::net::IpAddr>().is_err() {
            return Err("the listener answered no address".into());
        }
        Ok((rtt_us, seen_as.to_string()))
    };
    match attempt() {
        Ok((rtt_us, seen_as)) => {
            result.rtt_us = Some(rtt_us);
            result.seen_as = Some(seen_as);
        }
        Err(error) => result.error = Some(error),
    }
    result
}

/// A bandwidth probe: sends `bytes` bytes from `from` to host `to_host`'s listener at `to`,
/// as host `host` proving `secret`, and returns the seconds from the first byte until the
/// listener acknowledged them all.
///
/// Errors (as text): `bytes` over [`MAX_STREAM_BYTES`], the connection or handshake fails,
/// the listener refuses the length or does not acknowledge within [`STREAM_TIMEOUT`].
pub(crate) fn stream_to(
    from: &str,
    to: &str,
    to_host: u64,
    bytes: u64,
    secret: &ProbeSecret,
    host: u64,
) -> std::result::Result<f64, String> {
    if bytes > MAX_STREAM_BYTES {
        return Err(format!(
            "a bandwidth probe of {bytes} bytes is over the limit of {MAX_STREAM_BYTES}"
        ));
    }
    let mut stream = open(from, to, to_host, secret, host)?;
    let io = |e: std::io::Error| e.to_string();
    stream.set_write_timeout(Some(STREAM_TIMEOUT)).map_err(io)?;
    stream.set_read_timeout(Some(STREAM_TIMEOUT)).map_err(io)?;
    let started = Instant::now();
    let refused = |e: std::io::Error| {
        format!("the listener closed the stream ({e}): it refused {bytes} bytes, or went away")
    };
    stream.write_all(b"B").map_err(refused)?;
    stream.write_all(&bytes.to_le_bytes()).map_err(refused)?;
    let chunk = vec![0x5au8; usize::try_from(bytes).unwrap_or(usize::MAX).min(1 << 20)];
    let mut left = bytes;
    while left > 0 {
        if started.elapsed() > STREAM_TIMEOUT {
            return Err(format!("sending took over {STREAM_TIMEOUT:?}"));
        }
        let n = chunk.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        stream.write_all(&chunk[..n]).map_err(refused)?;
        left -= n as u64;
    }
    let mut line = String::new();
    BufReader::new((&stream).take(16))
        .read_line(&mut line)
        .map_err(|e| format!("no acknowledgement within {STREAM_TIMEOUT:?}: {e}"))?;
    if line.trim() != "ok" {
        return Err("the listener did not acknowledge the bytes".into());
    }
    Ok(started.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOCAL: &str = "127.0.0.1";

    /// Everything a connection gets back before the listener closes it.
    fn answer_to(stream: &mut TcpStream) -> Vec<u8> {
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        answer
    }

    #[test]
    fn honest_probes_get_their_answers_and_strangers_get_nothing() {
        let secret = ProbeSecret::random();
        let address = listen("127.0.0.1:0", secret.clone(), 1, 4 << 20)
            .expect("listen")
            .to_string();

        // An idle stranger holds a slot and delays nobody.
        let idle = TcpStream::connect(&address).expect("connect");
        let honest = reach(LOCAL, &address, 1, &secret, 0);
        assert_eq!(honest.error, None);
        assert_eq!(honest.seen_as.as_deref(), Some(LOCAL));
        assert!(honest.rtt_us.is_some());
        let streamed = stream_to(LOCAL, &address, 1, 3 << 20, &secret, 0);
        assert!(streamed.is_ok(), "{streamed:?}");
        drop(idle);

        // Garbage, and the old unauthenticated reachability probe: no address comes back.
        let mut garbage = TcpStream::connect(&address).expect("connect");
        garbage.write_all(&[0xff; 64]).expect("garbage");
        assert_eq!(answer_to(&mut garbage), b"");
        let mut old = TcpStream::connect(&address).expect("connect");
        old.write_all(b"?").expect("probe");
        old.shutdown(std::net::Shutdown::Write).expect("shutdown");
        assert_eq!(answer_to(&mut old), b"");

        // Another survey's secret, a probe meant for another host, or one that claims the
        // listener's own identity gets no answer (each retried for a while: run at once).
        let (other, elsewhere, itself) = std::thread::scope(|scope| {
            let other = scope.spawn(|| reach(LOCAL, &address, 1, &ProbeSecret::random(), 0));
            let elsewhere = scope.spawn(|| reach(LOCAL, &address, 2, &secret, 0));
            let itself = scope.spawn(|| reach(LOCAL, &address, 1, &secret, 1));
            (
                other.join().expect("probe"),
                elsewhere.join().expect("probe"),
                itself.join().expect("probe"),
            )
        });
        assert!(
            other.seen_as.is_none() && other.error.is_some(),
            "{other:?}"
        );
        assert!(
            itself.seen_as.is_none() && itself.error.is_some(),
            "{itself:?}"
        );
        assert!(elsewhere.seen_as.is_none(), "{elsewhere:?}");
        assert!(
            elsewhere
                .error
                .as_deref()
                .is_some_and(|e| e.contains("did not prove itself as host 2")),
            "{elsewhere:?}"
        );

        // A proved connection that announces more bytes than the launcher allowed is
        // closed without an acknowledgement, before it is read.
        let mut long = connect_from(LOCAL, &address).expect("connect");
        prove_prober(&mut long, &secret, 0, 1).expect("handshake");
        long.write_all(b"B").expect("kind");
        long.write_all(&((4u64 << 20) + 1).to_le_bytes())
            .expect("length");
        assert_eq!(answer_to(&mut long), b"");
        let refused = stream_to(LOCAL, &address, 1, 5 << 20, &secret, 0);
        assert!(refused.is_err(), "{refused:?}");
        assert!(stream_to(LOCAL, &address, 1, MAX_STREAM_BYTES + 1, &secret, 0).is_err());

        // Honest probes still work after all of it.
        assert_eq!(
            reach(LOCAL, &address, 1, &secret, 0).seen_as.as_deref(),
            Some(LOCAL)
        );
    }

    #[test]
    fn a_full_listener_closes_more_connections_at_once_and_serves_again_when_freed() {
        let secret = ProbeSecret::random();
        let address = listen("127.0.0.1:0", secret.clone(), 0, 0)
            .expect("listen")
            .to_string();
        let squatters: Vec<TcpStream> = (0..MAX_CONNECTIONS)
            .map(|_| TcpStream::connect(&address).expect("connect"))
            .collect();
        // One more: closed with nothing written (at once while the slots are held; a slot
        // that frees meanwhile gives it a handshake that waits for a hello in vain).
        let mut extra = TcpStream::connect(&address).expect("connect");
        extra.write_all(b"?").expect("probe");
        extra.shutdown(std::net::Shutdown::Write).expect("shutdown");
        assert_eq!(answer_to(&mut extra), b"");
        // The squatters leave: an honest probe gets a slot (retrying while they are closed).
        drop(squatters);
        let honest = reach(LOCAL, &address, 0, &secret, 3);
        assert_eq!(honest.seen_as.as_deref(), Some(LOCAL), "{honest:?}");
        // A listener that allows no bandwidth probe refuses every one.
        assert!(stream_to(LOCAL, &address, 0, 1, &secret, 3).is_err());
    }

    #[test]
    fn a_launcher_without_a_secret_gets_errors_not_probes() {
        let results = reach_each(LOCAL, &["127.0.0.1:9".into()], &[], None, 0);
        assert_eq!(results[0].error.as_deref(), Some(OLDER_LAUNCHER));
        assert!(
            listen(
                "127.0.0.1:0",
                ProbeSecret::random(),
                0,
                MAX_STREAM_BYTES + 1
            )
            .is_err()
        );
    }
}
