//! What each rank's collectives wait for, for the stall diagnosis: every blocking call of a
//! group records its wait ([`waiting`]: group, operation, the peer it waits on, bytes
//! expected, since when) for as long as it blocks; a reporter thread publishes the waits
//! older than [`REPORT_AFTER`] to the rendezvous store under `wait/<rank>`
//! ([`start_reporter`]), over its own connection, not the stalled link; and rank 0 reads
//! every rank's ([`read_waits`]) to say which rank waits on which (NCCL's RAS client does
//! the same for NCCL's collectives).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use serde::{Deserialize, Serialize};

use crate::rendezvous::StoreClient;

/// A wait is published once it has lasted this long (shorter ones are a step's normal
/// synchronisation).
pub(crate) const REPORT_AFTER: Duration = Duration::from_secs(1);

/// How often the reporter looks at this rank's wait.
const REPORT_INTERVAL: Duration = Duration::from_millis(500);

/// One blocking collective call of this process.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wait {
    /// The group, as the ranks named it when they connected (`dp0/tp0`, …).
    pub group: String,
    /// `all-reduce`, `broadcast`, `recv`, …
    pub operation: String,
    /// What the call does with the peer: `receiving from`, `sending to`, `waiting for`.
    pub verb: String,
    /// The global rank it waits on.
    pub peer_rank: u64,
    /// Bytes the call expects from the peer, when it knows.
    pub bytes_expected: Option<u64>,
    /// When the wait began, milliseconds since the Unix epoch (comparable across hosts
    /// within their clock offset).
    pub since_unix_ms: u64,
}

impl Wait {
    /// Whether `other` is the same wait (its start read from the clocks again may differ
    /// by a millisecond or two).
    fn same_as(&self, other: &Wait) -> bool {
        Wait {
            since_unix_ms: other.since_unix_ms,
            ..self.clone()
        } == *other
            && self.since_unix_ms.abs_diff(other.since_unix_ms) < 100
    }

    /// Seconds since the wait began, by this host's clock.
    pub fn seconds(&self) -> f64 {
        unix_ms().saturating_sub(self.since_unix_ms) as f64 / 1e3
    }
}

/// A wait as its call records it: nothing allocated (the group is shared with its
/// communicator, the names are static), one clock read.
struct Record {
    group: Arc<str>,
    operation: &'static str,
    verb: &'static str,
    peer_rank: u64,
    bytes_expected: Option<u64>,
    began: Instant,
}

impl Record {
    /// The published form, its start on the Unix clock.
    fn wait(&self) -> Wait {
        Wait {
            group: self.group.to_string(),
            operation: self.operation.to_string(),
            verb: self.verb.to_string(),
            peer_rank: self.peer_rank,
            bytes_expected: self.bytes_expected,
            since_unix_ms: unix_ms().saturating_sub(self.began.elapsed().as_millis() as u64),
        }
    }
}

/// The waits under way in this process, by thread (a rank's collectives run on its step
/// thread; a test process runs several at once).
static CURRENT: Mutex<Option<HashMap<ThreadId, Record>>> = Mutex::new(None);

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Clears the wait it recorded when dropped (the call returned, or failed).
pub struct WaitGuard(());

impl Drop for WaitGuard {
    fn drop(&mut self) {
        let mut current = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(waits) = current.as_mut() {
            waits.remove(&std::thread::current().id());
        }
    }
}

/// Records that this process now blocks in `operation` of `group`, `verb` global rank
/// `peer_rank`, until the guard is dropped.
pub fn waiting(
    group: Arc<str>,
    operation: &'static str,
    verb: &'static str,
    peer_rank: u64,
    bytes_expected: Option<u64>,
) -> WaitGuard {
    let record = Record {
        group,
        operation,
        verb,
        peer_rank,
        bytes_expected,
        began: Instant::now(),
    };
    CURRENT
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(std::thread::current().id(), record);
    WaitGuard(())
}

/// This process's longest wait, if it has lasted at least `at_least`.
pub fn current(at_least: Duration) -> Option<Wait> {
    let current = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
    current
        .as_ref()?
        .values()
        .filter(|record| record.began.elapsed() >= at_least)
        .min_by_key(|record| record.began)
        .map(Record::wait)
}

/// The calling thread's wait (tests).
#[cfg(test)]
fn of_this_thread() -> Option<Wait> {
    let current = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
    current
        .as_ref()?
        .get(&std::thread::current().id())
        .map(Record::wait)
}

/// The store key of `rank`'s wait.
fn key(rank: u64) -> String {
    crate::rendezvous::rank_key(rank, "wait")
}

/// Stops the reporter thread when dropped.
pub struct ReporterGuard(Arc<AtomicBool>);

