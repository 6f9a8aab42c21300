//! Opening the devices of a pool, standing in for one that cannot be opened, and the
//! swappable slots of redundant pools.

use std::sync::Arc;

use tessera_device::{open_device, BlockDevice, DeviceSpec, SwappableDevice};
use tessera_pool::Pool;

use super::{Error, Result};

pub(super) fn open_devices(specs: &[String]) -> Result<Vec<Arc<dyn BlockDevice>>> {
    specs
        .iter()
        .map(|s| {
            let spec = DeviceSpec::parse(s).map_err(|e| Error::invalid(e.to_string()))?;
            open_device(&spec).map_err(|e| match e.kind() {
                // Another pool, node or program holds it (the message names the device).
                std::io::ErrorKind::ResourceBusy => match owner_label(&spec) {
                    Some(pool) => Error::busy(format!("{e}; it belongs to pool '{pool}'")),
                    None => Error::busy(e.to_string()),
                },
                _ => Error::io(&format!("device {s}"), e),
            })
        })
        .collect()
}

/// The pool named by the label of a file or block device that someone else holds (read
/// without taking it), to say whose it is.
fn owner_label(spec: &DeviceSpec) -> Option<String> {
    let path = match spec {
        DeviceSpec::File { path, .. } => path,
        DeviceSpec::Fault { inner, .. } => return owner_label(inner),
        _ => return None,
    };
    let mut b = vec![0u8; tessera_pool::format::LABEL_AREA];
    std::io::Read::read_exact(&mut std::fs::File::open(path).ok()?, &mut b).ok()?;
    tessera_pool::format::Label::decode_area(&b)
        .ok()
        .flatten()
        .map(|(l, _)| l.pool_name)
}

/// Stands in for a mirror's device that could not be opened: every I/O fails with ENODEV,
/// so the pool marks it failed. Its size is large enough never to limit the layout.
pub(super) struct MissingDevice(pub(super) String);

pub(super) struct MissingHandle;

impl tessera_io::IoHandle for MissingHandle {
    unsafe fn submit(
        &mut self,
        io: &mut tessera_io::CoreIo,
        _op: tessera_io::IoOp,
        tag: tessera_io::Tag,
    ) {
        io.complete(tag, -libc::ENODEV)
    }
    fn size(&self) -> u64 {
        1 << 60
    }
}

impl BlockDevice for MissingDevice {
    fn describe(&self) -> String {
        format!("{} (missing)", self.0)
    }
    fn size(&self) -> u64 {
        1 << 60
    }
    fn read_at(&self, _: u64, _: &mut [u8]) -> std::io::Result<()> {
        Err(std::io::Error::from_raw_os_error(libc::ENODEV))
    }
    fn write_at(&self, _: u64, _: &[u8]) -> std::io::Result<()> {
        Err(std::io::Error::from_raw_os_error(libc::ENODEV))
    }
    fn write_zeroes_at(&self, _: u64, _: u64) -> std::io::Result<()> {
        Err(std::io::Error::from_raw_os_error(libc::ENODEV))
    }
    fn sync(&self) -> std::io::Result<()> {
        Err(std::io::Error::from_raw_os_error(libc::ENODEV))
    }
    fn open_handle(self: Arc<Self>) -> Box<dyn tessera_io::IoHandle> {
        Box::new(MissingHandle)
    }
}

/// Wrap the devices of a redundant pool in swappable slots (other layouts: as they are).
pub(super) fn wrap_slots(
    redundant: bool,
    devs: Vec<Arc<dyn BlockDevice>>,
) -> (Vec<Arc<dyn BlockDevice>>, Vec<Arc<SwappableDevice>>) {
    if !redundant {
        return (devs, Vec::new());
    }
    let slots: Vec<Arc<SwappableDevice>> = devs.into_iter().map(SwappableDevice::new).collect();
    let devs = slots
        .iter()
        .map(|s| s.clone() as Arc<dyn BlockDevice>)
        .collect();
    (devs, slots)
}

/// Bytes device `i` of `p` must have: its data start (1 MiB; 17 MiB for parity layouts,
/// whose stripe journal precedes the data, docs/format.md §1) plus its data length.
pub(super) fn slot_need(p: &Pool, i: usize) -> u64 {
    let l = &p.core.layout;
    let start = if l.kind.is_parity() {
        tessera_pool::format::DEV_DATA_START + (16 << 20)
    } else {
        tessera_pool::format::DEV_DATA_START
    };
    l.dev_data_len[i] + start
}

/// What a device swapped into a slot must hold: what the layout uses of the slot (a
/// stand-in for a missing device claims a huge size).
pub(super) fn fit_slots(p: &Pool, slots: &[Arc<SwappableDevice>]) {
    for (i, s) in slots.iter().enumerate() {
        s.set_required_size(slot_need(p, i));
    }
}

pub(super) fn spec_path(s: &str) -> Option<std::path::PathBuf> {
    match DeviceSpec::parse(s) {
        Ok(DeviceSpec::File { path, .. }) => Some(path),
        _ => None,
    }
}

/// The spec to remember in the registry: files by path alone (they exist now).
pub(super) fn canonical_spec(s: &str) -> String {
    match DeviceSpec::parse(s) {
        Ok(DeviceSpec::File { path, .. }) => std::fs::canonicalize(&path)
            .unwrap_or(path)
            .display()
            .to_string(),
        _ => s.to_string(),
    }
}
