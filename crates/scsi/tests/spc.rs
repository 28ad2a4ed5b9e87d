mod common;
use common::*;
use scsi::sense::SENSE_BYTES_MAX;
use scsi::{AccessState, Command, LuSettings, Nexus, PortGroup, Status, TargetPort};
use std::sync::Arc;

fn inquiry(evpd: bool, page: u8, alloc: u16) -> [u8; 6] {
    let [hi, lo] = alloc.to_be_bytes();
    [0x12, u8::from(evpd), page, hi, lo, 0]
}

#[test]
fn invalid_opcodes_and_malformed_cdbs() {
    let mut t = T::new();
    for op in [0x04u8, 0x05, 0x07, 0x3B, 0x3C, 0x48, 0x7F, 0xFF] {
        assert_sense(
            &t.err(&[op, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]),
            5,
            0x20,
            0,
        );
    }
    assert_sense(&t.err(&[], &[]), 5, 0x20, 0);
    // A READ(10) opcode in a 6-byte CDB.
    invalid_cdb(&t.err(&[0x28, 0, 0, 0, 0, 0], &[]));
    // NACA and LINK are unsupported; the pointer names the control byte.
    let s = t.err(&[0x00, 0, 0, 0, 0, 0x04], &[]);
    assert_eq!(s.sense_key_specific, Some([0xCA, 0, 5]));
    invalid_cdb(&t.err(&[0x00, 0, 0, 0, 0, 0x01], &[]));
    // Vendor-specific control bits are fine.
    t.ok(&[0x00, 0, 0, 0, 0, 0xC0], &[]);
}

#[test]
fn standard_inquiry() {
    let mut t = T::new();
    let d = t.ok(&inquiry(false, 0, 255), &[]);
    assert_eq!(d.len(), 96);
    // TPGS = 01b (implicit ALUA), 3PC.
    assert_eq!(&d[..8], &[0x00, 0x00, 0x06, 0x12, 91, 0x18, 0x00, 0x02]);
    assert_eq!(&d[8..16], b"FERROSAN");
    assert_eq!(&d[16..32], b"RAM DISK        ");
    assert_eq!(&d[32..36], b"0001");
    assert_eq!(
        &d[58..66],
        &[0x00, 0xA0, 0x04, 0x60, 0x04, 0xC0, 0x09, 0x60]
    );
    // Allocation length truncation.
    let c = t.run(&inquiry(false, 0, 36), &[]);
    assert_eq!(
        (c.status, c.transfer_len, t.data_in.len()),
        (Status::Good, 36, 36)
    );
    let c = t.run(&inquiry(false, 0, 0), &[]);
    assert_eq!(
        (c.status, c.transfer_len, t.data_in.len()),
        (Status::Good, 0, 0)
    );
    t.limit = 10;
    let c = t.run(&inquiry(false, 0, 96), &[]);
    assert_eq!((c.transfer_len, t.data_in.len()), (96, 10));
    t.limit = 1 << 24;
    // Page code without EVPD, CMDDT.
    let s = t.err(&inquiry(false, 0x80, 255), &[]);
    assert_eq!(s.sense_key_specific, Some([0xC0, 0, 2]));
    invalid_cdb(&t.err(&[0x12, 0x02, 0, 0, 255, 0], &[]));
}

#[test]
fn vpd_pages() {
    let mut t = T::new();
    let d = t.ok(&inquiry(true, 0x00, 255), &[]);
    assert_eq!(d, [0, 0, 0, 6, 0x00, 0x80, 0x83, 0xB0, 0xB1, 0xB2]);
    for &page in &d[4..] {
        let p = t.ok(&inquiry(true, page, 1024), &[]);
        assert_eq!(p[1], page);
        assert_eq!(usize::from(u16::from_be_bytes([p[2], p[3]])) + 4, p.len());
    }
    invalid_cdb(&t.err(&inquiry(true, 0x99, 255), &[]));
    assert_eq!(
        t.ok(&inquiry(true, 0x80, 255), &[]),
        b"\x00\x80\x00\x06fs0001"
    );
    assert_eq!(t.ok(&inquiry(true, 0x80, 3), &[]).len(), 3);
}

#[test]
fn device_identification_page() {
    let mut t = T::new();
    let d = t.ok(&inquiry(true, 0x83, 1024), &[]);
    let mut at = 4;
    let mut seen = Vec::new();
    while at < d.len() {
        let (code_set, kind, len) = (d[at] & 0x0F, d[at + 1], usize::from(d[at + 3]));
        seen.push((code_set, kind, d[at + 4..at + 4 + len].to_vec()));
        at += 4 + len;
    }
    assert_eq!(at, d.len());
    assert_eq!(
        seen[0],
        (
            1,
            0x03,
            vec![0x50, 0x01, 0x40, 0x50, 0x12, 0x34, 0x56, 0x78]
        )
    );
    assert_eq!(seen[1], (2, 0x01, b"FERROSANfs0001".to_vec()));
    assert_eq!(seen[2], (1, 0x14, vec![0, 0, 0, 1]));
    assert_eq!(seen[3], (1, 0x15, vec![0, 0, 0, 1]), "target port group");
    let port = b"iqn.2026-11.org.ferrosan:demo,t,0x0001";
    assert_eq!(seen[4].1, 0x18);
    assert_eq!(seen[4].2.len() % 4, 0);
    assert_eq!(&seen[4].2[..port.len()], port);
    assert!(seen[4].2[port.len()..].iter().all(|&b| b == 0));
    assert_eq!(seen[5].1, 0x28);
    assert!(seen[5].2.starts_with(b"iqn.2026-11.org.ferrosan:demo\0"));
}

