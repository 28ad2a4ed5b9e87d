//! One small test per rule of the config model.

use super::*;
use std::net::SocketAddr;
use std::sync::Arc;

const FILE: &str = "ferrosan.toml";

/// A minimal valid config; tests append to it or replace parts of it.
const BASE: &str = r#"
[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260"]

[[device]]
name = "disk1"
store = "ram"
size = "1G"

[[target]]
iqn = "iqn.2026-11.org.ferrosan:t1"

  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ { lun = 0, device = "disk1" } ]
"#;

fn load(text: &str) -> Config {
    match Config::from_toml_str(text, FILE) {
        Ok(c) => c,
        Err(e) => panic!("expected a valid config, got:\n{e}\n---\n{text}"),
    }
}

fn errors(text: &str) -> Vec<ConfigError> {
    match Config::from_toml_str(text, FILE) {
        Ok(_) => panic!("expected errors for:\n{text}"),
        Err(e) => e.errors,
    }
}

/// The single error of `text`; asserts it is on the line containing `needle` and names `field`.
fn one_error(text: &str, needle: &str, field: &str) -> ConfigError {
    let errs = errors(text);
    assert_eq!(errs.len(), 1, "expected one error, got: {errs:#?}");
    let e = errs.into_iter().next().unwrap();
    assert_eq!(e.line, line_of(text, needle), "wrong line: {e}");
    assert!(
        e.field.contains(field),
        "field {:?} does not name {field:?}: {e}",
        e.field
    );
    assert_eq!(e.file, FILE);
    assert!(e.column >= 1);
    e
}

/// 1-based line of the last occurrence of `needle`.
fn line_of(text: &str, needle: &str) -> usize {
    let at = text
        .rfind(needle)
        .unwrap_or_else(|| panic!("{needle:?} not in text"));
    text[..at].matches('\n').count() + 1
}

fn with_device(extra: &str) -> String {
    format!("{BASE}\n[[device]]\n{extra}\n")
}

// ---- sizes -------------------------------------------------------------------------------

#[test]
fn sizes_are_written_in_the_largest_whole_unit_and_read_back() {
    use super::names::size_text;
    for (bytes, text) in [
        (1u64 << 30, "1G"),
        (1536 << 20, "1536M"),
        (4096, "4K"),
        (512, "512"),
        (0, "0"),
        (3 << 50, "3P"),
        ((1 << 30) + 512, "1073742336"),
    ] {
        assert_eq!(size_text(bytes), text);
        assert_eq!(parse_size(text), Ok(bytes), "{text}");
    }
}

#[test]
fn size_accepts_integers_and_binary_units() {
    assert_eq!(parse_size("4096"), Ok(4096));
    assert_eq!(parse_size("4096B"), Ok(4096));
    assert_eq!(parse_size("512M"), Ok(512 << 20));
    assert_eq!(parse_size("1G"), Ok(1 << 30));
    assert_eq!(parse_size("1g"), Ok(1 << 30));
    assert_eq!(parse_size("10T"), Ok(10 << 40));
    assert_eq!(parse_size("2P"), Ok(2 << 50));
    assert_eq!(parse_size("64K"), Ok(64 << 10));
    assert_eq!(parse_size("8GiB"), Ok(8 << 30));
    assert_eq!(parse_size("3 MiB"), Ok(3 << 20));
    assert_eq!(parse_size("1TiB"), Ok(1 << 40));
    assert_eq!(parse_size(" 0 "), Ok(0));
}

#[test]
fn size_rejects_fractions_ambiguity_and_garbage() {
    assert!(parse_size("1.5G")
        .unwrap_err()
        .to_string()
        .contains("fractions"));
    assert!(parse_size("1GB")
        .unwrap_err()
        .to_string()
        .contains("ambiguous"));
    assert!(parse_size("1mb")
        .unwrap_err()
        .to_string()
        .contains("ambiguous"));
    assert!(parse_size("1X")
        .unwrap_err()
        .to_string()
        .contains("unknown unit"));
    assert!(parse_size("").is_err());
    assert!(parse_size("G").is_err());
    assert!(parse_size("-1G").is_err());
    assert!(parse_size("1G1").is_err());
    assert!(parse_size("16384P")
        .unwrap_err()
        .to_string()
        .contains("too large"));
    assert!(parse_size("99999999999999999999999")
        .unwrap_err()
        .to_string()
        .contains("too large"));
}

// ---- iSCSI names -------------------------------------------------------------------------

#[test]
fn iscsi_names_valid() {
    for n in [
        "iqn.2026-11.org.ferrosan:demo",
        "iqn.1998-01.com.vmware:esx1-4c1d2e3f",
        "iqn.1991-05.com.microsoft:backup01.example.org",
        "iqn.2001-04.com.example",
        "iqn.2001-04.com.example:storage:diskarrays-sn-a8675309",
        "iqn.2001-04.com.example:stockage.données",
        "eui.02004567A425678D",
        "eui.02004567a425678d",
        "naa.52004567BA64678D",
        "naa.62004567BA64678D0123456789ABCDEF",
    ] {
        assert!(is_valid_iscsi_name(n), "{n}: {:?}", check_iscsi_name(n));
    }
}

#[test]
fn iscsi_names_invalid() {
    for n in [
        "",
        "iqn",
        "iqn.",
        "iqn.2026-13.org.x",
        "iqn.2026-00.org.x",
        "iqn.26-11.org.x",
        "iqn.2026-11",
        "iqn.2026-11.",
        "iqn.2026-11.org..x",
        "iqn.2026-11.org.x:",
        "iqn.2026-11.Org.x",
        "iqn.2026-11.org.x:Disk",
        "IQN.2026-11.org.x",
        "iqn.2026-11.org.x:a b",
        "iqn.2026-11.org.x:a_b",
        "iqn.2026-11.org_x",
        "eui.02004567A425678",
        "eui.02004567A425678DD",
        "eui.0200456GA425678D",
        "naa.0123",
        "naa.62004567BA64678D0123456789ABCDE",
        "foo.bar",
        "org.ferrosan:demo",
    ] {
        assert!(!is_valid_iscsi_name(n), "{n} should be invalid");
    }
    assert!(check_iscsi_name("iqn.2026-11.org.x:Disk")
        .unwrap_err()
        .to_string()
        .contains("lowercase"));
}

#[test]
fn iscsi_name_length_limit_is_223_bytes() {
    let head = "iqn.2026-11.org.x:";
    let ok = format!("{head}{}", "a".repeat(ISCSI_NAME_BYTES_MAX - head.len()));
    assert_eq!(ok.len(), 223);
    assert!(is_valid_iscsi_name(&ok));
    let long = format!("{ok}a");
    assert!(check_iscsi_name(&long)
        .unwrap_err()
        .to_string()
        .contains("223"));
}

// ---- portals -------------------------------------------------------------------------------

#[test]
fn listen_addresses_parse() {
    let a = |s: &str| parse_listen(s).unwrap();
    assert_eq!(
        a("127.0.0.1:3260"),
        "127.0.0.1:3260".parse::<SocketAddr>().unwrap()
    );
    assert_eq!(
        a("10.0.0.1"),
        "10.0.0.1:3260".parse::<SocketAddr>().unwrap()
    );
    assert_eq!(a("[::1]:3261"), "[::1]:3261".parse::<SocketAddr>().unwrap());
    assert_eq!(a("[::1]"), "[::1]:3260".parse::<SocketAddr>().unwrap());
    assert!(parse_listen("::1")
        .unwrap_err()
        .to_string()
        .contains("brackets"));
    assert!(parse_listen("localhost:3260").is_err());
    assert!(parse_listen("127.0.0.1:0")
        .unwrap_err()
        .to_string()
        .contains("port 0"));
    assert!(parse_listen("127.0.0.1:65536").is_err());
    assert!(parse_listen("[::ffff:10.0.0.1]:3260")
        .unwrap_err()
        .to_string()
        .contains("IPv4-mapped"));
    assert!(parse_listen("224.0.0.1:3260")
        .unwrap_err()
        .to_string()
        .contains("multicast"));
}

#[test]
fn portal_overlap_matrix() {
    let o = |a: &str, b: &str| portals_overlap(a.parse().unwrap(), b.parse().unwrap());
    // (a, b, overlap?)
    let cases = [
        ("127.0.0.1:3260", "127.0.0.1:3260", true),
        ("127.0.0.1:3260", "127.0.0.1:3261", false),
        ("127.0.0.1:3260", "10.0.0.1:3260", false),
        ("0.0.0.0:3260", "10.0.0.1:3260", true),
        ("0.0.0.0:3260", "0.0.0.0:3260", true),
        ("0.0.0.0:3260", "0.0.0.0:3261", false),
        ("0.0.0.0:3260", "10.0.0.1:3261", false),
        ("[::]:3260", "[::1]:3260", true),
        ("[::]:3260", "[::]:3260", true),
        ("[::1]:3260", "[::1]:3260", true),
        ("[::1]:3260", "[2001:db8::1]:3260", false),
        ("0.0.0.0:3260", "[::]:3260", false),
        ("[::]:3260", "127.0.0.1:3260", false),
        ("0.0.0.0:3260", "[::1]:3260", false),
    ];
    for (a, b, want) in cases {
        assert_eq!(o(a, b), want, "{a} vs {b}");
        assert_eq!(o(b, a), want, "{b} vs {a} (symmetry)");
    }
}

#[test]
fn overlapping_portals_in_the_file_are_errors() {
    let text = BASE.replace(
        r#"listen = ["127.0.0.1:3260"]"#,
        "listen = [\"0.0.0.0:3260\",\n \"[::]:3260\"]\n\n[[portal_group]]\ntag = 2\nlisten = [\"10.1.1.1:3260\"]",
    );
    let e = one_error(&text, "10.1.1.1", "portal_group 2: listen[0]");
    assert!(e.message.contains("overlaps 0.0.0.0:3260"), "{e}");
    let dup = BASE.replace(
        r#"["127.0.0.1:3260"]"#,
        r#"["127.0.0.1:3260", "127.0.0.1:3260"]"#,
    );
    let e = one_error(&dup, "listen =", "listen[1]");
    assert!(e.message.contains("already listed"), "{e}");
}

#[test]
fn port_zero_is_an_error() {
    let text = BASE.replace("127.0.0.1:3260", "127.0.0.1:0");
    let e = one_error(&text, "127.0.0.1:0", "portal_group 1: listen[0]");
    assert!(e.message.contains("port 0"));
}

#[test]
fn target_without_portals_is_an_error() {
    let none = BASE.replace(
        "[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:3260\"]\n",
        "",
    );
    let e = one_error(&none, "iqn = ", "portal_groups");
    assert!(e.message.contains("no portals"), "{e}");
    let empty = BASE.replace(
        "iqn = \"iqn.2026-11.org.ferrosan:t1\"",
        "iqn = \"iqn.2026-11.org.ferrosan:t1\"\nportal_groups = []",
    );
    one_error(&empty, "portal_groups = []", "portal_groups");
    let unknown = BASE.replace(
        "iqn = \"iqn.2026-11.org.ferrosan:t1\"",
        "iqn = \"iqn.2026-11.org.ferrosan:t1\"\nportal_groups = [7]",
    );
    let e = one_error(&unknown, "portal_groups = [7]", "portal_groups[0]");
    assert!(e.message.contains("tag 7"));
    let no_listen = BASE.replace("listen = [\"127.0.0.1:3260\"]", "listen = []");
    one_error(&no_listen, "listen = []", "portal_group 1: listen");
}

#[test]
fn portal_group_tag_range_and_duplicates() {
    let zero = BASE.replace("tag = 1", "tag = 0");
    let errs = errors(&zero);
    assert!(
        errs.iter()
            .any(|e| e.field.contains("tag") && e.line == line_of(&zero, "tag = 0")),
        "{errs:#?}"
    );
    let dup = BASE.replace(
        "listen = [\"127.0.0.1:3260\"]",
        "listen = [\"127.0.0.1:3260\"]\n\n[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.2:3260\"]",
    );
    let errs = errors(&dup);
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert!(
        errs[0].message.contains("duplicate portal group tag"),
        "{errs:#?}"
    );
    assert_eq!(errs[0].line, line_of(&dup, "tag = 1"));
}

// ---- devices -------------------------------------------------------------------------------

#[test]
fn block_size_must_be_512_or_4096() {
    let text = with_device("name = \"disk2\"\nstore = \"ram\"\nsize = \"1G\"\nblock_size = 1000");
    let e = one_error(&text, "block_size = 1000", "device \"disk2\": block_size");
    assert_eq!(e.message, "must be 512 or 4096, got 1000");
    assert_eq!(e.column, 14);
    let shown = e.to_string();
    assert_eq!(
        shown,
        format!(
            "ferrosan.toml:{}:14: device \"disk2\": block_size: must be 512 or 4096, got 1000",
            e.line
        )
    );
}

#[test]
fn size_must_be_a_multiple_of_block_size() {
    let text = with_device("name = \"disk2\"\nstore = \"ram\"\nsize = 1000000\nblock_size = 4096");
    let e = one_error(&text, "size = 1000000", "device \"disk2\": size");
    assert!(e.message.contains("multiple of block_size (4096)"), "{e}");
}

#[test]
fn bad_sizes_are_errors() {
    for (size, needle) in [
        ("\"1.5G\"", "fractions"),
        ("\"10GB\"", "ambiguous"),
        ("0", "0"),
        ("-512", "negative"),
        ("true", "a number of bytes"),
    ] {
        let text = with_device(&format!("name = \"disk2\"\nstore = \"ram\"\nsize = {size}"));
        let e = one_error(&text, &format!("size = {size}"), "device \"disk2\": size");
        assert!(e.message.contains(needle), "{size}: {e}");
    }
}

