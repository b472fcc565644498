#![no_main]
//! `cargo fuzz run gguf`: see `dc_fuzz::files::gguf`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| dc_fuzz::files::gguf(data));
