#![no_main]
//! `cargo fuzz run json_schema`: see `dc_fuzz::text::json_schema`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| dc_fuzz::text::json_schema(data));
