//! Mutual authentication of a run's internal TCP connections (the rendezvous store, the
//! collectives, the DP router links, the KV inboxes): a challenge–response keyed by a key
//! both ends hold ([`crate::keyring`]: the pair key of their two hosts, or the store key of
//! the client's host), which never crosses the wire.
//!
//! The connecting side (the client) sends a hello: a magic and version, the channel (what
//! the connection is for, e.g. `comm/dp0/tp/0`), the identity it claims and the identity it
//! expects of the server (positions or ranks), and a 32-byte random nonce. The server reads
//! at most [`MAX_HELLO_BYTES`] within [`HELLO_TIMEOUT`] before it sizes anything, checks the
//! channel and both identities, and answers its own nonce with its proof; the client checks
//! that proof and answers with its own. Each proof is HMAC-SHA256 (RFC 2104) keyed by the
//! key over the role (`server` or `client`, so a proof cannot be reflected), the channel,
//! both identities and both nonces (so it cannot be replayed on another connection).
//! Compared in constant time. The server picks the key from the identity the client claims
//! (the host that identity lives on), so a host can prove only identities of its own.
//!
//! Both ends leave with a [`Session`]: a key of this connection alone, from which the
//! control-plane links (the store, the DP router) MAC every frame ([`Sealer`], [`Opener`]:
//! HMAC-SHA256 over the direction, a sequence number and the frame), so a frame cannot be
//! altered, replayed, reordered or dropped unnoticed. The bulk links (tensors, KV) are not
//! MACed frame by frame, as with NCCL; nothing is encrypted: the data network is trusted
//! with what it carries.

use std::io::{Read, Write};
use std::net::{IpAddr, TcpStream};
use std::time::Duration;

use anyhow::{Result, anyhow, bail};
use hmac::{KeyInit, Mac};

use crate::keyring::Key;

/// How long a server waits for a hello, and each side for the other's answer.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// The most bytes a hello may take (a channel name of up to 1 KiB and fixed fields).
pub(crate) const MAX_HELLO_BYTES: usize = 4096;

/// The hello's first 8 bytes: the protocol and its version.
const MAGIC: &[u8; 8] = b"infer\x00h1";

/// Bytes of each nonce and each proof (SHA-256).
const NONCE_BYTES: usize = 32;

/// Longest channel name, bytes.
const MAX_CHANNEL_BYTES: usize = 1024;

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// What both sides must agree on: the channel and who is on each end.
#[derive(Clone, Copy, Debug)]
pub struct Claim<'a> {
    /// What the connection is for (`store`, `comm/GROUP`, `router/REPLICA`, `kv`).
    pub channel: &'a str,
    /// Who connects (a position in a group, a rank; [`LAUNCHER`] for the launcher).
    pub client: u64,
    /// Whom it expects to reach.
    pub server: u64,
}

/// The identity of a client that is no rank (the launcher, an agent).
pub const LAUNCHER: u64 = u64::MAX;

