#![no_main]
//! `cargo fuzz run stage_response`: see `dc_fuzz::wire::stage_response`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| dc_fuzz::wire::stage_response(data));
