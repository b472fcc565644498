#![no_main]
//! `cargo fuzz run control_body`: see `dc_fuzz::http::control_body`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| dc_fuzz::http::control_body(data));
