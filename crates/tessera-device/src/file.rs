//! Files and block devices, opened with O_DIRECT and driven through the core's io_uring.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::{opcode, types};
use tessera_io::AlignedBuf;

use crate::{check_range, out_of_range, BlockDevice, CoreIo, IoHandle, IoOp, Tag};
use tessera_io::cast::usize_of;

pub struct FileDevice {
    file: File,
    path: PathBuf,
    size: u64,
    is_block: bool,
    direct: bool,
    align: u32,
}

const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const BLKSSZGET: libc::c_ulong = 0x1268;

impl FileDevice {
    /// Open an existing file or block device. With `create_size`, a missing regular file is
    /// created (sparse) with that size.
    pub fn open(path: &Path, create_size: Option<u64>) -> io::Result<Arc<FileDevice>> {
        let ctx = |e: io::Error, what: &str| {
            io::Error::new(e.kind(), format!("{}: {what}: {e}", path.display()))
        };
        if !path.exists() {
            match create_size {
                Some(sz) => {
                    let f = OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .open(path)
                        .map_err(|e| ctx(e, "cannot create"))?;
                    f.set_len(sz).map_err(|e| ctx(e, "cannot size"))?;
                }
                None => {
                    return Err(io::Error::new(
                        io::ErrorKind::NotFound,
                        format!(
                            "{}: no such file or device (give PATH:SIZE to create a file)",
                            path.display()
                        ),
                    ))
                }
            }
        }
        // A block device is claimed with O_EXCL: the kernel then refuses it to every other
        // exclusive opener (another pool, mkfs, mount, md, LVM) and refuses the open while
        // the device is mounted or claimed (EBUSY).
        let is_block_path = std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device());
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.read(true).write(true);
            let mut flags = 0;
            if direct {
                flags |= libc::O_DIRECT;
            }
            if is_block_path {
                flags |= libc::O_EXCL;
            }
            o.custom_flags(flags);
            o.open(path)
        };
        // Some filesystems refuse O_DIRECT; fall back to buffered I/O and say so.
        let (file, direct) = match open(true) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::warn!(path = %path.display(),
                    "O_DIRECT not supported here: using buffered I/O");
                (open(false).map_err(|e| ctx(e, "cannot open"))?, false)
            }
            Err(e) if is_block_path && e.raw_os_error() == Some(libc::EBUSY) => {
                return Err(in_use(
                    path,
                    "mounted, or opened exclusively by another pool or program".into(),
                ))
            }
            Err(e) => return Err(ctx(e, "cannot open")),
        };
        if !is_block_path {
            lock_file(&file, path)?;
        }
        let meta = file.metadata().map_err(|e| ctx(e, "cannot stat"))?;
        let is_block = meta.file_type().is_block_device();
        let (mut size, mut align) = (meta.len(), 512u32);
        if is_block {
            let mut sz: u64 = 0;
            let mut ssz: libc::c_int = 0;
            // SAFETY: ioctls writing into properly typed locals on an open fd.
            unsafe {
                if libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut sz) != 0 {
                    return Err(ctx(
                        io::Error::last_os_error(),
                        "cannot read block device size",
                    ));
                }
                if libc::ioctl(file.as_raw_fd(), BLKSSZGET, &mut ssz) == 0 && ssz > 0 {
                    align = ssz as u32;
                }
            }
            size = sz;
        } else if !meta.file_type().is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{}: not a regular file or block device", path.display()),
            ));
        }
        if let Some(want) = create_size {
            if !is_block && want > size {
                file.set_len(want).map_err(|e| ctx(e, "cannot grow"))?;
                size = want;
            }
        }
        if !direct {
            align = 1;
        }
        size -= size % 4096;
        Ok(Arc::new(FileDevice {
            file,
            path: path.to_path_buf(),
            size,
            is_block,
            direct,
            align,
        }))
    }

    fn aligned(&self, offset: u64, len: usize, ptr: *const u8) -> bool {
        let a = self.align as u64;
        !self.direct
            || (offset.is_multiple_of(a)
                && (len as u64).is_multiple_of(a)
                && (ptr as u64).is_multiple_of(a))
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
        // SAFETY: plain syscall on our fd.
        let r = unsafe { libc::fallocate(self.file.as_raw_fd(), mode, offset as i64, len as i64) };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    fn zero_mode(&self) -> libc::c_int {
        if self.is_block {
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        }
    }
}

/// The error for a device another pool, node or program holds: names the device and, when
/// /proc/locks tells, the process holding it.
fn in_use(path: &Path, why: String) -> io::Error {
    io::Error::new(
        io::ErrorKind::ResourceBusy,
        format!("device {} is in use ({why})", path.display()),
    )
}

/// How long [`lock_file`] waits for a lock whose holder has exited. A process killed
/// with I/O in flight keeps its files open in its io_uring until the kernel has torn the
/// ring down, which waits for that I/O: the lock outlives the process by milliseconds
/// (longer on a slow device), and a supervisor restarting the node at once meets it.
const DEAD_HOLDER_WAIT: Duration = Duration::from_secs(10);

