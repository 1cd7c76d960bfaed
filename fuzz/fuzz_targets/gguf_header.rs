//! Fuzzes the GGUF header reader (`runtime::formats::gguf::Header::read`): any bytes give a header
//! or an error, never a panic, an abort or an allocation sized by a hostile length field.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = infer::runtime::formats::gguf::Header::read(&mut std::io::Cursor::new(data));
});