fn rtpg(format: u8, alloc: u32) -> [u8; 12] {
    let [a, b, c, d] = alloc.to_be_bytes();
    [0xA3, (format << 5) | 0x0A, 0, 0, 0, 0, a, b, c, d, 0, 0]
}

/// A nexus through port 2 of a target with two ports, each its own group: 1 optimized,
/// 2 non-optimized.
fn two_group_nexus() -> Nexus {
    let groups: Arc<[PortGroup]> = Arc::new([
        PortGroup {
            id: 1,
            state: AccessState::ActiveOptimized,
            ports: vec![1],
        },
        PortGroup {
            id: 2,
            state: AccessState::ActiveNonOptimized,
            ports: vec![2],
        },
    ]);
    Nexus {
        id: 9,
        initiator_port: "iqn.1994-05.com.example:mp,i,0x00023d000009".into(),
        target_port: Arc::new(TargetPort {
            relative_id: 2,
            name: "iqn.2026-11.org.ferrosan:demo,t,0x0002".into(),
            target_name: "iqn.2026-11.org.ferrosan:demo".into(),
            group: 2,
            groups,
            shipped: false,
        }),
    }
}

#[test]
fn report_target_port_groups_lists_every_group_with_its_state() {
    let mut t = T::new();
    t.nexus = two_group_nexus();
    let descriptor = |id: u8, state: u8, port: u8| [state, 0x0F, 0, id, 0, 0, 0, 1, 0, 0, 0, port];
    let mut want = vec![0, 0, 0, 24];
    want.extend_from_slice(&descriptor(1, 0x0, 1));
    want.extend_from_slice(&descriptor(2, 0x1, 2));
    assert_eq!(t.ok(&rtpg(0, 1024), &[]), want, "length-only header");
    // Extended header: format type 1, no implicit transition time; the length covers it.
    let mut ext = vec![0, 0, 0, 28, 0x10, 0, 0, 0];
    ext.extend_from_slice(&want[4..]);
    assert_eq!(t.ok(&rtpg(1, 1024), &[]), ext, "extended header");
    // The allocation length truncates; the length field still tells the whole size.
    assert_eq!(t.ok(&rtpg(0, 6), &[]), want[..6].to_vec());
    assert_eq!(t.ok(&rtpg(0, 0), &[]), Vec::<u8>::new());
    // Standard INQUIRY: MULTIP, the target has two ports; a one-port target does not say so.
    assert_eq!(t.ok(&inquiry(false, 0, 96), &[])[6] & 0x10, 0x10);
    let mut single = T::new();
    assert_eq!(single.ok(&inquiry(false, 0, 96), &[])[6] & 0x10, 0);
    // VPD 83h names the group of the port the command came through.
    let d = t.ok(&inquiry(true, 0x83, 1024), &[]);
    assert!(
        d.windows(8).any(|w| w == [0x01, 0x15, 0, 4, 0, 0, 0, 2]),
        "no target port group 2 designator in {d:02x?}"
    );
}

#[test]
fn report_target_port_groups_rejects_unknown_formats_and_reserved_bits() {
    let mut t = T::new();
    for format in 2..8 {
        let s = t.err(&rtpg(format, 64), &[]);
        assert_eq!(s.sense_key_specific, Some([0xCF, 0, 1]), "format {format}");
    }
    for byte in [2, 3, 4, 5, 10] {
        let mut cdb = rtpg(0, 64);
        cdb[byte] = 0x01;
        invalid_cdb(&t.err(&cdb, &[]));
    }
    // Listed by REPORT SUPPORTED OPERATION CODES (one command: A3h, service action 0Ah).
    let d = t.ok(&[0xA3, 0x0C, 0x02, 0xA3, 0, 0x0A, 0, 0, 1, 0, 0, 0], &[]);
    assert_eq!(d[1] & 0x07, 0x03, "supported, as the standard says");
    assert_eq!(&d[4..6], &[0xA3, 0xEA]);
}

