//! The one all-reduce bench: what `infer bench allreduce` measures, in its local worker
//! processes and in collectives-only ranks ([`crate::runtime::exec::worker`]'s
//! `Job::AllReduce`) alike. It sweeps sizes as nccl-tests' `all_reduce_perf` does
//! ([`time_all_reduce`]) and times one plain TCP stream as the baseline; the reports live
//! with the callers.

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

/// Runs the bench over `group`: with `tcp_first`, the sweep over its TCP ring, then one
/// tiny all-reduce that decides its transport; the sweep over its own transport (skipped
/// when `tcp_first` found no transport but TCP); one plain TCP stream; a barrier. Every
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
    let tcp_rows = if sweep.tcp_first {
        let rows = time_all_reduce(group.tcp_mut(), sweep.max_bytes)?;
        // The first all-reduce decides the transport (a tiny one, collectively).
        group.all_reduce_sum(&mut [0f32])?;
        rows
    } else {
        Vec::new()
    };
    let rows = if sweep.tcp_first && !group.uses_shared_memory() {
        Vec::new()
    } else {
        time_all_reduce(group, sweep.max_bytes)?
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
        stream_bytes_per_sec,
    }))
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