/// The client's side on a connected `stream`: proves `claim.client` and checks that the
/// server is `claim.server` of `claim.channel`, both holding `key`. Read timeouts of
/// [`HELLO_TIMEOUT`] apply meanwhile and are cleared after. Returns the connection's
/// [`Session`].
///
/// Errors: the server closes the connection (it refused the claim or the key), answers
/// with a wrong proof, or takes longer than [`HELLO_TIMEOUT`]; I/O errors.
pub fn client(stream: &mut TcpStream, key: &Key, claim: Claim) -> Result<Session> {
    if claim.channel.len() > MAX_CHANNEL_BYTES {
        bail!("channel name of {} bytes is too long", claim.channel.len());
    }
    stream.set_read_timeout(Some(HELLO_TIMEOUT))?;
    let client_nonce: [u8; NONCE_BYTES] = rand::random();
    let mut hello = Vec::with_capacity(64 + claim.channel.len());
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&(claim.channel.len() as u16).to_le_bytes());
    hello.extend_from_slice(claim.channel.as_bytes());
    hello.extend_from_slice(&claim.client.to_le_bytes());
    hello.extend_from_slice(&claim.server.to_le_bytes());
    hello.extend_from_slice(&client_nonce);
    stream.write_all(&hello)?;
    let mut answer = [0u8; 2 * NONCE_BYTES];
    stream.read_exact(&mut answer).map_err(|error| match error.kind() {
        std::io::ErrorKind::UnexpectedEof => anyhow!(
            "the peer closed the connection during the handshake: it refused this run's key or `{}` as {} → {} (another run, another host's key, or a stale address?)",
            claim.channel,
            claim.client,
            claim.server
        ),
        _ => anyhow!("the handshake on `{}` failed: {error}", claim.channel),
    })?;
    let (server_nonce, server_proof) = answer.split_at(NONCE_BYTES);
    proof(key, "server", claim, &client_nonce, server_nonce)
        .verify_slice(server_proof)
        .map_err(|_| {
            anyhow!(
                "the peer at {} did not prove this run's key for `{}`: not the member expected there",
                stream
                    .peer_addr()
                    .map_or_else(|_| "?".into(), |a| a.to_string()),
                claim.channel
            )
        })?;
    let mine = proof(key, "client", claim, &client_nonce, server_nonce).finalize();
    stream.write_all(&mine.into_bytes())?;
    stream.set_read_timeout(None)?;
    Ok(Session::new(key, claim, &client_nonce, server_nonce, true))
}

/// The server's side on an accepted `stream` of `channel`, as `server`: reads the hello
/// (bounded, within [`HELLO_TIMEOUT`]), takes the key for the client identity it claims
/// from `key_for` (`None`: an identity not accepted here), proves itself and checks the
/// client's proof. Returns the client's identity and the connection's [`Session`]. Read
/// timeouts are cleared after.
///
/// Errors (the caller closes the connection and goes on accepting): no hello in time, a
/// wrong magic, channel or server identity, a client identity `key_for` refuses, a wrong
/// proof; I/O errors.
pub fn server(
    stream: &mut TcpStream,
    channel: &str,
    server: u64,
    key_for: &dyn Fn(u64) -> Option<Key>,
) -> Result<(u64, Session)> {
    // One deadline for the whole exchange: a peer that trickles a byte at a time cannot
    // hold the connection longer than `HELLO_TIMEOUT`.
    let deadline = std::time::Instant::now() + HELLO_TIMEOUT;
    let mut head = [0u8; 10];
    read_by(stream, &mut head, deadline)?;
    if &head[..8] != MAGIC {
        bail!("not a handshake of this protocol");
    }
    let channel_bytes = u16::from_le_bytes([head[8], head[9]]) as usize;
    if channel_bytes != channel.len() || 10 + channel_bytes + 16 + NONCE_BYTES > MAX_HELLO_BYTES {
        bail!("a hello for another channel");
    }
    let mut rest = vec![0u8; channel_bytes + 16 + NONCE_BYTES];
    read_by(stream, &mut rest, deadline)?;
    let (claimed_channel, rest) = rest.split_at(channel_bytes);
    let (ids, client_nonce) = rest.split_at(16);
    let client = u64::from_le_bytes(ids[..8].try_into()?);
    let claimed_server = u64::from_le_bytes(ids[8..].try_into()?);
    if claimed_channel != channel.as_bytes() || claimed_server != server {
        bail!("a hello for another channel or peer");
    }
    let key = key_for(client).ok_or_else(|| anyhow!("a client identity not accepted here"))?;
    let claim = Claim {
        channel,
        client,
        server,
    };
    let server_nonce: [u8; NONCE_BYTES] = rand::random();
    let mine = proof(&key, "server", claim, client_nonce, &server_nonce).finalize();
    let mut answer = Vec::with_capacity(2 * NONCE_BYTES);
    answer.extend_from_slice(&server_nonce);
    answer.extend_from_slice(&mine.into_bytes());
    stream.write_all(&answer)?;
    let mut theirs = [0u8; NONCE_BYTES];
    read_by(stream, &mut theirs, deadline)?;
    proof(&key, "client", claim, client_nonce, &server_nonce)
        .verify_slice(&theirs)
        .map_err(|_| anyhow!("the client's proof is wrong"))?;
    stream.set_read_timeout(None)?;
    Ok((
        client,
        Session::new(&key, claim, client_nonce, &server_nonce, false),
    ))
}