#[test]
fn block_limits_and_provisioning_pages() {
    let mut t = T::new();
    let d = t.ok(&inquiry(true, 0xB0, 255), &[]);
    assert_eq!(d.len(), 64);
    let be32 = |at: usize| u32::from_be_bytes(d[at..at + 4].try_into().unwrap());
    assert_eq!(d[4] & 1, 1); // WSNZ
    assert_eq!(d[5], 128); // max compare and write
    assert_eq!(&d[6..8], &[0, 8]); // optimal transfer length granularity: one physical block
    assert_eq!(be32(8), (8 << 20) / 512);
    assert_eq!(be32(20), 1 << 20);
    assert_eq!(be32(24), 256);
    assert_eq!(be32(28), 8);
    assert_eq!(u64::from_be_bytes(d[36..44].try_into().unwrap()), 0xFFFF);
    let d = t.ok(&inquiry(true, 0xB1, 255), &[]);
    assert_eq!(&d[4..6], &[0, 1]);
    let d = t.ok(&inquiry(true, 0xB2, 255), &[]);
    assert_eq!(d, [0, 0xB2, 0, 4, 0, 0xE4, 0x02, 0]);

    let mut thick = T::with(
        LuSettings {
            thin: false,
            ..LuSettings::default()
        },
        4 * MIB,
    );
    let d = thick.ok(&inquiry(true, 0xB2, 255), &[]);
    assert_eq!(d, [0, 0xB2, 0, 4, 0, 0, 0, 0]);
    let d = thick.ok(&inquiry(true, 0xB0, 255), &[]);
    assert_eq!(&d[20..32], &[0; 12]);
}

#[test]
fn unit_attention_lifecycle() {
    let mut t = T::new();
    t.lu.nexus_added(1);
    t.lu.nexus_added(2);
    // INQUIRY and REPORT LUNS neither report nor clear it.
    t.ok(&inquiry(false, 0, 96), &[]);
    t.ok(&[0xA0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], &[]);
    assert_sense(&t.err(&[0, 0, 0, 0, 0, 0], &[]), 0x06, 0x29, 0x00);
    t.ok(&[0, 0, 0, 0, 0, 0], &[]);
    // Nexus 2 still has its own; REQUEST SENSE reports and clears it.
    t.nexus = nexus(2);
    let d = t.ok(&[0x03, 0, 0, 0, 252, 0], &[]);
    assert_eq!((d[0], d[2], d[12], d[13]), (0x70, 0x06, 0x29, 0x00));
    let d = t.ok(&[0x03, 0, 0, 0, 252, 0], &[]);
    assert_eq!((d[2], d[12]), (0x00, 0x00));
    t.ok(&[0, 0, 0, 0, 0, 0], &[]);
    // LU reset: every nexus, the requester's included.
    t.lu.logical_unit_reset(2);
    assert_sense(&t.err(&read10(0, 1), &[]), 0x06, 0x29, 0x03);
    t.nexus = nexus(1);
    assert_sense(&t.err(&read10(0, 1), &[]), 0x06, 0x29, 0x03);
    t.ok(&read10(0, 1), &[]);
    // Capacity change.
    t.lu.capacity_changed();
    assert_sense(&t.err(&[0, 0, 0, 0, 0, 0], &[]), 0x06, 0x2A, 0x09);
    t.lu.reported_luns_changed();
    t.lu.inquiry_data_changed();
    assert_sense(&t.err(&[0, 0, 0, 0, 0, 0], &[]), 0x06, 0x3F, 0x0E);
    assert_sense(&t.err(&[0, 0, 0, 0, 0, 0], &[]), 0x06, 0x3F, 0x03);
    t.ok(&[0, 0, 0, 0, 0, 0], &[]);
    // A lost nexus has nothing queued when it comes back without a new login.
    t.lu.capacity_changed();
    t.lu.nexus_lost(1);
    t.ok(&[0, 0, 0, 0, 0, 0], &[]);
    // The UA comes before an invalid opcode.
    t.lu.nexus_added(1);
    assert_sense(&t.err(&[0xFF, 0, 0, 0, 0, 0], &[]), 0x06, 0x29, 0x00);
}

#[test]
fn request_sense_formats_and_allocation() {
    let mut t = T::new();
    let d = t.ok(&[0x03, 0, 0, 0, 252, 0], &[]);
    assert_eq!(d.len(), 18);
    assert_eq!(&d[..8], &[0x70, 0, 0, 0, 0, 0, 0, 10]);
    let d = t.ok(&[0x03, 1, 0, 0, 252, 0], &[]);
    assert_eq!(d, [0x72, 0, 0, 0, 0, 0, 0, 0]);
    t.lu.nexus_added(1);
    let d = t.ok(&[0x03, 1, 0, 0, 4, 0], &[]);
    assert_eq!(d, [0x72, 0x06, 0x29, 0x00]);
    invalid_cdb(&t.err(&[0x03, 2, 0, 0, 252, 0], &[]));
}

fn mode_sense6(dbd: bool, pc: u8, page: u8, subpage: u8, alloc: u8) -> [u8; 6] {
    [
        0x1A,
        if dbd { 0x08 } else { 0 },
        (pc << 6) | page,
        subpage,
        alloc,
        0,
    ]
}
fn mode_sense10(llbaa: bool, dbd: bool, pc: u8, page: u8, alloc: u16) -> [u8; 10] {
    let [hi, lo] = alloc.to_be_bytes();
    let b1 = if llbaa { 0x10 } else { 0 } | if dbd { 0x08 } else { 0 };
    [0x5A, b1, (pc << 6) | page, 0, 0, 0, 0, hi, lo, 0]
}

