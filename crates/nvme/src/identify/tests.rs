use super::*;

fn controller() -> Controller {
    Controller {
        serial: "0123456789abcdef".into(),
        model: "ferrosan".into(),
        firmware: "0.1.0".into(),
        cntlid: 0x21,
        kind: ControllerType::Io,
        mdts: 8,
        maxcmd: 128,
        nn: 32,
        oncs: ONCS_COMPARE | ONCS_DSM | ONCS_WRITE_ZEROES | ONCS_RESERVATIONS,
        fused_compare_write: true,
        volatile_write_cache: false,
        cmic: CMIC_MULTI_PORT | CMIC_MULTI_CONTROLLER | CMIC_ANA,
        oaes: OAES_NS_ATTRIBUTE | OAES_ANA_CHANGE,
        aerl: 3,
        elpe: 63,
        kas: 10,
        anatt: 10,
        anagrpmax: 2,
        nanagrpid: 2,
        subnqn: "nqn.2026-11.org.ferrosan:demo".into(),
        in_capsule: 8192,
    }
}

fn le16(d: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([d[at], d[at + 1]])
}

fn le32(d: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(d[at..at + 4].try_into().unwrap())
}

#[test]
fn identify_controller_puts_each_field_where_hosts_read_it() {
    let d = controller().encode();
    assert_eq!(d.len(), 4096);
    assert_eq!(&d[4..24], b"0123456789abcdef    ");
    assert_eq!(&d[24..32], b"ferrosan");
    assert!(d[32..64].iter().all(|&b| b == b' '));
    assert_eq!(&d[64..72], b"0.1.0   ");
    assert_eq!((d[76], d[77]), (0x0B, 8));
    assert_eq!(le16(&d, 78), 0x21);
    assert_eq!(le32(&d, 80), 0x0002_0000);
    assert_eq!(le32(&d, 92), 0x900);
    assert_eq!(le32(&d, 96) & 1, 1, "128-bit host ID");
    assert_eq!(d[111], 1);
    assert_eq!((d[258], d[262]), (3, 63));
    assert_eq!(le16(&d, 320), 10);
    assert_eq!(
        (d[342], d[343], le32(&d, 344), le32(&d, 348)),
        (10, 0x1F, 2, 2)
    );
    assert_eq!((d[512], d[513], le16(&d, 514)), (0x66, 0x44, 128));
    assert_eq!(le32(&d, 516), 32);
    assert_eq!(le16(&d, 520), 0x2D);
    assert_eq!(le16(&d, 522), 1);
    assert_eq!(d[525], 0);
    assert_eq!(le32(&d, 536), 0x0010_0001);
    assert_eq!(&d[768..768 + 29], b"nqn.2026-11.org.ferrosan:demo");
    assert_eq!(d[768 + 29], 0);
    // IOCCSZ: (64 + 8192) / 16; IORCSZ: 1; one SGL descriptor.
    assert_eq!((le32(&d, 1792), le32(&d, 1796), d[1803]), (516, 1, 1));
}

#[test]
fn without_ana_the_ana_fields_are_zero_and_strings_are_printable() {
    let mut c = controller();
    c.cmic = CMIC_MULTI_CONTROLLER;
    c.model = "dev\u{7}\u{e9}ice".into();
    let d = c.encode();
    assert_eq!(&d[342..352], &[0; 10]);
    assert_eq!(&d[24..30], b"device");
}

#[test]
fn identify_namespace_reports_size_format_sharing_and_identity() {
    let ns = Namespace {
        blocks: 1 << 21,
        block_shift: 12,
        thin: true,
        shared: true,
        reservations: true,
        write_protected: false,
        anagrpid: 1,
        nguid: [0xA5; 16],
        eui64: [0x5A; 8],
    };
    let d = ns.encode();
    for at in [0, 8, 16] {
        assert_eq!(
            u64::from_le_bytes(d[at..at + 8].try_into().unwrap()),
            1 << 21
        );
    }
    assert_eq!(
        (d[24], d[25], d[26], d[30], d[31], d[33]),
        (1, 0, 0, 1, 0xFF, 0x09)
    );
    assert_eq!(le32(&d, 92), 1);
    assert_eq!(d[99], 0);
    assert_eq!(&d[104..120], &[0xA5; 16]);
    assert_eq!(&d[120..128], &[0x5A; 8]);
    assert_eq!((le16(&d, 128), d[130]), (0, 12));
    let thick = Namespace {
        thin: false,
        write_protected: true,
        ..ns
    }
    .encode();
    assert_eq!((thick[24], thick[33], thick[99]), (0, 0, 1));
}

#[test]
fn the_active_namespace_list_starts_after_the_given_id() {
    let d = active_namespaces(&[7, 1, 3, 3], 0);
    assert_eq!(
        (le32(&d, 0), le32(&d, 4), le32(&d, 8), le32(&d, 12)),
        (1, 3, 7, 0)
    );
    let d = active_namespaces(&[7, 1, 3], 3);
    assert_eq!((le32(&d, 0), le32(&d, 4)), (7, 0));
    let many: Vec<u32> = (1..=2000).collect();
    let d = active_namespaces(&many, 0);
    assert_eq!((le32(&d, 0), le32(&d, 4092)), (1, 1024));
}

#[test]
fn namespace_descriptors_list_eui64_nguid_and_uuid() {
    let d = ns_descriptors(&[1; 8], &[2; 16], &[3; 16]);
    assert_eq!(d.len(), 4096);
    assert_eq!(&d[0..4], &[1, 8, 0, 0]);
    assert_eq!(&d[4..12], &[1; 8]);
    assert_eq!(&d[12..16], &[2, 16, 0, 0]);
    assert_eq!(&d[32..36], &[3, 16, 0, 0]);
    assert_eq!(&d[36..52], &[3; 16]);
    assert_eq!(d[52], 0, "the list ends with a zero NIDT");
}