impl Drop for ReporterGuard {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Starts the thread that publishes this rank's wait under `rank/<rank>/wait` whenever it
/// changes (an empty value: no wait longer than [`REPORT_AFTER`]), on its own connection
/// to the store at `address`.
///
/// Errors: the store cannot be reached or refuses `keys`.
pub fn start_reporter(
    address: &str,
    keys: &crate::keyring::Keyring,
    rank: u64,
    timeout: Duration,
) -> Result<ReporterGuard> {
    let mut store = StoreClient::connect(address, keys, Some(rank), timeout)?;
    store.set(&key(rank), b"")?;
    let stop = Arc::new(AtomicBool::new(false));
    let thread_stop = Arc::clone(&stop);
    std::thread::Builder::new()
        .name("wait-reporter".into())
        .spawn(move || {
            let mut published: Option<Wait> = None;
            while !thread_stop.load(Ordering::SeqCst) {
                let now = current(REPORT_AFTER);
                let unchanged = match (&now, &published) {
                    (Some(now), Some(published)) => now.same_as(published),
                    (None, None) => true,
                    _ => false,
                };
                if !unchanged {
                    let value = match &now {
                        Some(wait) => serde_json::to_vec(wait).unwrap_or_default(),
                        None => Vec::new(),
                    };
                    if store.set(&key(rank), &value).is_err() {
                        break;
                    }
                    published = now;
                }
                std::thread::sleep(REPORT_INTERVAL);
            }
        })?;
    Ok(ReporterGuard(stop))
}

/// What one rank reported.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum RankWait {
    /// It waits in a collective.
    Waiting(Wait),
    /// It is in no collective call (computing, idle, or stuck outside the collectives).
    NotWaiting,
    /// It never reported (not started yet, or its reporter is gone).
    Unknown,
}

/// Every rank of `ranks`' reported wait, read from `store` without waiting.
///
/// Errors: the store is lost.
pub fn read_waits(
    store: &mut StoreClient,
    ranks: std::ops::Range<u64>,
) -> Result<Vec<(u64, RankWait)>> {
    let mut waits = Vec::new();
    for rank in ranks {
        let wait = match store.get(&key(rank), Duration::ZERO) {
            Ok(value) if value.is_empty() => RankWait::NotWaiting,
            Ok(value) => {
                serde_json::from_slice(&value).map_or(RankWait::Unknown, RankWait::Waiting)
            }
            Err(error) if error.to_string().contains("lost the rendezvous store") => {
                return Err(error);
            }
            Err(_) => RankWait::Unknown,
        };
        waits.push((rank, wait));
    }
    Ok(waits)
}

/// One line naming who waits on whom among `waits` (one replica's ranks): each waiting
/// rank's wait, the ranks in no collective, and, when every waiting rank waits on ranks that
/// are themselves in none, those ranks as the ones holding the others up. E.g. `rank 0
/// waits on rank 2 (all-reduce in group `dp0/tp0`, receiving from, 4.1 s); rank 2 is in no
/// collective: rank 2 holds the others up (computing, or stuck outside the collectives)`.
pub fn diagnose(waits: &[(u64, RankWait)]) -> String {
    let mut parts = Vec::new();
    for (rank, wait) in waits {
        parts.push(match wait {
            RankWait::Waiting(w) => format!(
                "rank {rank} waits on rank {} ({} in group `{}`, {}{}, {:.1} s)",
                w.peer_rank,
                w.operation,
                w.group,
                w.verb,
                w.bytes_expected
                    .map(|b| format!(" {b} bytes"))
                    .unwrap_or_default(),
                w.seconds()
            ),
            RankWait::NotWaiting => format!("rank {rank} is in no collective"),
            RankWait::Unknown => format!("rank {rank} has not reported"),
        });
    }
    let waited_on: Vec<u64> = waits
        .iter()
        .filter_map(|(_, w)| match w {
            RankWait::Waiting(w) => Some(w.peer_rank),
            _ => None,
        })
        .collect();
    let culprits: Vec<u64> = waits
        .iter()
        .filter(|(rank, w)| matches!(w, RankWait::NotWaiting) && waited_on.contains(rank))
        .map(|(rank, _)| *rank)
        .collect();
    let mut line = parts.join("; ");
    if !culprits.is_empty() {
        let names: Vec<String> = culprits.iter().map(|r| format!("rank {r}")).collect();
        line.push_str(&format!(
            ": {} holds the others up (computing, or stuck outside the collectives)",
            names.join(", ")
        ));
    } else if waits.iter().all(|(_, w)| matches!(w, RankWait::Waiting(_))) && !waits.is_empty() {
        line.push_str(": every rank waits on another (a lost or black-holed link between them)");
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait(peer_rank: u64) -> RankWait {
        RankWait::Waiting(Wait {
            group: "dp0/tp0".into(),
            operation: "all-reduce".into(),
            verb: "receiving from".into(),
            peer_rank,
            bytes_expected: Some(4608),
            since_unix_ms: unix_ms() - 4000,
        })
    }

    #[test]
    fn a_rank_in_no_collective_that_others_wait_on_is_named_as_the_holdup() {
        let line = diagnose(&[(0, wait(2)), (1, wait(2)), (2, RankWait::NotWaiting)]);
        assert!(
            line.starts_with(
                "rank 0 waits on rank 2 (all-reduce in group `dp0/tp0`, receiving from 4608 bytes, 4."
            ),
            "{line}"
        );
        assert!(line.ends_with("rank 2 is in no collective: rank 2 holds the others up (computing, or stuck outside the collectives)"), "{line}");
    }

    #[test]
    fn ranks_waiting_on_each_other_point_at_a_link() {
        let line = diagnose(&[(0, wait(1)), (1, wait(0))]);
        assert!(
            line.ends_with("(a lost or black-holed link between them)"),
            "{line}"
        );
        let line = diagnose(&[(0, wait(1)), (1, RankWait::Unknown)]);
        assert!(line.ends_with("rank 1 has not reported"), "{line}");
    }

    #[test]
    fn a_wait_is_current_while_its_guard_lives() {
        let guard = waiting("g".into(), "recv", "receiving from", 3, None);
        assert_eq!(of_this_thread().map(|w| w.peer_rank), Some(3));
        assert_eq!(current(Duration::from_secs(3600)), None);
        drop(guard);
        assert_eq!(of_this_thread(), None);
    }
}
