//! The README's examples run as written: every `infer …` line of its Examples block (but the
//! servers, which run until stopped) runs from a directory that has the repository's
//! `examples/`, in order, with `infer` on `PATH`, and none is refused as bad input.

use std::path::Path;
use std::process::Command;

#[test]
fn readme_examples_run_as_written() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    crate::support::model::smollm2();
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let examples = readme
        .split("## Examples")
        .nth(1)
        .and_then(|rest| rest.split("```sh\n").nth(1))
        .and_then(|block| block.split("```").next())
        .expect("an ```sh block under ## Examples");
    let lines: Vec<&str> = examples
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("infer "))
        // Servers run until Ctrl-C; the serving tests cover them.
        .filter(|l| !l.contains("infer up") && !l.contains("bench serve"))
        .collect();
    assert!(lines.len() >= 10, "too few examples found: {lines:?}");
    let dir = tempfile::tempdir().expect("tempdir");
    std::os::unix::fs::symlink(root.join("examples"), dir.path().join("examples"))
        .expect("link examples/");
    let bin = tempfile::tempdir().expect("tempdir");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_infer"), bin.path().join("infer"))
        .expect("link infer");
    let path = format!(
        "{}:{}",
        bin.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    for line in lines {
        let output = Command::new("sh")
            .arg("-c")
            .arg(line)
            .current_dir(dir.path())
            .env("PATH", &path)
            .env("NO_COLOR", "1")
            .output()
            .expect("run sh");
        // 0: done; 1: the answer is "no" (an infeasible pinned layout, doctor errors).
        let code = output.status.code();
        assert!(
            matches!(code, Some(0 | 1)),
            "`{line}` exited {code:?}:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}
