#![no_main]
//! `cargo fuzz run generation_request`: see `dc_fuzz::wire::generation_request`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| dc_fuzz::wire::generation_request(data));
