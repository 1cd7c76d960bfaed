//! Fuzzes the `nvidia-smi topo -m` / topology JSON importer (`Topology::import`): any text
//! gives a topology or an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = infer::topology::Topology::import(&text, "fuzz.txt");
});
