//! `infer smoke`'s serving check, as a user's CI would do it: the real binary's `infer up`
//! on a free loopback port, `/health` until ready, one chat request through the OpenAI API,
//! then SIGTERM and a clean exit — nothing left running.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::runtime::cuda::checks::Check;

/// Everything `infer smoke` checks: the GPU's rows ([`crate::runtime::exec::gpu_checks::run`])
/// and then, when the model ran there, `exe up --device cuda` answering a chat request.
///
/// Errors: no driver or no GPU (nothing to check).
pub fn run(
    cache_dir: &Path,
    dirs: &[std::path::PathBuf],
    model: &Path,
    exe: &Path,
) -> Result<crate::runtime::exec::gpu_checks::Report> {
    let mut report = crate::runtime::exec::gpu_checks::run(cache_dir, dirs, model)?;
    report
        .checks
        .push(chat_check(exe, model, "cuda", Duration::from_secs(300)));
    Ok(report)
}

/// Starts `exe up --model <model> --device <device>` on 127.0.0.1, asks it one chat
/// question, stops it with SIGTERM and waits for it; the row says what happened. The server
/// gets `timeout` to become ready.
pub fn chat_check(exe: &Path, model: &Path, device: &str, timeout: Duration) -> Check {
    let name = format!("infer up --device {device} answers a chat request");
    let log = tempfile::NamedTempFile::new();
    let outcome = log
        .context("cannot create the server's log file")
        .and_then(|log| {
            let result = serve_and_ask(exe, model, device, timeout, log.path());
            result.map_err(|error| {
                let tail = std::fs::read_to_string(log.path()).unwrap_or_default();
                let tail: Vec<&str> = tail.lines().rev().take(5).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                error.context(format!("the server said:\n{}", tail.join("\n")))
            })
        });
    match outcome {
        Ok(detail) => Check {
            name,
            passed: true,
            detail,
        },
        Err(error) => Check {
            name,
            passed: false,
            detail: format!("{error:#}"),
        },
    }
}

/// Stops the server when the check ends, whatever happened.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn serve_and_ask(
    exe: &Path,
    model: &Path,
    device: &str,
    timeout: Duration,
    log: &Path,
) -> Result<String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .context("no free loopback port")?
        .port();
    let output = std::fs::File::create(log).context("cannot open the server's log")?;
    let mut server = Server(
        Command::new(exe)
            .arg("up")
            .arg("--model")
            .arg(model)
            .args(["--device", device, "--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .stdin(Stdio::null())
            .stdout(output.try_clone().context("cannot share the log")?)
            .stderr(output)
            .spawn()
            .with_context(|| format!("cannot start `{}`", exe.display()))?,
    );
    let base = format!("http://127.0.0.1:{port}");
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(120)))
        .http_status_as_error(false)
        .build()
        .into();
    let ready_secs = wait_ready(&mut server, &agent, &base, timeout)?;
    let models: serde_json::Value = agent
        .get(format!("{base}/v1/models"))
        .call()?
        .body_mut()
        .read_json()?;
    let id = models["data"][0]["id"]
        .as_str()
        .context("/v1/models lists no model")?
        .to_string();
    let asked = Instant::now();
    let mut response = agent
        .post(format!("{base}/v1/chat/completions"))
        .send_json(serde_json::json!({
            "model": id,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
            "temperature": 0,
        }))?;
    let status = response.status();
    let body: serde_json::Value = response.body_mut().read_json()?;
    if status != 200 {
        bail!("the chat request got HTTP {status}: {body}");
    }
    let answer = body["choices"][0]["message"]["content"]
        .as_str()
        .filter(|a| !a.trim().is_empty())
        .with_context(|| format!("the answer has no text: {body}"))?
        .to_string();
    let answer_secs = asked.elapsed().as_secs_f64();
    stop_server(&mut server)?;
    Ok(format!(
        "ready in {ready_secs:.1} s; answered {:?} in {answer_secs:.1} s; stopped cleanly on SIGTERM",
        answer.trim()
    ))
}

/// Waits until the server at `base` answers `GET /health` with 200, polling every 200 ms
/// through `agent`: the seconds it took.
///
/// Errors: the server exits first, or is not ready within `timeout`.
fn wait_ready(
    server: &mut Server,
    agent: &ureq::Agent,
    base: &str,
    timeout: Duration,
) -> Result<f64> {
    let started = Instant::now();
    loop {
        if let Some(status) = server.0.try_wait()? {
            bail!("`infer up` exited before it was ready ({status})");
        }
        let ready = agent
            .get(format!("{base}/health"))
            .call()
            .is_ok_and(|r| r.status() == 200);
        if ready {
            break;
        }
        if started.elapsed() > timeout {
            bail!("`infer up` was not ready after {} s", timeout.as_secs());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(started.elapsed().as_secs_f64())
}

/// Sends the server SIGTERM (it drains and exits 0) and waits up to 30 s for it.
///
/// Errors: the signal cannot be sent, the server does not stop in time or exits with
/// another status.
fn stop_server(server: &mut Server) -> Result<()> {
    // SIGTERM: the server drains and exits 0.
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&server.0),
        rustix::process::Signal::TERM,
    )
    .context("cannot signal the server")?;
    let stopping = Instant::now();
    let status = loop {
        if let Some(status) = server.0.try_wait()? {
            break status;
        }
        if stopping.elapsed() > Duration::from_secs(30) {
            bail!("`infer up` did not stop within 30 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if !status.success() {
        bail!("`infer up` exited with {status} after SIGTERM");
    }
    Ok(())
}
