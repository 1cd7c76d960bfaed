//! Rank 0's links to the other DP replicas' drivers, as the [`Router`](super::router::Router)
//! holds them: one authenticated TCP connection each ([`super::router`](mod@super::router)'s frames). A lost
//! link fails the server, or, when the launcher restarts a replica alone
//! (`--max-restarts` with `--dp`: [`Rejoin`]), marks the replica down (its requests in
//! flight get an error naming the cause, the router sends it nothing, `/health` names it
//! `restarting`) and links to the replica's next start as soon as its driver publishes
//! its address in the rendezvous store.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tokio::net::TcpStream;
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tokio::sync::watch;

use super::router::{
    CHANNEL, FromReplica, MetricsWaiters, Pending, ToReplica, read_frame, write_frame,
};
use super::scheduler::{Event, MetricsSnapshot};

/// How often a replica that is down is looked for in the store.
const REJOIN_POLL: Duration = Duration::from_millis(200);

/// The store key under which replica driver `rank` publishes where the router reaches it.
pub(crate) fn router_key(rank: u64) -> String {
    crate::rendezvous::rank_key(rank, "router")
}

/// What a replica's driver publishes under [`router_key`]: its start (incarnation) and
/// its address, `3 10.0.0.2:41000`.
pub(crate) fn router_value(incarnation: usize, address: std::net::SocketAddr) -> String {
    format!("{incarnation} {address}")
}

/// Reads [`router_value`]'s text: (incarnation, address).
///
/// Errors: text of another form.
fn parse_router_value(bytes: &[u8]) -> Result<(usize, std::net::SocketAddr)> {
    let text = String::from_utf8_lossy(bytes);
    let (incarnation, address) = text
        .split_once(' ')
        .with_context(|| format!("a replica published a malformed address `{text}`"))?;
    Ok((
        incarnation
            .parse()
            .with_context(|| format!("a malformed incarnation in `{text}`"))?,
        address
            .parse()
            .with_context(|| format!("a malformed address in `{text}`"))?,
    ))
}

/// Where a router finds a restarted replica: the rendezvous store (rank 0's connection to
/// it proves rank 0's host keys).
#[derive(Clone)]
pub(crate) struct Rejoin {
    /// `MASTER_ADDR:MASTER_PORT`.
    pub store: String,
}

/// What every link of a router shares: how a lost link ends.
pub(super) struct Links {
    /// Fails the whole server (no [`Rejoin`]).
    pub fail: Arc<watch::Sender<Option<String>>>,
    /// Restarted replicas are linked again.
    pub rejoin: Option<Rejoin>,
    /// Rank 0's host's keys.
    pub keys: crate::keyring::Keyring,
}

/// One connection to a replica's driver.
pub(super) struct Link {
    pub frames: UnboundedSender<ToReplica>,
    pub pending: Pending,
    /// Its last reported metrics, and when they arrived.
    pub metrics: Arc<Mutex<(MetricsSnapshot, Instant)>>,
    /// Scrapes waiting for its current metrics.
    pub waiters: MetricsWaiters,
}

/// A replica whose driver is another rank process: its link, or why it is down.
pub(super) struct Remote {
    /// Its index among the replicas (1, 2, …).
    pub replica: usize,
    /// Its driver's global rank.
    pub driver: u64,
    link: Mutex<Option<Arc<Link>>>,
    /// Why it is down, while it restarts.
    down: Mutex<Option<String>>,
    /// The start of the replica the link is to (0: the first).
    incarnation: AtomicUsize,
    /// When it went down.
    down_since: Mutex<Option<Instant>>,
}

