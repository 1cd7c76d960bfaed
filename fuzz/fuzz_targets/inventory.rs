//! Fuzzes the launch inventory parser (`cluster::parse_launch_inventory`): any text gives
//! hosts or an error naming what is wrong, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = infer::inventory::parse_launch_inventory(&text, std::path::Path::new("hosts.toml"));
});