/// Connects to `address` from `source` (this host's data address, when the run knows it:
/// the server checks that a peer comes from its host's, see [`check_source`]; `None` lets
/// routing pick) and proves `claim` ([`client`]), retrying both until `timeout`: a
/// listener that is busy with strangers closes new connections at once, and frees a slot
/// within [`HELLO_TIMEOUT`]. Returns the connection, its read timeout cleared, and its
/// [`Session`].
///
/// Errors: the last failure at `timeout` (unreachable, refused, `source` not an address of
/// this host, or a peer that does not prove the key).
pub fn connect(
    address: std::net::SocketAddr,
    source: Option<IpAddr>,
    key: &Key,
    claim: Claim,
    timeout: Duration,
) -> Result<(TcpStream, Session)> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let attempt = open(address, source)
            .map_err(anyhow::Error::from)
            .and_then(|mut stream| client(&mut stream, key, claim).map(|s| (stream, s)));
        match attempt {
            Ok(stream) => return Ok(stream),
            Err(error) if std::time::Instant::now() >= deadline => {
                return Err(error.context(format!(
                    "cannot reach {address} as `{}` within {timeout:?}",
                    claim.channel
                )));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// A TCP connection to `address`, bound to `source` first when given (so that it leaves
/// from that address on a host with several), within a second.
///
/// Errors: `source` cannot be bound (not this host's), the connection fails.
fn open(address: std::net::SocketAddr, source: Option<IpAddr>) -> std::io::Result<TcpStream> {
    let Some(source) = source else {
        return TcpStream::connect_timeout(&address, Duration::from_secs(1));
    };
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(address),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.bind(&std::net::SocketAddr::new(source, 0).into())?;
    socket.connect_timeout(&address.into(), Duration::from_secs(1))?;
    Ok(socket.into())
}

/// Checks that `stream`'s peer, which has proved itself as a process of some host, comes
/// from that host's data address (`expected`, from the run's keys; `None` where the run
/// does not know it: one host, `--nnodes` nodes): a key that leaked from its host is no
/// use elsewhere. Peers bind their connections to that address ([`connect`]).
///
/// Errors: the peer's address is unknown, or not `expected`.
pub fn check_source(stream: &TcpStream, expected: Option<IpAddr>) -> Result<()> {
    let Some(expected) = expected else {
        return Ok(());
    };
    let peer = stream.peer_addr()?.ip();
    if peer != expected {
        bail!("a peer proved the key of the host at {expected} but connected from {peer}");
    }
    Ok(())
}

/// Fills `buffer` from `stream` by `deadline`.
///
/// Errors: the deadline passes, the peer closes the connection, I/O errors.
fn read_by(stream: &mut TcpStream, buffer: &mut [u8], deadline: std::time::Instant) -> Result<()> {
    let mut filled = 0;
    while filled < buffer.len() {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            bail!("no complete handshake within {HELLO_TIMEOUT:?}");
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buffer[filled..])? {
            0 => bail!("the peer closed the connection during the handshake"),
            n => filled += n,
        }
    }
    Ok(())
}

/// The MAC of one side's proof (or, with role `session`, of the session key), before
/// finalizing.
fn proof(
    key: &Key,
    role: &str,
    claim: Claim,
    client_nonce: &[u8],
    server_nonce: &[u8],
) -> HmacSha256 {
    let mut mac = mac_with(key.bytes());
    for part in [role.as_bytes(), claim.channel.as_bytes()] {
        mac.update(&(part.len() as u64).to_le_bytes());
        mac.update(part);
    }
    mac.update(&claim.client.to_le_bytes());
    mac.update(&claim.server.to_le_bytes());
    mac.update(client_nonce);
    mac.update(server_nonce);
    mac
}

/// An HMAC-SHA256 keyed by `key`.
fn mac_with(key: &[u8]) -> HmacSha256 {
    HmacSha256::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"))
}

/// Bytes of a frame's MAC ([`Sealer::seal`]).
pub const TAG_BYTES: usize = 32;

/// What one authenticated connection shares after its handshake: a key of its own
/// (HMAC-SHA256 of the handshake's key over the claim and both nonces), from which each
/// direction MACs its frames. Split it into the two halves a connection's writer and reader
/// use.
pub struct Session {
    key: [u8; 32],
    /// Whether this end is the client (it seals `client→server` frames).
    client: bool,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Session(…)")
    }
}