impl Remote {
    /// Its link, `None` while it is down.
    pub(super) fn link(&self) -> Option<Arc<Link>> {
        self.link.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Why it is down (restarting), if it is.
    pub(super) fn down(&self) -> Option<String> {
        self.down.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Its last reported metrics, their progress aged by the time since the report (a
    /// replica that is down reports nothing running).
    pub(super) fn last_report(&self) -> MetricsSnapshot {
        let Some(link) = self.link() else {
            return MetricsSnapshot::default();
        };
        let (snapshot, at) = link
            .metrics
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        MetricsSnapshot {
            progress: snapshot.progress.clone().aged(at.elapsed()),
            ..snapshot
        }
    }

    /// Seconds it has been down, if it is.
    pub(super) fn down_secs(&self) -> Option<f64> {
        self.down_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map(|t| t.elapsed().as_secs_f64())
    }
}

/// Links to replica `replica` (driver rank `driver`) at `address`, published by its
/// start `incarnation`. Must run inside the HTTP runtime.
///
/// Errors: it cannot be reached or does not prove its host's key.
pub(super) async fn connect(
    replica: usize,
    driver: u64,
    (incarnation, address): (usize, String),
    links: &Arc<Links>,
) -> Result<Arc<Remote>> {
    let remote = Arc::new(Remote {
        replica,
        driver,
        link: Mutex::new(None),
        down: Mutex::new(None),
        incarnation: AtomicUsize::new(incarnation),
        down_since: Mutex::new(None),
    });
    let link = open(&remote, &address, links).await?;
    *remote.link.lock().unwrap_or_else(|e| e.into_inner()) = Some(link);
    Ok(remote)
}

/// Reads replica driver `driver`'s published address (waiting up to `timeout`).
///
/// Errors: it published nothing in time, or a malformed value.
pub(crate) fn published(
    store: &mut crate::rendezvous::StoreClient,
    driver: u64,
    timeout: Duration,
) -> Result<(usize, String)> {
    let (incarnation, address) = parse_router_value(&store.get(&router_key(driver), timeout)?)?;
    Ok((incarnation, address.to_string()))
}

/// Connects to `remote`'s driver at `address` and starts the tasks that carry its frames.
///
/// Errors: it cannot be reached or does not prove its host's key.
async fn open(remote: &Arc<Remote>, address: &str, links: &Arc<Links>) -> Result<Arc<Link>> {
    let (replica, driver) = (remote.replica, remote.driver);
    let key = links
        .keys
        .pair_key_with_rank(driver)
        .with_context(|| format!("DP replica {replica}: no key for rank {driver}'s host"))?;
    let (address, source) = (address.to_string(), links.keys.own_address());
    let (stream, session) = tokio::task::spawn_blocking(move || -> Result<_> {
        let socket: std::net::SocketAddr = address
            .parse()
            .with_context(|| format!("DP replica {replica}: a malformed address `{address}`"))?;
        let (stream, session) = crate::handshake::connect(
            socket,
            source,
            &key,
            crate::handshake::Claim {
                channel: CHANNEL,
                client: 0,
                server: replica as u64,
            },
            crate::handshake::HELLO_TIMEOUT * 2,
        )
        .with_context(|| {
            format!("cannot reach DP replica {replica} at {address} and authenticate")
        })?;
        stream.set_nonblocking(true)?;
        Ok((stream, session))
    })
    .await??;
    let stream = TcpStream::from_std(stream)?;
    stream.set_nodelay(true)?;
    let (mut reader, mut writer) = stream.into_split();
    let (mut sealer, mut opener) = session.split();
    let (frames, mut outgoing) = unbounded_channel::<ToReplica>();
    tokio::spawn(async move {
        while let Some(frame) = outgoing.recv().await {
            if write_frame(&mut writer, &mut sealer, &frame).await.is_err() {
                break;
            }
        }
    });
    let link = Arc::new(Link {
        frames,
        pending: Arc::default(),
        metrics: Arc::new(Mutex::new((MetricsSnapshot::default(), Instant::now()))),
        waiters: Arc::default(),
    });
    let (reader_link, reader_remote, reader_links) =
        (Arc::clone(&link), Arc::clone(remote), Arc::clone(links));
    tokio::spawn(async move {
        let error = relay_events(&mut reader, &mut opener, &reader_link, replica).await;
        lost(&reader_remote, &reader_link, error, &reader_links);
    });
    Ok(link)
}

/// Passes the replica's frames on (events to their requests, metrics into the link) until
/// the link ends, and says why.
async fn relay_events(
    reader: &mut tokio::net::tcp::OwnedReadHalf,
    opener: &mut crate::handshake::Opener,
    link: &Link,
    replica: usize,
) -> String {
    loop {
        let (id, event) = match read_frame(reader, opener).await {
            Ok(FromReplica::Event { id, event }) => (id, event),
            Ok(FromReplica::Metrics(snapshot)) => {
                *link.metrics.lock().unwrap_or_else(|e| e.into_inner()) =
                    (snapshot, Instant::now());
                continue;
            }
            Ok(FromReplica::Stopped { reason }) => {
                return format!("DP replica {replica} stopped: {reason}");
            }
            Ok(FromReplica::MetricsNow { id, snapshot }) => {
                *link.metrics.lock().unwrap_or_else(|e| e.into_inner()) =
                    (snapshot.clone(), Instant::now());
                let waiter = link
                    .waiters
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&id);
                if let Some(waiter) = waiter {
                    let _ = waiter.send(snapshot);
                }
                continue;
            }
            Err(error) => {
                return format!("DP replica {replica} disconnected: {error:#}");
            }
        };
        let done = matches!(
            event,
            Event::Done { .. } | Event::Error(_) | Event::HandedOff { .. }
        );
        let mut pending = link.pending.lock().unwrap_or_else(|e| e.into_inner());
        let delivered = pending
            .get(&id)
            .is_some_and(|events| events.send(event).is_ok());
        if done || !delivered {
            pending.remove(&id);
        }
        if !delivered && !done {
            let _ = link.frames.send(ToReplica::Cancel { id });
        }
    }
}

/// `remote`'s `link` ended with `error`: every request on it gets the error; then the
/// server fails, or (with [`Rejoin`]) the replica is down until its next start links.
fn lost(remote: &Arc<Remote>, link: &Link, error: String, links: &Arc<Links>) {
    let restarting = links.rejoin.is_some();
    let told = if restarting {
        format!("{error}; the replica is restarting, retry the request")
    } else {
        error.clone()
    };
    for (_, events) in link
        .pending
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .drain()
    {
        let _ = events.send(Event::Error(told.clone()));
    }
    let Some(rejoin) = &links.rejoin else {
        let _ = links.fail.send(Some(error));
        return;
    };
    *remote.link.lock().unwrap_or_else(|e| e.into_inner()) = None;
    *remote.down.lock().unwrap_or_else(|e| e.into_inner()) = Some(error);
    *remote.down_since.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
    let (remote, links, rejoin) = (Arc::clone(remote), Arc::clone(links), rejoin.clone());
    tokio::spawn(async move { relink(&remote, &links, &rejoin).await });
}

/// Waits until `remote`'s replica publishes a newer start than the one lost, links to it,
/// and marks it up again. Keeps looking while the router lives: a start that cannot be
/// reached is followed by another.
async fn relink(remote: &Arc<Remote>, links: &Arc<Links>, rejoin: &Rejoin) {
    let mut store: Option<crate::rendezvous::StoreClient> = None;
    loop {
        let lost = remote.incarnation.load(Ordering::SeqCst);
        let (address, keys, driver) = (rejoin.store.clone(), links.keys.clone(), remote.driver);
        let looked = tokio::task::spawn_blocking(move || -> Result<_> {
            let mut client = match store {
                Some(client) => client,
                None => crate::rendezvous::StoreClient::connect(
                    &address,
                    &keys,
                    Some(0),
                    Duration::from_secs(5),
                )?,
            };
            let published = published(&mut client, driver, Duration::from_millis(100));
            Ok((client, published))
        })
        .await;
        let next = match looked {
            Ok(Ok((client, published))) => {
                store = Some(client);
                published
                    .ok()
                    .filter(|(incarnation, _)| *incarnation > lost)
            }
            _ => {
                store = None;
                None
            }
        };
        let Some((incarnation, address)) = next else {
            tokio::time::sleep(REJOIN_POLL).await;
            continue;
        };
        remote.incarnation.store(incarnation, Ordering::SeqCst);
        match open(remote, &address, links).await {
            Ok(link) => {
                *remote.link.lock().unwrap_or_else(|e| e.into_inner()) = Some(link);
                *remote.down.lock().unwrap_or_else(|e| e.into_inner()) = None;
                *remote.down_since.lock().unwrap_or_else(|e| e.into_inner()) = None;
                return;
            }
            // That start is gone already: wait for the next.
            Err(_) => tokio::time::sleep(REJOIN_POLL).await,
        }
    }
}

/// The first start of every remote replica, as rank 0 reads them from the store:
/// (incarnation, address, driver rank) of replicas 1…`dp − 1`.
///
/// Errors: a replica that publishes nothing within `timeout`, a malformed value.
pub(crate) fn first_starts(
    store: &mut crate::rendezvous::StoreClient,
    dp: u64,
    replica_size: u64,
    timeout: Duration,
) -> Result<Vec<((usize, String), u64)>> {
    (1..dp)
        .map(|r| {
            let driver = r * replica_size;
            Ok((published(store, driver, timeout)?, driver))
        })
        .collect()
}

/// Checks that `remote`'s link is up before a submit.
///
/// Errors: the replica is down, with why.
pub(super) fn up(remote: &Remote) -> Result<Arc<Link>, String> {
    match (remote.link(), remote.down()) {
        (Some(link), None) => Ok(link),
        (_, Some(why)) => Err(format!(
            "DP replica {} is restarting ({why}); retry the request",
            remote.replica
        )),
        (None, None) => Err(format!("DP replica {} is not linked", remote.replica)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_published_address_carries_its_start() {
        let address: std::net::SocketAddr = "10.0.0.2:41000".parse().expect("address");
        let value = router_value(3, address);
        assert_eq!(value, "3 10.0.0.2:41000");
        assert_eq!(
            parse_router_value(value.as_bytes()).expect("parsed"),
            (3, address)
        );
        assert!(parse_router_value(b"10.0.0.2:41000").is_err());
        assert!(parse_router_value(b"x 10.0.0.2:41000").is_err());
    }

    #[test]
    fn a_down_replica_refuses_submits_with_why() {
        let remote = Remote {
            replica: 2,
            driver: 4,
            link: Mutex::new(None),
            down: Mutex::new(Some("DP replica 2 disconnected".into())),
            incarnation: AtomicUsize::new(0),
            down_since: Mutex::new(Some(Instant::now())),
        };
        let error = up(&remote).err().expect("down");
        assert!(error.starts_with("DP replica 2 is restarting (DP replica 2 disconnected)"));
        assert_eq!(remote.last_report().running, 0);
        assert!(remote.down_secs().is_some());
    }
}
