//! ALUA over the wire: a target served by two portal groups, one active/optimized and one
//! active/non-optimized. Through either portal, REPORT TARGET PORT GROUPS lists both groups with
//! their states and ports, INQUIRY says implicit ALUA, and VPD 83h names the group of the port the
//! initiator logged in through.

mod common;

use common::raw::Raw;
use common::{free_port, Daemon};

const IQN: &str = "iqn.2024-01.dev.ferrosan:alua";

fn rtpg(extended: bool) -> [u8; 12] {
    [
        0xA3,
        (u8::from(extended) << 5) | 0x0A,
        0,
        0,
        0,
        0,
        0,
        0,
        1,
        0,
        0,
        0,
    ]
}

#[test]
fn report_target_port_groups_and_inquiry_through_each_portal() {
    let second_port = free_port();
    let daemon = Daemon::start_config(
        IQN,
        &format!(
            "[[portal_group]]\ntag = 2\nlisten = [\"127.0.0.1:{second_port}\"]\nalua_state = \"active-non-optimized\"\n{}",
            common::open_ram_target(IQN)
        ),
    );
    // Group 1 (the harness's portal group): active/optimized, port 1; group 2: non-optimized.
    let mut groups = vec![0, 0, 0, 24];
    groups.extend_from_slice(&[0x00, 0x03, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1]);
    groups.extend_from_slice(&[0x01, 0x03, 0, 2, 0, 0, 0, 1, 0, 0, 0, 2]);
    for (port, group, isid) in [(daemon.port, 1u8, 1u8), (second_port, 2, 2)] {
        let mut client = Raw::login(port, IQN, isid);
        // The new nexus's first command collects its power-on unit attention.
        let bhs = client.command(9, &[0; 6], 0x80, 0);
        client.send(&bhs, &[]);
        client.recv();
        let bhs = client.command(1, &rtpg(false), 0xc0, 256);
        client.send(&bhs, &[]);
        assert_eq!(client.read_data(), groups, "through group {group}");
        let bhs = client.command(2, &rtpg(true), 0xc0, 256);
        client.send(&bhs, &[]);
        let extended = client.read_data();
        assert_eq!(extended[..8], [0, 0, 0, 28, 0x10, 0, 0, 0]);
        assert_eq!(
            extended[8..],
            groups[4..],
            "extended, through group {group}"
        );
        // Standard INQUIRY: TPGS = 01b, implicit ALUA.
        let bhs = client.command(3, &[0x12, 0, 0, 0, 96, 0], 0xc0, 96);
        client.send(&bhs, &[]);
        assert_eq!(client.read_data()[5] & 0x30, 0x10);
        // Device identification VPD: the target port group of this portal.
        let bhs = client.command(4, &[0x12, 1, 0x83, 1, 0, 0], 0xc0, 256);
        client.send(&bhs, &[]);
        let vpd = client.read_data();
        assert!(
            vpd.windows(8)
                .any(|w| w == [0x01, 0x15, 0, 4, 0, 0, 0, group]),
            "no target port group {group} designator: {vpd:02x?}"
        );
    }
}
