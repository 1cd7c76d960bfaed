//! `infer bench allreduce`'s reports from an [`AllreduceBench`]: nccl-tests' tables next to
//! one plain TCP stream, or the JSON report `infer plan --calibration` reads.

use crate::plan::calibration::{AllreduceJsonRow, AllreduceReport, AllreduceTable, Scope};
use crate::runtime::collectives::bench::AllreduceBench;
use crate::runtime::collectives::{AllreduceRow, nccl_tests_table};

/// The `--json` report of the local bench: the TCP table, and the shared-memory one when
/// it was measured.
pub(super) fn local_json(world: usize, report: &AllreduceBench) -> AllreduceReport {
    let mut tables = vec![json_table(
        "TCP ring over loopback",
        Scope::IntraHost,
        world,
        Vec::new(),
        (&report.tcp_rows, report.tcp_message_secs),
    )];
    if !report.rows.is_empty() {
        tables.push(json_table(
            &report.transport,
            Scope::IntraHost,
            world,
            Vec::new(),
            (&report.rows, report.message_secs),
        ));
    }
    AllreduceReport {
        bench: "allreduce".into(),
        tables,
        stream_bytes_per_sec: report.stream_bytes_per_sec,
    }
}

/// The text report of the local bench: the TCP table, the shared-memory one (or why it
/// was not measured), and one plain TCP stream's GB/s.
pub(super) fn local_text(world: usize, report: &AllreduceBench) -> String {
    let stream = report.stream_bytes_per_sec / 1e9;
    let mut table = allreduce_table(
        &format!("TCP ring over loopback, {world} processes on this host"),
        &report.tcp_rows,
        world,
        stream,
    );
    table.push_str(&message_line(report.tcp_message_secs));
    table.push('\n');
    if report.rows.is_empty() {
        table.push_str(&format!(
            "# shared memory: not measured ({})\n",
            report.transport
        ));
    } else {
        table.push_str(&allreduce_table(
            &format!("{}, {world} processes on this host", report.transport),
            &report.rows,
            world,
            stream,
        ));
        table.push_str(&message_line(report.message_secs));
    }
    table.push_str(&format!(
        "\n# one plain TCP stream between two processes: {stream:.3} GB/s\n"
    ));
    table
}

/// The `--json` report of the bench over `hosts`: one table, inter-host when the ranks
/// spanned more than one.
pub(super) fn cluster_json(
    world: usize,
    report: &AllreduceBench,
    hosts: Vec<String>,
) -> AllreduceReport {
    let scope = if hosts.len() > 1 {
        Scope::InterHost
    } else {
        Scope::IntraHost
    };
    AllreduceReport {
        bench: "allreduce".into(),
        tables: vec![json_table(
            &report.transport,
            scope,
            world,
            hosts,
            (&report.rows, report.message_secs),
        )],
        stream_bytes_per_sec: report.stream_bytes_per_sec,
    }
}

/// The text report of the bench over `hosts`: its table and the stream from the last rank.
pub(super) fn cluster_text(world: usize, report: &AllreduceBench, hosts: &[String]) -> String {
    let stream = report.stream_bytes_per_sec / 1e9;
    let mut table = allreduce_table(
        &format!(
            "{world} processes on hosts {} over the data network ({})",
            hosts.join(", "),
            report.transport
        ),
        &report.rows,
        world,
        stream,
    );
    table.push_str(&message_line(report.message_secs));
    table.push_str(&format!(
        "\n# one plain TCP stream from the last rank to rank 0: {stream:.3} GB/s\n"
    ));
    table
}

/// One transport's rows and message latency as `infer bench allreduce --json` prints them.
fn json_table(
    transport: &str,
    scope: Scope,
    world: usize,
    hosts: Vec<String>,
    (rows, message_secs): (&[AllreduceRow], Option<f64>),
) -> AllreduceTable {
    AllreduceTable {
        transport: transport.to_string(),
        scope,
        world_size: world,
        hosts,
        message_secs,
        rows: rows
            .iter()
            .map(|r| AllreduceJsonRow {
                bytes: r.bytes as u64,
                time_secs: r.time_secs,
                algbw_bytes_per_sec: r.algbw_bytes_per_sec(),
                busbw_bytes_per_sec: r.busbw_bytes_per_sec(world),
            })
            .collect(),
    }
}

/// The line under a table that gives its transport's message latency, when measured.
fn message_line(message_secs: Option<f64>) -> String {
    message_secs.map_or(String::new(), |secs| {
        format!(
            "# one 8-byte send/recv, rank 0 to rank 1 (half a ping-pong round trip): {:.1} us\n",
            secs * 1e6
        )
    })
}

/// One nccl-tests style table (size, count, type, time, algbw, busbw) with its busbw at
/// 16 MiB as a share of `stream_gbps`.
fn allreduce_table(title: &str, rows: &[AllreduceRow], world: usize, stream_gbps: f64) -> String {
    let mut table = format!(
        "# all-reduce (sum, float32): {title}\n{}",
        nccl_tests_table(rows, world)
    );
    if let Some(row) = rows.iter().find(|r| r.bytes == 16 << 20) {
        let busbw = row.busbw_bytes_per_sec(world) / 1e9;
        table.push_str(&format!(
            "# busbw at 16 MiB = {busbw:.3} GB/s = {:.0}% of one plain TCP stream\n",
            100.0 * busbw / stream_gbps
        ));
    }
    table
}
