#![no_main]
//! `cargo fuzz run stage_request`: see `dc_fuzz::wire::stage_request`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| dc_fuzz::wire::stage_request(data));
