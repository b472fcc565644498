#![no_main]
//! `cargo fuzz run model_config`: see `dc_fuzz::files::model_config`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| dc_fuzz::files::model_config(data));
