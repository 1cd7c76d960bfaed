//! Fuzzes the readers of `infer plan --calibration` (pasted nccl-tests `all_reduce_perf`
//! output, `infer bench allreduce --json`, `infer bench decode --json`): any text gives a
//! measurement or an error, never a panic; a link it accepts has a positive bandwidth and
//! latency, a decode a positive bandwidth.
#![no_main]

use infer::plan::calibration::{Measurement, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match parse("fuzz.txt", &text) {
        Ok(Measurement::Link(link)) => {
            assert!(link.bytes_per_sec > 0.0 && link.latency_secs > 0.0)
        }
        Ok(Measurement::Decode(decode)) => assert!(decode.weight_bytes_per_sec > 0.0),
        Err(_) => {}
    }
});
