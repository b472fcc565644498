#![no_main]
//! `cargo fuzz run openai_body`: see `dc_fuzz::http::openai_body`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| dc_fuzz::http::openai_body(data));