#[test]
fn mode_sense_all_pages_layout() {
    let mut t = T::new();
    let d = t.ok(&mode_sense6(false, 0, 0x3F, 0, 255), &[]);
    assert_eq!(usize::from(d[0]) + 1, d.len());
    assert_eq!((d[1], d[2], d[3]), (0, 0x10, 8)); // DPOFUA, one short block descriptor
    assert_eq!(&d[4..12], &[0, 0, 0x20, 0, 0, 0, 2, 0]);
    // Pages in ascending order: caching (WCE set), control, informational exceptions.
    assert_eq!(&d[12..15], &[0x08, 0x12, 0x04]);
    assert_eq!(&d[32..35], &[0x0A, 0x0A, 0x00]);
    assert_eq!(&d[44..47], &[0x1C, 0x0A, 0x08]);
    assert_eq!(d.len(), 56);
    // Subpage FFh with all pages is the same set here.
    assert_eq!(t.ok(&mode_sense6(false, 0, 0x3F, 0xFF, 255), &[]), d);
    // DBD drops the descriptor.
    let d = t.ok(&mode_sense6(true, 0, 0x08, 0, 255), &[]);
    assert_eq!(d.len(), 4 + 20);
    assert_eq!((d[0], d[3]), (23, 0));
    // Changeable: only WCE and D_SENSE.
    let d = t.ok(&mode_sense6(true, 1, 0x3F, 0, 255), &[]);
    assert_eq!(&d[4..7], &[0x08, 0x12, 0x04]);
    assert!(d[7..24].iter().all(|&b| b == 0));
    assert_eq!(&d[24..29], &[0x0A, 0x0A, 0x04, 0x00, 0x08]);
    assert!(d[29..36].iter().all(|&b| b == 0));
    // Default equals the configured WCE.
    let d = t.ok(&mode_sense6(true, 2, 0x08, 0, 255), &[]);
    assert_eq!(d[6], 0x04);
    // Saved values are not supported.
    assert_sense(
        &t.err(&mode_sense6(false, 3, 0x3F, 0, 255), &[]),
        5,
        0x39,
        0,
    );
    invalid_cdb(&t.err(&mode_sense6(false, 0, 0x19, 0, 255), &[]));
    invalid_cdb(&t.err(&mode_sense6(false, 0, 0x08, 0x01, 255), &[]));
}

#[test]
fn mode_sense_residuals() {
    let mut t = T::new();
    let c = t.run(&mode_sense6(false, 0, 0x3F, 0, 4), &[]);
    assert_eq!(
        (c.status, c.transfer_len, t.data_in.len()),
        (Status::Good, 4, 4)
    );
    assert_eq!(t.data_in[0], 55); // the header still tells the full length
    let c = t.run(&mode_sense6(false, 0, 0x3F, 0, 255), &[]);
    assert_eq!(c.transfer_len, 56);
}

#[test]
fn mode_sense_10_and_long_lba() {
    let mut t = T::new();
    let d = t.ok(&mode_sense10(false, false, 0, 0x0A, 1024), &[]);
    assert_eq!(usize::from(u16::from_be_bytes([d[0], d[1]])) + 2, d.len());
    assert_eq!((d[3], d[4], d[7]), (0x10, 0, 8));
    assert_eq!(d.len(), 8 + 8 + 12);
    let d = t.ok(&mode_sense10(true, false, 0, 0x0A, 1024), &[]);
    assert_eq!((d[4], d[7]), (1, 16));
    assert_eq!(u64::from_be_bytes(d[8..16].try_into().unwrap()), 8192);
    assert_eq!(u32::from_be_bytes(d[20..24].try_into().unwrap()), 512);
    assert_eq!(d.len(), 8 + 16 + 12);
}

fn caching_page(wce: bool) -> Vec<u8> {
    let mut p = vec![0u8; 20];
    p[0] = 0x08;
    p[1] = 0x12;
    p[2] = if wce { 0x04 } else { 0 };
    p
}
fn mode_select6(params: &[u8]) -> [u8; 6] {
    [0x15, 0x10, 0, 0, params.len() as u8, 0]
}

#[test]
fn mode_select_wce_round_trip_and_ua_for_others() {
    let mut t = T::new();
    t.lu.nexus_added(1);
    t.lu.nexus_added(2);
    assert_sense(&t.err(&[0; 6], &[]), 6, 0x29, 0);
    let mut params = vec![0u8; 4];
    params.extend(caching_page(false));
    t.ok(&mode_select6(&params), &params);
    assert!(!t.lu.write_cache_enabled());
    let d = t.ok(&mode_sense6(true, 0, 0x08, 0, 255), &[]);
    assert_eq!(d[6], 0);
    // Nexus 2: POWER ON first, then MODE PARAMETERS CHANGED.
    t.nexus = nexus(2);
    assert_sense(&t.err(&[0; 6], &[]), 6, 0x29, 0);
    assert_sense(&t.err(&[0; 6], &[]), 6, 0x2A, 0x01);
    t.ok(&[0; 6], &[]);
    // Setting the same value again raises nothing.
    t.ok(&mode_select6(&params), &params);
    t.nexus = nexus(1);
    t.ok(&[0; 6], &[]);
}

