#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| edgeinfer::fuzz::mqtt_session(data));
