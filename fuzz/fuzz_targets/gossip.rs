#![no_main]
//! `cargo fuzz run gossip`: see `dc_fuzz::wire::gossip`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| dc_fuzz::wire::gossip(data));
