//! The one all-reduce bench: what `infer bench allreduce` measures, in its local worker
//! processes and in collectives-only ranks ([`crate::runtime::exec::worker`]'s
//! `Job::AllReduce`) alike. It sweeps sizes as nccl-tests' `all_reduce_perf` does
//! ([`time_all_reduce`]), times one message's latency as nccl-tests' `sendrecv_perf` does at
//! its smallest size ([`time_message`]), and one plain TCP stream as the baseline; the
//! reports live with the callers.

use std::time::Duration;

use anyhow::Result;
use serde::{Deserialize, Serialize};

use super::shm::ShmComm;
use super::{AllreduceRow, Comm, TcpComm, tcp_stream_bytes_per_sec, time_all_reduce};
use crate::keyring::Keyring;
use crate::rendezvous::StoreClient;

/// What one all-reduce bench measured; rank 0's result.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AllreduceBench {
    /// The sweep over the group's TCP ring alone, measured first when
    /// [`AllreduceSweep::tcp_first`] asks for it; empty otherwise.
    #[serde(default)]
    pub tcp_rows: Vec<AllreduceRow>,
    /// The sweep over the group's own transport. Empty when the TCP ring was swept first
    /// and the group has no other transport (`transport` says why).
    pub rows: Vec<AllreduceRow>,
    /// What carried `rows` (`ShmComm::transport`).
    pub transport: String,
    /// One 8-byte message between the first two members over the TCP connections alone,
    /// seconds (half a ping-pong round trip); measured with `tcp_rows`.
    #[serde(default)]
    pub tcp_message_secs: Option<f64>,
    /// The same over the group's own transport (`rows`'); `None` when `rows` is empty.
    #[serde(default)]
    pub message_secs: Option<f64>,
    /// One plain TCP stream, rank [`AllreduceSweep::stream_from`] → rank 0, bytes/s.
    pub stream_bytes_per_sec: f64,
}

/// How an all-reduce bench runs; the same on every member.
#[derive(Clone, Debug)]
pub struct AllreduceSweep<'a> {
    /// Largest message, bytes (sizes double from 8 B).
    pub max_bytes: usize,
    /// Whether to sweep the group's TCP ring alone first (the local bench's first table).
    pub tcp_first: bool,
    /// The rank whose plain TCP stream to rank 0 is timed (≥ 1).
    pub stream_from: u64,
    /// Where rank 0 listens for that stream.
    pub bind_addr: &'a str,
    /// Timeout of the stream's store waits.
    pub timeout: Duration,
}

/// Runs the bench over `group`: with `tcp_first`, the sweep over its TCP ring and one
/// message's latency over TCP; the same over its own transport (skipped when `tcp_first`
/// found no transport but TCP); one plain TCP stream; a barrier. Every
/// member of `group` (global rank `rank`, its store client `store`) must call it with the
/// same `sweep`; it blocks until all are done. Rank 0 returns the result, the others
/// `None`.
///
/// Errors: a collective, the stream or the store failing.
pub fn bench_all_reduce(
    group: &mut ShmComm,
    store: &mut StoreClient,
    rank: u64,
    sweep: &AllreduceSweep,
) -> Result<Option<AllreduceBench>> {
    let (tcp_rows, tcp_message_secs) = if sweep.tcp_first {
        let rows = time_all_reduce(group.tcp_mut(), sweep.max_bytes)?;
        (rows, time_message(group.tcp_mut())?)
    } else {
        (Vec::new(), None)
    };
    let (rows, message_secs) = if sweep.tcp_first && !group.uses_shared_memory() {
        (Vec::new(), None)
    } else {
        let rows = time_all_reduce(group, sweep.max_bytes)?;
        (rows, time_message(group)?)
    };
    let transport = group.transport();
    let stream_bytes_per_sec = tcp_stream_bytes_per_sec(
        store,
        rank,
        sweep.stream_from,
        sweep.bind_addr,
        sweep.timeout,
    )?;
    group.barrier()?;
    Ok((rank == 0).then_some(AllreduceBench {
        tcp_rows,
        rows,
        transport,
        tcp_message_secs,
        message_secs,
        stream_bytes_per_sec,
    }))
}

/// The latency of one 8-byte message between the group's first two members, seconds:
/// half the median round trip of a ping-pong (200 round trips after 20 to warm up), while
/// the other members wait in a barrier, as a TP chain's other ranks wait for their turn.
/// Every member must call it; `None` in a group of one.
///
/// Errors: a send, receive or the barrier failing.
fn time_message(comm: &mut dyn Comm) -> Result<Option<f64>> {
    const WARM_UP: usize = 20;
    const ROUND_TRIPS: usize = 200;
    if comm.size() < 2 {
        return Ok(None);
    }
    comm.barrier()?;
    let mut round_trips = Vec::with_capacity(ROUND_TRIPS);
    let ping = [0u8; 8];
    match comm.rank() {
        0 => {
            for i in 0..WARM_UP + ROUND_TRIPS {
                let start = std::time::Instant::now();
                comm.send(1, &ping)?;
                comm.recv(1)?;
                if i >= WARM_UP {
                    round_trips.push(start.elapsed().as_secs_f64());
                }
            }
        }
        1 => {
            for _ in 0..WARM_UP + ROUND_TRIPS {
                let message = comm.recv(0)?;
                comm.send(0, &message)?;
            }
        }
        _ => {}
    }
    comm.barrier()?;
    round_trips.sort_by(f64::total_cmp);
    Ok(round_trips
        .get(round_trips.len() / 2)
        .map(|round_trip| round_trip / 2.0))
}

/// One process of the local all-reduce bench (`infer bench allreduce-worker`): joins the
/// others at the store on `store_address` with its host's `keys`, then runs
/// [`bench_all_reduce`] over loopback, the TCP ring first, then shared memory (unless
/// `shm_disable` or unavailable), then the stream rank 1 → rank 0. Rank 0 returns the
/// result; the others `None`.
///
/// Errors: the store or a peer cannot be reached within 60 s, a collective fails.
pub fn local_worker(
    store_address: &str,
    keys: &Keyring,
    rank: u64,
    world: usize,
    max_bytes: usize,
    shm_disable: bool,
) -> Result<Option<AllreduceBench>> {
    let timeout = Duration::from_secs(60);
    let mut store = StoreClient::connect(store_address, keys, Some(rank), timeout)?;
    let members: Vec<u64> = (0..world as u64).collect();
    let tcp = TcpComm::connect(&mut store, "bench", &members, rank, "127.0.0.1", timeout)?;
    let mut group = if shm_disable {
        ShmComm::tcp_only(tcp, &format!("{}=1", crate::envvars::SHM_DISABLE))
    } else {
        ShmComm::new(tcp)?
    };
    let sweep = AllreduceSweep {
        max_bytes,
        tcp_first: true,
        stream_from: 1,
        bind_addr: "127.0.0.1",
        timeout,
    };
    bench_all_reduce(&mut group, &mut store, rank, &sweep)
}
