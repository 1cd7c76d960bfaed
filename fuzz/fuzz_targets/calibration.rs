//! Fuzzes the all-reduce table reader of `infer plan --calibration` (pasted nccl-tests
//! `all_reduce_perf` output): any text gives a measured link or an error, never a panic,
//! and a link it accepts has a positive bandwidth and latency.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(link) = infer::plan::calibration::parse_allreduce_table("fuzz.txt", &text) {
        assert!(link.bytes_per_sec > 0.0 && link.latency_secs > 0.0);
    }
});
