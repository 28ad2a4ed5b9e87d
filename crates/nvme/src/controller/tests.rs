use super::*;
use crate::log::AnaState;

const LIMITS: ControllerLimits = ControllerLimits {
    io_queues_max: 4,
    mqes: 127,
    mdts: 8,
    in_capsule: 8192,
    kato_ms_max: 60_000,
};

fn sqe(op: u8, nsid: u32, cdw10: u32, cdw11: u32) -> Sqe {
    let mut s = [0u8; 64];
    s[0] = op;
    s[2..4].copy_from_slice(&7u16.to_le_bytes());
    s[4..8].copy_from_slice(&nsid.to_le_bytes());
    s[40..44].copy_from_slice(&cdw10.to_le_bytes());
    s[44..48].copy_from_slice(&cdw11.to_le_bytes());
    Sqe(s)
}

fn property_set_cc(value: u32) -> Sqe {
    let mut s = [0u8; 64];
    s[0] = crate::sqe::FABRICS;
    s[4] = fabrics::fctype::PROPERTY_SET;
    s[44..48].copy_from_slice(&fabrics::reg::CC.to_le_bytes());
    s[48..52].copy_from_slice(&value.to_le_bytes());
    Sqe(s)
}

fn enabled() -> Controller {
    let mut c = Controller::new(3, ControllerType::Io, LIMITS, 15_000);
    assert_eq!(c.property(&property_set_cc(1)).1, Status::SUCCESS);
    assert!(c.regs.ready());
    c
}

fn namespace(nsid: u32) -> NamespaceView {
    NamespaceView {
        nsid,
        identify: identify::Namespace {
            blocks: 2048,
            block_shift: 9,
            thin: true,
            shared: true,
            reservations: true,
            write_protected: false,
            anagrpid: 1,
            nguid: [nsid as u8; 16],
            eui64: [nsid as u8; 8],
        },
        uuid: [0xA0 | nsid as u8; 16],
    }
}

fn data(answer: Answer) -> Vec<u8> {
    match answer {
        Answer::Now { status, data, .. } => {
            assert_eq!(status, Status::SUCCESS);
            data
        }
        other => panic!("{other:?}"),
    }
}

fn status(answer: Answer) -> Status {
    match answer {
        Answer::Now { status, .. } => status,
        other => panic!("{other:?}"),
    }
}

#[test]
fn admin_commands_wait_for_the_host_to_enable_the_controller() {
    let mut c = Controller::new(1, ControllerType::Io, LIMITS, 0);
    let view = View::default();
    assert_eq!(
        status(c.admin(&sqe(admin::opcode::IDENTIFY, 0, 1, 0), &view)),
        COMMAND_SEQUENCE_ERROR
    );
    assert_eq!(c.property(&property_set_cc(1)).1, Status::SUCCESS);
    assert_eq!(
        data(c.admin(&sqe(admin::opcode::IDENTIFY, 0, 1, 0), &view)).len(),
        4096
    );
}

#[test]
fn identify_answers_from_the_view() {
    let mut c = enabled();
    let ns = [namespace(1), namespace(3)];
    let view = View {
        subnqn: "nqn.2026-11.org.ferrosan:demo",
        serial: "abc",
        model: "ferrosan",
        firmware: "0.1",
        namespaces: &ns,
        ..View::default()
    };
    let ctrl = data(c.admin(&sqe(admin::opcode::IDENTIFY, 0, 1, 0), &view));
    assert_eq!(u16::from_le_bytes([ctrl[78], ctrl[79]]), 3);
    assert_eq!(
        u32::from_le_bytes(ctrl[516..520].try_into().unwrap()),
        3,
        "NN"
    );
    assert!(ctrl[768..].starts_with(b"nqn.2026-11.org.ferrosan:demo\0"));
    let list = data(c.admin(&sqe(admin::opcode::IDENTIFY, 0, 2, 0), &view));
    assert_eq!(&list[..12], &[1, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]);
    let list = data(c.admin(&sqe(admin::opcode::IDENTIFY, 1, 2, 0), &view));
    assert_eq!(&list[..8], &[3, 0, 0, 0, 0, 0, 0, 0]);
    let ns3 = data(c.admin(&sqe(admin::opcode::IDENTIFY, 3, 0, 0), &view));
    assert_eq!(u64::from_le_bytes(ns3[..8].try_into().unwrap()), 2048);
    // An inactive namespace reads as zeros; NSID 0 is invalid.
    assert_eq!(
        data(c.admin(&sqe(admin::opcode::IDENTIFY, 2, 0, 0), &view)),
        vec![0; 4096]
    );
    assert_eq!(
        status(c.admin(&sqe(admin::opcode::IDENTIFY, 0, 0, 0), &view)),
        Status::INVALID_NAMESPACE
    );
    let desc = data(c.admin(&sqe(admin::opcode::IDENTIFY, 3, 3, 0), &view));
    assert_eq!(&desc[..4], &[1, 8, 0, 0]);
    assert_eq!(&desc[4..12], &[3; 8]);
    assert_eq!(
        status(c.admin(&sqe(admin::opcode::IDENTIFY, 2, 3, 0), &view)),
        Status::INVALID_NAMESPACE
    );
    // CNS values not offered.
    assert_eq!(
        status(c.admin(&sqe(admin::opcode::IDENTIFY, 0, 0x10, 0), &view)),
        Status::INVALID_FIELD
    );
}

