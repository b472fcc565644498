#![no_main]
//! `cargo fuzz run generation_events`: see `dc_fuzz::wire::generation_events`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| dc_fuzz::wire::generation_events(data));
