//! `infer up --max-restarts N`: a gang that fails (a killed rank, a stalled replica, a
//! black-holed link between two hosts) is stopped and started again while the launcher's
//! HTTP front stays up: 503 with `Retry-After` meanwhile, an error naming the cause for the
//! requests in flight, `infer_restarts_total{cause}`, the same answers afterwards, and the
//! run's end, with its cause, once no restart is left. The same for an engine launched with
//! `--engine llamacpp` (its server killed or stopped, an RPC worker stopped on another host),
//! for prefill/decode roles, and for `--nnodes` launches; a DP replica other than rank 0's
//! restarts alone (here and on another host) while the others serve.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::cluster::TestCluster;
use crate::support::llamacpp::{complete, engine_processes, start_llamacpp};
use crate::support::process::{alive, free_port, infer, join_later, nnodes_up, run_dir_of, signal};
use crate::support::server::{Server, metric, retry_after};

/// `GET path`: status, `Retry-After` and body.
fn get_with_retry_after(server: &Server, path: &str) -> (u16, Option<String>, String) {
    let mut response = ureq::get(&format!("{}{path}", server.url))
        .config()
        .http_status_as_error(false)
        .build()
        .call()
        .expect("GET");
    let retry_after = retry_after(&response);
    let status = response.status().as_u16();
    (
        status,
        retry_after,
        response.body_mut().read_to_string().unwrap_or_default(),
    )
}

/// Asserts that among the 503s `unavailable` (status, `Retry-After`, body) one says the
/// first restart of one is under way after `cause`, with a `Retry-After` of at least 1 s.
fn assert_first_restart(unavailable: &[(u16, Option<String>, String)], cause: &str) {
    let restarting = unavailable
        .iter()
        .find(|(_, _, body)| body.contains("\"restarting\""))
        .unwrap_or_else(|| panic!("no `restarting` 503 among {unavailable:?}"));
    assert!(
        restarting.2.contains("restart 1 of 1") && restarting.2.contains(cause),
        "{restarting:?}"
    );
    assert!(
        restarting
            .1
            .as_deref()
            .is_some_and(|s| s.parse::<u64>().is_ok_and(|s| s >= 1)),
        "Retry-After: {restarting:?}"
    );
}

