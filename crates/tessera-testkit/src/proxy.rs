//! A TCP relay on loopback that shapes one path: it adds a one-way delay and/or limits
//! the bandwidth of each direction, and both can change while connections run (a path
//! that becomes slow, then fast again).
//!
//! Each direction of each connection is a reader thread and a writer thread joined by a
//! bounded channel: the reader stamps what it reads with its arrival time, the writer
//! forwards it once `arrival + delay` has passed and, with a rate limit, once the
//! emulated link has serialized it (`len / rate` after the previous chunk). What the
//! writer has not forwarded yet backs up into the channel and then the sockets, as a
//! queue at a bottleneck does. Threads and buffers are bounded ([`MAX_CONNECTIONS`],
//! [`QUEUED_CHUNKS`]); dropping the proxy shuts every connection down and joins every
//! thread.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tessera_io::sync::MutexExt;

/// Connections relayed at once; more are closed at accept.
pub const MAX_CONNECTIONS: usize = 32;
/// Largest piece read at once: small enough that a rate limit paces smoothly.
const CHUNK: usize = 8 << 10;
/// Pieces a direction holds before its reader stops reading (1 MiB).
pub const QUEUED_CHUNKS: usize = 128;
/// The longest a thread sleeps before looking at the stop flag again.
const NAP: Duration = Duration::from_millis(20);

/// The shaping in force; read by the writers for every chunk.
#[derive(Default)]
struct Shape {
    delay_ns: AtomicU64,
    /// Bytes per second per direction; 0: unlimited.
    rate: AtomicU64,
}

struct Conn {
    sockets: [TcpStream; 2],
    threads: Vec<JoinHandle<()>>,
}

/// A shaping relay to one target; see the module documentation.
pub struct ShapingProxy {
    addr: SocketAddr,
    shape: Arc<Shape>,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<Conn>>>,
    acceptor: Option<JoinHandle<()>>,
}

impl ShapingProxy {
    /// Listen on a free loopback port and relay every connection to `target`, unshaped
    /// until told otherwise.
    pub fn start(target: &str) -> ShapingProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let shape = Arc::new(Shape::default());
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<Conn>>> = Arc::default();
        let target = target.to_string();
        let (sh, st, cs) = (shape.clone(), stop.clone(), conns.clone());
        let acceptor = std::thread::Builder::new()
            .name("shaping-proxy".into())
            .spawn(move || accept_loop(&listener, &target, &sh, &st, &cs))
            .expect("spawn the proxy");
        ShapingProxy {
            addr,
            shape,
            stop,
            conns,
            acceptor: Some(acceptor),
        }
    }

    /// `HOST:PORT` to connect to instead of the target.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// Delay added to each direction (a round trip grows by twice this).
    pub fn set_delay(&self, one_way: Duration) {
        let ns = u64::try_from(one_way.as_nanos()).unwrap_or(u64::MAX);
        self.shape.delay_ns.store(ns, Relaxed);
    }

    /// Bandwidth of each direction in bytes per second; `None`: unlimited.
    pub fn set_rate(&self, bytes_per_sec: Option<u64>) {
        self.shape.rate.store(bytes_per_sec.unwrap_or(0), Relaxed);
    }
}

