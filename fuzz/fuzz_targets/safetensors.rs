#![no_main]
//! `cargo fuzz run safetensors`: see `dc_fuzz::files::safetensors`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| dc_fuzz::files::safetensors(data));