/// Polls `/health` every 20 ms until it answers 200 again; panics after `within`. Returns
/// the 503s seen meanwhile (status, `Retry-After`, body).
fn until_serving_again(server: &Server, within: Duration) -> Vec<(u16, Option<String>, String)> {
    let deadline = Instant::now() + within;
    let mut unavailable = Vec::new();
    loop {
        let answer = get_with_retry_after(server, "/health");
        if answer.0 == 200 && !unavailable.is_empty() {
            return unavailable;
        }
        if answer.0 != 200 {
            unavailable.push(answer);
        }
        assert!(
            Instant::now() < deadline,
            "/health did not turn 503 and back to 200 within {within:?}: {unavailable:?}\n{}",
            server.stderr_so_far()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Streams `body` from `/v1/completions` on a thread of its own; the thread returns the
/// whole event stream.
fn stream_in_background(server: &Server, body: Value) -> std::thread::JoinHandle<String> {
    let url = format!("{}/v1/completions", server.url);
    std::thread::spawn(move || match ureq::post(&url).send_json(body) {
        Ok(mut response) => response.body_mut().read_to_string().unwrap_or_default(),
        Err(error) => format!("request failed: {error}"),
    })
}

/// Every rank pid of the run's current manifest.
fn manifest_pids(server: &Server) -> Vec<u32> {
    server.manifest()["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|r| r["pid"].as_u64().expect("pid") as u32)
        .collect()
}

/// PP 2 with `--max-restarts 1`: SIGKILL of rank 1 while a stream is in flight. The stream
/// ends with an error event naming rank 1; meanwhile `/health` is 503 `restarting` with
/// `Retry-After`; then the server answers as before with new ranks, and `/metrics` counts
/// the restart. A second SIGKILL finds no restart left: `infer up` exits non-zero naming
/// it, with no rank left, and the run directory keeps the first failure in `restart-1/`.
#[test]
fn a_killed_rank_restarts_the_gang_while_the_front_stays_up() {
    let mut command = infer();
    command.args([
        "up",
        "--port",
        "0",
        "--threads",
        "1",
        "--pp",
        "2",
        "--max-restarts",
        "1",
    ]);
    let mut server = Server::start_command(command);
    let body = json!({"prompt": "Hello", "max_tokens": 8, "temperature": 0});
    let (status, before) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{before}");
    let first = manifest_pids(&server);
    let stream = stream_in_background(
        &server,
        // Greedy, this prompt runs to the 1,000 tokens.
        json!({"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "stream": true}),
    );
    // The stream is under way once a token has been generated.
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&server.metrics(), "infer_generation_tokens_total") < 9.0 {
        assert!(Instant::now() < deadline, "the stream did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    signal(first[1], rustix::process::Signal::KILL);
    let unavailable = until_serving_again(&server, Duration::from_secs(30));
    assert_first_restart(&unavailable, "rank 1 exited");
    let events = stream.join().expect("stream");
    assert!(
        events.ends_with("data: [DONE]\n\n")
            && events.contains("data: {\"error\":")
            && events.contains("rank 1"),
        "{}",
        &events[events.len().saturating_sub(600)..]
    );
    // Serving again: the same greedy answer from new ranks; the old ones are gone.
    let (status, after) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{after}");
    assert_eq!(after["choices"][0]["text"], before["choices"][0]["text"]);
    let second = manifest_pids(&server);
    assert!(second.iter().all(|pid| !first.contains(pid)), "{second:?}");
    for pid in &first {
        assert!(
            !alive(*pid),
            "rank pid {pid} of the failed start still runs"
        );
    }
    let metrics = server.metrics();
    assert_eq!(
        metric(&metrics, "infer_restarts_total{cause=\"rank_exited\"}"),
        1.0
    );
    assert_eq!(metric(&metrics, "infer_gang_serving"), 1.0);
    let run_dir = run_dir_of(&server.startup);
    let outcome: Value = serde_json::from_slice(
        &std::fs::read(format!("{run_dir}/restart-1/outcome.json"))
            .expect("restart-1/outcome.json"),
    )
    .expect("JSON");
    assert!(
        outcome["error"]
            .as_str()
            .is_some_and(|e| e.contains("rank 1")),
        "{outcome}"
    );
    assert_eq!(server.manifest()["restarts"][0]["cause"], "rank_exited");
    // No restart left: the next failure ends the run with its cause.
    signal(second[1], rustix::process::Signal::KILL);
    let (status, rest) = server.wait_exit(Duration::from_secs(30));
    assert!(!status.success(), "{rest}");
    assert!(
        rest.contains("the gang failed again after 1 restart (--max-restarts 1)")
            && rest.contains("rank 1"),
        "{rest}"
    );
    for pid in second {
        assert!(!alive(pid), "rank pid {pid} is still running");
    }
}

/// TP 3, rank 2 stuck inside its third step (the tests' fault; the restart runs clean):
/// `/health` turns 503 naming the stall, and 5 s later the gang restarts; the request that
/// met the stall gets an error naming it, and the server answers again.
#[test]
fn a_stalled_replica_restarts_after_the_grace_and_the_request_in_flight_is_told_why() {
    let mut command = infer();
    command
        .env("INFER_TEST_FAULT", "stall:rank=2:step=3")
        .args(["up", "--port", "0", "--threads", "1", "--tp", "3"])
        .args(["--stall-timeout", "2", "--max-restarts", "1"]);
    let server = Server::start_command(command);
    let sent = Instant::now();
    let stream = stream_in_background(
        &server,
        json!({"prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": true}),
    );
    let unavailable = until_serving_again(&server, Duration::from_secs(40));
    let serving_again = sent.elapsed();
    assert!(
        unavailable
            .iter()
            .any(|(_, _, body)| body.contains("replica 0 stalled")),
        "{unavailable:?}"
    );
    assert!(
        serving_again >= Duration::from_secs(2 + 5),
        "restarted {serving_again:?} after the request, before --stall-timeout + the grace"
    );
    let events = stream.join().expect("stream");
    assert!(
        events.contains("the server failed and restarts: replica 0 stalled")
            && events.contains("rank 2 holds the others up")
            && events.ends_with("data: [DONE]\n\n"),
        "{events}"
    );
    let (status, reply) = server.post(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(status, 200, "{reply}");
    assert_eq!(
        metric(&server.metrics(), "infer_restarts_total{cause=\"stalled\"}"),
        1.0
    );
}

/// The black-holed link between two hosts (network namespaces with their own sshd; every
/// packet to rank 1's collective connections dropped) with `--max-restarts 1`: the stall is
/// diagnosed, the gang is restarted through the agents already running on both hosts (new
/// ports, out of the rule's way), and the server answers again.
#[test]
fn a_black_holed_link_between_two_hosts_restarts_the_gang_through_the_agents() {
    crate::support::model::smollm2();
    let Some(cluster) = TestCluster::start(2, 1) else {
        return;
    };
    cluster.trust_hosts();
    let inventory = cluster.inventory.display().to_string();
    let server = Server::start(&[
        "--cluster",
        &inventory,
        "--pp",
        "2",
        "--stall-timeout",
        "2",
        "--max-restarts",
        "1",
    ]);
    let body = json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0});
    let (status, before) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{before}");
    cluster.black_hole_rank_1(&server.manifest());
    let url = format!("{}/v1/completions", server.url);
    let request = std::thread::spawn({
        let body = body.clone();
        move || {
            let _ = ureq::post(&url).send_json(body);
        }
    });
    let unavailable = until_serving_again(&server, Duration::from_secs(60));
    assert!(
        unavailable
            .iter()
            .any(|(_, _, body)| body.contains("every rank waits on another")),
        "{unavailable:?}"
    );
    let (status, after) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{after}");
    assert_eq!(after["choices"][0]["text"], before["choices"][0]["text"]);
    assert_eq!(server.manifest()["ranks"][1]["host"], "h1");
    assert_eq!(
        metric(&server.metrics(), "infer_restarts_total{cause=\"stalled\"}"),
        1.0
    );
    drop(server);
    let _ = request.join();
}

/// Waits up to `within` until `/metrics` shows `series` at `value` or more.
fn until_metric(server: &Server, series: &str, value: f64, within: Duration) {
    let deadline = Instant::now() + within;
    while metric(&server.metrics(), series) < value {
        assert!(
            Instant::now() < deadline,
            "`{series}` did not reach {value} within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The JSON file `name` of the run directory `run_dir`.
fn run_file(run_dir: &Path, name: &str) -> Value {
    let path = run_dir.join(name);
    serde_json::from_slice(
        &std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .expect("JSON")
}

/// `--engine llamacpp --max-restarts 1` here: SIGKILL of llama-server while a stream is in
/// flight. The stream ends with an error event naming it; meanwhile `/health` is 503
/// `restarting` with `Retry-After`; then a new llama-server answers as the first did, and
/// `/metrics` counts the restart. A second failure (llama-server stopped with SIGSTOP: its
/// `/metrics` silent past `--stall-timeout` and the grace) finds no restart left: `infer up`
/// exits non-zero naming the stall, no llama-server left, the first failure in `restart-1/`.
/// See: #39
#[test]
fn a_killed_llamacpp_server_restarts_behind_the_front_and_a_stalled_one_ends_the_run() {
    let run_dir = tempfile::tempdir().expect("run dir");
    // --stall-timeout 5: far above one step's time, even on a busy shared machine.
    let mut server = start_llamacpp(
        &["--max-restarts", "1", "--stall-timeout", "5"],
        run_dir.path(),
    );
    let before = complete(&server, "The capital of France is");
    let first = engine_processes(run_dir.path());
    assert_eq!(first.len(), 1, "{first:?}");
    let stream = stream_in_background(
        &server,
        json!({"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0,
               "ignore_eos": true, "stream": true}),
    );
    until_metric(
        &server,
        "llamacpp:requests_processing",
        1.0,
        Duration::from_secs(20),
    );
    // The launcher reads a running request's progress from llama.cpp's `llama_decode`
    // calls, which count while it runs (its predicted tokens count only once it ends: a
    // long generation would look stalled).
    let steps = metric(&server.metrics(), "llamacpp:n_decode_total");
    until_metric(
        &server,
        "llamacpp:n_decode_total",
        steps + 1.0,
        Duration::from_secs(20),
    );
    signal(first[0].2, rustix::process::Signal::KILL);
    let unavailable = until_serving_again(&server, Duration::from_secs(60));
    assert_first_restart(&unavailable, "`localhost llama-server` (node 0) exited");
    let events = stream.join().expect("stream");
    assert!(
        events.ends_with("data: [DONE]\n\n")
            && events.contains("the server failed and restarts: `localhost llama-server`"),
        "{}",
        &events[events.len().saturating_sub(600)..]
    );
    // Serving again: the same greedy answer from a new llama-server.
    let after = complete(&server, "The capital of France is");
    assert_eq!(after["choices"][0]["text"], before["choices"][0]["text"]);
    let second = engine_processes(run_dir.path());
    assert_ne!(second[0].2, first[0].2);
    assert!(!alive(first[0].2), "the killed llama-server is still there");
    let metrics = server.metrics();
    assert_eq!(
        metric(&metrics, "infer_restarts_total{cause=\"engine_exited\"}"),
        1.0
    );
    assert_eq!(metric(&metrics, "infer_gang_serving"), 1.0);
    let outcome = run_file(run_dir.path(), "restart-1/outcome.json");
    assert!(
        outcome["error"]
            .as_str()
            .is_some_and(|e| e.contains("llama-server")),
        "{outcome}"
    );
    assert!(run_dir.path().join("restart-1/node0.log").exists());
    let manifest = run_file(run_dir.path(), "manifest.json");
    assert_eq!(manifest["restarts"][0]["cause"], "engine_exited");
    // No restart left: a stalled llama-server ends the run with its cause. Until then, the
    // front's `/health` says it is stalled (the frozen server's own never answers).
    signal(second[0].2, rustix::process::Signal::STOP);
    let deadline = Instant::now() + Duration::from_secs(20);
    let stalled = loop {
        let answer = ureq::get(&format!("{}/health", server.url))
            .config()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(1)))
            .build()
            .call();
        if let Ok(mut response) = answer
            && response.status() == 503
        {
            let body = response.body_mut().read_to_string().unwrap_or_default();
            if body.contains("\"stalled\"") {
                break body;
            }
        }
        assert!(Instant::now() < deadline, "/health never said `stalled`");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        stalled.contains("`localhost llama-server` answered no `GET /metrics`"),
        "{stalled}"
    );
    let (status, rest) = server.wait_exit(Duration::from_secs(60));
    assert!(!status.success(), "{rest}");
    assert!(
        rest.contains("the engine failed again after 1 restart (--max-restarts 1)")
            && rest.contains(
                "the engine stalled: `localhost llama-server` answered no `GET /metrics`"
            ),
        "{rest}"
    );
    assert!(
        !alive(second[0].2),
        "the stopped llama-server is still there"
    );
}

/// `--engine llamacpp` over two hosts (llama-server on h0, its RPC worker on h1) with
/// `--max-restarts 1`: the RPC worker stopped (SIGSTOP) under a request stalls the head,
/// and `--stall-timeout` (5 s) plus the grace later every engine process on both hosts is
/// stopped and started again through the agents; the request in flight is told why, and the
/// new pair answers as the first did. See: #39
#[test]
fn a_stopped_llamacpp_rpc_worker_restarts_every_engine_process_on_every_host() {
    let Some(cluster) = TestCluster::start(2, 1) else {
        return;
    };
    cluster.trust_hosts();
    let inventory = cluster.inventory.display().to_string();
    let run_dir = tempfile::tempdir().expect("run dir");
    let server = start_llamacpp(
        &[
            "--cluster",
            &inventory,
            "--stall-timeout",
            "5",
            "--max-restarts",
            "1",
        ],
        run_dir.path(),
    );
    let before = complete(&server, "The capital of France is");
    let first = engine_processes(run_dir.path());
    let labels: Vec<&str> = first.iter().map(|p| p.0.as_str()).collect();
    assert_eq!(
        labels,
        ["h1 ggml-rpc-server", "h0 llama-server"],
        "{first:?}"
    );
    signal(first[0].2, rustix::process::Signal::STOP);
    let url = format!("{}/v1/completions", server.url);
    let stopped_at = Instant::now();
    let request = std::thread::spawn(move || {
        let mut response = ureq::post(&url)
            .config()
            .http_status_as_error(false)
            .build()
            .send_json(json!({"prompt": "Paris is", "max_tokens": 8, "temperature": 0}))
            .expect("an answer");
        (
            response.status().as_u16(),
            response.body_mut().read_to_string().unwrap_or_default(),
        )
    });
    let unavailable = until_serving_again(&server, Duration::from_secs(90));
    assert!(
        stopped_at.elapsed() >= Duration::from_secs(5 + 5),
        "restarted {:?} after the stop, before --stall-timeout + the grace: {unavailable:?}\n{}",
        stopped_at.elapsed(),
        server.stderr_so_far()
    );
    assert!(
        unavailable.iter().any(|(_, _, body)| body
            .contains("the engine stalled: `h0 llama-server`")
            && body.contains("it depends on h1 ggml-rpc-server")),
        "{unavailable:?}"
    );
    let (status, body) = request.join().expect("client");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("the engine stalled"), "{body}");
    let after = complete(&server, "The capital of France is");
    assert_eq!(after["choices"][0]["text"], before["choices"][0]["text"]);
    assert_eq!(
        metric(&server.metrics(), "infer_restarts_total{cause=\"stalled\"}"),
        1.0
    );
    let second = engine_processes(run_dir.path());
    for (label, _, pid) in &first {
        assert!(
            !alive(*pid),
            "{label} (pid {pid}) of the first start still runs"
        );
        assert!(second.iter().all(|p| p.2 != *pid), "{second:?}");
    }
}

/// `/health` every 50 ms until every replica is `ok` again, asserting that it answers 200
/// all the while (`degraded` naming replica 1 `restarting` at least once); panics after
/// `within`. Returns how long it took.
fn until_replica_back(server: &Server, within: Duration) -> Duration {
    let began = Instant::now();
    let mut restarting = false;
    loop {
        let (status, body) = server.get("/health");
        assert_eq!(status, 200, "{body}\n{}", server.stderr_so_far());
        let health: Value = serde_json::from_str(&body).expect("JSON");
        let replica = &health["replicas"][1];
        restarting |= health["status"] == "degraded" && replica["status"] == "restarting";
        if restarting && health["status"] == "ok" {
            return began.elapsed();
        }
        assert!(
            began.elapsed() < within,
            "replica 1 did not restart and come back within {within:?}: {body}\n{}",
            server.stderr_so_far()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// DP 2 × PP 2 with `--max-restarts 2`: SIGKILL of rank 3 (replica 1's second stage)
/// while each replica streams. Replica 1's stream ends with an error naming the cause;
/// replica 0's finishes untouched, and `/health` stays 200 (`degraded`, replica 1
/// `restarting`) until replica 1's new ranks serve again; ranks 0 and 1 are the same
/// processes throughout. Then replica 1's driver stopped (SIGSTOP: its heartbeat lost)
/// restarts it alone again; a third failure finds no restart left and ends the run.
#[test]
fn a_failed_dp_replica_restarts_alone_while_the_other_serves() {
    let mut command = infer();
    command.args([
        "up",
        "--port",
        "0",
        "--threads",
        "1",
        "--dp",
        "2",
        "--pp",
        "2",
    ]);
    command.args(["--max-restarts", "2"]);
    let mut server = Server::start_command(command);
    let body = json!({"prompt": "Hello", "max_tokens": 8, "temperature": 0});
    let (status, before) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{before}");
    let first = manifest_pids(&server);
    assert_eq!(first.len(), 4);
    let long = |max_tokens: u64| json!({"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "stream": true});
    let tokens = || metric(&server.metrics(), "infer_generation_tokens_total");
    let until_tokens = |at_least: f64| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while tokens() < at_least {
            assert!(Instant::now() < deadline, "the stream did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    // The first stream goes to replica 0; the second to the less loaded replica 1.
    let on_replica_0 = stream_in_background(&server, long(200));
    until_tokens(tokens() + 2.0);
    let on_replica_1 = stream_in_background(&server, long(1000));
    until_tokens(tokens() + 4.0);
    let routed = |replica: usize| {
        metric(
            &server.metrics(),
            &format!("infer_dp_requests_routed_total{{replica=\"{replica}\"}}"),
        )
    };
    let routed_1 = routed(1);
    assert!(routed_1 >= 1.0, "replica 1 streams nothing");
    signal(first[3], rustix::process::Signal::KILL);
    until_replica_back(&server, Duration::from_secs(60));
    let lost = on_replica_1.join().expect("stream");
    // The error names the lost rank (from replica 1's scheduler), or the lost replica (from
    // the router, when the link went first).
    assert!(
        lost.contains("data: {\"error\":")
            && (lost.contains("rank 3") || lost.contains("the replica is restarting")),
        "{}",
        &lost[lost.len().saturating_sub(600)..]
    );
    let kept = on_replica_0.join().expect("stream");
    assert!(
        !kept.contains("\"error\"") && kept.ends_with("data: [DONE]\n\n"),
        "replica 0's stream: {}",
        &kept[kept.len().saturating_sub(600)..]
    );
    let second = manifest_pids(&server);
    assert_eq!(second[..2], first[..2], "replica 0's ranks were restarted");
    assert!(
        second[2..].iter().all(|pid| !first.contains(pid)),
        "{second:?}"
    );
    assert!(!alive(first[2]) && !alive(first[3]));
    // Both replicas answer as before.
    let replies = server.post_all(
        "/v1/completions",
        &[body.clone(), body.clone(), body.clone()],
    );
    for (status, reply) in &replies {
        assert_eq!(*status, 200, "{reply}");
        assert_eq!(reply["choices"][0]["text"], before["choices"][0]["text"]);
    }
    assert!(
        routed(1) > routed_1,
        "nothing was routed to the new replica 1"
    );
    let metrics = server.metrics();
    assert_eq!(
        metric(&metrics, "infer_restarts_total{cause=\"rank_exited\"}"),
        1.0
    );
    let run_dir = run_dir_of(&server.startup);
    assert!(Path::new(&format!("{run_dir}/restart-1/rank3.log")).exists());
    assert_eq!(server.manifest()["restarts"][0]["cause"], "rank_exited");
    // Replica 1's driver frozen: its heartbeat stops, and replica 1 restarts alone again.
    signal(second[2], rustix::process::Signal::STOP);
    until_replica_back(&server, Duration::from_secs(60));
    let third = manifest_pids(&server);
    assert_eq!(third[..2], first[..2]);
    assert_eq!(
        metric(
            &server.metrics(),
            "infer_restarts_total{cause=\"heartbeat_lost\"}"
        ),
        1.0
    );
    let (status, reply) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{reply}");
    // No restart left: the run ends with the cause, no rank left anywhere.
    signal(third[3], rustix::process::Signal::KILL);
    let (status, rest) = server.wait_exit(Duration::from_secs(30));
    assert!(!status.success(), "{rest}");
    assert!(
        rest.contains("the gang failed again after 2 restarts (--max-restarts 2)")
            && rest.contains("rank 3"),
        "{rest}"
    );
    for pid in first.iter().chain(&second).chain(&third) {
        assert!(!alive(*pid), "rank pid {pid} is still running");
    }
}

/// `--cluster` with DP 2 over two hosts (namespaces with their own sshd; replica 1 is rank
/// 1 on h1) and `--max-restarts 1`: SIGKILL of rank 1 restarts replica 1 alone through h1's
/// agent while rank 0 on h0 serves on; then both replicas answer again.
#[test]
fn a_dp_replica_on_another_host_restarts_alone_through_its_agent() {
    crate::support::model::smollm2();
    let Some(cluster) = TestCluster::start(2, 1) else {
        return;
    };
    cluster.trust_hosts();
    let inventory = cluster.inventory.display().to_string();
    let server = Server::start(&["--cluster", &inventory, "--dp", "2", "--max-restarts", "1"]);
    let body = json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0});
    let (status, before) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{before}");
    let first = manifest_pids(&server);
    assert_eq!(server.manifest()["ranks"][1]["host"], "h1");
    signal(first[1], rustix::process::Signal::KILL);
    until_replica_back(&server, Duration::from_secs(60));
    let second = manifest_pids(&server);
    assert_eq!(second[0], first[0], "rank 0 was restarted");
    assert_ne!(second[1], first[1]);
    assert_eq!(server.manifest()["ranks"][1]["host"], "h1");
    let replies = server.post_all("/v1/completions", &[body.clone(), body.clone()]);
    for (status, reply) in &replies {
        assert_eq!(*status, 200, "{reply}");
        assert_eq!(reply["choices"][0]["text"], before["choices"][0]["text"]);
    }
    assert_eq!(
        metric(
            &server.metrics(),
            "infer_restarts_total{cause=\"rank_exited\"}"
        ),
        1.0
    );
}

/// `--nnodes 2 --max-restarts 1` (torchrun's model, both nodes on this host; PP 2: rank 0
/// on node 0, rank 1 on node 1): SIGKILL of node 1's rank. Node 0's front answers 503
/// `restarting`, node 0 opens a new store at the same address and node 1's launcher
/// (still running) joins that start with a new rank; the server answers as before, and
/// Ctrl-C on node 0 stops both nodes with exit 0.
#[test]
fn a_node_restarts_its_share_with_node_zero_under_nnodes() {
    use std::process::Stdio;
    crate::support::model::smollm2();
    let store_port = free_port().to_string();
    let node_1_dir = tempfile::tempdir().expect("temp dir");
    let node = |rank: &str| nnodes_up(rank, &store_port, &["--pp", "2", "--max-restarts", "1"]);
    let mut second = node("1");
    second.args([
        "--run-dir",
        &node_1_dir.path().join("run").display().to_string(),
    ]);
    let joining = join_later(second, Stdio::null());
    let mut head = Server::start_command(node("0"));
    let mut other = joining.join().expect("node 1 started");
    let body = json!({"prompt": "Hello", "max_tokens": 8, "temperature": 0});
    let (status, before) = head.post("/v1/completions", &body);
    assert_eq!(status, 200, "{before}");
    let node_1_rank = |dir: &Path| -> u32 {
        let manifest = run_file(dir, "manifest.json");
        manifest["ranks"][0]["pid"].as_u64().expect("pid") as u32
    };
    let first = node_1_rank(&node_1_dir.path().join("run"));
    signal(first, rustix::process::Signal::KILL);
    let unavailable = until_serving_again(&head, Duration::from_secs(60));
    // Node 0 sees its own rank fail with the lost peer (or rank 1's heartbeat stop).
    assert_first_restart(&unavailable, "rank ");
    let (status, after) = head.post("/v1/completions", &body);
    assert_eq!(status, 200, "{after}");
    assert_eq!(after["choices"][0]["text"], before["choices"][0]["text"]);
    let second = node_1_rank(&node_1_dir.path().join("run"));
    assert_ne!(second, first);
    assert!(alive(second) && !alive(first));
    assert!(
        node_1_dir.path().join("run/restart-1/rank1.log").exists(),
        "node 1 kept the failed start's files"
    );
    assert!(
        matches!(other.try_wait(), Ok(None)),
        "node 1's launcher exited"
    );
    let ranks = head.rank_pids();
    signal(head.child.id(), rustix::process::Signal::INT);
    let (status, rest) = head.wait_for_gang_exit(&ranks);
    assert_eq!(status.code(), Some(0), "{}{rest}", head.startup);
    assert_eq!(other.wait().expect("node 1 exits").code(), Some(0));
    assert!(!alive(second));
}

/// Prefill/decode disaggregation (`--prefill 1 --decode 1`) with `--max-restarts 1`: SIGKILL
/// of the decode replica's rank restarts the whole gang (roles are not restarted alone),
/// and the new gang hands the next request off from prefill to decode as the first did.
#[test]
fn a_killed_decode_rank_restarts_the_disaggregated_gang() {
    let mut command = infer();
    command.args(["up", "--port", "0", "--threads", "1"]);
    command.args(["--prefill", "1", "--decode", "1", "--max-restarts", "1"]);
    let server = Server::start_command(command);
    let body = json!({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 8, "temperature": 0});
    let (status, before) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{before}");
    let first = manifest_pids(&server);
    signal(first[1], rustix::process::Signal::KILL);
    let unavailable = until_serving_again(&server, Duration::from_secs(60));
    assert_first_restart(&unavailable, "rank ");
    let (status, after) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{after}");
    assert_eq!(after["choices"][0]["text"], before["choices"][0]["text"]);
    let metrics = server.metrics();
    // Rank 0's counters began again with the new gang: one hand-off since.
    assert_eq!(
        metric(&metrics, "infer_pd_handoffs_total"),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "infer_restarts_total{cause=\"rank_exited\"}"),
        1.0
    );
    assert!(
        manifest_pids(&server)
            .iter()
            .all(|pid| !first.contains(pid))
    );
}

/// DP 2 with replica 1's rank stuck in its third step (the tests' fault; the restart runs
/// clean), `--stall-timeout 2 --max-restarts 1`: `/health` stays 200 naming replica 1
/// stalled, then restarting, while replica 0 answers; 5 s past the timeout replica 1 alone
/// is restarted (rank 0 the same process) and every replica is `ok` again.
#[test]
fn a_stalled_dp_replica_restarts_alone_after_the_grace() {
    let mut command = infer();
    command
        .env("INFER_TEST_FAULT", "stall:rank=1:step=3")
        .args(["up", "--port", "0", "--threads", "1", "--dp", "2"])
        .args(["--stall-timeout", "2", "--max-restarts", "1"]);
    let server = Server::start_command(command);
    let first = manifest_pids(&server);
    let body = json!({"prompt": "Hello", "max_tokens": 8, "temperature": 0});
    // Two at once: one of them runs on replica 1 and meets the stall.
    let stuck = {
        let (url, body) = (format!("{}/v1/completions", server.url), body.clone());
        std::thread::spawn(move || {
            let both = [body.clone(), body];
            std::thread::scope(|scope| {
                let handles: Vec<_> = both
                    .iter()
                    .map(|b| {
                        let url = url.clone();
                        scope.spawn(move || {
                            ureq::post(&url)
                                .config()
                                .http_status_as_error(false)
                                .build()
                                .send_json(b)
                                .map(|r| r.status().as_u16())
                                .unwrap_or(0)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("client"))
                    .collect::<Vec<u16>>()
            })
        })
    };
    let began = Instant::now();
    let mut stalled_seen = false;
    loop {
        let (status, text) = server.get("/health");
        assert_eq!(status, 200, "{text}");
        let health: Value = serde_json::from_str(&text).expect("JSON");
        stalled_seen |= health["replicas"][1]["status"] == "stalled";
        if stalled_seen && health["status"] == "ok" {
            break;
        }
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "replica 1 did not stall and come back: {text}\n{}",
            server.stderr_so_far()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        began.elapsed() >= Duration::from_secs(2 + 5),
        "restarted before --stall-timeout + the grace"
    );
    let statuses = stuck.join().expect("clients");
    assert!(statuses.contains(&200), "{statuses:?}");
    let second = manifest_pids(&server);
    assert_eq!(second[0], first[0], "rank 0 was restarted");
    assert_ne!(second[1], first[1]);
    let replies = server.post_all("/v1/completions", &[body.clone(), body.clone()]);
    assert!(
        replies.iter().all(|(status, _)| *status == 200),
        "{replies:?}"
    );
    assert_eq!(
        metric(&server.metrics(), "infer_restarts_total{cause=\"stalled\"}"),
        1.0
    );
}

/// `--nnodes 2`, node 0 with `--max-restarts 1` (node 1 with 3): node 1's rank killed
/// twice. The second failure finds no restart left on node 0: it exits non-zero with the
/// cause, and node 1's launcher, told through the store, exits non-zero at once naming node
/// 0's end (rather than waiting for a next start), with no rank left on either node.
#[test]
fn with_no_restart_left_every_node_of_an_nnodes_launch_ends() {
    use std::process::Stdio;
    crate::support::model::smollm2();
    let store_port = free_port().to_string();
    let node_1_dir = tempfile::tempdir().expect("temp dir");
    let run_1 = node_1_dir.path().join("run");
    let layout = ["--pp", "2", "--max-restarts", "1"];
    // Node 1 would restart more: only node 0's word ends it.
    let mut second = nnodes_up("1", &store_port, &["--pp", "2", "--max-restarts", "3"]);
    second.args(["--run-dir", &run_1.display().to_string()]);
    let joining = join_later(second, Stdio::piped());
    let mut head = Server::start_command(nnodes_up("0", &store_port, &layout));
    let other = joining.join().expect("node 1 started");
    let node_1_rank = || -> u32 {
        let manifest = run_file(&run_1, "manifest.json");
        manifest["ranks"][0]["pid"].as_u64().expect("pid") as u32
    };
    let first = node_1_rank();
    signal(first, rustix::process::Signal::KILL);
    until_serving_again(&head, Duration::from_secs(60));
    let second = node_1_rank();
    assert_ne!(second, first);
    signal(second, rustix::process::Signal::KILL);
    let (status, rest) = head.wait_exit(Duration::from_secs(30));
    assert!(!status.success(), "{rest}");
    assert!(
        rest.contains("after 1 restart (--max-restarts 1)"),
        "{rest}"
    );
    let ended = Instant::now();
    let output = other.wait_with_output().expect("node 1 exits");
    assert!(
        ended.elapsed() < Duration::from_secs(20),
        "node 1 waited {:?} for a start that never came",
        ended.elapsed()
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("node 0 ended the run"), "{stderr}");
    assert!(!alive(second));
}
