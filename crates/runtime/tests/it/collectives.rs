//! Collectives against serial references, over real sockets (and a real shared-memory
//! segment) between threads that each join the group through a real rendezvous store: group
//! sizes 1–6, lengths that do not divide evenly, and a peer that disappears. Every test runs
//! over both transports: TCP, and the shared-memory segment (all-reduce, send/recv and
//! broadcast through it).

use std::time::Duration;

use crate::support::runtime::{Transport, with_group};

const TRANSPORTS: [Transport; 2] = [Transport::Tcp, Transport::Shm];

/// Integer-valued data so sums are exact whatever the order.
fn data(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((rank * 7919 + i * 31) % 1001) as f32 - 500.0)
        .collect()
}

#[test]
fn all_reduce_matches_the_serial_sum_for_sizes_1_to_6() {
    for transport in TRANSPORTS {
        for n in 1..=6 {
            // 600 001 floats span three 1 MiB shared-memory pieces (both buffers, reused).
            for len in [0, 1, 5, 7, 1000, 65_539, 600_001] {
                let per_rank: Vec<Vec<f32>> = (0..n).map(|r| data(r, len)).collect();
                let expected: Vec<f32> = (0..len)
                    .map(|i| per_rank.iter().map(|d| d[i]).sum())
                    .collect();
                let results = with_group(n, transport, |comm| {
                    let mut values = data(comm.rank(), len);
                    comm.all_reduce_sum(&mut values).expect("all-reduce");
                    // A second call on the same group reuses the segment's slots.
                    let mut again = data(comm.rank(), len);
                    comm.all_reduce_sum(&mut again).expect("all-reduce");
                    assert_eq!(values, again);
                    values
                });
                for (rank, values) in results.iter().enumerate() {
                    assert!(
                        values == &expected,
                        "{transport:?} n={n} len={len} rank={rank}"
                    );
                }
            }
        }
    }
}

#[test]
fn all_reduce_gives_bitwise_identical_results_on_every_rank() {
    // Non-integer values: the sum order matters, but every rank must end with the same bits.
    for transport in TRANSPORTS {
        let results = with_group(5, transport, |comm| {
            let mut values: Vec<f32> = (0..300_007)
                .map(|i| ((i * (comm.rank() + 3)) as f32).sin() / 3.0)
                .collect();
            comm.all_reduce_sum(&mut values).expect("all-reduce");
            values.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        });
        assert!(results.windows(2).all(|w| w[0] == w[1]), "{transport:?}");
    }
}

#[test]
fn the_shared_segment_is_unlinked_once_every_member_has_mapped_it() {
    let prefix = format!("infer-shm-{}-", std::process::id());
    let leftovers = || -> Vec<String> {
        std::fs::read_dir("/dev/shm")
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|name| name.starts_with(&prefix))
                    .collect()
            })
            .unwrap_or_default()
    };
    let sums = with_group(3, Transport::Shm, |comm| {
        // Still mapped and working after the file is gone.
        let mut values = vec![comm.rank() as f32; 10];
        comm.all_reduce_sum(&mut values).expect("all-reduce");
        values[0]
    });
    assert_eq!(sums, vec![3.0; 3]);
    // Other tests of this process may be between creating and unlinking their own file;
    // ours was unlinked before the group returned, so at most theirs remain, and briefly.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !leftovers().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(leftovers(), Vec::<String>::new());
}

#[test]
fn all_gather_broadcast_send_recv_all_to_all_and_barrier() {
    for (transport, n) in TRANSPORTS
        .into_iter()
        .flat_map(|t| (1..=6).map(move |n| (t, n)))
    {
        let results = with_group(n, transport, |comm| {
            let (rank, size) = (comm.rank(), comm.size());
            let mine = data(rank, 3);
            let mut gathered = vec![0f32; 3 * size];
            comm.all_gather(&mine, &mut gathered).expect("all-gather");
            let mut message = if rank == size - 1 {
                format!("step from {rank}").into_bytes()
            } else {
                Vec::new()
            };
            comm.broadcast(&mut message, size - 1).expect("broadcast");
            // Uneven all-to-all: rank r sends r + j + 1 values to member j.
            let outgoing: Vec<Vec<f32>> = (0..size)
                .map(|j| vec![(rank * 10 + j) as f32; rank + j + 1])
                .collect();
            let incoming = comm.all_to_all_v(&outgoing).expect("all-to-all");
            // A pipeline: each rank passes a token to the next.
            let mut token = Vec::new();
            if size > 1 {
                if rank > 0 {
                    token = comm.recv(rank - 1).expect("recv");
                }
                if rank + 1 < size {
                    let mut next = token.clone();
                    next.push(rank as u8);
                    comm.send(rank + 1, &next).expect("send");
                }
            }
            comm.barrier().expect("barrier");
            (gathered, message, incoming, token)
        });
        let expected_gather: Vec<f32> = (0..n).flat_map(|r| data(r, 3)).collect();
        for (rank, (gathered, message, incoming, token)) in results.iter().enumerate() {
            assert_eq!(gathered, &expected_gather, "n={n} rank={rank}");
            assert_eq!(message, format!("step from {}", n - 1).as_bytes());
            for (sender, values) in incoming.iter().enumerate() {
                assert_eq!(
                    values,
                    &vec![(sender * 10 + rank) as f32; sender + rank + 1],
                    "n={n} {sender}→{rank}"
                );
            }
            assert_eq!(token, &(0..rank as u8).collect::<Vec<u8>>());
        }
    }
}