#[test]
fn features_keep_what_the_host_set_within_the_limits() {
    let mut c = enabled();
    let view = View::default();
    let set = |c: &mut Controller, fid: u32, v: u32| {
        c.admin(&sqe(admin::opcode::SET_FEATURES, 0, fid, v), &view)
    };
    let get = |c: &mut Controller, fid: u32| match c
        .admin(&sqe(admin::opcode::GET_FEATURES, 0, fid, 0), &view)
    {
        Answer::Now { dw0, status, .. } => {
            assert_eq!(status, Status::SUCCESS);
            dw0
        }
        other => panic!("{other:?}"),
    };
    assert_eq!(set(&mut c, 0x07, 7 | 7 << 16), Answer::value(3 | 3 << 16));
    assert_eq!(c.io_queues(), 4);
    assert_eq!(set(&mut c, 0x07, 1 | 1 << 16), Answer::value(1 | 1 << 16));
    assert_eq!(c.io_queues(), 2);
    assert_eq!(get(&mut c, 0x07), 1 | 1 << 16);
    assert_eq!(set(&mut c, 0x0F, 5_000), Answer::value(0));
    assert_eq!(c.kato_ms(), 5_000);
    assert_eq!(get(&mut c, 0x0F), 5_000);
    assert_eq!(status(set(&mut c, 0x0F, 60_001)), Status::INVALID_FIELD);
    // The write cache is the devices': the transport applies it.
    assert_eq!(set(&mut c, 0x06, 1), Answer::WriteCache { on: true });
    assert_eq!(set(&mut c, 0x06, 0), Answer::WriteCache { on: false });
    assert_eq!(get(&mut c, 0x06 | 3 << 8), 1 << 2, "changeable");
    assert_eq!(get(&mut c, 0x0B | 3 << 8), 1 << 2);
}

#[test]
fn a_notice_completes_a_held_request_once_until_its_page_is_read() {
    let mut c = enabled();
    let groups = [AnaGroup {
        id: 1,
        state: AnaState::Optimized,
        nsids: vec![1],
    }];
    let view = View {
        ana_groups: &groups,
        ana_change_count: 2,
        ..View::default()
    };
    // Not enabled by the host: kept silent.
    assert_eq!(c.notify(Notice::AnaChange, &[]), None);
    c.admin(
        &sqe(
            admin::opcode::SET_FEATURES,
            0,
            0x0B,
            identify::OAES_ANA_CHANGE | identify::OAES_NS_ATTRIBUTE,
        ),
        &view,
    );
    // No request held: owed, and delivered by the next request.
    assert_eq!(c.notify(Notice::AnaChange, &[]), None);
    let mut aer = sqe(admin::opcode::ASYNC_EVENT_REQUEST, 0, 0, 0);
    aer.0[2] = 40;
    assert_eq!(c.admin(&aer, &view), Answer::Held);
    assert_eq!(c.pending_notice(), Some((40, 0x000C_0302)));
    // Masked until the ANA page is read.
    aer.0[2] = 41;
    assert_eq!(c.admin(&aer, &view), Answer::Held);
    assert_eq!(c.notify(Notice::AnaChange, &[]), None);
    let page = data(c.admin(
        &sqe(
            admin::opcode::GET_LOG_PAGE,
            0,
            u32::from(lid::ANA) | 255 << 16,
            0,
        ),
        &view,
    ));
    assert_eq!(u64::from_le_bytes(page[..8].try_into().unwrap()), 2);
    assert_eq!(page[32], AnaState::Optimized as u8);
    assert_eq!(c.notify(Notice::AnaChange, &[]), Some((41, 0x000C_0302)));
    // The changed-namespace list collects the namespaces and empties when read.
    aer.0[2] = 42;
    assert_eq!(c.admin(&aer, &view), Answer::Held);
    assert_eq!(
        c.notify(Notice::NamespaceAttribute, &[2]),
        Some((42, 0x0004_0002))
    );
    c.notify(Notice::NamespaceAttribute, &[5]);
    let list = data(c.admin(
        &sqe(
            admin::opcode::GET_LOG_PAGE,
            0,
            u32::from(lid::CHANGED_NAMESPACES) | 1023 << 16,
            0,
        ),
        &view,
    ));
    assert_eq!(&list[..12], &[2, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0]);
    let list = data(c.admin(
        &sqe(
            admin::opcode::GET_LOG_PAGE,
            0,
            u32::from(lid::CHANGED_NAMESPACES) | 1023 << 16,
            0,
        ),
        &view,
    ));
    assert_eq!(&list[..4], &[0; 4]);
}