#[test]
fn mode_select_validation() {
    let mut t = T::new();
    let mut params = vec![0u8; 4];
    params.extend(caching_page(true));
    // A non-changeable bit (RCD) set.
    let mut bad = params.clone();
    bad[6] |= 0x01;
    let s = t.err(&mode_select6(&bad), &bad);
    assert_sense(&s, 5, 0x26, 0);
    assert_eq!(s.sense_key_specific, Some([0x88, 0, 6]));
    // Wrong page length.
    let mut bad = params.clone();
    bad[5] = 0x10;
    bad.truncate(22);
    assert_sense(&t.err(&mode_select6(&bad), &bad), 5, 0x26, 0);
    // Unknown page, subpage format.
    let bad = [0u8, 0, 0, 0, 0x19, 2, 0, 0];
    assert_sense(&t.err(&mode_select6(&bad), &bad), 5, 0x26, 0);
    let bad = [0u8, 0, 0, 0, 0x48, 2, 0, 0];
    assert_sense(&t.err(&mode_select6(&bad), &bad), 5, 0x26, 0);
    // Truncated page, truncated header.
    assert_sense(
        &t.err(&mode_select6(&params[..10]), &params[..10]),
        5,
        0x1A,
        0,
    );
    assert_sense(
        &t.err(&mode_select6(&params[..2]), &params[..2]),
        5,
        0x1A,
        0,
    );
    // SP=1, PF=0.
    invalid_cdb(&t.err(&[0x15, 0x11, 0, 0, 24, 0], &params));
    invalid_cdb(&t.err(&[0x15, 0x00, 0, 0, 24, 0], &params));
    // Zero length is a no-op.
    t.ok(&[0x15, 0x10, 0, 0, 0, 0], &[]);
    // A block descriptor with our block size passes; another size does not.
    let mut with_bd = vec![0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 2, 0];
    with_bd.extend(caching_page(true));
    t.ok(&mode_select6(&with_bd), &with_bd);
    with_bd[10] = 0x10;
    assert_sense(&t.err(&mode_select6(&with_bd), &with_bd), 5, 0x26, 0);
}

#[test]
fn d_sense_switches_to_descriptor_format() {
    let mut t = T::new();
    t.lu.nexus_added(1);
    let _ = t.err(&[0; 6], &[]);
    let mut params = vec![0u8; 8];
    params.extend_from_slice(&[0x0A, 0x0A, 0x04, 0x10, 0, 0, 0, 0, 0xFF, 0xFF, 0, 0]);
    let mut cdb = [0x55, 0x10, 0, 0, 0, 0, 0, 0, 0, 0];
    cdb[8] = params.len() as u8;
    t.ok(&cdb, &params);
    let s = t.err(&read10(u32::MAX, 1), &[]);
    assert!(s.descriptor_format);
    let mut out = [0u8; SENSE_BYTES_MAX];
    assert_eq!(s.encode(&mut out), 8);
    assert_eq!(&out[..4], &[0x72, 0x05, 0x21, 0x00]);
    let d = t.ok(&mode_sense10(false, true, 0, 0x0A, 255), &[]);
    assert_eq!(d[10], 0x04);
    // Reset restores the defaults.
    t.lu.logical_unit_reset(1);
    let _ = t.err(&[0; 6], &[]);
    assert!(!t.err(&read10(u32::MAX, 1), &[]).descriptor_format);
}

#[test]
fn start_stop_unit() {
    let mut t = T::new();
    t.ok(&[0x1B, 0, 0, 0, 0x01, 0], &[]);
    t.ok(&[0x1B, 1, 0, 0, 0x00, 0], &[]);
    t.ok(&[0x1B, 0, 0, 0, 0x04, 0], &[]);
    // LOEJ on a non-removable medium.
    let s = t.err(&[0x1B, 1, 0, 0, 0x02, 0], &[]);
    assert_eq!(s.sense_key_specific, Some([0xC9, 0, 4]));
    invalid_cdb(&t.err(&[0x1B, 0, 0, 0, 0x03, 0], &[]));
    // A power condition ignores LOEJ/START.
    t.ok(&[0x1B, 0, 0, 0, 0x32, 0], &[]);
    invalid_cdb(&t.err(&[0x1B, 0x02, 0, 0, 0, 0], &[]));
    // Still ready afterwards.
    t.ok(&[0; 6], &[]);
}

