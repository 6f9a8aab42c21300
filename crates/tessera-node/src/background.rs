//! Background classes' settings (scrub now; rebuild and resync as they land), kept in
//! `DATA_DIR/background.json` (docs/format.md §8) and changed live through the API.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde_json::Value;
use tessera_pool::{Error, ErrorKind};
use tessera_qos::BackgroundLimits;

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
    Error::new(
        ErrorKind::NotFound,
        format!("background class '{class}' not found (classes: scrub, rebuild, resync)"),
    )
}

impl Background {
    pub fn load(data_dir: &Path) -> Result<Background, String> {
        let path = data_dir.join("background.json");
        let set = match std::fs::read_to_string(&path) {
            Ok(t) => serde_json::from_str(&t).map_err(|e| format!("{}: {e}", path.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        Ok(Background {
            path,
            set: Mutex::new(set),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, BackgroundLimits>> {
        self.set.lock().unwrap_or_else(|e| e.into_inner())
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

    pub fn list(&self) -> Value {
        let mut out = serde_json::Map::new();
        for (c, _) in CLASSES {
            let l = self.limits(c).expect("known class");
            out.insert(
                c.to_string(),
                serde_json::to_value(l).unwrap_or(Value::Null),
            );
        }
        Value::Object(out)
    }

    /// Set (`Some`) or reset to the default (`None`) a class's settings; persistent.
    /// Running jobs pick the change up when they next start.
    pub fn put(&self, class: &str, limits: Option<BackgroundLimits>) -> Result<Value, Error> {
        self.limits(class)?;
        if let Some(l) = &limits {
            l.validate()
                .map_err(|e| Error::new(ErrorKind::InvalidInput, e))?;
        }
        let mut set = self.lock();
        let mut next = set.clone();
        match limits {
            Some(l) => next.insert(class.to_string(), l),
            None => next.remove(class),
        };
        let text = serde_json::to_string_pretty(&next).expect("background settings serialise");
        crate::registry::write_atomic(&self.path, text.as_bytes())
            .map_err(|e| Error::new(ErrorKind::Io, e))?;
        *set = next;
        drop(set);
        Ok(serde_json::to_value(self.limits(class)?).unwrap_or(Value::Null))
    }
}