/// Rank 1 returns at once and drops its sockets (and, over shared memory, stops taking
/// part); the others fail naming it and the group, well before the 10 s timeout: in an
/// all-reduce, or waiting for its message (rank 0) and sending it more than a ring and a
/// socket buffer hold (rank 2).
#[test]
fn a_vanished_peer_is_named_in_the_error() {
    for (transport, case) in TRANSPORTS
        .into_iter()
        .flat_map(|t| ["all-reduce", "send/recv"].map(move |c| (t, c)))
    {
        let started = std::time::Instant::now();
        let results = with_group(3, transport, |comm| {
            if comm.rank() == 1 {
                return None;
            }
            let outcome = match case {
                "all-reduce" => {
                    std::thread::sleep(Duration::from_millis(100));
                    comm.all_reduce_sum(&mut [1f32; 10])
                }
                _ if comm.rank() == 0 => comm.recv(1).map(drop),
                _ => comm.send(1, &message(2, 64 << 20)),
            };
            Some(outcome.map_err(|e| format!("{e:#}")))
        });
        for result in results.into_iter().flatten() {
            let error = result.expect_err("the group lost a member");
            assert!(
                error.contains("group `test`") && error.contains("rank 1"),
                "{transport:?} {case}: {error}"
            );
            if matches!(transport, Transport::Shm) {
                assert!(error.contains("(shared memory)"), "{case}: {error}");
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{transport:?} {case}: {:?}",
            started.elapsed()
        );
    }
}

/// The bytes member `from` sends as its message of `len` bytes.
fn message(from: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + from * 7 + len) as u8).collect()
}

/// Lengths around and beyond a shared-memory ring (1 MiB for up to 4 members, 512 KiB for
/// 5): empty, odd, one short of a ring, and three rings and a bit.
const LENGTHS: [usize; 5] = [0, 1, 7, (1 << 20) - 3, (3 << 20) + 5];

#[test]
fn messages_larger_than_a_ring_pass_whole_and_in_order() {
    for (transport, n) in TRANSPORTS
        .into_iter()
        .flat_map(|t| [2usize, 3, 5].map(move |n| (t, n)))
    {
        let results = with_group(n, transport, |comm| {
            let (rank, size) = (comm.rank(), comm.size());
            // Down the chain with `recv`: each member passes every message on, so a message
            // is read while the next member's ring is still being filled.
            let mut forward = Vec::new();
            for len in LENGTHS {
                let bytes = if rank == 0 {
                    message(0, len)
                } else {
                    comm.recv(rank - 1).expect("recv")
                };
                if rank + 1 < size {
                    comm.send(rank + 1, &bytes).expect("send");
                }
                forward.push(bytes);
            }
            // Back up it with `recv_into`, each member sending its own.
            let mut backward = Vec::new();
            for len in LENGTHS {
                if rank + 1 < size {
                    let mut bytes = vec![0u8; len];
                    comm.recv_into(rank + 1, &mut bytes).expect("recv_into");
                    backward.push(bytes);
                }
                if rank > 0 {
                    comm.send(rank - 1, &message(rank, len)).expect("send");
                }
            }
            let mut broadcast = if rank == 1 {
                message(1, LENGTHS[4])
            } else {
                Vec::new()
            };
            comm.broadcast(&mut broadcast, 1).expect("broadcast");
            (forward, backward, broadcast)
        });
        for (rank, (forward, backward, broadcast)) in results.iter().enumerate() {
            for (i, len) in LENGTHS.into_iter().enumerate() {
                assert!(
                    forward[i] == message(0, len),
                    "{transport:?} n={n} rank {rank} forward {len}"
                );
                if rank + 1 < n {
                    assert!(
                        backward[i] == message(rank + 1, len),
                        "{transport:?} n={n} rank {rank} backward {len}"
                    );
                }
            }
            assert!(
                *broadcast == message(1, LENGTHS[4]),
                "{transport:?} n={n} rank {rank}"
            );
        }
    }
}