#[test]
fn prevent_allow_medium_removal() {
    let mut t = T::new();
    t.lu.nexus_added(1);
    let _ = t.err(&[0; 6], &[]);
    t.ok(&[0x1E, 0, 0, 0, 1, 0], &[]);
    assert!(t.lu.removal_prevented_by(1));
    t.ok(&[0x1E, 0, 0, 0, 0, 0], &[]);
    assert!(!t.lu.removal_prevented_by(1));
    t.ok(&[0x1E, 0, 0, 0, 1, 0], &[]);
    t.lu.nexus_lost(1);
    assert!(!t.lu.removal_prevented_by(1));
    t.lu.nexus_added(1);
    let _ = t.err(&[0; 6], &[]);
    t.ok(&[0x1E, 0, 0, 0, 1, 0], &[]);
    t.lu.logical_unit_reset(1);
    assert!(!t.lu.removal_prevented_by(1));
    let _ = t.err(&[0; 6], &[]);
    invalid_cdb(&t.err(&[0x1E, 0, 0, 0, 2, 0], &[]));
    invalid_cdb(&t.err(&[0x1E, 0, 0, 0, 4, 0], &[]));
}

fn rsoc(options: u8, rctd: bool, opcode: u8, sa: u16, alloc: u32) -> [u8; 12] {
    let mut c = [0u8; 12];
    c[0] = 0xA3;
    c[1] = 0x0C;
    c[2] = options | if rctd { 0x80 } else { 0 };
    c[3] = opcode;
    c[4..6].copy_from_slice(&sa.to_be_bytes());
    c[6..10].copy_from_slice(&alloc.to_be_bytes());
    c
}

/// Every reported command is dispatched (never INVALID COMMAND OPERATION CODE), and every
/// opcode not reported is refused with it.
#[test]
fn supported_opcodes_match_dispatch() {
    for (thin, spc2) in [(true, false), (false, false), (true, true)] {
        let mut t = T::with(
            LuSettings {
                thin,
                ..LuSettings::default()
            },
            4 * MIB,
        );
        t.lu.set_spc2_reservations(spc2);
        let d = t.ok(&rsoc(0, false, 0, 0, 65535), &[]);
        let len = u32::from_be_bytes(d[..4].try_into().unwrap()) as usize;
        assert_eq!(len + 4, d.len());
        let mut listed = Vec::new();
        for desc in d[4..].chunks(8) {
            let (op, sa, servactv) = (desc[0], u16::from_be_bytes([desc[2], desc[3]]), desc[5] & 1);
            let cdb_len = usize::from(u16::from_be_bytes([desc[6], desc[7]]));
            listed.push((op, sa, servactv == 1));
            let mut cdb = vec![0u8; cdb_len];
            cdb[0] = op;
            if servactv == 1 {
                cdb[1] = sa as u8;
            }
            let c = t.run(&cdb, &[]);
            if let Some(s) = c.sense {
                assert!(
                    !(s.key == 5 && s.asc == 0x20),
                    "listed opcode {op:02x} is not dispatched"
                );
            }
            // The one-command form agrees.
            let one = t.ok(
                &rsoc(if servactv == 1 { 2 } else { 1 }, false, op, sa, 512),
                &[],
            );
            assert_eq!(one[1] & 0x07, 3);
            assert_eq!(usize::from(u16::from_be_bytes([one[2], one[3]])), cdb_len);
            assert_eq!(one[4], op);
            assert_eq!(one.len(), 4 + cdb_len);
            // The wrong reporting option for the opcode kind.
            let wrong = if servactv == 1 { 1 } else { 2 };
            invalid_cdb(&t.err(&rsoc(wrong, false, op, sa, 512), &[]));
        }
        assert_eq!(listed.iter().any(|&(op, _, _)| op == 0x42), thin);
        assert_eq!(listed.iter().any(|&(op, _, _)| op == 0x16), spc2);
        assert!(listed.iter().any(|&(op, sa, _)| op == 0x5F && sa == 6));
        for op in 0..=255u8 {
            if listed.iter().any(|&(o, _, _)| o == op) {
                continue;
            }
            let c = t.run(&[op, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]);
            let s = c
                .sense
                .unwrap_or_else(|| panic!("unlisted opcode {op:02x} succeeded"));
            assert_sense(&s, 5, 0x20, 0);
            let one = t.ok(&rsoc(1, false, op, 0, 512), &[]);
            assert_eq!(one, [0, 1, 0, 0]);
        }
    }
}

#[test]
fn supported_opcodes_timeouts_and_options() {
    let mut t = T::new();
    let d = t.ok(&rsoc(0, true, 0, 0, 65535), &[]);
    assert_eq!((d.len() - 4) % 20, 0);
    assert_eq!(d[4 + 5], 0x02); // CTDP, TEST UNIT READY has no service actions
    assert_eq!(&d[12..16], &[0, 0x0A, 0, 0]);
    let one = t.ok(&rsoc(1, true, 0x28, 0, 512), &[]);
    assert_eq!(one[1], 0x83);
    assert_eq!(one.len(), 4 + 10 + 12);
    // Option 3: opcode, with its service action where it has them.
    let one = t.ok(&rsoc(3, false, 0x9E, 0x10, 512), &[]);
    assert_eq!((one[1], one[4], one[5]), (3, 0x9E, 0x10));
    let one = t.ok(&rsoc(2, false, 0x9E, 0x1F, 512), &[]);
    assert_eq!(one, [0, 1, 0, 0]);
    invalid_cdb(&t.err(&rsoc(4, false, 0, 0, 512), &[]));
    // Allocation length truncation.
    let c = t.run(&rsoc(0, false, 0, 0, 10), &[]);
    assert_eq!((c.transfer_len, t.data_in.len()), (10, 10));
}

