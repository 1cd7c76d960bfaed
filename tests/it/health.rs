//! Forward progress is health: `/health` turns 503 naming the stalled replica when a rank
//! stops making progress (the tests' injected fault, `INFER_TEST_FAULT`: the rank's process
//! and heartbeats stay alive, as with a wedged collective), `/ping` stays 200, the router
//! keeps serving from the replicas that still progress, and a saturated server is never
//! called stalled.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::cluster::TestCluster;
use crate::support::process::{alive, infer, postmortem, run_dir_of, signal};
use crate::support::server::{Server, metric};

/// `infer up --port 0 --threads 1 EXTRA` with `INFER_TEST_FAULT=fault`.
fn start_with_fault(fault: &str, extra: &[&str]) -> Server {
    let mut command = infer();
    command
        .env("INFER_TEST_FAULT", fault)
        .args(["up", "--port", "0", "--threads", "1"])
        .args(extra);
    Server::start_command(command)
}

/// `/health`'s status and JSON body.
fn health(server: &Server) -> (u16, Value) {
    let (status, body) = server.get("/health");
    let json = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    (status, json)
}

/// Polls `/health` every 100 ms until `done` accepts it; panics after `within`. Returns
/// the accepted answer and when it came.
fn health_until(
    server: &Server,
    within: Duration,
    done: impl Fn(u16, &Value) -> bool,
) -> (u16, Value, Instant) {
    let deadline = Instant::now() + within;
    loop {
        let (status, body) = health(server);
        if done(status, &body) {
            return (status, body, Instant::now());
        }
        assert!(
            Instant::now() < deadline,
            "/health never turned as expected within {within:?}: {status} {body}\n{}",
            server.stderr_so_far()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits up to 5 s for the 503's message to hold `conclusion` (the ranks report their waits
/// after `REPORT_AFTER`, 1 s), then asserts it holds every one of `expected`.
fn assert_diagnosis(server: &Server, conclusion: &str, expected: &[&str]) {
    let (_, body, _) = health_until(server, Duration::from_secs(5), |_, b| {
        b["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains(conclusion))
    });
    let message = body["error"]["message"].as_str().unwrap_or_default();
    for expected in expected {
        assert!(message.contains(expected), "{expected}: {body}");
    }
}

/// TP 3, rank 2 stalls at its third step: within `--stall-timeout` + 2 s of the request
/// that meets it `/health` is 503 naming replica 0 with the request running and which rank
/// waits on which (ranks 0 and 1 on rank 2, which is in no collective), `/debug/ranks`
/// shows the same, `/metrics` shows the stall, rank 0 logs it, and `/ping` (liveness) still
/// answers 200.
#[test]
fn a_stalled_rank_turns_health_503_naming_its_replica_while_ping_stays_200() {
    let server = start_with_fault(
        "stall:rank=2:step=3",
        &["--tp", "3", "--stall-timeout", "2"],
    );
    let (status, body) = health(&server);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "ok", "{body}");
    assert_eq!(body["replicas"][0]["status"], "ok", "{body}");

    let sent = Instant::now();
    // The request meets the stall; it ends when the server is stopped.
    let request = post_in_background(&server, json!({"prompt": "Hello", "max_tokens": 8}));
    let (status, body, at) = health_until(&server, Duration::from_secs(20), |s, _| s == 503);
    assert_eq!(status, 503);
    let waited = at - sent;
    assert!(
        waited <= Duration::from_secs(2 + 2),
        "503 came {waited:?} after the request, past --stall-timeout + 2 s: {body}"
    );
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("replica 0 stalled: no step completed for")
            && message.contains("1 request(s) running"),
        "{body}"
    );
    assert_eq!(body["health"]["status"], "unavailable", "{body}");
    assert_eq!(body["health"]["replicas"][0]["status"], "stalled", "{body}");
    // Once the ranks have reported their waits, the diagnosis names the stalled rank.
    assert_diagnosis(
        &server,
        "holds the others up",
        &[
            "rank 0 waits on rank 2 (",
            "rank 1 waits on rank 2 (",
            "rank 2 is in no collective: rank 2 holds the others up",
        ],
    );
    let (status, ranks) = server.get("/debug/ranks");
    assert_eq!(status, 200, "{ranks}");
    let ranks: Value = serde_json::from_str(&ranks).expect("JSON");
    let states: Vec<(&str, Option<u64>)> = ranks["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|r| {
            (
                r["state"].as_str().unwrap_or_default(),
                r["wait"]["peer_rank"].as_u64(),
            )
        })
        .collect();
    assert_eq!(
        states,
        [
            ("waiting", Some(2)),
            ("waiting", Some(2)),
            ("in_no_collective", None)
        ],
        "{ranks}"
    );

    let (status, text) = server.get("/ping");
    assert_eq!((status, text.as_str()), (200, "pong"));
    let metrics = server.metrics();
    assert_eq!(
        metric(&metrics, "infer_replica_stalled{replica=\"0\"}"),
        1.0
    );
    assert!(metric(&metrics, "infer_seconds_since_last_step{replica=\"0\"}") > 2.0);
    // Rank 0 logs the stall with its diagnosis (a `[rank 0]` line of `infer up`).
    let logged = |log: &str| {
        log.lines().any(|l| {
            l.contains("[rank 0] warning: replica 0 stalled")
                && l.contains("rank 2 holds the others up")
        })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !logged(&server.stderr_so_far()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = server.stderr_so_far();
    assert!(logged(&log), "{log}");
    // Stopping the server ends the request in flight.
    let run_dir = run_dir_of(&server.startup);
    drop(server);
    let _ = request.join();
    // The post-mortem names the stall first, with its diagnosis.
    let (code, report) = postmortem(&run_dir);
    assert_eq!(code, Some(1), "{report}");
    let cause = &report["findings"][0];
    assert_eq!(cause["check"], "run-outcome", "{report}");
    assert_eq!(cause["severity"], "error", "{report}");
    let message = cause["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("a replica stalled before the run was stopped: replica 0 stalled")
            && message.contains("rank 2 holds the others up"),
        "{report}"
    );
}

/// Posts `body` to `/v1/completions` on a thread of its own (a request that may never be
/// answered while the server runs).
fn post_in_background(server: &Server, body: Value) -> std::thread::JoinHandle<()> {
    let url = format!("{}/v1/completions", server.url);
    std::thread::spawn(move || {
        let _ = ureq::post(&url).send_json(body);
    })
}

/// DP 2, replica 1's only rank stalls at its third step: `/health` stays 200 but says
/// `degraded`, naming replica 1; the router sends it nothing more, and replica 0 answers
/// every later request.
#[test]
fn dp_2_with_one_stalled_replica_is_degraded_and_the_other_keeps_serving() {
    let server = start_with_fault(
        "stall:rank=1:step=3",
        &["--dp", "2", "--stall-timeout", "2"],
    );
    let body = json!({"prompt": "Hello", "max_tokens": 8, "temperature": 0});
    // Two at once: the first to replica 0, the second to the less loaded replica 1, where
    // it meets the stall.
    let stuck = [
        post_in_background(&server, body.clone()),
        post_in_background(&server, body.clone()),
    ];
    let (status, health, _) = health_until(&server, Duration::from_secs(20), |_, b| {
        b["status"] == "degraded" || b["health"]["status"].is_string()
    });
    assert_eq!(status, 200, "{health}");
    assert_eq!(health["replicas"][0]["status"], "ok", "{health}");
    assert_eq!(health["replicas"][1]["status"], "stalled", "{health}");
    assert!(
        health["replicas"][1]["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("replica 1 stalled")),
        "{health}"
    );
    let routed = |metrics: &str| metric(metrics, "infer_dp_requests_routed_total{replica=\"1\"}");
    let before = routed(&server.metrics());
    for _ in 0..3 {
        let (status, reply) = server.post("/v1/completions", &body);
        assert_eq!(status, 200, "{reply}");
    }
    let metrics = server.metrics();
    assert_eq!(routed(&metrics), before, "{metrics}");
    assert_eq!(
        metric(&metrics, "infer_replica_stalled{replica=\"1\"}"),
        1.0
    );
    assert_eq!(
        metric(&metrics, "infer_replica_stalled{replica=\"0\"}"),
        0.0
    );
    drop(server);
    for request in stuck {
        let _ = request.join();
    }
}

/// A saturated server is never stalled: idle past `--stall-timeout` first, then 16
/// streams decoding while a 2,000-token prompt prefills in chunks on this host's cores,
/// `/health` polled throughout answers 200 `ok`, and every request completes.
#[test]
fn sixteen_streams_and_a_long_prompt_in_chunks_never_look_stalled() {
    let mut command = infer();
    command.args([
        "up",
        "--port",
        "0",
        "--threads",
        "2",
        "--stall-timeout",
        "3",
    ]);
    let server = Server::start_command(command);
    // Idle longer than the timeout: an idle server is healthy, and the wait for the first
    // step starts when work arrives.
    std::thread::sleep(Duration::from_secs(4));
    let short =
        json!({"prompt": "Tell me a story about a fox.", "max_tokens": 24, "stream": false});
    let long = json!({"prompt": "one two three four ".repeat(500), "max_tokens": 2});
    let mut bodies = vec![short; 16];
    bodies.push(long);
    let done = std::sync::atomic::AtomicBool::new(false);
    let (replies, polls) = std::thread::scope(|scope| {
        let poller = scope.spawn(|| {
            let mut polls = Vec::new();
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                polls.push(health(&server));
                std::thread::sleep(Duration::from_millis(100));
            }
            polls
        });
        let replies = server.post_all("/v1/completions", &bodies);
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        (replies, poller.join().expect("poller"))
    });
    for (status, reply) in &replies {
        assert_eq!(*status, 200, "{reply}");
    }
    let prompt_tokens = replies[16].1["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(prompt_tokens >= 2000, "{}", replies[16].1);
    assert!(polls.len() > 10, "{} polls", polls.len());
    for (status, body) in &polls {
        assert_eq!(
            (*status, body["status"].as_str()),
            (200, Some("ok")),
            "{body}"
        );
    }
    let metrics = server.metrics();
    assert_eq!(
        metric(&metrics, "infer_replica_stalled{replica=\"0\"}"),
        0.0
    );
}

/// A black-holed collective link between two hosts (network namespaces with their own
/// sshd): PP 2, rank 0 on h0 and rank 1 on h1; every packet to rank 1's collective
/// connections is dropped (iptables DROP; the processes, their
/// heartbeats and the SSH control path untouched). Within `--stall-timeout` + 2 s of the
/// request that meets it `/health` is 503, and the diagnosis names both ranks waiting on
/// each other: a link, not a rank.
#[test]
fn a_black_holed_link_between_two_hosts_turns_health_503_naming_both_ranks() {
    crate::support::model::smollm2();
    let Some(cluster) = TestCluster::start(2, 1) else {
        return;
    };
    cluster.trust_hosts();
    let inventory = cluster.inventory.display().to_string();
    let server = Server::start(&["--cluster", &inventory, "--pp", "2", "--stall-timeout", "2"]);
    let body = json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0});
    let (status, reply) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{reply}");
    let manifest = server.manifest();
    assert_eq!(manifest["ranks"][1]["host"], "h1", "{manifest}");
    cluster.black_hole_rank_1(&manifest);
    let sent = Instant::now();
    let request = post_in_background(&server, body);
    let (_, body, at) = health_until(&server, Duration::from_secs(20), |s, _| s == 503);
    let waited = at - sent;
    assert!(
        waited <= Duration::from_secs(2 + 2),
        "503 came {waited:?} after the request, past --stall-timeout + 2 s: {body}"
    );
    assert_diagnosis(
        &server,
        "every rank waits on another",
        &[
            "replica 0 stalled",
            "rank 0 waits on rank 1 (",
            "rank 1 waits on rank 0 (",
            "(a lost or black-holed link between them)",
        ],
    );
    drop(server);
    let _ = request.join();
}

/// A frozen rank (SIGSTOP: its heartbeats stop with it) stops the gang naming it, no rank
/// is left, and the post-mortem says first that a rank stopped heartbeating.
#[test]
fn a_frozen_rank_stops_the_gang_and_the_post_mortem_names_it() {
    let mut command = infer();
    command.args(["up", "--port", "0", "--threads", "1", "--tp", "3"]);
    let mut server = Server::start_command(command);
    let ranks = server.rank_pids();
    let run_dir = run_dir_of(&server.startup);
    signal(ranks[1], rustix::process::Signal::STOP);
    let (status, rest) = server.wait_exit(Duration::from_secs(30));
    assert!(!status.success(), "{rest}");
    assert!(rest.contains("rank 1 stopped heartbeating"), "{rest}");
    for pid in ranks {
        assert!(!alive(pid), "rank pid {pid} is still running");
    }
    let (code, report) = postmortem(&run_dir);
    assert_eq!(code, Some(1), "{report}");
    let message = report["findings"][0]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(
        message.starts_with(
            "a rank stopped heartbeating: frozen (SIGSTOP, swapped out) or wedged hard: rank 1 stopped heartbeating"
        ),
        "{report}"
    );
    // `--run last` is the newest run under the cache's `runs/`: a copy of this one, newer
    // than another there.
    let cache = tempfile::tempdir().expect("tempdir");
    let runs = cache.path().join("runs");
    std::fs::create_dir_all(runs.join("run-00000000000000aa")).expect("old run");
    std::fs::write(runs.join("run-00000000000000aa/manifest.json"), "{}").expect("manifest");
    std::thread::sleep(Duration::from_millis(20));
    let copy = runs.join("run-00000000000000bb");
    std::fs::create_dir_all(&copy).expect("copy");
    for file in ["manifest.json", "outcome.json"] {
        std::fs::copy(std::path::Path::new(&run_dir).join(file), copy.join(file)).expect(file);
    }
    let output = infer()
        .env("INFER_CACHE_DIR", cache.path())
        .args(["doctor", "--run", "last", "--json"])
        .output()
        .expect("doctor");
    let last: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(
        last["findings"][0]["message"], report["findings"][0]["message"],
        "{last}"
    );
    let evidence = last["findings"][0]["evidence"].to_string();
    assert!(evidence.contains("run-00000000000000bb"), "{last}");
}
