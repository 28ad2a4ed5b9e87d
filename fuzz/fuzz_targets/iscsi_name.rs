//! iSCSI names as they arrive on the wire and in configs: never a panic; a normal form is its
//! own normal form (so comparing normal forms compares names); a configured name is exactly
//! the wire's reading of it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use seam::name::{NodeName, ISCSI_NAME_BYTES_MAX};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(name) = NodeName::from_wire(text) {
        assert!(!name.as_str().is_empty());
        assert!(name.as_str().len() <= ISCSI_NAME_BYTES_MAX);
        assert_eq!(NodeName::from_wire(name.as_str()).as_ref(), Ok(&name));
    }
    if let Ok(configured) = NodeName::from_config(text) {
        assert!(configured.is_well_formed());
        assert_eq!(NodeName::from_wire(text).as_ref(), Ok(&configured));
    }
});