#[test]
fn lu_settings_are_validated() {
    use scsi::LogicalUnit;
    use std::sync::Arc;
    let store = Arc::new(store::RamStore::new(MIB));
    let ok = LogicalUnit::new(store.clone(), identity(), LuSettings::default());
    assert!(ok.is_ok());
    let bad_bs = LuSettings {
        block_size: 1024,
        ..LuSettings::default()
    };
    assert!(LogicalUnit::new(store.clone(), identity(), bad_bs).is_err());
    let mut id = identity();
    id.vendor = "TOO LONG VENDOR".into();
    assert!(LogicalUnit::new(store.clone(), id, LuSettings::default()).is_err());
    let mut id = identity();
    id.naa_len = 12;
    assert!(LogicalUnit::new(store.clone(), id, LuSettings::default()).is_err());
    let mut id = identity();
    id.serial = String::new();
    assert!(LogicalUnit::new(store.clone(), id, LuSettings::default()).is_err());
    let tiny = Arc::new(store::RamStore::new(100));
    assert!(LogicalUnit::new(tiny, identity(), LuSettings::default()).is_err());
}

#[test]
fn data_in_vec_is_reused() {
    let mut t = T::new();
    t.ok(&read10(0, 8), &[]);
    let cap = t.data_in.capacity();
    let ptr = t.data_in.as_ptr();
    for _ in 0..10 {
        let cmd = Command {
            cdb: &read10(0, 8),
            data_out: &[],
            data_in_limit: 1 << 20,
        };
        t.lu.execute(&t.nexus, &cmd, &mut t.data_in);
        assert_eq!((t.data_in.capacity(), t.data_in.as_ptr()), (cap, ptr));
    }
}

#[test]
fn software_write_protect() {
    let mut t = T::new();
    let control = |swp: u8| {
        let mut p = vec![0u8; 4];
        p.extend_from_slice(&[0x0A, 0x0A, 0x00, 0x10, swp, 0, 0, 0, 0xFF, 0xFF, 0, 0]);
        p
    };
    let on = control(0x08);
    t.ok(&mode_select6(&on), &on);
    let d = t.ok(&mode_sense6(true, 0, 0x0A, 0, 255), &[]);
    assert_eq!((d[2] & 0x80, d[8] & 0x08), (0x80, 0x08));
    t.ok(&read10(0, 1), &[]);
    assert_sense(&t.err(&write10(0, 1), &[0; 512]), 0x07, 0x27, 0x00);
    let off = control(0);
    t.ok(&mode_select6(&off), &off);
    t.ok(&write10(0, 1), &[0; 512]);
    let d = t.ok(&mode_sense6(true, 0, 0x0A, 0, 255), &[]);
    assert_eq!(d[2] & 0x80, 0);
}

