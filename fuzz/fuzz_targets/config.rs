//! The config model: `Config::from_toml_str` on arbitrary text and `parse_size` on arbitrary
//! strings. Invariants: a config that loads writes back (`to_toml`) to text that loads to the
//! same config; a parsed size prints back to the same number and fits in u64.
#![no_main]

use arbitrary::Arbitrary;
use engine::config::{parse_size, Config};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Input {
    Toml(String),
    /// TOML assembled from known sections and keys with arbitrary values, so validation (not
    /// only the TOML parser) is reached.
    Sections(Vec<(u8, u8, String)>),
    Size(String),
}

const SECTIONS: &[&str] = &[
    "[server]",
    "[limits]",
    "[[portal_group]]",
    "[[device]]",
    "[[target]]",
    "[[target.group]]",
];
const KEYS: &[&str] = &[
    "workers",
    "identity_seed",
    "max_connections",
    "max_connections_per_source",
    "max_sessions",
    "max_queue_depth",
    "max_recv_data_segment_length",
    "max_burst_length",
    "first_burst_length",
    "max_outstanding_r2t",
    "login_timeout_s",
    "memory_per_connection_bytes",
    "max_text_length",
    "tag",
    "listen",
    "name",
    "store",
    "path",
    "size",
    "block_size",
    "serial",
    "naa",
    "read_only",
    "write_cache",
    "thin",
    "iqn",
    "alias",
    "portal_groups",
    "initiators",
    "any_initiator",
    "luns",
];

fuzz_target!(|input: Input| {
    let text = match input {
        Input::Size(s) => {
            if let Ok(n) = parse_size(&s) {
                assert_eq!(parse_size(&n.to_string()), Ok(n), "{s:?}");
                let digits: String = s
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_digit())
                    .collect();
                let base: u64 = digits.parse().expect("a size starts with digits");
                assert!(n >= base, "{s:?} -> {n}");
            }
            return;
        }
        Input::Toml(t) => t,
        Input::Sections(items) => {
            let mut t = String::new();
            for (section, key, value) in items.iter().take(40) {
                if section % 4 == 0 {
                    t.push_str(SECTIONS[*section as usize / 4 % SECTIONS.len()]);
                    t.push('\n');
                }
                t.push_str(KEYS[*key as usize % KEYS.len()]);
                t.push_str(" = ");
                t.push_str(value);
                t.push('\n');
            }
            t
        }
    };
    match Config::from_toml_str(&text, "fuzz.toml") {
        Ok(config) => {
            let written = config.to_toml();
            let again = Config::from_toml_str(&written, "written.toml")
                .unwrap_or_else(|e| panic!("to_toml output does not load: {e}\n{written}"));
            assert_eq!(again, config, "round trip changed the config\n{written}");
        }
        Err(errors) => {
            let shown = errors.to_string();
            assert!(!shown.is_empty(), "an error with no message");
        }
    }
});