/// Take an exclusive, non-blocking `flock` on a regular file used as a device, for as long
/// as `file` stays open (the lock goes with the open file description: a second open of
/// the same file, in this process or another, is refused).
///
/// A lock whose holder has exited is waited for (up to [`DEAD_HOLDER_WAIT`]) rather than
/// refused. The lock stays on the descriptor the dead process's io_uring used on purpose:
/// it ends only once the last of that process's writes has completed, so none of them can
/// land after this process has started recovering the pool from the device.
fn lock_file(file: &File, path: &Path) -> io::Result<()> {
    let deadline = Instant::now() + DEAD_HOLDER_WAIT;
    loop {
        // SAFETY: flock on an fd this function's caller owns; no memory is involved.
        let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(io::Error::new(
                e.kind(),
                format!("{}: cannot lock: {e}", path.display()),
            ));
        }
        let holder = file.metadata().ok().and_then(|m| flock_holder(&m));
        let why = match holder {
            Some(Holder::Alive(pid)) => format!("locked by process {pid}"),
            Some(Holder::Gone(_)) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Some(Holder::Gone(pid)) => format!(
                "locked by process {}, which has exited, and still locked after {:?}",
                pid.map_or_else(|| "?".into(), |p| p.to_string()),
                DEAD_HOLDER_WAIT
            ),
            None => "locked by another process".into(),
        };
        return Err(in_use(
            path,
            format!("{why}: a device belongs to one pool of one node at a time"),
        ));
    }
}

/// The holder of a `flock`, as /proc tells it.
enum Holder {
    Alive(u32),
    /// The process that took the lock has exited (its pid, when /proc/locks still shows
    /// it: in another pid namespace a freed pid reads as 0), or the lock is gone.
    Gone(Option<u32>),
}

/// The holder of a `flock` on the file `meta` describes, from /proc/locks
/// (`ID: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE START END`, major and minor in hex).
/// None when /proc/locks cannot be read.
fn flock_holder(meta: &std::fs::Metadata) -> Option<Holder> {
    use std::os::unix::fs::MetadataExt;
    let dev = meta.dev();
    let want = format!(
        "{:02x}:{:02x}:{}",
        libc::major(dev),
        libc::minor(dev),
        meta.ino()
    );
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    let pid: Option<u32> = locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // A waiter's line starts with "ID: ->"; only holders have FLOCK in field 1.
        (f.len() >= 6 && f[1] == "FLOCK" && f[5] == want)
            .then(|| f[4].parse().ok())
            .flatten()
    });
    // No line: the lock was released since the attempt (try again).
    Some(match pid {
        None | Some(0) => Holder::Gone(None),
        Some(p) if process_alive(p) => Holder::Alive(p),
        Some(p) => Holder::Gone(Some(p)),
    })
}

/// Whether process `pid` is alive: it exists and is not a zombie (a zombie has closed its
/// files; what still holds them is its io_uring's teardown).
fn process_alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `PID (COMM) STATE ...`: COMM may hold spaces and parentheses, so look after the last ')'.
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next());
    !matches!(state, Some("Z" | "X" | "x"))
}

struct FileHandle {
    dev: Arc<FileDevice>,
    fd: types::Fd,
}

impl IoHandle for FileHandle {
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        let size = self.dev.size;
        let entry = match op {
            IoOp::Read { offset, len, buf } => {
                if let Err(e) = check_range(size, offset, len as u64) {
                    return io.complete(tag, e);
                }
                if !self.dev.aligned(offset, len as usize, buf) {
                    return io.complete(tag, -libc::EINVAL);
                }
                opcode::Read::new(self.fd, buf, len).offset(offset).build()
            }
            IoOp::Write { offset, len, buf } => {
                if let Err(e) = check_range(size, offset, len as u64) {
                    return io.complete(tag, e);
                }
                if !self.dev.aligned(offset, len as usize, buf) {
                    return io.complete(tag, -libc::EINVAL);
                }
                opcode::Write::new(self.fd, buf, len).offset(offset).build()
            }
            IoOp::Flush => opcode::Fsync::new(self.fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            IoOp::Discard { offset, len } => {
                if let Err(e) = check_range(size, offset, len) {
                    return io.complete(tag, e);
                }
                opcode::Fallocate::new(self.fd, len)
                    .offset(offset)
                    .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                    .build()
            }
            IoOp::WriteZeroes { offset, len, .. } => {
                if let Err(e) = check_range(size, offset, len) {
                    return io.complete(tag, e);
                }
                opcode::Fallocate::new(self.fd, len)
                    .offset(offset)
                    .mode(self.dev.zero_mode())
                    .build()
            }
        };
        // SAFETY: the fd lives as long as self.dev (held by this handle, which the caller
        // keeps until completions drain); buffers are guaranteed by the submitter.
        unsafe { io.push_sqe(entry, tag) };
    }
    fn size(&self) -> u64 {
        self.dev.size
    }
}