#[test]
fn offline_lu_answers_not_ready_until_back_online_then_reports_the_change() {
    let mut t = T::new();
    t.lu.nexus_added(1);
    t.err(&[0, 0, 0, 0, 0, 0], &[]);
    t.ok(&write10(0, 1), &pattern(512, 7));
    assert!(t.lu.set_offline(true));
    assert!(!t.lu.set_offline(true), "already offline: no change");
    assert!(t.lu.is_offline());
    // The medium is out of reach: TEST UNIT READY, reads, writes, capacity, flushes.
    for cdb in [
        &[0u8, 0, 0, 0, 0, 0][..],
        &read10(0, 1),
        &write10(0, 1),
        &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        &[0x35, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        &[0x1A, 0, 0x3F, 0, 255, 0],
    ] {
        let data_out = if cdb[0] == 0x2A {
            pattern(512, 9)
        } else {
            vec![]
        };
        assert_sense(&t.err(cdb, &data_out), 0x02, 0x04, 0x03);
    }
    // What does not need the medium still answers.
    t.ok(&inquiry(false, 0, 96), &[]);
    t.ok(&[0xA0, 0, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0], &[]);
    // REQUEST SENSE describes the state.
    let d = t.ok(&[0x03, 0, 0, 0, 252, 0], &[]);
    assert_eq!((d[2], d[12], d[13]), (0x02, 0x04, 0x03));
    // An invalid opcode is still an invalid opcode.
    assert_sense(&t.err(&[0xFF, 0, 0, 0, 0, 0], &[]), 5, 0x20, 0);
    // A pending unit attention comes first.
    t.lu.capacity_changed();
    assert_sense(&t.err(&read10(0, 1), &[]), 0x06, 0x2A, 0x09);
    assert_sense(&t.err(&read10(0, 1), &[]), 0x02, 0x04, 0x03);
    // Back online: every nexus hears the medium may have changed, then reads what was there.
    t.lu.nexus_added(2);
    assert!(t.lu.set_offline(false));
    assert!(!t.lu.is_offline());
    assert_sense(&t.err(&read10(0, 1), &[]), 0x06, 0x28, 0x00);
    assert_eq!(t.ok(&read10(0, 1), &[]), pattern(512, 7));
    t.nexus = nexus(2);
    assert_sense(&t.err(&[0, 0, 0, 0, 0, 0], &[]), 0x06, 0x29, 0x00);
    assert_sense(&t.err(&[0, 0, 0, 0, 0, 0], &[]), 0x06, 0x28, 0x00);
    t.ok(&[0, 0, 0, 0, 0, 0], &[]);
    // Online when online: nothing to report.
    assert!(!t.lu.set_offline(false));
    t.ok(&[0, 0, 0, 0, 0, 0], &[]);
}

#[test]
fn operator_turns_the_write_cache_off_and_on_live() {
    let mut t = T::new();
    t.lu.nexus_added(1);
    assert_sense(&t.err(&[0; 6], &[]), 6, 0x29, 0);
    t.ok(&write10(0, 1), &pattern(512, 3));
    let flushes = t.store.flushes.load(std::sync::atomic::Ordering::SeqCst);
    assert!(t.lu.set_write_cache(false).unwrap());
    assert_eq!(
        t.store.flushes.load(std::sync::atomic::Ordering::SeqCst),
        flushes + 1,
        "turning the cache off makes what it held durable"
    );
    assert_sense(&t.err(&[0; 6], &[]), 6, 0x2A, 0x01);
    let current = t.ok(&mode_sense6(true, 0, 0x08, 0, 255), &[]);
    let default = t.ok(&mode_sense6(true, 2, 0x08, 0, 255), &[]);
    assert_eq!(
        (current[6], default[6]),
        (0, 0),
        "current and default WCE off"
    );
    assert!(!t.lu.settings().write_cache);
    // A reset goes back to the operator's setting, not the one at start.
    t.lu.logical_unit_reset(1);
    t.err(&[0; 6], &[]);
    assert!(!t.lu.write_cache_enabled());
    assert!(!t.lu.set_write_cache(false).unwrap(), "no change, no UA");
    t.ok(&[0; 6], &[]);
    assert!(t.lu.set_write_cache(true).unwrap());
    assert!(t.lu.write_cache_enabled());
    assert_sense(&t.err(&[0; 6], &[]), 6, 0x2A, 0x01);
}

#[test]
fn operator_write_protects_the_device_live() {
    let mut t = T::new();
    t.lu.nexus_added(1);
    t.err(&[0; 6], &[]);
    assert!(t.lu.set_read_only(true));
    assert!(!t.lu.set_read_only(true));
    assert_sense(&t.err(&[0; 6], &[]), 6, 0x2A, 0x01);
    let d = t.ok(&mode_sense6(true, 0, 0x08, 0, 255), &[]);
    assert_eq!(d[2] & 0x80, 0x80, "WP in the mode parameter header");
    assert_sense(&t.err(&write10(0, 1), &[0; 512]), 0x07, 0x27, 0x00);
    t.ok(&read10(0, 1), &[]);
    assert!(t.lu.settings().read_only);
    assert!(t.lu.set_read_only(false));
    t.err(&[0; 6], &[]);
    t.ok(&write10(0, 1), &[0; 512]);
}

#[test]
fn operator_renames_product_and_serial_live_but_never_the_naa() {
    let mut t = T::new();
    t.lu.nexus_added(1);
    t.err(&[0; 6], &[]);
    let mut renamed = identity();
    renamed.product = "VM STORE".into();
    renamed.serial = "array7-0001".into();
    assert_eq!(t.lu.set_identity(renamed.clone()), Ok(true));
    assert_eq!(t.lu.set_identity(renamed.clone()), Ok(false));
    assert_sense(&t.err(&[0; 6], &[]), 6, 0x3F, 0x03);
    let d = t.ok(&inquiry(false, 0, 96), &[]);
    assert_eq!(&d[16..32], b"VM STORE        ");
    let d = t.ok(&inquiry(true, 0x80, 255), &[]);
    assert_eq!(&d[4..], b"array7-0001");
    let mut other_naa = renamed.clone();
    other_naa.naa[7] ^= 1;
    assert!(t.lu.set_identity(other_naa).is_err());
    let mut too_long = renamed;
    too_long.product = "a product name of more than sixteen".into();
    assert!(t.lu.set_identity(too_long).is_err());
    t.ok(&[0; 6], &[]);
    assert_eq!(
        t.lu.identity().product,
        "VM STORE",
        "a refused change changes nothing"
    );
}