#[test]
fn ram_needs_a_size_and_no_path() {
    let text = with_device("name = \"disk2\"\nstore = \"ram\"");
    let e = one_error(&text, "store = \"ram\"", "device \"disk2\": size");
    assert!(e.message.contains("needs a size"));
    let text = with_device("name = \"disk2\"\nstore = \"ram\"\nsize = \"1G\"\npath = \"/x\"");
    one_error(&text, "path = \"/x\"", "device \"disk2\": path");
}

#[test]
fn file_and_block_need_a_path_and_block_has_no_size() {
    let text = with_device("name = \"disk2\"\nstore = \"file\"");
    one_error(&text, "store = \"file\"", "device \"disk2\": path");
    let text =
        with_device("name = \"disk2\"\nstore = \"block\"\npath = \"/dev/sdb\"\nsize = \"1G\"");
    one_error(&text, "size = \"1G\"", "device \"disk2\": size");
    let ok = load(&with_device(
        "name = \"disk2\"\nstore = \"file\"\npath = \"/x.img\"",
    ));
    assert_eq!(
        ok.device("disk2").unwrap().store,
        StoreKind::File {
            path: "/x.img".into(),
            size_bytes: None
        }
    );
}

#[test]
fn unknown_store_is_an_error() {
    let text = with_device("name = \"disk2\"\nstore = \"tape\"");
    let e = one_error(&text, "store = \"tape\"", "device \"disk2\": store");
    assert!(e
        .message
        .contains("\"ram\", \"file\", \"block\" or \"rbd\""));
}

#[test]
fn rbd_devices_name_their_image_and_cluster() {
    let text = with_device(
        "name = \"vm\"\nstore = \"rbd\"\nimage = \"pool1/vm-disk\"\nceph_conf = \"/etc/ceph/a.conf\"\nceph_client = \"client.iscsi\"",
    );
    let c = Config::from_toml_str(&text, FILE).unwrap();
    let d = c.device("vm").unwrap();
    assert_eq!(
        d.store,
        StoreKind::Rbd(store::RbdSpec {
            pool: "pool1".into(),
            image: "vm-disk".into(),
            conf: Some("/etc/ceph/a.conf".into()),
            client: Some("client.iscsi".into()),
        })
    );
    // Two gateways export one image under different device names with one identity.
    let other = with_device("name = \"elsewhere\"\nstore = \"rbd\"\nimage = \"pool1/vm-disk\"");
    let o = Config::from_toml_str(&other, FILE).unwrap();
    let e = o.device("elsewhere").unwrap();
    assert_eq!((&d.serial, &d.naa), (&e.serial, &e.naa));
    let quick = Config::from_cli(&[], &[], "", &["rbd:pool1/vm-disk".into()]).unwrap();
    assert_eq!(quick.devices[0].naa, d.naa);
    // The saved form reads back the same.
    let again = Config::from_toml_str(&c.to_toml(), FILE).unwrap();
    assert_eq!(again.device("vm").unwrap().store, d.store);
}

#[test]
fn rbd_device_errors_are_located() {
    for (extra, needle, field, says) in [
        ("store = \"rbd\"", "store = \"rbd\"", "image", "needs image"),
        (
            "store = \"rbd\"\nimage = \"justname\"",
            "image = ",
            "image",
            "POOL/IMAGE",
        ),
        (
            "store = \"rbd\"\nimage = \"p/ns/i\"",
            "image = ",
            "image",
            "namespaces",
        ),
        (
            "store = \"rbd\"\nimage = \"/i\"",
            "image = ",
            "image",
            "POOL/IMAGE",
        ),
        (
            "store = \"rbd\"\nimage = \"p/i\"\npath = \"/x\"",
            "path = ",
            "path",
            "no path",
        ),
        (
            "store = \"rbd\"\nimage = \"p/i\"\nsize = \"1G\"",
            "size = ",
            "size",
            "image's own",
        ),
        (
            "store = \"rbd\"\nimage = \"p/i\"\nceph_client = \"\"",
            "ceph_client",
            "ceph_client",
            "client name",
        ),
    ] {
        let text = with_device(&format!("name = \"r\"\n{extra}"));
        let e = one_error(&text, needle, field);
        assert!(e.message.contains(says), "{extra}: {e}");
    }
    let twice = format!(
        "{}\n[[device]]\nname = \"b\"\nstore = \"rbd\"\nimage = \"p/i\" # again\n",
        with_device("name = \"a\"\nstore = \"rbd\"\nimage = \"p/i\"")
    );
    let e = one_error(&twice, "# again", "image");
    assert!(e.message.contains("already the image of"), "{e}");
}

#[test]
fn rbd_lun_specs_parse() {
    let c = Config::from_cli(
        &[],
        &[],
        "",
        &["rbd:rbd/img,conf=/c/ceph.conf,client=client.gw,ro".into()],
    )
    .unwrap();
    assert_eq!(
        c.devices[0].store,
        StoreKind::Rbd(store::RbdSpec {
            pool: "rbd".into(),
            image: "img".into(),
            conf: Some("/c/ceph.conf".into()),
            client: Some("client.gw".into()),
        })
    );
    assert!(c.targets[0].groups[0].luns[0].read_only);
    assert!(!c.devices[0].write_cache, "write-through unless asked");
    let c = Config::from_cli(&[], &[], "", &["rbd:rbd/img,write_cache".into()]).unwrap();
    assert!(c.devices[0].write_cache);
    for bad in ["rbd:img", "rbd:rbd/img,size=1G", "rbd:a/b/c"] {
        assert!(
            Config::from_cli(&[], &[], "", &[bad.into()]).is_err(),
            "{bad}"
        );
    }
}