impl Session {
    fn new(
        key: &Key,
        claim: Claim,
        client_nonce: &[u8],
        server_nonce: &[u8],
        client: bool,
    ) -> Session {
        let key = proof(key, "session", claim, client_nonce, server_nonce).finalize();
        Session {
            key: key.into_bytes().into(),
            client,
        }
    }

    /// The writer's half (MACs what this end sends) and the reader's (checks what it
    /// receives).
    pub fn split(self) -> (Sealer, Opener) {
        let (mine, theirs) = if self.client {
            (b"client->server", b"server->client")
        } else {
            (b"server->client", b"client->server")
        };
        (
            Sealer(Direction::new(&self.key, mine)),
            Opener(Direction::new(&self.key, theirs)),
        )
    }
}

/// One direction of a session: its key and the next frame's sequence number.
struct Direction {
    mac: HmacSha256,
    next: u64,
}

impl Direction {
    fn new(key: &[u8; 32], label: &[u8; 14]) -> Direction {
        let mut mac = mac_with(key);
        mac.update(label);
        Direction { mac, next: 0 }
    }

    /// The MAC of frame number `self.next` with `body`; advances the number.
    fn tag(&mut self, body: &[u8]) -> HmacSha256 {
        let mut mac = self.mac.clone();
        mac.update(&self.next.to_le_bytes());
        mac.update(&(body.len() as u64).to_le_bytes());
        mac.update(body);
        self.next += 1;
        mac
    }
}

/// MACs the frames one end sends, numbered from 0.
pub struct Sealer(Direction);

impl Sealer {
    /// The tag to send after `body` (the next frame of this direction).
    pub fn seal(&mut self, body: &[u8]) -> [u8; TAG_BYTES] {
        self.0.tag(body).finalize().into_bytes().into()
    }
}

/// Checks the frames one end receives, in order.
pub struct Opener(Direction);

impl Opener {
    /// Checks that `tag` is the MAC of `body` as the next frame of this direction (compared
    /// in constant time).
    ///
    /// Errors: an altered, replayed, reordered or missing frame; the connection must then
    /// be dropped.
    pub fn open(&mut self, body: &[u8], tag: &[u8]) -> Result<()> {
        self.0
            .tag(body)
            .verify_slice(tag)
            .map_err(|_| anyhow!("a frame whose MAC is wrong (altered, replayed or out of order): the link is not trusted any more"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keyring::Keyring;
    use std::net::TcpListener;

    /// A run whose ranks 0, 1 and 2 are on hosts 0, 1 and 2.
    fn run(secret: &str) -> Keyring {
        Keyring::master(secret, crate::keyring::LAUNCHER_HOST, vec![0, 1, 2])
    }

    /// Runs the server side (rank 1 on host 1, accepting ranks `accept` of the run with
    /// `server_secret`) on one accepted connection and the client side (`client_keys`, a
    /// host's keyring) against it.
    fn pair(
        server_secret: &str,
        client_keys: &Keyring,
        claim: Claim<'static>,
        accept: fn(u64) -> bool,
    ) -> (Result<(u64, Session)>, Result<Session>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let keys = run(server_secret).for_host(1).expect("host 1");
        let server_side = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().expect("accept");
            let key_for = |client: u64| {
                accept(client)
                    .then(|| keys.pair_key_with_rank(client))
                    .flatten()
            };
            server(&mut stream, "comm/dp0/tp/0", 1, &key_for)
        });
        let mut stream = TcpStream::connect(address).expect("connect");
        let key = client_keys.pair_key(1).expect("a key for host 1");
        let client_side = client(&mut stream, &key, claim);
        drop(stream);
        (server_side.join().expect("server"), client_side)
    }

    const CLAIM: Claim<'static> = Claim {
        channel: "comm/dp0/tp/0",
        client: 0,
        server: 1,
    };

