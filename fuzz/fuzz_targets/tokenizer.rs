#![no_main]
//! `cargo fuzz run tokenizer`: see `dc_fuzz::text::tokenizer`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| dc_fuzz::text::tokenizer(data));
