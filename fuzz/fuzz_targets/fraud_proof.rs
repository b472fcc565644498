#![no_main]
//! `cargo fuzz run fraud_proof`: see `dc_fuzz::proof::fraud_proof`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| dc_fuzz::proof::fraud_proof(data));
