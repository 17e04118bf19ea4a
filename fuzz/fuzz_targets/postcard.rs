#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| edgeinfer::fuzz::postcard(data));