#[test]
fn an_unknown_lun_option_is_named_not_read_as_a_size() {
    let e = Config::from_cli(&[], &[], "", &["ram:64M,blocksize=4096".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown option `blocksize=4096` (did you mean `block_size`?)"),
        "{e}"
    );
    let e = Config::from_cli(&[], &[], "", &["rbd:rbd/img,zzz".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown option `zzz`;") && e.contains("client="),
        "{e}"
    );
    // A file path may hold commas; one close to an option is still caught.
    let c = Config::from_cli(&[], &[], "", &["file:/tmp/a,b.img,size=1M".into()]).unwrap();
    assert!(
        matches!(&c.devices[0].store, StoreKind::File { path, .. } if path.ends_with("a,b.img"))
    );
    let e = Config::from_cli(&[], &[], "", &["file:/tmp/x.img,sise=1M".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("did you mean `size`?"), "{e}");
}

#[test]
fn a_key_written_twice_is_named_at_its_second_line() {
    let text = with_device("name = \"a\"\nstore = \"ram\"\nsize = \"1G\"\nstore = \"file\"");
    let e = one_error(&text, "store = \"file\"", "store");
    assert!(e.message.contains("duplicate key `store`"), "{e}");
    let text = with_device("name = \"a\"\n\"size\" = \"1G\"\nsize = \"2G\"");
    let e = one_error(&text, "size = \"2G\"", "size");
    assert!(e.message.contains("duplicate key `size`"), "{e}");
}

#[test]
fn duplicate_device_names_paths_and_naas_are_errors() {
    let text = with_device("name = \"disk1\"\nstore = \"ram\"\nsize = \"1G\"");
    let e = one_error(&text, "name = \"disk1\"", "device \"disk1\": name");
    assert!(e.message.contains("duplicate"));
    let text = format!(
        "{}\n[[device]]\nname = \"b\"\nstore = \"file\"\npath = \"/same.img\"\n",
        with_device("name = \"a\"\nstore = \"file\"\npath = \"/same.img\"")
    );
    let errs = errors(&text);
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert!(errs[0].field.contains("device \"b\": path"));
    let text = format!(
        "{}\n[[device]]\nname = \"b\"\nstore = \"ram\"\nsize = 4096\nnaa = \"0x3000000000000001\"\n",
        with_device("name = \"a\"\nstore = \"ram\"\nsize = 4096\nnaa = \"0x3000000000000001\"")
    );
    let errs = errors(&text);
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert!(errs[0].field.contains("device \"b\": naa"), "{errs:#?}");
}

#[test]
fn device_names_serials_and_naas_are_checked() {
    let text = with_device("name = \"bad name\"\nstore = \"ram\"\nsize = 4096");
    one_error(&text, "bad name", "name");
    let text = with_device(
        "name = \"d\"\nstore = \"ram\"\nsize = 4096\nserial = \"this serial is too long\"",
    );
    one_error(&text, "serial =", "device \"d\": serial");
    let text = with_device("name = \"d\"\nstore = \"ram\"\nsize = 4096\nnaa = \"0x1234\"");
    one_error(&text, "naa =", "device \"d\": naa");
    let text =
        with_device("name = \"d\"\nstore = \"ram\"\nsize = 4096\nnaa = \"0x6000000000000001\"");
    let e = one_error(&text, "naa =", "device \"d\": naa");
    assert!(
        e.message.contains("8-byte NAA must be of type 2, 3 or 5"),
        "{e}"
    );
    let c = load(&with_device("name = \"d\"\nstore = \"ram\"\nsize = 4096\nnaa = \"60014051234567890123456789abcdef\"\nserial = \"SN-1\""));
    let d = c.device("d").unwrap();
    assert_eq!(d.naa.len(), 16);
    assert_eq!(d.naa[0], 0x60);
    assert_eq!(d.serial, "SN-1");
}

#[test]
fn device_defaults() {
    let c = load(BASE);
    let d = c.device("disk1").unwrap();
    assert_eq!(
        d.store,
        StoreKind::Ram {
            size_bytes: 1 << 30
        }
    );
    assert_eq!(d.block_size, 512);
    assert!(!d.read_only);
    assert!(!d.write_cache, "write-through by default");
    assert!(d.thin);
    assert_eq!(d.serial.len(), 16);
    assert_eq!(d.naa.len(), 8);
    assert_eq!(d.naa[0] >> 4, 3, "NAA type 3");
}

// ---- identity -----------------------------------------------------------------------------

#[test]
fn derived_identity_is_stable_and_distinct() {
    let a = load(BASE);
    let b = load(BASE);
    assert_eq!(a.devices[0].serial, b.devices[0].serial);
    assert_eq!(a.devices[0].naa, b.devices[0].naa);
    // Pinned: FNV-1a 64 of "device:disk1". A change here changes every LU's identity.
    assert_eq!(
        a.devices[0].serial,
        format!("{:016x}", names::fnv1a64(b"device:disk1"))
    );
    assert_eq!(names::fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(names::fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    let other = load(&BASE.replace("disk1", "disk9"));
    assert_ne!(a.devices[0].naa, other.devices[0].naa);
    assert_ne!(a.devices[0].serial, other.devices[0].serial);
    let seeded = load(&format!("[server]\nidentity_seed = \"host-a\"\n{BASE}"));
    assert_ne!(a.devices[0].naa, seeded.devices[0].naa);
}

#[test]
fn cli_identity_is_stable() {
    let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let a = Config::from_cli(&[], &[], "", &args(&["ram:1G", "file:/tmp/x.img"])).unwrap();
    let b = Config::from_cli(&[], &[], "", &args(&["ram:1G", "file:/tmp/x.img"])).unwrap();
    assert_eq!(a, b);
    assert_ne!(a.devices[0].naa, a.devices[1].naa);
    let c = Config::from_cli(
        &[],
        &[],
        "iqn.2026-11.org.ferrosan:other",
        &args(&["ram:1G", "file:/tmp/x.img"]),
    )
    .unwrap();
    assert_ne!(
        a.devices[0].naa, c.devices[0].naa,
        "ram identity follows the target IQN"
    );
    assert_eq!(
        a.devices[1].naa, c.devices[1].naa,
        "file identity follows the path"
    );
}

// ---- targets and groups -------------------------------------------------------------------

#[test]
fn duplicate_target_iqns_are_errors() {
    let text = format!("{BASE}\n[[target]]\niqn = \"iqn.2026-11.org.ferrosan:t1\"\n  [[target.group]]\n  name = \"g\"\n  any_initiator = true\n");
    let errs = errors(&text);
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert!(errs[0].message.contains("duplicate target"));
    assert_eq!(errs[0].line, line_of(&text, "iqn = "));
}

#[test]
fn malformed_target_and_initiator_names_are_errors() {
    let text = BASE.replace("iqn.2026-11.org.ferrosan:t1", "iqn.2026-11.org.ferrosan:T1");
    let e = one_error(
        &text,
        "iqn = ",
        "target \"iqn.2026-11.org.ferrosan:T1\": iqn",
    );
    assert!(e.message.contains("lowercase"));
    let text = BASE.replace(
        "any_initiator = true",
        "initiators = [\"iqn.1998-01.com.vmware:esx1\", \"esx2\"]",
    );
    one_error(&text, "initiators = ", "group \"all\": initiators[1]");
}

#[test]
fn group_needs_initiators_or_any_initiator() {
    let text = BASE.replace("  any_initiator = true\n", "");
    let e = one_error(&text, "name = \"all\"", "group \"all\": initiators");
    assert!(e.message.contains("any_initiator = true"));
    let text = BASE.replace(
        "any_initiator = true",
        "any_initiator = false\n  initiators = []",
    );
    one_error(&text, "name = \"all\"", "group \"all\": initiators");
    let text = BASE.replace(
        "any_initiator = true",
        "any_initiator = true\n  initiators = [\"iqn.1998-01.com.vmware:esx1\"]",
    );
    one_error(&text, "any_initiator = true", "any_initiator");
}

#[test]
fn only_one_any_initiator_group_per_target() {
    let text = format!("{BASE}\n  [[target.group]]\n  name = \"more\"\n  any_initiator = true\n");
    one_error(
        &text,
        "any_initiator = true",
        "group \"more\": any_initiator",
    )
    .message
    .contains("already has any_initiator");
}

#[test]
fn target_needs_a_group() {
    let text = "[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:3260\"]\n[[target]]\niqn = \"iqn.2026-11.org.x:t\"\n";
    one_error(text, "iqn = ", "group");
}

#[test]
fn duplicate_group_names_in_a_target_are_errors() {
    let text = format!("{BASE}\n  [[target.group]]\n  name = \"all\"\n  initiators = [\"iqn.1998-01.com.vmware:esx1\"]\n");
    let errs = errors(&text);
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert!(errs[0].field.contains("group \"all\": name"));
    assert_eq!(errs[0].line, text.lines().count() - 1);
}

#[test]
fn an_initiator_in_two_groups_is_an_error() {
    let text = BASE.replace("any_initiator = true", "initiators = [\"iqn.1998-01.com.vmware:esx1\"]")
        + "\n  [[target.group]]\n  name = \"second\"\n  initiators = [\"iqn.2000-01.org.x:a\", \"iqn.1998-01.com.vmware:esx1\"]\n";
    let e = one_error(
        &text,
        "\"iqn.2000-01.org.x:a\"",
        "group \"second\": initiators[1]",
    );
    assert!(e.message.contains("already listed in group \"all\""), "{e}");
    // Two separate targets may share an initiator.
    let two_targets = format!("{BASE}\n[[target]]\niqn = \"iqn.2026-11.org.ferrosan:t2\"\n  [[target.group]]\n  name = \"all\"\n  any_initiator = true\n");
    load(&two_targets);
}

#[test]
fn lun_mapping_rules() {
    let dup = BASE.replace(
        "luns = [ { lun = 0, device = \"disk1\" } ]",
        "luns = [ { lun = 0, device = \"disk1\" },\n    { lun = 0, device = \"disk2\" } ]",
    ) + "\n[[device]]\nname = \"disk2\"\nstore = \"ram\"\nsize = 4096\n";
    let e = one_error(&dup, "{ lun = 0, device = \"disk2\"", "luns[1].lun");
    assert!(e.message.contains("LUN 0 is mapped twice"));
    let unknown = BASE.replace("device = \"disk1\" }", "device = \"nope\" }");
    let e = one_error(&unknown, "device = \"nope\"", "luns[0].device");
    assert!(e.message.contains("no [[device]] is named \"nope\""));
    assert_eq!(
        e.column,
        line_containing(&unknown, "\"nope\"")
            .find("\"nope\"")
            .unwrap()
            + 1
    );
    let twice = BASE.replace(
        "{ lun = 0, device = \"disk1\" }",
        "{ lun = 0, device = \"disk1\" }, { lun = 1, device = \"disk1\" }",
    );
    one_error(&twice, "lun = 1", "luns[1].device");
    let big = BASE.replace("lun = 0", "lun = 16384");
    one_error(&big, "lun = 16384", "luns[0].lun");
    let missing = BASE.replace("lun = 0, ", "");
    one_error(&missing, "{ device", "luns[0].lun");
}

#[test]
fn a_device_mapped_again_is_named_by_its_first_lun() {
    let thrice = BASE.replace(
        "{ lun = 0, device = \"disk1\" }",
        "{ lun = 3, device = \"disk1\" },\n    { lun = 1, device = \"disk1\" },\n    { lun = 2, device = \"disk1\" }",
    );
    let errs = errors(&thrice);
    assert_eq!(errs.len(), 2, "{errs:#?}");
    for (e, at) in errs.iter().zip(["luns[1].device", "luns[2].device"]) {
        assert!(e.field.ends_with(at), "{e}");
        assert!(e.message.contains("already mapped as LUN 3"), "{e}");
    }
    // A LUN number taken by a mapping with an error is taken all the same.
    let taken = BASE.replace(
        "{ lun = 0, device = \"disk1\" }",
        "{ lun = 0, device = \"disk1\" },\n    { lun = 1, device = \"disk1\" },\n    { lun = 1, device = \"disk2\" }",
    ) + "\n[[device]]\nname = \"disk2\"\nstore = \"ram\"\nsize = 4096\n";
    let errs = errors(&taken);
    assert_eq!(errs.len(), 2, "{errs:#?}");
    assert!(
        errs[1].message.contains("LUN 1 is mapped twice"),
        "{}",
        errs[1]
    );
}

fn line_containing<'a>(text: &'a str, needle: &str) -> &'a str {
    text.lines().find(|l| l.contains(needle)).unwrap()
}

#[test]
fn a_mapping_says_only_its_own_read_only() {
    let text = BASE.replace(
        "device = \"disk1\" }",
        "device = \"disk1\", read_only = true }",
    );
    let c = load(&text);
    assert!(c.targets[0].groups[0].luns[0].read_only);
    let text = BASE.replace("size = \"1G\"", "size = \"1G\"\nread_only = true");
    let c = load(&text);
    assert!(c.devices[0].read_only);
    assert!(
        !c.targets[0].groups[0].luns[0].read_only,
        "a read-only device is write-protected by its LU, not by each mapping: turning it \
         writable live (or in the saved file) leaves no mapping read-only behind"
    );
}

#[test]
fn group_for_precedence() {
    let c = load(&format!(
        "{BASE}\n  [[target.group]]\n  name = \"esx\"\n  initiators = [\"iqn.1998-01.com.vmware:esx1\"]\n"
    ));
    let t = &c.targets[0];
    assert_eq!(
        t.group_for(&n("iqn.1998-01.com.vmware:esx1")).unwrap().name,
        "esx",
        "exact match beats any_initiator"
    );
    assert_eq!(
        t.group_for(&n("IQN.1998-01.COM.VMWARE:ESX1")).unwrap().name,
        "esx",
        "case-insensitive"
    );
    assert_eq!(
        t.group_for(&n("iqn.1998-01.com.vmware:esx2")).unwrap().name,
        "all"
    );
    let closed = load(&BASE.replace(
        "any_initiator = true",
        "initiators = [\"iqn.1998-01.com.vmware:esx1\"]",
    ));
    assert!(closed.targets[0]
        .group_for(&n("iqn.1998-01.com.vmware:esx2"))
        .is_none());
    assert!(closed.targets[0]
        .group_for(&n("iqn.1998-01.com.vmware:esx1"))
        .is_some());
}

#[test]
fn portal_groups_default_to_all() {
    let text = BASE.replace(
        "listen = [\"127.0.0.1:3260\"]",
        "listen = [\"127.0.0.1:3260\"]\n\n[[portal_group]]\ntag = 9\nlisten = [\"127.0.0.1:3261\"]",
    );
    let c = load(&text);
    assert_eq!(c.targets[0].portal_groups, vec![1, 9]);
}

#[test]
fn only_one_connection_per_session_is_accepted() {
    let text = format!("[limits]\nmax_connections_per_session = 2\n{BASE}");
    one_error(
        &text,
        "max_connections_per_session",
        "max_connections_per_session",
    );
    load(&format!(
        "[limits]\nmax_connections_per_session = 1\n{BASE}"
    ));
}

#[test]
fn alua_state_is_per_portal_group() {
    let text = BASE.replace(
        "listen = [\"127.0.0.1:3260\"]",
        "listen = [\"127.0.0.1:3260\"]\n\n[[portal_group]]\ntag = 9\nlisten = [\"127.0.0.1:3261\"]\nalua_state = \"active-non-optimized\"",
    );
    let c = load(&text);
    let states: Vec<_> = c
        .portal_groups
        .iter()
        .map(|p| (p.tag, p.alua_state))
        .collect();
    assert_eq!(
        states,
        vec![
            (1, scsi::AccessState::ActiveOptimized),
            (9, scsi::AccessState::ActiveNonOptimized)
        ]
    );
    for (name, state) in [
        ("standby", scsi::AccessState::Standby),
        ("unavailable", scsi::AccessState::Unavailable),
    ] {
        let c = load(&text.replace("active-non-optimized", name));
        assert_eq!(c.portal_groups[1].alua_state, state);
    }
    // Transitioning is a state between two others, never a configured one.
    let bad = text.replace("\"active-non-optimized\"", "\"transitioning\"");
    let e = one_error(&bad, "transitioning", "alua_state");
    assert!(e.message.contains("active-optimized"), "{e}");
    assert!(e.message.contains("unavailable"), "{e}");
}

#[test]
fn alias_is_checked() {
    let text = BASE.replace(
        "iqn = \"iqn.2026-11.org.ferrosan:t1\"",
        "iqn = \"iqn.2026-11.org.ferrosan:t1\"\nalias = \"\"",
    );
    one_error(&text, "alias", "alias");
}

// ---- server, limits, unknown keys, syntax ----------------------------------------------------

#[test]
fn unknown_keys_are_errors() {
    let text = with_device("name = \"d\"\nstore = \"ram\"\nsize = 4096\nblok_size = 512");
    let e = one_error(&text, "blok_size", "blok_size");
    assert!(e.message.contains("unknown field"), "{e}");
    assert!(e.message.ends_with("(did you mean `block_size`?)"), "{e}");
    assert_eq!(e.column, 1);
    let text = format!("[limits]\nmax_sesions = 3\n{BASE}");
    let e = one_error(&text, "max_sesions", "max_sesions");
    assert!(e.message.ends_with("(did you mean `max_sessions`?)"), "{e}");
    let text = format!("[srever]\nworkers = 1\n{BASE}");
    let e = one_error(&text, "srever", "srever");
    assert!(e.message.ends_with("(did you mean `server`?)"), "{e}");
    // A type is named in words.
    let text = BASE.replace("lun = 0", "lun = \"zero\"");
    let e = one_error(&text, "\"zero\"", "lun");
    assert!(e.message.contains("expected a whole number"), "{e}");
    // Nothing close: no guess.
    let text = with_device("name = \"d\"\nstore = \"ram\"\nsize = 4096\nzzzzzz = 1");
    let e = one_error(&text, "zzzzzz", "zzzzzz");
    assert!(!e.message.contains("did you mean"), "{e}");
    let text = BASE.replace("device = \"disk1\" }", "device = \"disk1\", ro = true }");
    one_error(&text, "ro = true", "ro");
}

#[test]
fn type_errors_name_the_key() {
    let text = format!("[limits]\nmax_sessions = \"lots\"\n{BASE}");
    let e = one_error(&text, "\"lots\"", "max_sessions");
    assert_eq!(e.column, 16);
}

#[test]
fn syntax_errors_are_located() {
    let text = format!("{BASE}\n[[device]\n");
    let errs = errors(&text);
    assert_eq!(errs.len(), 1);
    assert_eq!(errs[0].line, line_of(&text, "[[device]\n"));
    assert_eq!(errs[0].file, FILE);
}

#[test]
fn limits_defaults_ranges_and_relations() {
    let c = load(BASE);
    assert_eq!(c.limits, Limits::default());
    assert_eq!(c.limits.max_queue_depth, 128);
    assert_eq!(c.limits.max_recv_data_segment_length, 262_144);
    assert_eq!(c.server.workers, 0);
    let text =
        format!("[server]\nworkers = 4\n[limits]\nmax_sessions = 10\nlogin_timeout_s = 30\n{BASE}");
    let c = load(&text);
    assert_eq!(
        (
            c.server.workers,
            c.limits.max_sessions,
            c.limits.login_timeout_s
        ),
        (4, 10, 30)
    );
    let text = format!("[limits]\nmax_recv_data_segment_length = 511\n{BASE}");
    let e = one_error(&text, "= 511", "limits: max_recv_data_segment_length");
    assert!(e.message.contains("512..=16777215"));
    let text = format!("[limits]\nmax_burst_length = 65536\nfirst_burst_length = 131072\n{BASE}");
    one_error(&text, "first_burst_length", "limits: first_burst_length");
    let text = format!("[limits]\nmemory_per_connection_bytes = 65536\n{BASE}");
    one_error(&text, "memory_per", "limits: memory_per_connection_bytes");
    let text = format!("[server]\nworkers = -1\n{BASE}");
    one_error(&text, "workers", "server: workers");
    let text = format!("[limits]\nmax_burst_length = 32768\nmax_connections = 8\nmax_recv_data_segment_length = 8388608\n{BASE}");
    let c = load(&text);
    assert_eq!(
        c.limits.first_burst_length, 32768,
        "a default follows the limit it depends on"
    );
    assert_eq!(c.limits.max_connections_per_source, 8);
    assert_eq!(
        c.limits.memory_per_connection_bytes, 67_108_864,
        "the default already covers MRDSL + burst"
    );
    for (key, default, min, max) in LIMIT_TABLE {
        assert!(min <= default && default <= max, "{key}");
    }
}

#[test]
fn every_error_is_collected_in_file_order() {
    let text = r#"
[limits]
max_queue_depth = 0

[[portal_group]]
tag = 1
listen = ["127.0.0.1:0"]

[[device]]
name = "disk1"
store = "ram"
block_size = 1000
size = "1G"

[[device]]
name = "disk1"
store = "file"

[[target]]
iqn = "iqn.bad"

  [[target.group]]
  name = "g"
  luns = [ { lun = 0, device = "missing" } ]
"#;
    let errs = errors(text);
    let lines: Vec<usize> = errs.iter().map(|e| e.line).collect();
    let mut sorted = lines.clone();
    sorted.sort_unstable();
    assert_eq!(lines, sorted, "sorted by position");
    let want = [
        (line_of(text, "max_queue_depth"), "limits: max_queue_depth"),
        (line_of(text, "127.0.0.1:0"), "portal_group 1: listen[0]"),
        (
            line_of(text, "block_size = 1000"),
            "device \"disk1\": block_size",
        ),
        (
            line_of(text, "name = \"disk1\"\nstore = \"file\""),
            "device \"disk1\": name",
        ),
        (line_of(text, "store = \"file\""), "device \"disk1\": path"),
        (line_of(text, "iqn.bad"), "target \"iqn.bad\": iqn"),
        (line_of(text, "name = \"g\""), "group \"g\": initiators"),
        (line_of(text, "\"missing\""), "luns[0].device"),
    ];
    assert_eq!(errs.len(), want.len(), "{errs:#?}");
    for (e, (line, field)) in errs.iter().zip(want) {
        assert_eq!(e.line, line, "{e}");
        assert!(e.field.contains(field), "{e} should name {field}");
    }
    let shown = ConfigErrors { errors: errs }.to_string();
    assert_eq!(shown.lines().count(), want.len());
    assert!(shown.lines().all(|l| l.starts_with("ferrosan.toml:")));
}

// ---- whole files ------------------------------------------------------------------------------

#[test]
fn example_file_is_valid() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/ferrosan.toml");
    let c = Config::load(path).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.portal_groups.len(), 2);
    assert_eq!(c.devices.len(), 4);
    assert_eq!(c.targets.len(), 2);
    let vmware = c.target(&n("iqn.2026-11.org.ferrosan:vmware")).unwrap();
    assert_eq!(vmware.portal_groups, vec![1]);
    assert_eq!(
        vmware
            .group_for(&n("iqn.1998-01.com.vmware:esx1-4c1d2e3f"))
            .unwrap()
            .name,
        "esx-hosts"
    );
    assert!(vmware
        .group_for(&n("iqn.1998-01.com.vmware:esx9"))
        .is_none());
    let monitor = vmware
        .group_for(&n("iqn.2005-03.org.open-iscsi:monitor"))
        .unwrap();
    assert!(monitor.luns[0].read_only);
    let backup = c.target(&n("iqn.2026-11.org.ferrosan:backup")).unwrap();
    assert_eq!(backup.portal_groups, vec![1, 2]);
    assert_eq!(
        backup
            .group_for(&n("iqn.2005-03.org.open-iscsi:anyone"))
            .unwrap()
            .name,
        "everyone-else"
    );
    assert_eq!(
        c.device("vmfs1").unwrap().store,
        StoreKind::File {
            path: "/var/lib/ferrosan/vmfs1.img".into(),
            size_bytes: Some(2 << 40)
        }
    );
    assert_eq!(
        c.device("vmfs2").unwrap().naa,
        vec![0x3f, 0x00, 0xd0, 0x0d, 0xca, 0xfe, 0x00, 0x02]
    );
    assert_eq!(
        c.device("scratch").unwrap().store,
        StoreKind::Ram {
            size_bytes: 8 << 30
        }
    );
    assert_eq!(c.limits.max_connections, 512);
    // Authentication: discovery CHAP, target-wide users, esx1's own credentials.
    assert!(matches!(c.discovery.resolved(), ResolvedAuth::Chap { .. }));
    let ResolvedAuth::Chap { users, mutual } =
        auth_for(vmware, &n("iqn.1998-01.com.vmware:esx1-4c1d2e3f"))
    else {
        panic!("esx1 must need CHAP");
    };
    assert_eq!(users[0].user, "esx1");
    assert_eq!(mutual.unwrap().user, "ferrosan-vmware");
    let ResolvedAuth::Chap { users, .. } =
        auth_for(vmware, &n("iqn.1998-01.com.vmware:esx2-5a6b7c8d"))
    else {
        panic!("esx2 must need CHAP");
    };
    assert_eq!(users[0].user, "vmware");
    assert_eq!(
        auth_for(backup, &n("iqn.2005-03.org.open-iscsi:anyone")),
        ResolvedAuth::None
    );
    assert!(vmware.source_allowed(
        vmware.group_for(&n("iqn.1998-01.com.vmware:esx2-5a6b7c8d")),
        "192.0.2.7".parse().unwrap()
    ));
    assert!(!vmware.source_allowed(None, "127.0.0.1".parse().unwrap()));
    assert!(!vmware.source_allowed(Some(monitor), "192.0.2.7".parse().unwrap()));
    assert!(vmware.source_allowed(Some(monitor), "192.0.2.99".parse().unwrap()));
}

#[test]
fn full_config_round_trips_through_to_toml() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/ferrosan.toml");
    let c = Config::load(path).unwrap();
    // The example's secrets are inline: to_toml() redacts them, and loading that text refuses
    // exactly those lines. With the secrets put back, everything else round-trips.
    let text = c.to_toml();
    for secret in [
        "d1sc0very-s3cret-2026",
        "vmw-hosts-s3cret-2026",
        "target-proves-itself-2026",
        "esx1-own-s3cret-2026",
    ] {
        assert!(!text.contains(secret), "to_toml wrote a secret:\n{text}");
    }
    let errs = Config::from_toml_str(&text, "generated.toml")
        .unwrap_err()
        .errors;
    assert_eq!(errs.len(), 4, "{errs:#?}");
    assert!(
        errs.iter().all(|e| e.message.contains("redacted")),
        "{errs:#?}"
    );
    let restored = text
        .replacen("<redacted>", "d1sc0very-s3cret-2026", 1)
        .replacen("<redacted>", "vmw-hosts-s3cret-2026", 1)
        .replacen("<redacted>", "target-proves-itself-2026", 1)
        .replacen("<redacted>", "esx1-own-s3cret-2026", 1);
    let again = Config::from_toml_str(&restored, "generated.toml")
        .unwrap_or_else(|e| panic!("{e}\n{restored}"));
    assert_eq!(c, again);
    let demo = Config::demo();
    assert_eq!(
        Config::from_toml_str(&demo.to_toml(), "demo.toml").unwrap(),
        demo
    );
}