/// A stranger on a member's port while the group forms (as a local user sees the port in
/// `/proc/net/tcp`): garbage, an idle connection and a connection with another run's secret
/// come first, and none takes a slot or holds the members up; the one with the wrong secret
/// is refused in its handshake. The members then form the group and sum correctly.
#[test]
fn strangers_on_a_members_port_take_no_slot_and_hold_nobody_up() {
    use infer_runtime::rendezvous::{StoreClient, StoreServer, random_token};
    use infer_runtime::runtime::collectives::{Comm, TcpComm};
    use std::io::Write;
    // Three ranks on one host: the launcher holds the run's keys, ranks their host's.
    let run = infer_runtime::keyring::Keyring::master(
        &random_token(),
        infer_runtime::keyring::LAUNCHER_HOST,
        vec![0, 0, 0],
    );
    let token = run.on_host(0);
    let server = StoreServer::start("127.0.0.1:0", &run).expect("store");
    let address = server.address().to_string();
    let members: Vec<u64> = vec![0, 1, 2];
    let (go, gate) = std::sync::mpsc::channel::<()>();
    let gate = std::sync::Mutex::new(gate);
    let started = std::time::Instant::now();
    let sums = std::thread::scope(|scope| {
        let racer = scope.spawn(|| {
            let mut store =
                StoreClient::connect(&address, &run, None, Duration::from_secs(10)).expect("store");
            let port = String::from_utf8(
                store
                    .get("rank/2/comm/test", Duration::from_secs(10))
                    .expect("rank 2 listens"),
            )
            .expect("address");
            let mut garbage = std::net::TcpStream::connect(&port).expect("connect");
            garbage.write_all(&[0xff; 16]).expect("garbage");
            let idle = std::net::TcpStream::connect(&port).expect("connect");
            let mut impostor = std::net::TcpStream::connect(&port).expect("connect");
            let another_run = infer_runtime::keyring::Keyring::master(
                "another run's secret",
                infer_runtime::keyring::LAUNCHER_HOST,
                vec![0, 0, 0],
            );
            let refused = infer_runtime::handshake::client(
                &mut impostor,
                &another_run.on_host(0).pair_key(0).expect("key"),
                infer_runtime::handshake::Claim {
                    channel: "comm/test",
                    client: 0,
                    server: 2,
                },
            );
            assert!(refused.is_err(), "a wrong secret is refused");
            for _ in 0..2 {
                go.send(()).expect("go");
            }
            (garbage, idle)
        });
        let handles: Vec<_> = members
            .iter()
            .map(|&rank| {
                let (address, token, members, gate) = (&address, &token, &members, &gate);
                scope.spawn(move || {
                    if rank < 2 {
                        // Ranks 0 and 1 connect only after the strangers.
                        gate.lock().expect("gate").recv().expect("go");
                    }
                    let mut store =
                        StoreClient::connect(address, token, Some(rank), Duration::from_secs(10))
                            .expect("store");
                    let mut comm = TcpComm::connect(
                        &mut store,
                        "test",
                        members,
                        rank,
                        "127.0.0.1",
                        Duration::from_secs(10),
                    )
                    .expect("the members form the group");
                    let mut values = data(rank as usize, 100);
                    comm.all_reduce_sum(&mut values).expect("all-reduce");
                    values
                })
            })
            .collect();
        let sums: Vec<Vec<f32>> = handles
            .into_iter()
            .map(|h| h.join().expect("rank"))
            .collect();
        drop(racer.join().expect("racer"));
        sums
    });
    let expected: Vec<f32> = (0..100)
        .map(|i| (0..3).map(|rank| data(rank, 100)[i]).sum())
        .collect();
    for sum in sums {
        assert_eq!(sum, expected);
    }
    assert!(
        started.elapsed() < infer_runtime::handshake::HELLO_TIMEOUT,
        "the idle stranger held the group up: {:?}",
        started.elapsed()
    );
}
