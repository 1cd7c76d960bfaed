//! Mutual authentication of a run's internal TCP connections (the rendezvous store, the
//! collectives, the DP router links, the KV inboxes): a challenge–response keyed by the
//! run secret, which never crosses the wire.
//!
//! The connecting side (the client) sends a hello: a magic and version, the channel (what
//! the connection is for, e.g. `comm/dp0/tp/0`), the identity it claims and the identity it
//! expects of the server (positions or ranks), and a 32-byte random nonce. The server reads
//! at most [`MAX_HELLO_BYTES`] within [`HELLO_TIMEOUT`] before it sizes anything, checks the
//! channel and both identities, and answers its own nonce with its proof; the client checks
//! that proof and answers with its own. Each proof is HMAC-SHA256 (RFC 2104) keyed by the
//! secret over the role (`server` or `client`, so a proof cannot be reflected), the channel,
//! both identities and both nonces (so it cannot be replayed on another connection).
//! Compared in constant time. An attacker who sees every handshake learns no secret and
//! cannot take a slot; what later crosses the connection (tensors, KV, JSON) is neither
//! encrypted nor authenticated frame by frame, as with NCCL: the data network is trusted with
//! it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use anyhow::{Result, anyhow, bail};
use hmac::{KeyInit, Mac};

/// How long a server waits for a hello, and each side for the other's answer.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// The most bytes a hello may take (a channel name of up to 1 KiB and fixed fields).
pub const MAX_HELLO_BYTES: usize = 4096;

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
/// server is `claim.server` of `claim.channel`, both knowing `secret`. Read timeouts of
/// [`HELLO_TIMEOUT`] apply meanwhile and are cleared after.
///
/// Errors: the server closes the connection (it refused the claim or the secret), answers
/// with a wrong proof, or takes longer than [`HELLO_TIMEOUT`]; I/O errors.
pub fn client(stream: &mut TcpStream, secret: &str, claim: Claim) -> Result<()> {
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
            "the peer closed the connection during the handshake: it refused this run's secret or `{}` as {} → {} (another run, or a stale address?)",
            claim.channel,
            claim.client,
            claim.server
        ),
        _ => anyhow!("the handshake on `{}` failed: {error}", claim.channel),
    })?;
    let (server_nonce, server_proof) = answer.split_at(NONCE_BYTES);
    proof(secret, "server", claim, &client_nonce, server_nonce)
        .verify_slice(server_proof)
        .map_err(|_| {
            anyhow!(
                "the peer at {} did not prove this run's secret for `{}`: not a member of this run",
                stream
                    .peer_addr()
                    .map_or_else(|_| "?".into(), |a| a.to_string()),
                claim.channel
            )
        })?;
    let mine = proof(secret, "client", claim, &client_nonce, server_nonce).finalize();
    stream.write_all(&mine.into_bytes())?;
    stream.set_read_timeout(None)?;
    Ok(())
}

/// The server's side on an accepted `stream` of `channel`, as `server`: reads the hello
/// (bounded, within [`HELLO_TIMEOUT`]), accepts the client identity only when `accept`
/// does, proves itself and checks the client's proof. Returns the client's identity.
/// Read timeouts are cleared after.
///
/// Errors (the caller closes the connection and goes on accepting): no hello in time, a
/// wrong magic, channel or server identity, a client identity `accept` refuses, a wrong
/// proof; I/O errors.
pub fn server(
    stream: &mut TcpStream,
    secret: &str,
    channel: &str,
    server: u64,
    accept: &dyn Fn(u64) -> bool,
) -> Result<u64> {
    stream.set_read_timeout(Some(HELLO_TIMEOUT))?;
    let mut head = [0u8; 10];
    stream.read_exact(&mut head)?;
    if &head[..8] != MAGIC {
        bail!("not a handshake of this protocol");
    }
    let channel_bytes = u16::from_le_bytes([head[8], head[9]]) as usize;
    if channel_bytes != channel.len() || 10 + channel_bytes + 16 + NONCE_BYTES > MAX_HELLO_BYTES {
        bail!("a hello for another channel");
    }
    let mut rest = vec![0u8; channel_bytes + 16 + NONCE_BYTES];
    stream.read_exact(&mut rest)?;
    let (claimed_channel, rest) = rest.split_at(channel_bytes);
    let (ids, client_nonce) = rest.split_at(16);
    let client = u64::from_le_bytes(ids[..8].try_into()?);
    let claimed_server = u64::from_le_bytes(ids[8..].try_into()?);
    if claimed_channel != channel.as_bytes() || claimed_server != server || !accept(client) {
        bail!("a hello for another channel, peer or identity");
    }
    let claim = Claim {
        channel,
        client,
        server,
    };
    let server_nonce: [u8; NONCE_BYTES] = rand::random();
    let mine = proof(secret, "server", claim, client_nonce, &server_nonce).finalize();
    let mut answer = Vec::with_capacity(2 * NONCE_BYTES);
    answer.extend_from_slice(&server_nonce);
    answer.extend_from_slice(&mine.into_bytes());
    stream.write_all(&answer)?;
    let mut theirs = [0u8; NONCE_BYTES];
    stream.read_exact(&mut theirs)?;
    proof(secret, "client", claim, client_nonce, &server_nonce)
        .verify_slice(&theirs)
        .map_err(|_| anyhow!("the client's proof is wrong"))?;
    stream.set_read_timeout(None)?;
    Ok(client)
}