#[test]
fn event_requests_beyond_the_limit_are_refused_and_a_reset_drops_them() {
    let mut c = enabled();
    let view = View::default();
    for _ in 0..AER_MAX {
        assert_eq!(
            c.admin(&sqe(admin::opcode::ASYNC_EVENT_REQUEST, 0, 0, 0), &view),
            Answer::Held
        );
    }
    assert_eq!(
        status(c.admin(&sqe(admin::opcode::ASYNC_EVENT_REQUEST, 0, 0, 0), &view)),
        AER_LIMIT_EXCEEDED
    );
    assert_eq!(c.property(&property_set_cc(0)).1, Status::SUCCESS);
    assert!(c.take_held().is_empty());
}

#[test]
fn the_command_effects_page_lists_what_runs() {
    let mut c = enabled();
    let page = data(c.admin(
        &sqe(
            admin::opcode::GET_LOG_PAGE,
            0,
            u32::from(lid::COMMAND_EFFECTS) | 1023 << 16,
            0,
        ),
        &View::default(),
    ));
    let at = |base: usize, op: usize| {
        u32::from_le_bytes(page[base + op * 4..base + op * 4 + 4].try_into().unwrap())
    };
    assert_eq!(at(0, 0x06), 1, "Identify");
    assert_eq!(at(0, 0x01), 0, "Create I/O SQ: not on fabrics");
    assert_eq!(at(1024, 0x02), 1, "Read");
    assert_eq!(at(1024, 0x01), 3, "Write changes blocks");
}

#[test]
fn pages_of_the_other_controller_kind_are_refused() {
    let mut c = enabled();
    let view = View::default();
    assert_eq!(
        status(c.admin(
            &sqe(
                admin::opcode::GET_LOG_PAGE,
                0,
                u32::from(lid::DISCOVERY) | 255 << 16,
                0
            ),
            &view
        )),
        Status::INVALID_FIELD
    );
    let mut d = Controller::new(1, ControllerType::Discovery, LIMITS, 0);
    d.property(&property_set_cc(1));
    assert_eq!(
        status(d.admin(
            &sqe(
                admin::opcode::GET_LOG_PAGE,
                0,
                u32::from(lid::ANA) | 255 << 16,
                0
            ),
            &view
        )),
        Status::INVALID_FIELD
    );
    let page = data(d.admin(
        &sqe(
            admin::opcode::GET_LOG_PAGE,
            0,
            u32::from(lid::DISCOVERY) | 255 << 16,
            0,
        ),
        &view,
    ));
    assert_eq!(page.len(), 1024);
}

#[test]
fn an_abort_withdraws_a_held_event_request_and_hands_io_queues_to_the_transport() {
    let mut c = enabled();
    let view = View::default();
    let mut aer = sqe(admin::opcode::ASYNC_EVENT_REQUEST, 0, 0, 0);
    aer.0[2] = 40;
    assert_eq!(c.admin(&aer, &view), Answer::Held);
    let abort = |sqid: u32, cid: u32| sqe(admin::opcode::ABORT, 0, sqid | cid << 16, 0);
    assert_eq!(
        c.admin(&abort(0, 40), &view),
        Answer::EventRequestAborted { cid: 40 }
    );
    // Withdrawn: a notice now has no request to complete.
    assert_eq!(c.notify(Notice::AnaChange, &[]), None);
    assert_eq!(c.admin(&abort(0, 40), &view), Answer::value(1), "not found");
    assert_eq!(
        c.admin(&abort(2, 9), &view),
        Answer::Abort { sqid: 2, cid: 9 }
    );
}