#[test]
fn load_reports_missing_file() {
    let e = Config::load("/nonexistent/ferrosan.toml").unwrap_err();
    assert_eq!(e.errors.len(), 1);
    assert_eq!(e.errors[0].line, 0);
    assert!(
        e.to_string()
            .starts_with("/nonexistent/ferrosan.toml: file: cannot open"),
        "{e}"
    );
}

// ---- demo and CLI -------------------------------------------------------------------------------

#[test]
fn demo_config() {
    let c = Config::demo();
    assert_eq!(
        c.portal_groups,
        vec![PortalGroup {
            tag: 1,
            listen: vec!["127.0.0.1:3260".parse().unwrap()],
            nvme_listen: vec!["127.0.0.1:4420".parse().unwrap()],
            nvme_discovery_listen: None,
            alua_state: scsi::AccessState::ActiveOptimized,
            gateway: None,
            peer_address: None,
        }]
    );
    assert_eq!(c.targets.len(), 1);
    let t = &c.targets[0];
    assert_eq!(t.iqn.as_str(), DEMO_TARGET_IQN);
    assert_eq!(
        t.nqn.as_ref().map(NodeName::as_str),
        Some("nqn.2026-11.org.ferrosan:demo")
    );
    assert_eq!(t.portal_groups, vec![1]);
    assert_eq!(t.groups.len(), 1);
    assert!(t.groups[0].any_initiator);
    assert_eq!(
        t.groups[0].luns,
        vec![LunMapping {
            lun: 0,
            device: "lun0".into(),
            read_only: false
        }]
    );
    assert_eq!(
        c.devices[0].store,
        StoreKind::Ram {
            size_bytes: 1 << 30
        }
    );
    assert_eq!(c.devices[0].block_size, 512);
    assert!(t.group_for(&n("iqn.1998-01.com.vmware:anyone")).is_some());
    assert_eq!(
        Config::from_cli(&[], &[], "", &[]).unwrap(),
        c,
        "a bare `serve` is the demo"
    );
    assert!(is_valid_iscsi_name(DEMO_TARGET_IQN));
}

#[test]
fn from_cli_builds_a_quick_export() {
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let c = Config::from_cli(
        &s(&["0.0.0.0:3260", "[::]:3260"]),
        &[],
        "iqn.2026-11.org.example:quick",
        &s(&[
            "ram:512M",
            "file:/srv/a,b.img,size=10G,block_size=4096",
            "block:/dev/sdb,ro",
        ]),
    )
    .unwrap();
    assert_eq!(c.portal_groups[0].listen.len(), 2);
    assert_eq!(c.targets[0].iqn.as_str(), "iqn.2026-11.org.example:quick");
    assert_eq!(
        c.devices[0].store,
        StoreKind::Ram {
            size_bytes: 512 << 20
        }
    );
    assert_eq!(
        c.devices[1].store,
        StoreKind::File {
            path: "/srv/a,b.img".into(),
            size_bytes: Some(10 << 30)
        }
    );
    assert_eq!(c.devices[1].block_size, 4096);
    assert_eq!(
        c.devices[2].store,
        StoreKind::Block {
            path: "/dev/sdb".into()
        }
    );
    assert!(c.devices[2].read_only);
    let luns: Vec<u64> = c.targets[0].groups[0].luns.iter().map(|l| l.lun).collect();
    assert_eq!(luns, vec![0, 1, 2]);
    assert!(c.targets[0].groups[0].luns[2].read_only);
    assert!(c.targets[0].groups[0].any_initiator);
}

#[test]
fn from_cli_errors_name_the_argument() {
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let cases: [(&[&str], &str, &[&str], &str); 9] = [
        (&["nohost:3260"], "", &[], "--listen nohost:3260"),
        (&["127.0.0.1:0"], "", &[], "--listen 127.0.0.1:0"),
        (
            &["0.0.0.0:3260", "10.0.0.1:3260"],
            "",
            &[],
            "--listen 10.0.0.1:3260",
        ),
        (&[], "iqn.bad", &[], "--target iqn.bad"),
        (&[], "", &["ram:1.5G"], "--lun ram:1.5G"),
        (&[], "", &["ram"], "--lun ram"),
        (&[], "", &["tape:/dev/st0"], "--lun tape:/dev/st0"),
        (
            &[],
            "",
            &["file:/a.img,size=1000"],
            "--lun file:/a.img,size=1000",
        ),
        (
            &[],
            "",
            &["file:/a.img", "file:/a.img"],
            "--lun file:/a.img",
        ),
    ];
    for (listen, target, luns, field) in cases {
        let e = Config::from_cli(&s(listen), &[], target, &s(luns)).unwrap_err();
        assert_eq!(e.file, COMMAND_LINE);
        assert_eq!(e.line, 0);
        assert_eq!(e.field, field, "{e}");
        assert!(
            e.to_string()
                .starts_with(&format!("<command line>: {field}: ")),
            "{e}"
        );
    }
}

#[test]
fn config_doc_mentions_every_limit() {
    let doc = include_str!("../../../../docs/CONFIG.md");
    for (key, default, _, _) in LIMIT_TABLE {
        assert!(
            doc.contains(&format!("`{key}`")),
            "docs/CONFIG.md does not document limits.{key}"
        );
        let _ = default;
    }
    for key in [
        "workers",
        "identity_seed",
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
        "lun",
        "device",
        "chap_algorithms",
        "auth",
        "users",
        "mutual",
        "allowed_sources",
        "initiator",
        "user",
        "secret",
        "secret_file",
        "login_failures_max",
        "login_failure_window_s",
    ] {
        assert!(
            doc.contains(&format!("`{key}`")),
            "docs/CONFIG.md does not document {key}"
        );
    }
}

#[test]
fn config_doc_example_is_valid() {
    let doc = include_str!("../../../../docs/CONFIG.md");
    let start = doc
        .rfind("```toml\n")
        .expect("CONFIG.md has a toml example")
        + "```toml\n".len();
    let len = doc[start..].find("```").expect("closed code block");
    let c = load(&doc[start..start + len]);
    assert_eq!(c.targets[0].groups.len(), 2);
}

#[test]
fn missing_required_keys_point_at_their_table() {
    let text = format!("{BASE}\n[[device]]\nstore = \"ram\"\nsize = 4096\n");
    let e = one_error(&text, "[[device]]", "device #2: name");
    assert!(e.message.contains("missing"), "{e}");
    let text = format!("{BASE}\n[[portal_group]]\nlisten = [\"127.0.0.1:3999\"]\n");
    one_error(&text, "[[portal_group]]", "portal_group #2: tag");
}

#[test]
fn no_panic_on_any_prefix_of_the_example() {
    // Every truncation of a real file: each must give a config or located errors, never a panic.
    let text = include_str!("../../../../examples/ferrosan.toml");
    for (at, _) in text.char_indices().step_by(3) {
        if let Err(e) = Config::from_toml_str(&text[..at], FILE) {
            assert!(!e.errors.is_empty());
            assert!(e.errors.iter().all(|x| x.line >= 1 && x.column >= 1), "{e}");
        }
    }
}

// ---- authentication and access control ----------------------------------------------------

