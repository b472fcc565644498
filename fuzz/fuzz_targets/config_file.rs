#![no_main]
//! `cargo fuzz run config_file`: see `dc_fuzz::text::config_file`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| dc_fuzz::text::config_file(data));
