//! Fuzzes the NCCL log parser and every log check (`doctor::nccl_log::parse`,
//! `doctor::checks::nccl_logs`): any bytes, decoded as the doctor decodes them, give
//! findings, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = infer::doctor::nccl_log::decode(data);
    let log = infer::doctor::nccl_log::parse(&text, "fuzz.log");
    let _ = infer::doctor::checks::nccl_logs(std::slice::from_ref(&log), None);
});