/// BASE's target with `target_keys` at target level and `group_keys` in its group, then `extra`.
fn auth_config(target_keys: &str, group_keys: &str, extra: &str) -> String {
    format!(
        r#"
[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260"]

[[device]]
name = "disk1"
store = "ram"
size = "1G"

[[target]]
iqn = "iqn.2026-11.org.ferrosan:t1"
{target_keys}

  [[target.group]]
  name = "g"
  initiators = ["iqn.2026-11.org.test:a", "iqn.2026-11.org.test:b"]
  luns = [ {{ lun = 0, device = "disk1" }} ]
{group_keys}

  [[target.group]]
  name = "rest"
  any_initiator = true
{extra}
"#
    )
}

const A: &str = "iqn.2026-11.org.test:a";
const B: &str = "iqn.2026-11.org.test:b";
const OTHER: &str = "iqn.2026-11.org.test:other";

fn users_of(auth: ResolvedAuth) -> Vec<String> {
    match auth {
        ResolvedAuth::None => Vec::new(),
        ResolvedAuth::Chap { users, .. } => users.into_iter().map(|u| u.user).collect(),
    }
}

#[test]
fn no_auth_keys_means_no_authentication() {
    let c = load(BASE);
    assert_eq!(auth_for(&c.targets[0], &n(A)), ResolvedAuth::None);
    assert_eq!(c.discovery.resolved(), ResolvedAuth::None);
}

#[test]
fn most_specific_credentials_win() {
    let text = auth_config(
        r#"users = [ { user = "target-user", secret = "target-secret-1" } ]
mutual = { user = "tgt", secret = "mutual-secret-1" }"#,
        r#"  users = [ { user = "group-user", secret = "group-secret-1" } ]"#,
        r#"
  [[target.credentials]]
  initiator = "iqn.2026-11.org.test:b"
  users = [ { user = "b-user", secret = "b-secret-0001" } ]
  mutual = { user = "tgt-b", secret = "mutual-secret-b" }"#,
    );
    let c = load(&text);
    let t = &c.targets[0];
    assert_eq!(users_of(auth_for(t, &n(A))), ["group-user"]);
    assert_eq!(users_of(auth_for(t, &n(B))), ["b-user"]);
    assert_eq!(users_of(auth_for(t, &n(OTHER))), ["target-user"]);
    let ResolvedAuth::Chap { mutual, .. } = auth_for(t, &n(A)) else {
        panic!()
    };
    assert_eq!(
        mutual.unwrap().user,
        "tgt",
        "mutual inherited from the target"
    );
    let ResolvedAuth::Chap { mutual, .. } = auth_for(t, &n(B)) else {
        panic!()
    };
    assert_eq!(mutual.unwrap().user, "tgt-b");
}

#[test]
fn group_may_opt_out_or_in() {
    let text = auth_config(
        r#"users = [ { user = "target-user", secret = "target-secret-1" } ]"#,
        r#"  auth = "none""#,
        "",
    );
    let c = load(&text);
    assert_eq!(auth_for(&c.targets[0], &n(A)), ResolvedAuth::None);
    assert_eq!(
        users_of(auth_for(&c.targets[0], &n(OTHER))),
        ["target-user"]
    );
    // A group turns CHAP on with its own users while the target has none.
    let text = auth_config(
        "",
        r#"  users = [ { user = "g", secret = "group-secret-1" } ]"#,
        "",
    );
    let c = load(&text);
    assert_eq!(users_of(auth_for(&c.targets[0], &n(A))), ["g"]);
    assert_eq!(auth_for(&c.targets[0], &n(OTHER)), ResolvedAuth::None);
}

#[test]
fn short_secrets_are_errors() {
    let text = auth_config(
        r#"users = [ { user = "u", secret = "elevenbytes" } ]"#,
        "",
        "",
    );
    let e = one_error(
        &text,
        "elevenbytes",
        "target \"iqn.2026-11.org.ferrosan:t1\": users[0].secret",
    );
    assert!(e.message.contains("12"), "{e}");
    assert!(
        !e.to_string().contains("elevenbytes"),
        "errors never echo a secret: {e}"
    );
    load(&auth_config(
        r#"users = [ { user = "u", secret = "twelve-bytes" } ]"#,
        "",
        "",
    ));
}

#[test]
fn mutual_secret_equal_to_an_initiator_secret_is_an_error() {
    let text = auth_config(
        r#"users = [ { user = "u", secret = "same-secret-123" } ]
mutual = { user = "t", secret = "same-secret-123" }"#,
        "",
        "",
    );
    let e = one_error(&text, "mutual =", "mutual.secret");
    assert!(e.message.contains("RFC 7143"), "{e}");
    // Across scopes too: discovery users against a target's mutual secret.
    let text = auth_config(
        r#"users = [ { user = "u", secret = "target-secret-1" } ]
mutual = { user = "t", secret = "discovery-secret" }"#,
        "",
        "\n[discovery]\nusers = [ { user = \"d\", secret = \"discovery-secret\" } ]\n",
    );
    one_error(&text, "mutual =", "mutual.secret");
}

#[test]
fn auth_key_rules() {
    let e = one_error(
        &auth_config(r#"auth = "chap""#, "", ""),
        "auth = \"chap\"",
        "users",
    );
    assert!(e.message.contains("needs `users`"), "{e}");
    one_error(
        &auth_config(
            r#"auth = "none"
users = [ { user = "u", secret = "target-secret-1" } ]"#,
            "",
            "",
        ),
        "auth = \"none\"",
        "auth",
    );
    one_error(
        &auth_config(r#"auth = "kerberos""#, "", ""),
        "kerberos",
        "auth",
    );
    // A group may say auth = "chap" when the target has users.
    load(&auth_config(
        r#"users = [ { user = "u", secret = "target-secret-1" } ]
auth = "none""#
            .replace("auth = \"none\"", "")
            .as_str(),
        r#"  auth = "chap""#,
        "",
    ));
    one_error(
        &auth_config("", r#"  auth = "chap""#, ""),
        "auth = \"chap\"",
        "users",
    );
    one_error(
        &auth_config(
            r#"mutual = { user = "t", secret = "mutual-secret-1" }"#,
            "",
            "",
        ),
        "mutual =",
        "mutual",
    );
    one_error(
        &auth_config(
            r#"users = [ { user = "u", secret = "target-secret-1" }, { user = "u", secret = "target-secret-2" } ]"#,
            "",
            "",
        ),
        "users = [",
        "users[1].user",
    );
    one_error(
        &auth_config(r#"users = [ { user = "u" } ]"#, "", ""),
        "users = [",
        "users[0].secret",
    );
    one_error(
        &auth_config(
            r#"users = [ { user = "u", secret = "target-secret-1", secret_file = "/x" } ]"#,
            "",
            "",
        ),
        "users = [",
        "secret_file",
    );
    one_error(
        &auth_config(r#"users = [ { secret = "target-secret-1" } ]"#, "", ""),
        "users = [",
        "users[0].user",
    );
    one_error(
        &auth_config(
            "",
            "",
            "\n  [[target.credentials]]\n  initiator = \"iqn.2026-11.org.test:a\"\n",
        ),
        "[[target.credentials]]",
        "users",
    );
    one_error(
        &auth_config("", "", "\n[discovery]\nauth = \"chap\"\n"),
        "auth = \"chap\"",
        "discovery: users",
    );
}

#[test]
fn secret_files_must_be_private() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = std::env::temp_dir().join(format!("ferrosan-secret-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let private = dir.join("private");
    std::fs::write(&private, "from-a-file-secret\n").unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o600)).unwrap();
    let open = dir.join("open");
    std::fs::write(&open, "from-a-file-secret\n").unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();

    let keys = |path: &std::path::Path| {
        format!(
            "users = [ {{ user = \"u\", secret_file = \"{}\" }} ]",
            path.display()
        )
    };
    let c = load(&auth_config(&keys(&private), "", ""));
    let ResolvedAuth::Chap { users, .. } = auth_for(&c.targets[0], &n(A)) else {
        panic!()
    };
    assert_eq!(
        users[0].secret.expose(),
        b"from-a-file-secret",
        "trailing newline dropped"
    );
    assert!(
        !format!("{c:?}").contains("from-a-file"),
        "Debug redacts secrets"
    );
    // File-backed secrets round-trip through to_toml (the path is written, not the secret).
    let text = c.to_toml();
    assert!(!text.contains("from-a-file-secret"));
    assert_eq!(Config::from_toml_str(&text, FILE).unwrap(), c);

    let e = one_error(
        &auth_config(&keys(&open), "", ""),
        "secret_file",
        "secret_file",
    );
    assert!(e.message.contains("chmod 600"), "{e}");
    let e = one_error(
        &auth_config(&keys(&dir.join("missing")), "", ""),
        "secret_file",
        "secret_file",
    );
    assert!(e.message.contains("cannot read"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn allowed_sources_parse_and_apply() {
    let c = load(&auth_config(
        r#"allowed_sources = ["127.0.0.0/8", "::1/128"]"#,
        r#"  allowed_sources = ["127.0.0.2"]"#,
        "",
    ));
    let t = &c.targets[0];
    let g = t.group_for(&n(A));
    assert!(t.source_allowed(g, "127.0.0.2".parse().unwrap()));
    assert!(
        !t.source_allowed(g, "127.0.0.1".parse().unwrap()),
        "the group narrows"
    );
    assert!(t.source_allowed(t.group_for(&n(OTHER)), "127.0.0.1".parse().unwrap()));
    assert!(t.source_allowed(t.group_for(&n(OTHER)), "::1".parse().unwrap()));
    assert!(!t.source_allowed(t.group_for(&n(OTHER)), "10.0.0.1".parse().unwrap()));
    one_error(
        &auth_config(r#"allowed_sources = ["10.0.0.1/8"]"#, "", ""),
        "allowed_sources",
        "allowed_sources[0]",
    );
    one_error(
        &auth_config(r#"allowed_sources = []"#, "", ""),
        "allowed_sources",
        "allowed_sources",
    );
}

#[test]
fn chap_algorithms_are_checked() {
    let text = format!("[server]\nchap_algorithms = [\"md5\", \"sha256\"]\n{BASE}");
    assert_eq!(
        load(&text).server.chap_algorithms,
        vec![ChapAlgorithm::Md5, ChapAlgorithm::Sha256]
    );
    assert_eq!(
        load(BASE).server.chap_algorithms,
        ChapAlgorithm::ALL.to_vec()
    );
    one_error(
        &format!("[server]\nchap_algorithms = [\"md4\"]\n{BASE}"),
        "md4",
        "chap_algorithms[0]",
    );
    one_error(
        &format!("[server]\nchap_algorithms = [\"md5\", \"md5\"]\n{BASE}"),
        "chap_algorithms",
        "chap_algorithms[1]",
    );
}

#[test]
fn ram_luns_are_bounded() {
    assert!(Config::from_cli(&[], &[], "", &["ram:16T".into()]).is_ok());
    let e = Config::from_cli(&[], &[], "", &["ram:16P".into()]).unwrap_err();
    assert!(e.to_string().contains("largest RAM LUN"), "{e}");
    let text = with_device("name = \"disk2\"\nstore = \"ram\"\nsize = \"17T\"");
    one_error(&text, "size = \"17T\"", "device \"disk2\": size");
}

/// A name as an initiator would send it (normalised).
fn n(s: &str) -> NodeName {
    NodeName::from_wire(s).unwrap()
}

/// What a login by `initiator` must do: the authentication of the group it belongs to (the
/// engine takes both from one lookup, `Topology::admit`).
fn auth_for(t: &TargetConfig, initiator: &NodeName) -> ResolvedAuth {
    t.auth_in(initiator, t.group_for(initiator))
}

#[test]
fn portal_groups_name_their_gateways() {
    let text = format!(
        "[server]\ngateway = \"gw-a\"\n{BASE}\n[[portal_group]]\ntag = 7\nlisten = [\"127.0.0.1:3999\"]\ngateway = \"gw-b\"\n"
    );
    let c = Config::from_toml_str(&text, FILE).unwrap();
    assert_eq!(c.server.gateway.as_deref(), Some("gw-a"));
    let remote = c.portal_groups.iter().find(|p| p.tag == 7).unwrap();
    assert_eq!(remote.gateway.as_deref(), Some("gw-b"));
    assert!(!remote.served_by(Some("gw-a")));
    assert!(remote.served_by(Some("gw-b")));
    // Unnamed portal groups are served by whichever gateway this is.
    let local = c.portal_groups.iter().find(|p| p.tag != 7).unwrap();
    assert!(local.served_by(Some("gw-a")) && local.served_by(None));
    // Saved and read back the same.
    let again = Config::from_toml_str(&c.to_toml(), FILE).unwrap();
    assert_eq!(again.portal_groups, c.portal_groups);
    assert_eq!(again.server.gateway, c.server.gateway);
    let bad = format!("{BASE}\n[[portal_group]]\ntag = 7\nlisten = [\"127.0.0.1:3999\"]\ngateway = \"no spaces\"\n");
    let e = one_error(&bad, "gateway = ", "gateway");
    assert!(e.message.contains("a gateway name"), "{e}");
}

#[test]
fn at_most_gateways_max_gateways_share_the_controller_ids() {
    let groups = |n: usize| -> String {
        (0..n)
            .map(|i| {
                format!(
                    "[[portal_group]]\ntag = {}\nlisten = [\"127.0.0.{}:3260\"]\ngateway = \"g{i}\"\n",
                    i + 2,
                    i + 2
                )
            })
            .collect()
    };
    let fits = format!("{BASE}\n{}", groups(GATEWAYS_MAX));
    assert!(Config::from_toml_str(&fits, FILE).is_ok());
    let over = format!("{BASE}\n{}", groups(GATEWAYS_MAX + 1));
    let errs = errors(&over);
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert!(errs[0].message.contains("at most 32"), "{}", errs[0]);
    assert_eq!(errs[0].field, "portal_group: gateway");
}

#[test]
fn a_device_knows_where_it_was_defined_but_moving_it_changes_nothing() {
    let text = "[[device]]\nname = \"a\"\nstore = \"ram\"\nsize = \"1M\"\n\n\
                [[device]]\nname = \"b\"\nstore = \"ram\"\nsize = \"1M\"\n\n\
                [[target]]\niqn = \"iqn.2024-01.dev.ferrosan:t\"\n  [[target.group]]\n  \
                name = \"g\"\n  any_initiator = true\n  luns = [ { lun = 0, device = \"a\" }, \
                { lun = 1, device = \"b\" } ]\n\
                [[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:3260\"]\n";
    let c = load(text);
    let located: Vec<String> = c.devices.iter().map(|d| d.located()).collect();
    assert_eq!(
        located,
        vec![format!("{FILE}:1: device a"), format!("{FILE}:6: device b")]
    );
    // The same devices two lines further down are the same devices (reload leaves them).
    let moved = load(&format!("\n\n{text}"));
    assert_eq!(moved.devices, c.devices);
    assert_eq!(moved.devices[1].located(), format!("{FILE}:8: device b"));
}

#[test]
fn a_gateway_listening_only_on_wildcards_needs_a_peer_address() {
    let group = "[[portal_group]]\ntag = 7\nlisten = [\"0.0.0.0:3999\"]\ngateway = \"gw-b\"\n";
    let text = format!("[server]\ngateway = \"gw-a\"\n{BASE}\n{group}");
    let e = one_error(&text, "listen = [\"0.0.0.0:3999\"]", "listen");
    assert!(e.message.contains("peer_address"), "{e}");
    // Standby gateways ship nothing: nobody dials them.
    let standby = format!("[server]\ngateway = \"gw-a\"\ngateway_standby = true\n{BASE}\n{group}");
    Config::from_toml_str(&standby, FILE).unwrap();
    // With a peer address: saved and read back the same.
    let with =
        format!("[server]\ngateway = \"gw-a\"\n{BASE}\n{group}peer_address = \"127.0.0.1:3999\"\n");
    let c = Config::from_toml_str(&with, FILE).unwrap();
    let g = c.portal_groups.iter().find(|p| p.tag == 7).unwrap();
    assert_eq!(g.peer_address, Some("127.0.0.1:3999".parse().unwrap()));
    let again = Config::from_toml_str(&c.to_toml(), FILE).unwrap();
    assert_eq!(again.portal_groups, c.portal_groups);
    // A wildcard as the peer address, or one on a group of no named gateway, is refused.
    let wild =
        format!("[server]\ngateway = \"gw-a\"\n{BASE}\n{group}peer_address = \"0.0.0.0:3999\"\n");
    let e = one_error(&wild, "peer_address", "peer_address");
    assert!(e.message.contains("not a wildcard"), "{e}");
    let unnamed = format!(
        "{BASE}\n[[portal_group]]\ntag = 7\nlisten = [\"127.0.0.1:3999\"]\npeer_address = \"127.0.0.1:3999\"\n"
    );
    let e = one_error(&unnamed, "peer_address", "peer_address");
    assert!(e.message.contains("names its gateway"), "{e}");
}

// ---- device_roots ------------------------------------------------------------------------

#[test]
fn devices_outside_device_roots_are_refused_symlinks_resolved() {
    let dir = std::env::temp_dir().join(format!("ferrosan-roots-{}", std::process::id()));
    let luns = dir.join("luns");
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir_all(&luns).unwrap();
    std::fs::create_dir_all(&elsewhere).unwrap();
    std::fs::write(elsewhere.join("secret.img"), b"").unwrap();
    // A link inside the root that points out of it counts where it points.
    let link = luns.join("link.img");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(elsewhere.join("secret.img"), &link).unwrap();
    let config = |path: &std::path::Path| {
        format!(
            "[server]\ndevice_roots = [{:?}]\n\n[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:3260\"]\n\n[[device]]\nname = \"d\"\nstore = \"file\"\npath = {:?}\nsize = \"1M\"\n",
            luns.display().to_string(),
            path.display().to_string()
        )
    };
    // Inside: an existing file's directory, or a file still to be created there.
    load(&config(&luns.join("new.img")));
    for outside in [
        elsewhere.join("secret.img"),
        link.clone(),
        luns.join("../elsewhere/x.img"),
    ] {
        let text = config(&outside);
        let e = one_error(&text, "path =", "path");
        assert!(e.message.contains("outside server.device_roots"), "{e}");
    }
    // Without device_roots, any path.
    assert!(super::within_roots(&elsewhere.join("secret.img"), &[]).is_ok());
    // A root may be a single device or file.
    assert!(super::within_roots(&link, &[elsewhere.join("secret.img")]).is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_target_is_an_nvme_subsystem_under_its_nqn_on_its_groups_nvme_listeners() {
    let text = BASE
        .replace(
            "listen = [\"127.0.0.1:3260\"]",
            "listen = [\"127.0.0.1:3260\"]\nnvme_listen = [\"127.0.0.1\", \"[::1]:4421\"]",
        )
        .replace(
            "iqn = \"iqn.2026-11.org.ferrosan:t1\"",
            "iqn = \"iqn.2026-11.org.ferrosan:t1\"\nnqn = \"nqn.2026-11.org.ferrosan:t1\"",
        )
        .replace(
            "any_initiator = true",
            "initiators = [\"nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-0016d3cca427\", \"iqn.1993-08.org.debian:01:a\"]",
        );
    let c = load(&text);
    assert_eq!(
        c.portal_groups[0].nvme_listen,
        vec![
            "127.0.0.1:4420".parse::<SocketAddr>().unwrap(),
            "[::1]:4421".parse().unwrap()
        ]
    );
    let nqn = c.targets[0].nqn.clone().unwrap();
    assert_eq!(nqn.as_str(), "nqn.2026-11.org.ferrosan:t1");
    assert!(c.targets[0].groups[0].initiators[0].is_nqn());
    // Written back and read again: the same config.
    assert_eq!(load(&c.to_toml()), c);
}

#[test]
fn nqns_and_nvme_listeners_are_checked_like_their_iscsi_twins() {
    let nqn = |v: &str| {
        BASE.replace(
            "iqn = \"iqn.2026-11.org.ferrosan:t1\"",
            &format!("iqn = \"iqn.2026-11.org.ferrosan:t1\"\nnqn = \"{v}\""),
        )
    };
    one_error(&nqn("iqn.2026-11.org.ferrosan:t1"), "nqn =", "nqn");
    one_error(&nqn("nqn.2026-11.org.ferrosan:T1"), "nqn =", "nqn");
    one_error(&nqn("nqn.2014-08.org.nvmexpress.discovery"), "nqn =", "nqn");
    one_error(&nqn("nqn.bad"), "nqn =", "nqn");
    let as_iqn = BASE.replace(
        "iqn = \"iqn.2026-11.org.ferrosan:t1\"",
        "iqn = \"nqn.2026-11.org.ferrosan:t1\"",
    );
    one_error(&as_iqn, "iqn = \"nqn", "iqn");
    let overlapping = BASE.replace(
        "listen = [\"127.0.0.1:3260\"]",
        "listen = [\"127.0.0.1:3260\"]\nnvme_listen = [\"0.0.0.0:3260\"]",
    );
    one_error(&overlapping, "nvme_listen", "nvme_listen[0]");
}

#[test]
fn a_portal_group_may_be_nvme_only() {
    let text = BASE.replace(
        "listen = [\"127.0.0.1:3260\"]",
        "listen = [\"127.0.0.1:3260\"]\n\n[[portal_group]]\ntag = 2\nnvme_listen = [\"127.0.0.1:4421\"]",
    );
    let c = load(&text);
    assert!(c.portal_groups[1].listen.is_empty());
    assert_eq!(c.portal_groups[1].nvme_listen.len(), 1);
    assert_eq!(load(&c.to_toml()), c);
    // Neither: still an error.
    let neither = BASE.replace(
        "listen = [\"127.0.0.1:3260\"]",
        "listen = [\"127.0.0.1:3260\"]\n\n[[portal_group]]\ntag = 2\nlisten = []",
    );
    one_error(&neither, "listen = []", "listen");
}

#[test]
fn a_named_nvme_discovery_listener_overlaps_no_other_listener() {
    let e = errors(
        r#"
[[portal_group]]
tag = 1
nvme_listen = ["127.0.0.1:4420"]
nvme_discovery_listen = ["127.0.0.1:4420"]
"#,
    );
    assert!(
        e.iter()
            .any(|e| e.field.contains("nvme_discovery_listen[0]") && e.message.contains("overlaps")),
        "{e:?}"
    );
}

// ---- pools -------------------------------------------------------------------------------

#[test]
fn an_lvm_pool_names_a_thin_pool_and_owns_its_block_devices() {
    let text = format!(
        "{BASE}\n[[pool]]\nname = \"fast\"\nkind = \"lvm\"\nvg = \"vg0\"\nthin_pool = \"thin\"\n\
         \n[[device]]\nname = \"v1\"\nstore = \"block\"\npath = \"/dev/vg0/v1\"\n\
         \n[[device]]\nname = \"v2\"\nstore = \"block\"\npath = \"/dev/vg1/v2\"\n"
    );
    let c = load(&text);
    let pool = &c.pools[0];
    assert_eq!(
        pool.kind,
        PoolKind::Lvm(store::lvm::ThinPool {
            vg: "vg0".into(),
            pool: "thin".into()
        })
    );
    assert_eq!(pool.dir(), None);
    assert_eq!(pool.image("v1"), None);
    assert_eq!(c.pool_of(c.device("v1").unwrap()), Some(pool));
    // Another volume group's LV is no volume of the pool.
    assert_eq!(c.pool_of(c.device("v2").unwrap()), None);
    let again = load(&c.to_toml());
    assert_eq!(again.pools, c.pools);
}

#[test]
fn two_pools_never_hold_one_namespace_of_volumes() {
    let two = |a: &str, b: &str| {
        format!("{BASE}\n[[pool]]\nname = \"a\"\n{a}\n\n[[pool]]\nname = \"b\"\n{b}\n")
    };
    let lvm = |thin: &str| format!("kind = \"lvm\"\nvg = \"vg0\"\nthin_pool = \"{thin}\"");
    let e = one_error(&two(&lvm("t1"), &lvm("t2")), "vg0", "pool \"b\": vg");
    assert!(e.message.contains("pool a's already"), "{e}");
    let dir = "kind = \"dir\"\npath = \"/srv/ferrosan/pool\"";
    one_error(&two(dir, dir), "/srv/ferrosan/pool", "pool \"b\": path");
    let rbd = "kind = \"rbd\"\npool = \"rbd\"";
    one_error(&two(rbd, rbd), "pool = \"rbd\"", "pool \"b\": pool");
    // Other VGs, directories or Ceph pools: both load.
    let c = load(&two(
        &lvm("t1"),
        "kind = \"lvm\"\nvg = \"vg1\"\nthin_pool = \"t1\"",
    ));
    assert_eq!(c.pools.len(), 2);
    let c = load(&two(rbd, "kind = \"rbd\"\npool = \"other\""));
    assert_eq!(c.pools.len(), 2);
}

#[test]
fn an_lvm_pool_needs_lvm_names_and_nothing_of_other_kinds() {
    let pool = |lines: &str| format!("{BASE}\n[[pool]]\nname = \"p\"\nkind = \"lvm\"\n{lines}\n");
    one_error(&pool("vg = \"-vg\"\nthin_pool = \"t\""), "-vg", "vg");
    one_error(
        &pool("vg = \"vg\"\nthin_pool = \"t/x\""),
        "t/x",
        "thin_pool",
    );
    one_error(&pool("vg = \"vg\""), "[[pool]]", "thin_pool");
    let e = errors(&pool("vg = \"vg\"\nthin_pool = \"t\"\npath = \"/srv\""));
    let why = "only for kind = \"dir\", not for kind = \"lvm\"";
    assert!(
        e.iter()
            .any(|e| e.field.contains("path") && e.message == why),
        "{e:#?}"
    );
    // Each kind refuses the others' keys, with the kind each belongs to.
    let e = errors(&format!(
        "{BASE}\n[[pool]]\nname = \"p\"\nkind = \"rbd\"\npool = \"rbd\"\npath = \"/srv\"\nthin_pool = \"t\"\n"
    ));
    let fields: Vec<(&str, &str)> = e
        .iter()
        .map(|e| (e.field.as_str(), e.message.as_str()))
        .collect();
    assert_eq!(
        fields,
        [
            (
                "pool \"p\": path",
                "only for kind = \"dir\", not for kind = \"rbd\""
            ),
            (
                "pool \"p\": thin_pool",
                "only for kind = \"lvm\", not for kind = \"rbd\""
            )
        ],
        "{e:#?}"
    );
    let e = errors(&format!(
        "{BASE}\n[[pool]]\nname = \"p\"\npath = \"/srv/p\"\nvg = \"vg\"\n"
    ));
    assert!(e.iter().any(|e| e.field.contains("vg")), "{e:#?}");
    let e = errors(&format!("{BASE}\n[[pool]]\nname = \"p\"\nkind = \"zfs\"\n"));
    assert!(e[0].message.contains("\"lvm\""), "{e:#?}");
}

// ---- names that reach tools: never read as their options -----------------------------------

#[test]
fn no_object_name_starts_with_a_dash() {
    // A volume or snapshot name becomes an LVM LV name or a file name: never an option.
    for bad in ["-x", "--config=log", "-", ".", ".."] {
        assert!(check_object_name(bad).is_err(), "{bad:?}");
    }
    for good in ["a", "vm-1", "x.y_z", "a-", ".hidden"] {
        assert_eq!(check_object_name(good), Ok(()), "{good:?}");
    }
    let e = errors(&format!(
        "{BASE}\n[[device]]\nname = \"-d\"\nstore = \"ram\"\nsize = \"1M\"\n"
    ));
    assert!(e.iter().any(|e| e.field.contains("name")), "{e:#?}");
}

#[test]
fn pool_names_of_lvm_and_ceph_follow_their_rules_at_load() {
    let lvm = |vg: &str, thin: &str| {
        format!(
            "{BASE}\n[[pool]]\nname = \"p\"\nkind = \"lvm\"\nvg = {vg:?}\nthin_pool = {thin:?}\n"
        )
    };
    for (vg, thin, field) in [
        ("--config=log{file=/x}", "t", "vg"),
        ("vg", "-t", "thin_pool"),
        ("vg", "snapshot1", "thin_pool"),
        ("vg", "pvmove0", "thin_pool"),
        ("vg", "t_tdata", "thin_pool"),
        ("..", "t", "vg"),
        ("v g", "t", "vg"),
    ] {
        let text = lvm(vg, thin);
        let needle = if field == "vg" { vg } else { thin };
        one_error(&text, needle, field);
    }
    load(&lvm("vg-0.a+b_c", "thin"));
    let rbd =
        |pool: &str| format!("{BASE}\n[[pool]]\nname = \"p\"\nkind = \"rbd\"\npool = {pool:?}\n");
    for bad in ["-rbd", "--id=admin", "r b", "", "a/b"] {
        one_error(&rbd(bad), &format!("pool = {bad:?}"), "pool");
    }
    load(&rbd("rbd.ssd_1-x"));
}

#[test]
fn a_pool_made_in_memory_is_checked_as_loading_checks_it() {
    // What `ctl pool add` builds before any side effect (create_dir_all, lvs).
    let pool = |kind| PoolConfig {
        name: "p".into(),
        kind,
    };
    let lvm = |vg: &str, thin: &str| {
        pool(PoolKind::Lvm(store::lvm::ThinPool {
            vg: vg.into(),
            pool: thin.into(),
        }))
    };
    let e = lvm("--config=log{file=/tmp/x}", "t")
        .check(&[])
        .unwrap_err();
    assert!(e.0.starts_with("vg: "), "{e}");
    assert!(lvm("vg", "snapshot")
        .check(&[])
        .unwrap_err()
        .0
        .starts_with("thin_pool: "));
    assert_eq!(lvm("vg", "thin").check(&[]), Ok(()));
    let rbd = |p: &str, conf: Option<&str>| {
        pool(PoolKind::Rbd {
            pool: p.into(),
            conf: conf.map(PathBuf::from),
            client: None,
        })
    };
    assert!(rbd("-p", None)
        .check(&[])
        .unwrap_err()
        .0
        .starts_with("pool: "));
    assert!(rbd("rbd", Some(""))
        .check(&[])
        .unwrap_err()
        .0
        .starts_with("ceph_conf: "));
    assert_eq!(rbd("rbd", Some("/etc/ceph/ceph.conf")).check(&[]), Ok(()));
    let dir = |p: &str| pool(PoolKind::Dir { path: p.into() });
    assert!(dir("relative")
        .check(&[])
        .unwrap_err()
        .0
        .starts_with("path: "));
    let roots = [PathBuf::from("/nonexistent-root")];
    assert!(dir("/srv/p")
        .check(&roots)
        .unwrap_err()
        .0
        .contains("device_roots"));
    let mut named = dir("/srv/p");
    named.name = "-p".into();
    assert!(named.check(&[]).unwrap_err().0.starts_with("name: "));
}

#[test]
fn volume_and_snapshot_names_of_an_lvm_pool_are_lv_names() {
    let lvm = PoolConfig {
        name: "p".into(),
        kind: PoolKind::Lvm(store::lvm::ThinPool {
            vg: "vg".into(),
            pool: "thin".into(),
        }),
    };
    let dir = PoolConfig {
        name: "d".into(),
        kind: PoolKind::Dir {
            path: "/srv/d".into(),
        },
    };
    for pool in [&lvm, &dir] {
        assert!(pool.check_volume_name("-v").is_err());
        assert!(pool.check_snapshot_name("v", "-s").is_err());
        assert_eq!(pool.check_volume_name("v1"), Ok(()));
        assert_eq!(pool.check_snapshot_name("v1", "s1"), Ok(()));
    }
    // LVM reserves these; a directory pool does not care.
    assert!(lvm.check_volume_name("snapshot-db").is_err());
    assert!(lvm.check_volume_name("v_tmeta").is_err());
    assert_eq!(dir.check_volume_name("snapshot-db"), Ok(()));
    // VOLUME+SNAPSHOT is one LV name: 127 characters at most.
    let long = "v".repeat(64);
    assert!(lvm.check_snapshot_name(&long, &long).is_err());
    assert_eq!(dir.check_snapshot_name(&long, &long), Ok(()));
}

// ---- control characters in paths: refused, never written into a unit or rule ---------------

/// A path that would become a systemd directive if printed on a line of its own.
const DIRECTIVE: &str = "/srv/x\\nExecStartPre=+/bin/sh -c id";

#[test]
fn no_path_of_a_config_file_holds_a_control_character() {
    let server = |line: &str| format!("[server]\n{line}\n{BASE}");
    let cases = [
        (server(&format!("state_dir = \"{DIRECTIVE}\"")), "state_dir"),
        (server(&format!("control_socket = \"{DIRECTIVE}\"")), "control_socket"),
        (server(&format!("device_roots = [\"{DIRECTIVE}\"]")), "device_roots[0]"),
        (
            with_device(&format!("name = \"f\"\nstore = \"file\"\npath = \"{DIRECTIVE}\"\nsize = \"1M\"")),
            "path",
        ),
        (
            with_device("name = \"b\"\nstore = \"block\"\npath = \"/dev/x\\u007f\""),
            "path",
        ),
        (
            with_device(&format!("name = \"r\"\nstore = \"rbd\"\nimage = \"p/i\"\nceph_conf = \"{DIRECTIVE}\"")),
            "ceph_conf",
        ),
        (
            format!("{BASE}\n[[pool]]\nname = \"p\"\npath = \"{DIRECTIVE}\"\n"),
            "path",
        ),
        (
            format!("{BASE}\n[[pool]]\nname = \"p\"\nkind = \"rbd\"\npool = \"rbd\"\nceph_conf = \"/etc/ceph/\\t.conf\"\n"),
            "ceph_conf",
        ),
        (
            format!("{BASE}\n[discovery]\nusers = [ {{ user = \"u\", secret_file = \"{DIRECTIVE}\" }} ]\n"),
            "secret_file",
        ),
        (
            BASE.replace(
                "iqn = \"iqn.2026-11.org.ferrosan:t1\"",
                &format!(
                    "iqn = \"iqn.2026-11.org.ferrosan:t1\"\nnqn = \"nqn.2026-11.org.ferrosan:t1\"\n\
                     tls_keys = [ {{ host = \"nqn.2026-11.test:h\", key_file = \"{DIRECTIVE}\" }} ]"
                ),
            ),
            "key_file",
        ),
    ];
    for (text, field) in cases {
        let e = errors(&text);
        assert!(
            e.iter()
                .any(|e| e.field.ends_with(field) && e.message.contains("control character")),
            "{field}: {e:#?}"
        );
    }
}

#[test]
fn no_path_of_a_quick_export_or_a_ctl_device_holds_a_control_character() {
    for spec in [
        format!("file:{DIRECTIVE},size=1M"),
        "block:/dev/sd\na".to_string(),
        "rbd:p/i,conf=/etc/ceph/\r.conf".to_string(),
    ] {
        let spec = spec.replace("\\n", "\n");
        let e = Config::device_from_spec("d", &spec).unwrap_err();
        assert!(e.0.contains("control character"), "{spec:?}: {e}");
    }
}

#[test]
fn a_pool_made_in_memory_holds_no_control_character_either() {
    let dir = PoolConfig {
        name: "p".into(),
        kind: PoolKind::Dir {
            path: DIRECTIVE.replace("\\n", "\n").into(),
        },
    };
    let e = dir.check(&[]).unwrap_err();
    assert!(
        e.0.starts_with("path: ") && e.0.contains("control character"),
        "{e}"
    );
    let rbd = PoolConfig {
        name: "p".into(),
        kind: PoolKind::Rbd {
            pool: "rbd".into(),
            conf: Some("/etc/ceph/x\nExecStartPre=+/bin/sh".into()),
            client: None,
        },
    };
    assert!(rbd.check(&[]).unwrap_err().0.starts_with("ceph_conf: "));
}

#[test]
fn a_devices_lineage_is_checked_and_round_trips() {
    let with = |lines: &str| {
        format!(
            "[[portal_group]]\ntag = 1\nlisten = [\"127.0.0.1:3260\"]\n\n[[device]]\nname = \"c\"\nstore = \"ram\"\nsize = \"1M\"\n{lines}\n"
        )
    };
    let text = with("clone_of = \"a@monday\"\ncreated = \"2026-12-01T23:50:35Z\"");
    let config = Config::from_toml_str(&text, FILE).unwrap();
    let lineage = &config.devices[0].lineage;
    assert_eq!(lineage.clone_of.as_deref(), Some("a@monday"));
    assert_eq!(lineage.created.as_deref(), Some("2026-12-01T23:50:35Z"));
    let again = Config::from_toml_str(&config.to_toml(), FILE).unwrap();
    assert_eq!(again.devices[0].lineage, *lineage);
    for (bad, field) in [
        ("clone_of = \"a@\"", "clone_of"),
        ("clone_of = \"-x\"", "clone_of"),
        ("created = \"yesterday\"", "created"),
    ] {
        let e = errors(&with(bad));
        assert!(e[0].field.ends_with(field), "{bad}: {e:?}");
    }
    // Made now: an RFC 3339 UTC time to the second.
    let now = super::Lineage::now(None).created.unwrap();
    assert!(now.ends_with('Z') && now.len() == 20, "{now}");
}

/// A config with every kind of table and most keys set, in `dir` (a secret file and a TLS
/// key file are written there).
fn every_key(dir: &std::path::Path) -> String {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::create_dir_all(dir).unwrap();
    std::fs::create_dir_all(dir.join("pool")).unwrap();
    for (name, secret) in [
        ("secret", "from-a-file-2026"),
        ("mutual", "mutual-from-a-file"),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, format!("{secret}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let key = nvme::tls::ConfiguredKey::new(Some(nvme::tls::CipherHash::Sha256), &[7; 32]);
    let key_file = dir.join("host.key");
    std::fs::write(&key_file, format!("{}\n", key.unwrap().encode())).unwrap();
    std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let d = dir.display();
    format!(
        r#"[server]
workers = 3
chap_algorithms = ["sha256", "md5"]
dhchap_hashes = ["sha512", "sha256"]
dhchap_groups = ["ffdhe3072", "null"]
metrics_listen = "127.0.0.1:9100"
io_uring = false
state_dir = "{d}/state"
control_socket = "{d}/ctl.sock"
control_socket_group = "disk"
device_roots = ["{d}", "/dev"]
api_listen = "127.0.0.1:8443"
api_cert = "{d}/api.crt"
api_key = "{d}/api.key"

[limits]
max_sessions = 77
memory_per_connection_bytes = 4194304

[discovery]
auth = "chap"
users = [ {{ user = "disc", secret = "d1sc0very-s3cret-2026" }} ]
mutual = {{ user = "tgt", secret_file = "{d}/mutual" }}

[[portal_group]]
tag = 1
listen = ["127.0.0.1:3260", "[::1]:3260"]
nvme_listen = ["127.0.0.1:4420"]
nvme_discovery_listen = ["127.0.0.1:8009"]

[[portal_group]]
tag = 2
listen = ["127.0.0.2:3260"]
alua_state = "standby"
nvme_discovery_listen = []

[[pool]]
name = "files"
path = "{d}/pool"

[[pool]]
name = "ceph"
kind = "rbd"
pool = "rbd"
ceph_conf = "/etc/ceph/ceph.conf"
ceph_client = "client.iscsi"

[[pool]]
name = "thin"
kind = "lvm"
vg = "vg0"
thin_pool = "tp"

[[device]]
name = "mem"
store = "ram"
size = "16M"
block_size = 4096
vendor = "ACME"
product = "FAST DISK"
write_cache = true

[[device]]
name = "vol"
store = "file"
path = "{d}/pool/vol.img"
size = "1G"
cache = "page"
thin = false
read_only = true

[[device]]
name = "grown"
store = "file"
path = "{d}/grown.img"
serial = "own-serial-1"
naa = "0x6001405123456789abcdef0123456789"
offline = true
clone_of = "disk1@monday"
created = "2026-12-01T23:50:35Z"

[[device]]
name = "null"
store = "block"
path = "/dev/null"
cache = "direct"

[[device]]
name = "img"
store = "rbd"
image = "rbd/img"
ceph_conf = "/etc/ceph/ceph.conf"
ceph_client = "client.iscsi"

[[target]]
iqn = "iqn.2026-11.org.ferrosan:every"
nqn = "nqn.2026-11.org.ferrosan:every"
alias = "every key"
portal_groups = [2, 1]
users = [ {{ user = "t", secret = "target-users-2026" }}, {{ user = "t2", secret_file = "{d}/secret" }} ]
mutual = {{ user = "me", secret = "target-proves-2026" }}
allowed_sources = ["10.0.0.0/8", "::1"]
tls_keys = [ {{ host = "nqn.2026-11.org.ferrosan:host", key_file = "{d}/host.key", derivation = "libnvme-1.15" }} ]

  [[target.group]]
  name = "hosts"
  initiators = ["iqn.2026-11.org.ferrosan:h1", "iqn.2026-11.org.ferrosan:h2"]
  luns = [ {{ lun = 0, device = "mem" }}, {{ lun = 7, device = "vol", read_only = true }} ]
  auth = "none"
  allowed_sources = ["192.0.2.0/24"]

  [[target.group]]
  name = "rest"
  any_initiator = true
  luns = [ {{ lun = 1, device = "img" }}, {{ lun = 2, device = "null" }} ]
  users = [ {{ user = "g", secret = "group-secret-2026" }} ]

  [[target.credentials]]
  initiator = "iqn.2026-11.org.ferrosan:h1"
  users = [ {{ user = "h1", secret = "h1-own-secret-2026" }} ]
  mutual = {{ user = "me1", secret = "target-to-h1-2026" }}

[[target]]
iqn = "iqn.2026-11.org.ferrosan:plain"
  [[target.group]]
  name = "all"
  any_initiator = true
  luns = [ {{ lun = 0, device = "grown" }} ]
"#
    )
}

/// `revalidated` gives what loading the rendered text gives (debug builds check each call
/// against the text: this feeds it every kind of table, and edits the text refuses).
#[test]
fn revalidated_is_loading_the_rendered_text() {
    let dir = std::env::temp_dir().join(format!("ferrosan-revalidate-{}", std::process::id()));
    let text = every_key(&dir);
    let c = load(&text);
    assert_eq!(c.revalidated("x").unwrap(), c);
    let gateways = BASE
        .replace(
            "listen = [\"127.0.0.1:3260\"]",
            "listen = [\"127.0.0.1:3260\"]\ngateway = \"a\"\npeer_address = \"127.0.0.1:3270\"\n\
             [[portal_group]]\ntag = 2\nlisten = [\"127.0.0.2:3260\"]\ngateway = \"b\"",
        )
        .replace(
            "store = \"ram\"\nsize = \"1G\"",
            "store = \"rbd\"\nimage = \"rbd/disk1\"",
        );
    let gateways = format!(
        "[server]\ngateway = \"a\"\ngateway_standby = true\ngateway_alua = \"explicit\"\n{gateways}"
    );
    let g = load(&gateways);
    assert_eq!(g.revalidated("x").unwrap(), g);
    let demo = Config::demo();
    assert_eq!(demo.revalidated("x").unwrap(), demo);

    // Edits the config refuses, alone and together: the same errors, in the text's order,
    // without lines.
    type Edit = fn(&mut Config);
    let edits: [(&str, Edit); 12] = [
        ("device \"mem\": name", |c| {
            Arc::make_mut(&mut c.devices[1]).name = "mem".into()
        }),
        ("device \"grown\": path", |c| {
            Arc::make_mut(&mut c.devices[2]).store = c.devices[1].store.clone()
        }),
        ("luns[1].device", |c| {
            std::sync::Arc::make_mut(&mut c.targets[0]).groups[0].luns[1].device = "nope".into()
        }),
        ("luns[1].lun", |c| {
            std::sync::Arc::make_mut(&mut c.targets[0]).groups[0].luns[1].lun = 0
        }),
        ("device \"bad name\": name", |c| {
            Arc::make_mut(&mut c.devices[0]).name = "bad name".into()
        }),
        ("device \"mem\": size", |c| {
            Arc::make_mut(&mut c.devices[0]).store = StoreKind::Ram { size_bytes: 0 }
        }),
        ("device \"grown\": naa", |c| {
            Arc::make_mut(&mut c.devices[2]).naa = vec![1, 2, 3]
        }),
        ("device \"grown\": serial", |c| {
            Arc::make_mut(&mut c.devices[2]).serial = String::new()
        }),
        // Found before its path is, written after it: the text's order wins.
        ("device \"grown\": block_size", |c| {
            Arc::make_mut(&mut c.devices[2]).block_size = 1000
        }),
        ("group \"hosts\": any_initiator", |c| {
            std::sync::Arc::make_mut(&mut c.targets[0]).groups[0].any_initiator = true
        }),
        ("iqn", |c| {
            std::sync::Arc::make_mut(&mut c.targets[1]).iqn = c.targets[0].iqn.clone()
        }),
        ("mutual", |c| {
            std::sync::Arc::make_mut(&mut c.targets[0])
                .auth
                .mutual
                .as_mut()
                .unwrap()
                .secret = iscsi::chap::Secret::new(b"target-users-2026")
        }),
    ];
    let mut all = c.clone();
    for (field, edit) in edits {
        let mut edited = c.clone();
        edit(&mut edited);
        edit(&mut all);
        let errs = edited.revalidated("verb").unwrap_err().errors;
        assert!(
            errs.iter().any(|e| e.field.contains(field)),
            "{field}: {errs:#?}"
        );
        assert!(errs
            .iter()
            .all(|e| (e.file.as_str(), e.line, e.column) == ("verb", 0, 0)));
    }
    let errs = all.revalidated("verb").unwrap_err().errors;
    assert!(errs.len() >= 8, "{errs:#?}");

    // A number TOML cannot hold takes the text's way, and its error.
    let mut huge = c.clone();
    Arc::make_mut(&mut huge.devices[0]).store = StoreKind::Ram {
        size_bytes: u64::MAX,
    };
    let errs = huge.revalidated("verb").unwrap_err().errors;
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert_eq!(errs[0].line, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn revalidated_devices_keep_their_origin() {
    let mut c = load(BASE);
    assert_eq!(c.devices[0].located(), format!("{FILE}:6: device disk1"));
    c.devices
        .push(Config::device_from_spec("more", "ram:1M").unwrap().into());
    let again = c.revalidated("(ctl edit)").unwrap();
    assert_eq!(
        again.devices[0].located(),
        format!("{FILE}:6: device disk1")
    );
    assert_eq!(again.devices[1].located(), "device more");
}

/// Validation by difference (`revalidated_from`) answers what the whole way answers, the
/// same config or the same errors, and takes its quick way for device edits alone.
#[test]
fn revalidated_from_is_the_whole_way() {
    let dir = std::env::temp_dir().join(format!("ferrosan-delta-{}", std::process::id()));
    let mut base = load(&every_key(&dir));
    let spare = |name: &str| Config::device_from_spec(name, "ram:1M").unwrap();
    base.devices.push(spare("spare").into());
    let base = base.revalidated("x").unwrap();
    type Edit = fn(&mut Config);
    // (what, taken by difference, edit)
    let edits: [(&str, bool, Edit); 20] = [
        ("nothing", true, |_| {}),
        ("a device added", true, |c| {
            c.devices
                .push(Config::device_from_spec("more", "ram:1M").unwrap().into())
        }),
        ("an unmapped device removed", true, |c| {
            c.devices.retain(|d| d.name != "spare")
        }),
        ("a device's serial changed", true, |c| {
            Arc::make_mut(&mut c.devices[1]).serial = "another-1".into()
        }),
        ("two devices added", true, |c| {
            for name in ["a1", "a2"] {
                c.devices
                    .push(Config::device_from_spec(name, "ram:1M").unwrap().into());
            }
        }),
        ("a mapped device removed", false, |c| {
            c.devices.retain(|d| d.name != "vol")
        }),
        ("a name held twice", false, |c| {
            let again = c.devices[0].clone();
            c.devices.push(again)
        }),
        ("two new devices of one name", false, |c| {
            for _ in 0..2 {
                c.devices
                    .push(Config::device_from_spec("twin", "ram:1M").unwrap().into());
            }
        }),
        ("another's path", false, |c| {
            let mut d = Config::device_from_spec("more", "ram:1M").unwrap();
            d.store = c.devices[1].store.clone();
            c.devices.push(d.into())
        }),
        ("another's path, written another way", false, |c| {
            let mut d = Config::device_from_spec("more", "ram:1M").unwrap();
            let StoreKind::File { path, .. } = &c.devices[1].store else {
                panic!("vol is a file")
            };
            let (dir, file) = (path.parent().unwrap(), path.file_name().unwrap());
            d.store = StoreKind::Block {
                path: dir.join(".").join(file),
            };
            c.devices.push(d.into())
        }),
        ("another's image", false, |c| {
            let mut d = Config::device_from_spec("more", "ram:1M").unwrap();
            d.store = c.device("img").unwrap().store.clone();
            c.devices.push(d.into())
        }),
        ("another's NAA", false, |c| {
            let mut d = Config::device_from_spec("more", "ram:1M").unwrap();
            d.naa = c.devices[2].naa.clone();
            c.devices.push(d.into())
        }),
        ("a bad name", false, |c| {
            c.devices
                .push(Config::device_from_spec("ok", "ram:1M").unwrap().into());
            Arc::make_mut(c.devices.last_mut().unwrap()).name = "bad name".into();
        }),
        ("a path outside the roots", false, |c| {
            let mut d = Config::device_from_spec("more", "ram:1M").unwrap();
            d.store = StoreKind::Block {
                path: "/elsewhere/disk".into(),
            };
            c.devices.push(d.into())
        }),
        ("a LUN renumbered", true, |c| {
            std::sync::Arc::make_mut(&mut c.targets[0]).groups[0].luns[1].lun = 9
        }),
        ("a LUN mapped twice", false, |c| {
            std::sync::Arc::make_mut(&mut c.targets[0]).groups[0].luns[1].lun = 0
        }),
        ("a LUN of no device", false, |c| {
            std::sync::Arc::make_mut(&mut c.targets[0]).groups[0].luns[1].device = "nope".into()
        }),
        ("a device removed with its LUN", true, |c| {
            std::sync::Arc::make_mut(&mut c.targets[0]).groups[0]
                .luns
                .retain(|l| l.device != "vol");
            c.devices.retain(|d| d.name != "vol");
        }),
        ("a device added and mapped", true, |c| {
            c.devices
                .push(Config::device_from_spec("more", "ram:1M").unwrap().into());
            let lun = |device: &str| LunMapping {
                lun: 3,
                device: device.into(),
                read_only: false,
            };
            std::sync::Arc::make_mut(&mut c.targets[0]).groups[1]
                .luns
                .push(lun("more"));
        }),
        ("the [server] changed", false, |c| c.server.workers += 1),
    ];
    let said = |r: &Result<Config, ConfigErrors>| match r {
        Ok(c) => Ok(c.clone()),
        Err(e) => Err(e.errors.iter().map(|e| e.to_string()).collect::<Vec<_>>()),
    };
    for (what, quick, edit) in edits {
        let mut edited = base.clone();
        edit(&mut edited);
        let whole = edited.revalidated("verb");
        let mut probe = edited.clone();
        assert_eq!(
            super::delta::by_difference(&mut probe, &base, "verb"),
            quick,
            "{what}"
        );
        let added = (edited.devices.len() == base.devices.len() + 1
            && edited.devices[..base.devices.len()] == base.devices[..])
            .then(|| edited.devices.last().cloned())
            .flatten();
        let from = edited.revalidated_from(&base, "verb");
        assert_eq!(said(&from), said(&whole), "{what}");
        // A device added alone: `check_added` says what the whole way says.
        if let Some(device) = added {
            let errors = |r: Result<(), ConfigErrors>| r.map_err(|e| e.to_string());
            let whole = whole.map(drop).map_err(|e| e.to_string());
            assert_eq!(errors(base.check_added(&device, "verb")), whole, "{what}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_api_takes_its_certificate_and_key_together() {
    let server = |keys: &str| format!("[server]\napi_listen = \"127.0.0.1:8443\"\n{keys}\n{BASE}");
    let c = load(&server(""));
    assert_eq!(c.server.api_listen, Some("127.0.0.1:8443".parse().unwrap()));
    assert_eq!(
        (c.server.api_cert, c.server.api_key),
        (None, None),
        "a self-signed pair"
    );
    let both = load(&server(
        "api_cert = \"/etc/f/api.crt\"\napi_key = \"/etc/f/api.key\"",
    ));
    assert_eq!(
        both.server.api_key.as_deref(),
        Some(Path::new("/etc/f/api.key"))
    );
    let clients = load(&server("api_client_ca = \"/etc/f/clients.pem\""));
    assert_eq!(
        clients.server.api_client_ca.as_deref(),
        Some(Path::new("/etc/f/clients.pem"))
    );
    one_error(
        &server("api_client_ca = \"clients.pem\""),
        "clients.pem",
        "api_client_ca",
    );
    one_error(
        &server("api_cert = \"/etc/f/api.crt\""),
        "api_cert",
        "api_cert, api_key",
    );
    one_error(
        &server("api_key = \"relative.key\"\napi_cert = \"/a.crt\""),
        "relative.key",
        "api_key",
    );
    one_error(
        "[server]\napi_listen = \"nowhere\"\n",
        "nowhere",
        "api_listen",
    );
}