    fn host(secret: &str, host: u32) -> Keyring {
        run(secret).for_host(host).expect("host")
    }

    #[test]
    fn members_of_one_run_prove_themselves_to_each_other_and_share_a_session() {
        let (server, client) = pair("s3cret", &host("s3cret", 0), CLAIM, |id| id == 0);
        let (peer, server) = server.expect("server");
        assert_eq!(peer, 0);
        let (mut client_sealer, mut client_opener) = client.expect("client").split();
        let (mut server_sealer, mut server_opener) = server.split();
        let tag = client_sealer.seal(b"set job");
        server_opener
            .open(b"set job", &tag)
            .expect("the same session");
        let tag = server_sealer.seal(b"ok");
        client_opener
            .open(b"ok", &tag)
            .expect("the other direction");
        // An altered frame is refused.
        let tag = client_sealer.seal(b"set job");
        assert!(server_opener.open(b"set bob", &tag).is_err(), "altered");
    }

    #[test]
    fn a_peer_is_accepted_only_from_its_hosts_address() {
        // Host 0 at 127.0.0.2, host 1 (the server) at 127.0.0.1: every 127/8 address is
        // this machine's, so a connection can leave from either.
        let addresses: Vec<IpAddr> = vec![[127, 0, 0, 2].into(), [127, 0, 0, 1].into()];
        let keys = run("s3cret").with_addresses(addresses.clone());
        let (server_keys, client_keys) = (
            keys.for_host(1).expect("host 1"),
            keys.for_host(0).expect("host 0"),
        );
        assert_eq!(client_keys.own_address(), Some(addresses[0]));
        assert_eq!(server_keys.address_of_rank(0), Some(addresses[0]));
        // The addresses travel with a host's keys.
        let read = Keyring::from_text(&client_keys.to_text().expect("text")).expect("read");
        assert_eq!(read.own_address(), Some(addresses[0]));
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let server_side = std::thread::spawn(move || {
            (0..2)
                .map(|_| {
                    let (mut stream, _) = listener.accept().expect("accept");
                    let key_for = |client: u64| server_keys.pair_key_with_rank(client);
                    let (client, _) = server(&mut stream, "comm/dp0/tp/0", 1, &key_for)?;
                    check_source(&stream, server_keys.address_of_rank(client))?;
                    Ok(stream.peer_addr()?.ip())
                })
                .collect::<Vec<Result<IpAddr>>>()
        });
        let key = client_keys.pair_key(1).expect("key");
        // From its host's address: accepted. From another (the key taken elsewhere): the
        // handshake succeeds, and the source check refuses the connection.
        for source in [client_keys.own_address(), Some(addresses[1])] {
            let (stream, _) =
                connect(address, source, &key, CLAIM, Duration::from_secs(5)).expect("connect");
            assert_eq!(Some(stream.local_addr().expect("local").ip()), source);
        }
        let results = server_side.join().expect("server");
        assert_eq!(results[0].as_ref().expect("accepted"), &addresses[0]);
        let refused = format!("{:#}", results[1].as_ref().expect_err("refused"));
        assert!(
            refused.contains("host at 127.0.0.2 but connected from 127.0.0.1"),
            "{refused}"
        );
        // Where the run knows no address (one host, `--nnodes`), nothing is checked.
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let stream = TcpStream::connect(listener.local_addr().expect("address")).expect("connect");
        check_source(&stream, None).expect("no address to check");
    }

