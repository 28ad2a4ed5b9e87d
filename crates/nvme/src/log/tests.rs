use super::*;

fn glp(lid: u8, lsp: u8, numd: u32, offset: u64) -> Sqe {
    let mut s = Sqe([0; 64]);
    s.0[0] = 0x02;
    let cdw10 = u32::from(lid) | u32::from(lsp) << 8 | (numd & 0xFFFF) << 16;
    s.0[40..44].copy_from_slice(&cdw10.to_le_bytes());
    s.0[44..48].copy_from_slice(&(numd >> 16).to_le_bytes());
    s.0[48..52].copy_from_slice(&(offset as u32).to_le_bytes());
    s.0[52..56].copy_from_slice(&((offset >> 32) as u32).to_le_bytes());
    s
}

#[test]
fn get_log_page_takes_a_0s_based_dword_count_and_a_dword_offset() {
    let g = GetLogPage::decode(&glp(lid::ANA, 1, 1023, 0)).unwrap();
    assert_eq!((g.lid, g.lsp, g.offset, g.len), (0x0C, 1, 0, 4096));
    let g = GetLogPage::decode(&glp(lid::DISCOVERY, 0, 0x1_0000, 1024)).unwrap();
    assert_eq!((g.offset, g.len), (1024, 0x1_0001 * 4));
    assert_eq!(
        GetLogPage::decode(&glp(lid::SMART, 0, 0, 2)),
        Err(Status::INVALID_FIELD)
    );
    // The window: what was asked of the page, short at its end, refused past it.
    let page: Vec<u8> = (0..=255).collect();
    let g = GetLogPage::decode(&glp(lid::SMART, 0, 3, 248)).unwrap();
    assert_eq!(g.window(&page).unwrap(), &page[248..]);
    let g = GetLogPage::decode(&glp(lid::SMART, 0, 1, 8)).unwrap();
    assert_eq!(g.window(&page).unwrap(), &page[8..16]);
    let g = GetLogPage::decode(&glp(lid::SMART, 0, 0, 256)).unwrap();
    assert_eq!(g.window(&page).unwrap(), &[] as &[u8]);
    let g = GetLogPage::decode(&glp(lid::SMART, 0, 0, 260)).unwrap();
    assert_eq!(g.window(&page), Err(Status::INVALID_FIELD));
}

#[test]
fn smart_counts_in_thousands_of_512_byte_units_rounded_up() {
    let d = smart(&Health {
        read_bytes: 512_000 * 3 + 1,
        written_bytes: 512_000,
        read_commands: 7,
        write_commands: 9,
        media_errors: 2,
        power_on_hours: 5,
    });
    assert_eq!(d.len(), 512);
    assert_eq!(
        (d[0], u16::from_le_bytes([d[1], d[2]]), d[3], d[4], d[5]),
        (0, 300, 100, 10, 0)
    );
    let at = |i: usize| u64::from_le_bytes(d[i..i + 8].try_into().unwrap());
    assert_eq!(
        (at(32), at(48), at(64), at(80), at(128), at(160)),
        (4, 1, 7, 9, 5, 2)
    );
    assert_eq!(error_log(64).len(), 4096);
}

#[test]
fn changed_namespaces_overflow_to_all_ones() {
    let d = changed_namespaces(&[3, 1]);
    assert_eq!(
        (&d[0..4], &d[4..8], &d[8..12]),
        (&[3, 0, 0, 0][..], &[1, 0, 0, 0][..], &[0; 4][..])
    );
    let many: Vec<u32> = (1..=1025).collect();
    let d = changed_namespaces(&many);
    assert_eq!(&d[0..8], &[0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0]);
}

