//! Where the replicas of a new volume go: the nodes with the most free capacity, never two
//! replicas in one failure domain when the labels allow it.
//!
//! Failure domains are nested labels, widest first (default `zone`, then `rack`). The
//! first pass wants every replica in a different domain at every level; when the cluster
//! has too few zones, the next pass drops the widest level (different racks, any zone),
//! and the last pass only keeps replicas on different nodes. Among the nodes a pass
//! allows, the emptiest (most free bytes in its emptiest pool) goes first, so placement
//! levels used capacity out over time. The owner (the node the volume is created on)
//! always holds one replica: the datapath serves reads from it.

use std::collections::BTreeSet;

use crate::{best_pool, domain, NodeRecord};

/// One replica's place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placed {
    pub node: String,
    pub pool: String,
}

impl std::fmt::Display for Placed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.node, self.pool)
    }
}

/// The failure-domain levels placement spreads over, widest first.
pub const DEFAULT_LEVELS: &[&str] = &["zone", "rack"];

/// Why no placement exists; each names the node or the numbers that fall short.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("a volume needs at least one replica")]
    NoReplicas,
    #[error("node '{0}' is not a live member of the cluster")]
    NotMember(String),
    #[error("node '{0}' has no pool to hold its replica")]
    NoPool(String),
    #[error("{count} replicas need {count} live nodes with a pool; the cluster has {nodes}")]
    TooFewNodes { count: usize, nodes: usize },
}

/// Choose `count` places among `nodes`, the nodes named in `fixed` first (the owner of a
/// new volume; the surviving replicas when one is replaced). Errors say why no placement
/// exists (too few nodes, a node without pools).
pub fn place(
    nodes: &[NodeRecord],
    count: usize,
    fixed: &[&str],
    levels: &[&str],
) -> Result<Vec<Placed>, PlacementError> {
    if count == 0 {
        return Err(PlacementError::NoReplicas);
    }
    let mut order: Vec<&NodeRecord> = nodes.iter().filter(|n| best_pool(n).is_some()).collect();
    order.sort_by(|a, b| {
        let fa = best_pool(a).map_or(0, |p| p.free);
        let fb = best_pool(b).map_or(0, |p| p.free);
        fb.cmp(&fa).then_with(|| a.name.cmp(&b.name))
    });
    let mut chosen: Vec<&NodeRecord> = Vec::new();
    for f in fixed {
        let n = nodes
            .iter()
            .find(|n| n.name == *f)
            .ok_or_else(|| PlacementError::NotMember(f.to_string()))?;
        if best_pool(n).is_none() {
            return Err(PlacementError::NoPool(f.to_string()));
        }
        chosen.push(n);
    }
    // Pass k spreads over levels[k..]; the last pass (k = levels.len()) only over nodes.
    for k in 0..=levels.len() {
        if chosen.len() >= count {
            break;
        }
        let used = |chosen: &[&NodeRecord], lv: &str| -> BTreeSet<String> {
            chosen.iter().map(|c| domain(c, lv)).collect()
        };
        for n in &order {
            if chosen.len() >= count {
                break;
            }
            if chosen.iter().any(|c| c.name == n.name) {
                continue;
            }
            let clash = levels[k..]
                .iter()
                .any(|lv| used(&chosen, lv).contains(&domain(n, lv)));
            if !clash {
                chosen.push(n);
            }
        }
    }
    if chosen.len() < count {
        return Err(PlacementError::TooFewNodes {
            count,
            nodes: order.len(),
        });
    }
    Ok(chosen
        .into_iter()
        .map(|n| Placed {
            node: n.name.clone(),
            pool: best_pool(n).map(|p| p.name.clone()).unwrap_or_default(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PoolRecord;

    fn node(name: &str, zone: &str, rack: &str, free: u64) -> NodeRecord {
        let mut labels = std::collections::BTreeMap::new();
        if !zone.is_empty() {
            labels.insert("zone".into(), zone.into());
        }
        if !rack.is_empty() {
            labels.insert("rack".into(), rack.into());
        }
        NodeRecord {
            name: name.into(),
            labels,
            pools: vec![
                PoolRecord {
                    name: "small".into(),
                    size: 100,
                    free: free / 2,
                },
                PoolRecord {
                    name: "big".into(),
                    size: 1000,
                    free,
                },
            ],
            ..NodeRecord::default()
        }
    }

    fn names(p: &[Placed]) -> Vec<String> {
        p.iter().map(|p| p.node.clone()).collect()
    }

    #[test]
    fn spreads_over_zones_before_free_space() {
        let nodes = [
            node("a", "z1", "r1", 900),
            node("b", "z1", "r2", 800),
            node("c", "z2", "r3", 100),
            node("d", "z3", "r4", 50),
        ];
        let p = place(&nodes, 3, &["b"], DEFAULT_LEVELS).unwrap();
        assert_eq!(names(&p), ["b", "c", "d"]);
        assert!(p.iter().all(|p| p.pool == "big"), "the emptiest pool");
        // Without an owner: the emptiest of each zone.
        let p = place(&nodes, 2, &[], DEFAULT_LEVELS).unwrap();
        assert_eq!(names(&p), ["a", "c"]);
    }

    #[test]
    fn relaxes_zone_then_rack_when_the_labels_do_not_allow_it() {
        let nodes = [
            node("a", "z1", "r1", 900),
            node("b", "z1", "r1", 800),
            node("c", "z1", "r2", 100),
        ];
        // One zone: different racks first, then any node.
        assert_eq!(
            names(&place(&nodes, 2, &["a"], DEFAULT_LEVELS).unwrap()),
            ["a", "c"]
        );
        assert_eq!(
            names(&place(&nodes, 3, &["a"], DEFAULT_LEVELS).unwrap()),
            ["a", "c", "b"]
        );
        // Unlabelled nodes are each a domain of their own.
        let bare = [node("x", "", "", 5), node("y", "", "", 7)];
        assert_eq!(
            names(&place(&bare, 2, &[], DEFAULT_LEVELS).unwrap()),
            ["y", "x"]
        );
    }

    #[test]
    fn clear_errors() {
        let nodes = [node("a", "z1", "r1", 900), node("b", "z2", "r2", 900)];
        let e = place(&nodes, 3, &[], DEFAULT_LEVELS)
            .unwrap_err()
            .to_string();
        assert!(e.contains("3 replicas need 3 live nodes"), "{e}");
        let e = place(&nodes, 2, &["zz"], DEFAULT_LEVELS)
            .unwrap_err()
            .to_string();
        assert!(e.contains("'zz' is not a live member"), "{e}");
        let mut empty = node("e", "z3", "r3", 0);
        empty.pools.clear();
        let e = place(&[empty], 1, &["e"], DEFAULT_LEVELS)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no pool"), "{e}");
        assert!(place(&nodes, 0, &[], DEFAULT_LEVELS).is_err());
    }
}
