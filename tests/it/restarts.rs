//! `infer up --max-restarts N`: a gang that fails (a killed rank, a stalled replica, a
//! black-holed link between two hosts) is stopped and started again while the launcher's
//! HTTP front stays up: 503 with `Retry-After` meanwhile, an error naming the cause for the
//! requests in flight, `infer_restarts_total{cause}`, the same answers afterwards, and the
//! run's end, with its cause, once no restart is left.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::cluster::TestCluster;
use crate::support::process::{alive, infer, run_dir_of, signal};
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
    let restarting = unavailable
        .iter()
        .find(|(_, _, body)| body.contains("\"restarting\""))
        .unwrap_or_else(|| panic!("no `restarting` 503 among {unavailable:?}"));
    assert!(
        restarting.2.contains("restart 1 of 1") && restarting.2.contains("rank 1 exited"),
        "{restarting:?}"
    );
    assert!(
        restarting
            .1
            .as_deref()
            .is_some_and(|s| s.parse::<u64>().is_ok_and(|s| s >= 1)),
        "Retry-After: {restarting:?}"
    );
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
    infer::model::default::ensure(&mut |_| {}).expect("model");
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
