//! A volume's own snapshot history: what goes with it when it is deleted or given up.
//! A leaf module (it uses only the pool), so that snapshots, ownership and replicas can
//! all ask it without importing one another.

use std::sync::Arc;

use tessera_pool::{Pool, Volume};

/// The snapshots of `v`'s own history that nothing else reads: its ancestors, nearest
/// first, up to the first one another volume reads through (a clone made from it, or the
/// volume `v` was itself cloned from): that one and every older one stay.
pub(super) fn own_snapshots(p: &Pool, v: &Volume) -> Vec<Arc<Volume>> {
    let listed = p.snapshots();
    let mut lineage = vec![v.name.clone()];
    let mut out = Vec::new();
    for a in v.ancestors() {
        // A hidden one (deleted, still read through) is not listed: the pool drops it
        // with its last reader.
        let Some(info) = listed.iter().find(|s| s.id == a.id) else {
            continue;
        };
        if !info.children.iter().all(|c| lineage.contains(c)) {
            break;
        }
        lineage.push(a.name.clone());
        out.push(a);
    }
    out
}
