//! The runtime's pieces in this process, for the library-level tests: the CUDA kernels built
//! for the host (the harness standing in for a GPU) and collective groups of threads joined
//! through a real rendezvous store.

use std::sync::OnceLock;
use std::time::Duration;

use infer_runtime::rendezvous::{StoreClient, StoreServer, random_token};
use infer_runtime::runtime::collectives::shm::ShmComm;
use infer_runtime::runtime::collectives::{Comm, TcpComm};

/// The kernels built for the host once per test process.
pub fn host() -> &'static infer_runtime::runtime::cuda::host::HostKernels {
    static HOST: OnceLock<(
        tempfile::TempDir,
        infer_runtime::runtime::cuda::host::HostKernels,
    )> = OnceLock::new();
    &HOST
        .get_or_init(|| {
            let dir = tempfile::tempdir().expect("tempdir");
            let kernels = infer_runtime::runtime::cuda::host::HostKernels::build(
                dir.path(),
                &std::env::var("CXX").unwrap_or_else(|_| "c++".into()),
            )
            .unwrap_or_else(|e| panic!("{e:#}"));
            (dir, kernels)
        })
        .1
}

/// Which all-reduce a test group uses.
#[derive(Clone, Copy, Debug)]
pub enum Transport {
    /// The TCP ring.
    Tcp,
    /// The shared-memory all-reduce (checked to be the one chosen).
    Shm,
}

/// Runs `body(comm)` on `n` threads that join one group (through a real store on a free
/// port) over `transport`; returns each thread's result, in rank order.
pub fn with_group<T: Send>(
    n: usize,
    transport: Transport,
    body: impl Fn(&mut dyn Comm) -> T + Sync,
) -> Vec<T> {
    // Every member on one host (host 0); the store holds the run's keys.
    let run = infer_runtime::keyring::Keyring::master(
        &random_token(),
        infer_runtime::keyring::LAUNCHER_HOST,
        vec![0; n],
    );
    let server = StoreServer::start("127.0.0.1:0", &run).expect("store");
    let token = run.on_host(0);
    let address = server.address().to_string();
    let members: Vec<u64> = (0..n as u64).collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n as u64)
            .map(|rank| {
                let (address, token, members, body) =
                    (address.clone(), token.clone(), members.clone(), &body);
                scope.spawn(move || {
                    let mut store =
                        StoreClient::connect(&address, &token, Some(rank), Duration::from_secs(10))
                            .expect("store");
                    let mut comm = TcpComm::connect(
                        &mut store,
                        "test",
                        &members,
                        rank,
                        "127.0.0.1",
                        Duration::from_secs(10),
                    )
                    .expect("group");
                    match transport {
                        Transport::Tcp => body(&mut comm),
                        Transport::Shm => {
                            let mut comm = ShmComm::new(comm).expect("set-up");
                            if n > 1 {
                                // Make sure the transport is the one tested.
                                assert!(
                                    comm.transport().starts_with("shared memory"),
                                    "{}",
                                    comm.transport()
                                );
                            }
                            body(&mut comm)
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}