#[test]
fn the_ana_page_lists_each_group_with_its_state_and_namespaces() {
    let groups = [
        AnaGroup {
            id: 1,
            state: AnaState::Optimized,
            nsids: vec![1, 2],
        },
        AnaGroup {
            id: 2,
            state: AnaState::Inaccessible,
            nsids: vec![3],
        },
    ];
    let d = ana(9, &groups, false);
    assert_eq!(d.len(), 16 + 32 + 8 + 32 + 4);
    assert_eq!(u64::from_le_bytes(d[0..8].try_into().unwrap()), 9);
    assert_eq!(u16::from_le_bytes([d[8], d[9]]), 2);
    assert_eq!(&d[16..24], &[1, 0, 0, 0, 2, 0, 0, 0]);
    assert_eq!(d[32], 0x01);
    assert_eq!(&d[48..56], &[1, 0, 0, 0, 2, 0, 0, 0]);
    assert_eq!(&d[56..60], &[2, 0, 0, 0]);
    assert_eq!(d[72], 0x03);
    assert_eq!(&d[88..92], &[3, 0, 0, 0]);
    // Groups only: no namespace lists, counts of zero.
    let d = ana(9, &groups, true);
    assert_eq!(d.len(), 16 + 32 + 32);
    assert_eq!(&d[20..24], &[0; 4]);
}

#[test]
fn a_discovery_log_has_a_header_and_an_entry_per_port() {
    let e = DiscoveryEntry {
        kind: SubsystemType::Nvm,
        port_id: 1,
        ipv6: false,
        address: "192.0.2.10".into(),
        port: 4420,
        subnqn: "nqn.2026-11.org.ferrosan:demo".into(),
        tls_required: false,
    };
    let tls = DiscoveryEntry {
        port_id: 2,
        tls_required: true,
        ..e.clone()
    };
    let d = discovery(3, &[e.clone(), tls]);
    assert_eq!(d.len(), 3 * 1024);
    assert_eq!(u64::from_le_bytes(d[0..8].try_into().unwrap()), 3);
    assert_eq!(u64::from_le_bytes(d[8..16].try_into().unwrap()), 2);
    let entry = &d[1024..2048];
    assert_eq!(&entry[0..4], &[3, 1, 2, 0x04]);
    assert_eq!(&entry[4..10], &[1, 0, 0xFF, 0xFF, 32, 0]);
    assert_eq!(&entry[32..37], b"4420\0");
    assert_eq!(&entry[256..285], b"nqn.2026-11.org.ferrosan:demo");
    assert_eq!(&entry[512..523], b"192.0.2.10\0");
    assert_eq!(entry[768], 0, "no security type in the clear");
    let tls = &d[2048..3072];
    assert_eq!(tls[4], 2);
    assert_eq!(
        tls[3], 0x05,
        "TREQ: secure channel required, SQ flow control may be off"
    );
    assert_eq!(tls[768], 2, "TSAS: TLS 1.3");
    assert_eq!(&entry[10..12], &[0, 0], "no entry flags on a subsystem");
}

#[test]
fn discovery_services_are_described_as_persistent() {
    let here = DiscoveryEntry {
        kind: SubsystemType::CurrentDiscovery,
        port_id: 1,
        ipv6: true,
        address: "2001:db8::1".into(),
        port: 8009,
        subnqn: crate::fabrics::DISCOVERY_NQN.into(),
        tls_required: false,
    };
    let referral = DiscoveryEntry {
        kind: SubsystemType::Referral,
        address: "2001:db8::2".into(),
        port_id: 2,
        ..here.clone()
    };
    let d = discovery(1, &[here, referral]);
    for (at, subtype) in [(1024, 3), (2048, 1)] {
        let e = &d[at..at + 1024];
        assert_eq!(e[1], 2, "IPv6");
        assert_eq!(e[2], subtype);
        assert_eq!(
            u16::from_le_bytes([e[10], e[11]]),
            EFLAGS_EPCSD,
            "explicit persistent connections supported, not a duplicate"
        );
        assert_eq!(&e[256..292], crate::fabrics::DISCOVERY_NQN.as_bytes());
    }
}
