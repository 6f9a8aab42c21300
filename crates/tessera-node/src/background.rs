//! Background classes' settings (scrub now; rebuild and resync as they land), kept in
//! `DATA_DIR/background.json` (docs/format.md §8) and changed live through the API.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use tessera_io::sync::MutexExt;

use tessera_api::BackgroundList;
use tessera_qos::BackgroundLimits;

use crate::error::{Error, StartError};

/// The classes a node knows and their defaults (bytes per second).
pub const CLASSES: [(&str, u64); 3] = [
    ("scrub", 256 << 20),
    // 256 MiB/s: a QD1 client kept 68–79% of its IOPS at 512 MiB/s on the 2-core test
    // machine, 83–87% at 256 (docs/benchmarks.md); Linux md's default ceiling is 200 MB/s.
    ("rebuild", 256 << 20),
    ("resync", 256 << 20),
];

pub struct Background {
    path: PathBuf,
    set: Mutex<BTreeMap<String, BackgroundLimits>>,
}

fn unknown(class: &str) -> Error {
    Error::not_found(format!(
        "background class '{class}' not found (classes: scrub, rebuild, resync)"
    ))
}

impl Background {
    pub fn load(data_dir: &Path) -> Result<Background, StartError> {
        let path = data_dir.join("background.json");
        let set = crate::registry::load_json(&path).map_err(StartError::Catalog)?;
        Ok(Background {
            path,
            set: Mutex::new(set),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, BackgroundLimits>> {
        self.set.locked()
    }

    /// A class's settings: what was set, else the default.
    pub fn limits(&self, class: &str) -> Result<BackgroundLimits, Error> {
        let default = CLASSES
            .iter()
            .find(|(c, _)| *c == class)
            .ok_or_else(|| unknown(class))?
            .1;
        Ok(self
            .lock()
            .get(class)
            .cloned()
            .unwrap_or_else(|| BackgroundLimits::new(default)))
    }

    pub fn list(&self) -> BackgroundList {
        CLASSES
            .iter()
            .map(|(c, _)| (c.to_string(), self.limits(c).expect("known class")))
            .collect()
    }

    /// Set (`Some`) or reset to the default (`None`) a class's settings; persistent.
    /// Running jobs pick the change up when they next start.
    pub fn put(
        &self,
        class: &str,
        limits: Option<BackgroundLimits>,
    ) -> Result<BackgroundLimits, Error> {
        self.limits(class)?;
        if let Some(l) = &limits {
            l.validate()?;
        }
        let mut set = self.lock();
        let mut next = set.clone();
        match limits {
            Some(l) => next.insert(class.to_string(), l),
            None => next.remove(class),
        };
        let text = serde_json::to_string_pretty(&next).expect("background settings serialise");
        crate::registry::write_atomic(&self.path, text.as_bytes())?;
        *set = next;
        drop(set);
        self.limits(class)
    }
}
