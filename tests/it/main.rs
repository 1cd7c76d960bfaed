//! Integration tests: one binary, one module per area. Each test runs the real `infer`
//! binary (or the library at its public edge) on real inputs: the fixtures in
//! `../shared/fixtures/`, fake sysfs trees built in temp dirs, this machine.

// A test binary has no API: its helpers are `pub` for the other test modules.
#![allow(unreachable_pub)]

mod backend;
mod cluster;
mod collectives;
mod cuda;
pub mod device_ranks;
mod distributed;
mod doctor;
mod dummy;
mod engine;
mod engines;
mod fake_sysfs;
mod kernels;
mod model;
mod pd;
mod plan;
mod prefix;
mod readme;
mod scheduling;
pub mod serve;
mod sharding;
mod synthetic;
mod topo;

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

/// The repository's `../shared/fixtures/` directory (real-world inputs with expected facts).
pub fn shared_fixture(relative: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/fixtures")
        .join(relative);
    assert!(
        path.exists(),
        "fixture `{}` is missing: is `../shared` checked out beside the repo?",
        path.display()
    );
    path
}

/// The `infer` binary under test, with a clean environment for colour.
pub fn infer() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_infer"));
    command.env("NO_COLOR", "1").stdin(Stdio::null());
    command
}

/// Runs `infer` with `args` and returns its output.
pub fn run(args: &[&str]) -> Output {
    infer()
        .args(args)
        .output()
        .expect("failed to start the `infer` binary")
}

/// Runs `infer` with `args` and `stdin`, and returns its output.
pub fn run_with_stdin(args: &[&str], stdin: &[u8]) -> Output {
    use std::io::Write;
    let mut child = infer()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("failed to start the `infer` binary");
    child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(stdin)
        .expect("write stdin");
    child.wait_with_output().expect("wait for `infer`")
}

/// Stdout of a run that must succeed.
pub fn stdout_ok(output: &Output) -> String {
    assert!(
        output.status.success(),
        "`infer` failed with {:?}\nstderr:\n{}",
        output.status.code(),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout.clone()).expect("stdout is UTF-8")
}