impl BlockDevice for FileDevice {
    fn describe(&self) -> String {
        self.path.display().to_string()
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn alignment(&self) -> u32 {
        self.align
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        check_range(self.size, offset, buf.len() as u64)
            .map_err(|_| out_of_range(&self.describe(), offset, buf.len() as u64, self.size))?;
        if self.aligned(offset, buf.len(), buf.as_ptr()) {
            return self.file.read_exact_at(buf, offset);
        }
        // Bounce through an aligned buffer covering the aligned superset of the range.
        let a = self.align as u64;
        let start = offset - offset % a;
        let end = (offset + buf.len() as u64).next_multiple_of(a);
        let mut b = AlignedBuf::zeroed(usize_of(end - start));
        self.file
            .read_exact_at(&mut b.as_mut_slice()[..usize_of(end - start)], start)?;
        let s = usize_of(offset - start);
        buf.copy_from_slice(&b.as_slice()[s..s + buf.len()]);
        Ok(())
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        check_range(self.size, offset, buf.len() as u64)
            .map_err(|_| out_of_range(&self.describe(), offset, buf.len() as u64, self.size))?;
        if self.aligned(offset, buf.len(), buf.as_ptr()) {
            return self.file.write_all_at(buf, offset);
        }
        let a = self.align as u64;
        let start = offset - offset % a;
        let end = (offset + buf.len() as u64).next_multiple_of(a);
        let n = usize_of(end - start);
        let mut b = AlignedBuf::zeroed(n);
        self.file.read_exact_at(&mut b.as_mut_slice()[..n], start)?;
        let s = usize_of(offset - start);
        b.as_mut_slice()[s..s + buf.len()].copy_from_slice(buf);
        self.file.write_all_at(&b.as_slice()[..n], start)
    }
    fn write_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.size, offset, len)
            .map_err(|_| out_of_range(&self.describe(), offset, len, self.size))?;
        if len == 0 || self.fallocate(self.zero_mode(), offset, len).is_ok() {
            return Ok(());
        }
        // The filesystem cannot punch holes: write zeros.
        self.write_zero_blocks(offset, len)
    }
    fn fill_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.size, offset, len)
            .map_err(|_| out_of_range(&self.describe(), offset, len, self.size))?;
        if self.is_block {
            return self.write_zeroes_at(offset, len);
        }
        self.write_zero_blocks(offset, len)
    }
    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn open_handle(self: Arc<Self>) -> Box<dyn IoHandle> {
        let fd = types::Fd(self.file.as_raw_fd());
        Box::new(FileHandle { dev: self, fd })
    }
}

impl FileDevice {
    /// Write zero bytes over the range (its blocks end up allocated and written).
    fn write_zero_blocks(&self, offset: u64, len: u64) -> io::Result<()> {
        let chunk = AlignedBuf::zeroed(1 << 20);
        let mut done = 0;
        while done < len {
            let n = (len - done).min(1 << 20) as usize;
            self.write_at(offset + done, &chunk.as_slice()[..n])?;
            done += n as u64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_device_is_opened_by_one_owner_at_a_time() {
        let path = std::env::temp_dir().join(format!("tessera-lock-{}.img", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let first = FileDevice::open(&path, Some(4 << 20)).unwrap();
        let Err(e) = FileDevice::open(&path, None) else {
            panic!("a second open of a device in use succeeded");
        };
        assert_eq!(e.kind(), io::ErrorKind::ResourceBusy, "{e}");
        let msg = e.to_string();
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(
            msg.contains(&format!("process {}", std::process::id())),
            "{msg}"
        );
        // The lock lives as long as the device: once it is gone the file opens again.
        drop(first);
        let again = FileDevice::open(&path, None).unwrap();
        assert_eq!(again.size(), 4 << 20);
        drop(again);
        std::fs::remove_file(&path).unwrap();
    }

    /// A lock whose holder has exited while its open file lives on (as a killed node's
    /// io_uring keeps it until the ring is torn down) is waited for, not refused: here
    /// flock(1) takes the lock on a descriptor its shell keeps open for a second after
    /// flock itself exited.
    #[test]
    fn a_lock_left_by_an_exited_process_is_waited_for() {
        use std::io::BufRead;
        let path = std::env::temp_dir().join(format!("tessera-dead-{}.img", std::process::id()));
        let _ = std::fs::remove_file(&path);
        drop(FileDevice::open(&path, Some(4 << 20)).unwrap());
        let mut sh = std::process::Command::new("sh")
            .args([
                "-c",
                "exec 9<>\"$0\" && flock -x 9 && echo locked && exec sleep 1",
            ])
            .arg(&path)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("sh");
        let mut line = String::new();
        std::io::BufReader::new(sh.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "locked", "flock(1) did not take the lock");
        let dev = FileDevice::open(&path, None).expect("the dead holder's lock was waited for");
        sh.wait().unwrap();
        drop(dev);
        std::fs::remove_file(&path).unwrap();
    }
}
