#![no_main]
//! `cargo fuzz run revealed_row`: see `dc_fuzz::reveal::revealed_row`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| dc_fuzz::reveal::revealed_row(data));
