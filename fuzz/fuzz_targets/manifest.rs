#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| edgeinfer::fuzz::manifest(data));