impl Drop for ShapingProxy {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        // Wake the acceptor out of accept().
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
        let conns = std::mem::take(&mut *self.conns.locked());
        for c in &conns {
            for s in &c.sockets {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        for c in conns {
            for t in c.threads {
                let _ = t.join();
            }
        }
    }
}

fn accept_loop(
    listener: &TcpListener,
    target: &str,
    shape: &Arc<Shape>,
    stop: &Arc<AtomicBool>,
    conns: &Mutex<Vec<Conn>>,
) {
    for client in listener.incoming() {
        if stop.load(Relaxed) {
            return;
        }
        let Ok(client) = client else { continue };
        let mut live = conns.locked();
        // Forget connections whose threads have all ended (joined: they are done).
        let (ended, running): (Vec<Conn>, Vec<Conn>) = std::mem::take(&mut *live)
            .into_iter()
            .partition(|c| c.threads.iter().all(JoinHandle::is_finished));
        *live = running;
        for c in ended {
            for t in c.threads {
                let _ = t.join();
            }
        }
        if live.len() >= MAX_CONNECTIONS {
            continue;
        }
        let server = target
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .and_then(|a| TcpStream::connect_timeout(&a, Duration::from_secs(5)).ok());
        let Some(server) = server else { continue };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let clones = || -> std::io::Result<_> {
            Ok((
                client.try_clone()?,
                server.try_clone()?,
                server.try_clone()?,
                client.try_clone()?,
            ))
        };
        let Ok((c_read, s_write, s_read, c_write)) = clones() else {
            continue;
        };
        let mut threads = direction(c_read, s_write, shape, stop);
        threads.extend(direction(s_read, c_write, shape, stop));
        live.push(Conn {
            sockets: [client, server],
            threads,
        });
    }
}

/// The two threads relaying `from` to `to`.
fn direction(
    from: TcpStream,
    to: TcpStream,
    shape: &Arc<Shape>,
    stop: &Arc<AtomicBool>,
) -> Vec<JoinHandle<()>> {
    let (tx, rx) = sync_channel::<(Instant, Vec<u8>)>(QUEUED_CHUNKS);
    let (sh, st) = (shape.clone(), stop.clone());
    let mut threads = Vec::with_capacity(2);
    let from2 = from.try_clone();
    if let Ok(t) = std::thread::Builder::new()
        .name("shaping-proxy-rx".into())
        .spawn(move || read_side(from, &tx))
    {
        threads.push(t);
    }
    if let Ok(t) = std::thread::Builder::new()
        .name("shaping-proxy-tx".into())
        .spawn(move || {
            write_side(&rx, &to, &sh, &st);
            // One direction ended: end the connection, as a broken path would.
            let _ = to.shutdown(Shutdown::Both);
            if let Ok(f) = from2 {
                let _ = f.shutdown(Shutdown::Both);
            }
        })
    {
        threads.push(t);
    }
    threads
}

fn read_side(mut from: TcpStream, tx: &SyncSender<(Instant, Vec<u8>)>) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if tx.send((Instant::now(), buf[..n].to_vec())).is_err() {
            return;
        }
    }
}

fn write_side(
    rx: &Receiver<(Instant, Vec<u8>)>,
    mut to: &TcpStream,
    shape: &Shape,
    stop: &AtomicBool,
) {
    // When the emulated link has finished serializing what it forwarded last.
    let mut link_free = Instant::now();
    while let Ok((arrived, data)) = rx.recv() {
        let due = arrived + Duration::from_nanos(shape.delay_ns.load(Relaxed));
        let len = u64::try_from(data.len()).unwrap_or(u64::MAX);
        // A rate of 0 means unlimited: no serialization time.
        let at = match len
            .saturating_mul(1_000_000_000)
            .checked_div(shape.rate.load(Relaxed))
        {
            None => due,
            Some(ns) => due.max(link_free) + Duration::from_nanos(ns),
        };
        loop {
            if stop.load(Relaxed) {
                return;
            }
            let now = Instant::now();
            if now >= at {
                break;
            }
            std::thread::sleep((at - now).min(NAP));
        }
        link_free = at;
        if to.write_all(&data).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on loopback; returns its address.
    fn echo() -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for c in l.incoming().take(4) {
                let Ok(mut c) = c else { return };
                std::thread::spawn(move || {
                    let mut b = vec![0u8; 64 << 10];
                    while let Ok(n) = c.read(&mut b) {
                        if n == 0 || c.write_all(&b[..n]).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    fn round_trip(s: &mut TcpStream, len: usize) -> Duration {
        let t = Instant::now();
        let data = crate::data::pattern(len as u64, len);
        s.write_all(&data).unwrap();
        let mut back = vec![0u8; len];
        s.read_exact(&mut back).unwrap();
        assert!(back == data, "the relay changed the data");
        t.elapsed()
    }

    #[test]
    fn delay_and_rate_shape_the_path_and_can_be_removed() {
        let p = ShapingProxy::start(&echo());
        let mut s = TcpStream::connect(p.addr()).unwrap();
        s.set_nodelay(true).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let fast = round_trip(&mut s, 100);
        p.set_delay(Duration::from_millis(50));
        let delayed = round_trip(&mut s, 100);
        assert!(
            delayed >= Duration::from_millis(100),
            "two 50 ms legs took {delayed:?}"
        );
        p.set_delay(Duration::ZERO);
        // 256 KiB at 1 MiB/s in each direction: at least 250 ms (the legs overlap).
        p.set_rate(Some(1 << 20));
        let limited = round_trip(&mut s, 256 << 10);
        assert!(
            limited >= Duration::from_millis(240),
            "256 KiB at 1 MiB/s took {limited:?}"
        );
        p.set_rate(None);
        let again = round_trip(&mut s, 100);
        // Well below one shaped leg, with room for a busy machine's scheduling.
        assert!(
            again < Duration::from_millis(50),
            "unshaped again: {again:?} (first {fast:?})"
        );
        drop(s);
        drop(p);
    }
}