    #[test]
    fn a_replayed_or_reflected_frame_is_refused() {
        let (server, client) = pair("s3cret", &host("s3cret", 0), CLAIM, |id| id == 0);
        let (mut sealer, _) = client.expect("client").split();
        let (mut server_sealer, mut opener) = server.expect("server").1.split();
        let first = sealer.seal(b"add 1");
        opener.open(b"add 1", &first).expect("first");
        assert!(opener.open(b"add 1", &first).is_err(), "replayed");
        let reflected = server_sealer.seal(b"add 1");
        assert!(opener.open(b"add 1", &reflected).is_err(), "reflected");
    }

    #[test]
    fn another_run_another_channel_or_another_hosts_identity_is_refused() {
        let (server, client) = pair("s3cret", &host("other", 0), CLAIM, |_| true);
        assert!(server.is_err() && client.is_err());
        let wrong_channel = Claim {
            channel: "comm/dp1/tp/0",
            ..CLAIM
        };
        let (server, client) = pair("s3cret", &host("s3cret", 0), wrong_channel, |_| true);
        assert!(server.is_err(), "another group's hello");
        let message = format!("{:#}", client.expect_err("refused"));
        assert!(
            message.contains("closed the connection during the handshake"),
            "{message}"
        );
        let (server, _) = pair("s3cret", &host("s3cret", 0), CLAIM, |id| id == 5);
        assert!(server.is_err(), "an identity the server does not expect");
        let wrong_server = Claim { server: 2, ..CLAIM };
        let (server, _) = pair("s3cret", &host("s3cret", 0), wrong_server, |_| true);
        assert!(server.is_err(), "a hello meant for another member");
        // Host 2 holds this run's keys for itself only: claiming rank 0 (on host 0) fails,
        // claiming its own rank 2 works.
        let (server, client) = pair("s3cret", &host("s3cret", 2), CLAIM, |_| true);
        assert!(
            server.is_err() && client.is_err(),
            "host 2 cannot act as rank 0"
        );
        let own = Claim { client: 2, ..CLAIM };
        let (server, _) = pair("s3cret", &host("s3cret", 2), own, |_| true);
        assert_eq!(server.expect("its own rank").0, 2);
    }

    /// A stranger that sends its hello a byte a second is cut off at the deadline, not
    /// kept as long as it trickles.
    #[test]
    fn a_trickling_hello_is_cut_off_at_the_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let trickler = std::thread::spawn(move || {
            let mut stream = TcpStream::connect(address).expect("connect");
            for byte in MAGIC.iter().cycle().take(20) {
                if stream.write_all(&[*byte]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(700));
            }
        });
        let (mut stream, _) = listener.accept().expect("accept");
        let started = std::time::Instant::now();
        assert!(server(&mut stream, "comm/x", 0, &|_| Some(Key([7; 32]))).is_err());
        let waited = started.elapsed();
        assert!(
            waited < HELLO_TIMEOUT + Duration::from_secs(2),
            "held for {waited:?}"
        );
        drop(stream);
        trickler.join().expect("trickler");
    }

    #[test]
    fn garbage_and_silence_are_refused_without_a_large_buffer() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let mut garbage = TcpStream::connect(address).expect("connect");
        garbage.write_all(&[0xff; 64]).expect("garbage");
        let (mut stream, _) = listener.accept().expect("accept");
        assert!(server(&mut stream, "comm/x", 0, &|_| Some(Key([7; 32]))).is_err());
        // A hello that claims a 64 KiB channel is refused before anything is read into it.
        let mut long = TcpStream::connect(address).expect("connect");
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&u16::MAX.to_le_bytes());
        long.write_all(&hello).expect("hello");
        let (mut stream, _) = listener.accept().expect("accept");
        assert!(server(&mut stream, "comm/x", 0, &|_| Some(Key([7; 32]))).is_err());
    }
}