/// Connects to `address` and proves `claim` ([`client`]), retrying both until `timeout`:
/// a listener that is busy with strangers closes new connections at once, and frees a slot
/// within [`HELLO_TIMEOUT`]. Returns the connection, its read timeout cleared.
///
/// Errors: the last failure at `timeout` (unreachable, refused, or a peer that does not
/// prove the secret).
pub fn connect(
    address: std::net::SocketAddr,
    secret: &str,
    claim: Claim,
    timeout: Duration,
) -> Result<TcpStream> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let attempt = TcpStream::connect_timeout(&address, Duration::from_secs(1))
            .map_err(anyhow::Error::from)
            .and_then(|mut stream| client(&mut stream, secret, claim).map(|()| stream));
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

/// The MAC of one side's proof, before finalizing.
fn proof(
    secret: &str,
    role: &str,
    claim: Claim,
    client_nonce: &[u8],
    server_nonce: &[u8],
) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(secret.as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// Runs the server side on one accepted connection and the client side against it.
    fn pair(
        server_secret: &str,
        client_secret: &str,
        claim: Claim<'static>,
        accept: fn(u64) -> bool,
    ) -> (Result<u64>, Result<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let secret = server_secret.to_string();
        let server_side = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().expect("accept");
            server(&mut stream, &secret, "comm/dp0/tp/0", 1, &accept)
        });
        let mut stream = TcpStream::connect(address).expect("connect");
        let client_side = client(&mut stream, client_secret, claim);
        drop(stream);
        (server_side.join().expect("server"), client_side)
    }

    const CLAIM: Claim<'static> = Claim {
        channel: "comm/dp0/tp/0",
        client: 0,
        server: 1,
    };

    #[test]
    fn members_of_one_run_prove_themselves_to_each_other() {
        let (server, client) = pair("s3cret", "s3cret", CLAIM, |id| id == 0);
        assert_eq!(server.expect("server"), 0);
        client.expect("client");
    }

    #[test]
    fn another_secret_another_channel_or_an_unexpected_identity_is_refused() {
        let (server, client) = pair("s3cret", "other", CLAIM, |_| true);
        assert!(server.is_err() && client.is_err());
        let wrong_channel = Claim {
            channel: "comm/dp1/tp/0",
            ..CLAIM
        };
        let (server, client) = pair("s3cret", "s3cret", wrong_channel, |_| true);
        assert!(server.is_err(), "another group's hello");
        let message = format!("{:#}", client.expect_err("refused"));
        assert!(
            message.contains("closed the connection during the handshake"),
            "{message}"
        );
        let (server, _) = pair("s3cret", "s3cret", CLAIM, |id| id == 5);
        assert!(server.is_err(), "an identity the server does not expect");
        let wrong_server = Claim { server: 2, ..CLAIM };
        let (server, _) = pair("s3cret", "s3cret", wrong_server, |_| true);
        assert!(server.is_err(), "a hello meant for another member");
    }

    #[test]
    fn garbage_and_silence_are_refused_without_a_large_buffer() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let mut garbage = TcpStream::connect(address).expect("connect");
        garbage.write_all(&[0xff; 64]).expect("garbage");
        let (mut stream, _) = listener.accept().expect("accept");
        assert!(server(&mut stream, "s", "comm/x", 0, &|_| true).is_err());
        // A hello that claims a 64 KiB channel is refused before anything is read into it.
        let mut long = TcpStream::connect(address).expect("connect");
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&u16::MAX.to_le_bytes());
        long.write_all(&hello).expect("hello");
        let (mut stream, _) = listener.accept().expect("accept");
        assert!(server(&mut stream, "s", "comm/x", 0, &|_| true).is_err());
    }
}
