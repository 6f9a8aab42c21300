//! APTPL on a node: a LUN's persistent reservation state, saved while the last REGISTER
//! set APTPL, is served again after a restart (and not once a REGISTER cleared APTPL);
//! deleting the target deletes it.

use crate::common;

use common::*;
use tessera_api::IscsiAuth;
use tessera_iscsi::pr::{
    Nexus, PrError, ProutRequest, READ_KEYS, READ_RESERVATION, REGISTER, RESERVE,
};

const IQN: &str = "iqn.2026-11.io.tessera:pr";

#[test]
fn aptpl_state_survives_a_restart() {
    let mut n = TestNode::up("iscsi-pr");
    n.node()
        .iscsi_create(IQN, &["vol0".to_string()], IscsiAuth::default())
        .unwrap();
    let a = Nexus::new("iqn.2026-11.io.example:a", [0, 2, 0x3d, 0, 0, 1], IQN);
    let b = Nexus::new("iqn.2026-11.io.example:b", [0, 2, 0x3d, 0, 0, 2], IQN);
    let unit = |n: &TestNode| n.node().iscsi.target().target(IQN).unwrap().shared[0].clone();
    let u = unit(&n);
    u.pr_out(&a, &ProutRequest::basic(REGISTER, 0, 0, 0xa1, true))
        .unwrap();
    // APTPL is the last REGISTER's (SPC-4 §5.13.5).
    u.pr_out(&b, &ProutRequest::basic(REGISTER, 0, 0, 0xb2, true))
        .unwrap();
    u.pr_out(&a, &ProutRequest::basic(RESERVE, 3, 0xa1, 0, false))
        .unwrap();
    let (keys, resv) = (
        u.pr_in(READ_KEYS).unwrap(),
        u.pr_in(READ_RESERVATION).unwrap(),
    );
    drop(u);
    let dir = n.data_dir.join("iscsi-pr");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);

    n.restart();
    // As `tessera run` does: the persisted targets are served again.
    tessera_node::node::iscsi::start(n.node());
    let u = unit(&n);
    assert_eq!(u.pr_in(READ_KEYS).unwrap(), keys);
    assert_eq!(u.pr_in(READ_RESERVATION).unwrap(), resv);
    // b's registration came back too: it may not reserve while a holds the unit.
    assert_eq!(
        u.pr_out(&b, &ProutRequest::basic(RESERVE, 3, 0xb2, 0, false)),
        Err(PrError::Conflict)
    );
    // A REGISTER without APTPL: what is saved restores nothing.
    u.pr_out(&b, &ProutRequest::basic(REGISTER, 0, 0xb2, 0xb3, false))
        .unwrap();
    drop(u);
    n.restart();
    tessera_node::node::iscsi::start(n.node());
    assert_eq!(unit(&n).pr_in(READ_KEYS).unwrap(), vec![0u8; 8]);

    n.node().iscsi_delete(IQN).unwrap();
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
}
