#![no_main]
//! `cargo fuzz run chat_template`: see `dc_fuzz::text::chat_template`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| dc_fuzz::text::chat_template(data));
