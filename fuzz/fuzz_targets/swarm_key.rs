#![no_main]
//! `cargo fuzz run swarm_key`: see `dc_fuzz::text::swarm_key`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| dc_fuzz::text::swarm_key(data));
