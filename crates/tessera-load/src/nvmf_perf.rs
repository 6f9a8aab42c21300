//! `tessera nvmf perf`: a pipelined NVMe/TCP load generator, built like `nbd-perf` on the
//! same connection loop ([`crate::conn`]).
//!
//! The controller and its I/O queues are set up with the blocking initiator; then each
//! queue is driven by one thread that keeps `qd` commands outstanding (the command ID is
//! the slot index): every command that can be (re)issued is queued and leaves in one
//! non-blocking `sendmsg` (write data is sent from one payload buffer, not copied), and
//! PDUs are received into a large buffer and parsed in bulk, read data skipped in place.
//! Reads complete on the C2HData carrying the SUCCESS flag (the target skips the response
//! capsule when SQ flow control is off and no data digest is used) or on the response
//! capsule. Writes of up to 8 KiB travel in the capsule; larger ones wait for the target's
//! R2T and send H2CData PDUs of at most MAXH2CDATA bytes. The thread never blocks in a
//! send: while commands or data are still queued it polls for both directions and keeps
//! taking in completions and R2Ts. With `--busy-poll` the receive spins instead of
//! sleeping.

use crate::error::LoadError;
use std::net::TcpStream;
use tessera_io::cast::{u16_of, u32_of, usize_of};

use clap::Args;
use tessera_device::format_size;
use tessera_nvmf::initiator::{Controller, Options};
use tessera_nvmf::nvme::{self, Sqe};
use tessera_nvmf::pdu;

use crate::conn::{self, Buffers, Conn, Core, LoadArgs, Protocol, Words, Workload};
use crate::workload::{payload, Rng};

/// The workload of `tessera nvmf perf` (the target address, host NQN and digests are the
/// initiator's options, given to [`run`]).
#[derive(Args, Clone, Debug)]
pub struct NvmfPerfArgs {
    /// Subsystem NQN.
    #[arg(long)]
    nqn: String,
    /// Namespace ID.
    #[arg(long, default_value_t = 1)]
    nsid: u32,
    #[command(flatten)]
    load: LoadArgs,
    /// I/O queues, each driven by its own thread.
    #[arg(long, default_value_t = 1)]
    queues: u16,
}

const RECV_BUF: usize = 4 << 20;

/// The NVMe/TCP side of one I/O queue: PDU framing, namespace geometry, write data by R2T.
pub struct Nvmf {
    lba_shift: u32,
    nsid: u32,
    framing: pdu::Framing,
    limits: pdu::Limits,
    /// Largest H2CData PDU the target accepts.
    maxh2cdata: usize,
    /// Writes of at most this many bytes travel in the capsule; larger ones by R2T.
    in_capsule: usize,
    /// Write data asked for by R2T so far (bytes), per slot.
    r2t_asked: Vec<u32>,
    payload_crc: [u8; 4],
    /// Data digests of the H2CData pieces sent so far: (offset, length, CRC32C).
    piece_crc: Vec<(u32, u32, [u8; 4])>,
}

impl Nvmf {
    /// A queue of `qd` commands of `w.bs` bytes over `blocks` blocks of namespace `nsid`
    /// with `lba`-byte LBAs.
    #[allow(clippy::too_many_arguments)]
    fn conn(
        w: &Workload,
        nsid: u32,
        lba: u32,
        blocks: u64,
        qd: usize,
        framing: pdu::Framing,
        maxh2cdata: u32,
        rng: Rng,
    ) -> Conn<Nvmf> {
        let payload = payload(usize_of(w.bs));
        let proto = Nvmf {
            lba_shift: lba.trailing_zeros(),
            nsid,
            framing,
            limits: pdu::Limits {
                hdgst: framing.hdgst,
                ddgst: framing.ddgst,
                max_data: 2 << 20,
            },
            maxh2cdata: (maxh2cdata as usize).max(4096),
            in_capsule: tessera_nvmf::target::IN_CAPSULE,
            r2t_asked: vec![0; qd],
            payload_crc: pdu::crc(&payload).to_le_bytes(),
            piece_crc: Vec::new(),
        };
        // Room for a whole C2HData PDU of the largest transfer.
        let b = Buffers::new(payload, RECV_BUF, 2 << 20, qd * 100);
        Conn {
            core: Core::new(w, blocks, qd, rng, b),
            proto,
        }
    }

    /// The target asks for `len` bytes of the write in `slot` at `offset`: queue them as
    /// H2CData PDUs of at most MAXH2CDATA bytes.
    fn on_r2t(
        &mut self,
        c: &mut Core,
        slot: usize,
        ttag: u16,
        offset: u32,
        len: u32,
    ) -> Result<(), LoadError> {
        let (write, asked) = (c.slots[slot].write, self.r2t_asked[slot]);
        let end = offset as u64 + len as u64;
        if !write || usize_of(c.bs) <= self.in_capsule {
            return Err(LoadError::protocol(format!(
                "R2T for command {slot}, which has no data to send"
            )));
        }
        if offset != asked || len == 0 || end > c.bs {
            return Err(LoadError::protocol(format!(
                "R2T for {len} bytes at {offset} of command {slot} ({asked} of {} asked before)",
                c.bs
            )));
        }
        self.r2t_asked[slot] = u32_of(end);
        let mut at = offset;
        while at < u32_of(end) {
            let n = (u32_of(end) - at).min(u32_of(self.maxh2cdata));
            let last = at + n == u32_of(end);
            let mut h = [0u8; 160];
            let flags = if last { pdu::F_DATA_LAST } else { 0 };
            let hl = self
                .framing
                .data_pdu(&mut h, pdu::H2C_DATA, flags, u16_of(slot), ttag, at, n);
            c.b.out.push_bytes(&h[..hl]);
            c.b.out.push_payload(at as usize..(at + n) as usize);
            if self.framing.ddgst {
                let d = self.piece_digest(&c.b.payload, at, n);
                c.b.out.push_bytes(&d);
            }
            at += n;
        }
        Ok(())
    }

    fn piece_digest(&mut self, payload: &[u8], at: u32, n: u32) -> [u8; 4] {
        if let Some(&(_, _, d)) = self.piece_crc.iter().find(|p| p.0 == at && p.1 == n) {
            return d;
        }
        let d = pdu::crc(&payload[at as usize..(at + n) as usize]).to_le_bytes();
        if self.piece_crc.len() < 64 {
            self.piece_crc.push((at, n, d));
        }
        d
    }

    fn slot_of(c: &Core, cid: u16) -> Result<usize, LoadError> {
        c.slot_of(cid as u64, || {
            format!("PDU for command {cid}, which is not outstanding")
        })
    }
}

impl Protocol for Nvmf {
    const TOOL: &'static str = "nvmf-perf";
    const WORDS: Words = Words {
        requests: "commands",
        peer: "target",
        conn: "queue",
    };

    #[inline]
    fn encode(&mut self, c: &mut Core, slot: usize, write: bool, offset: u64) {
        let bs = c.bs;
        let slba = offset >> self.lba_shift;
        let nlb = u32_of(bs >> self.lba_shift);
        let in_capsule = write && usize_of(bs) <= self.in_capsule;
        let sqe = Sqe {
            opc: if write { nvme::IO_WRITE } else { nvme::IO_READ },
            cid: u16_of(slot),
            nsid: self.nsid,
            cdw10: u32_of(slba & 0xffff_ffff),
            cdw11: u32_of(slba >> 32),
            cdw12: nlb - 1,
            ..Sqe::default()
        }
        .with_sgl(
            if in_capsule {
                nvme::SGL_DATA_BLOCK_OFFSET
            } else {
                nvme::SGL_TRANSPORT_DATA_BLOCK
            },
            u32_of(bs),
        );
        let mut h = [0u8; 160];
        let data = if in_capsule { usize_of(bs) } else { 0 };
        let n = self.framing.capsule_cmd(&mut h, &sqe.encode(), data);
        c.b.out.push_bytes(&h[..n]);
        if in_capsule {
            c.b.out.push_payload(0..data);
            if self.framing.ddgst {
                c.b.out.push_bytes(&self.payload_crc);
            }
        }
        self.r2t_asked[slot] = 0;
    }

    /// Parse every complete PDU; returns how many commands completed.
    fn parse(&mut self, c: &mut Core, now: u64) -> Result<u64, LoadError> {
        let mut done = 0;
        loop {
            let avail = c.b.in_end - c.b.in_start;
            if avail < pdu::CH_LEN {
                return Ok(done);
            }
            let b = &c.b.inb[c.b.in_start..c.b.in_end];
            let f = pdu::check_header(pdu::Role::Host, b, &self.limits)
                .map_err(|e| LoadError::Protocol(format!("bad PDU from the target: {e}")))?;
            if avail < f.plen() {
                return Ok(done);
            }
            let (ty, flags) = (f.ch.ty, f.ch.flags);
            let cid = pdu::le16(b, if ty == pdu::CAPSULE_RESP { 20 } else { 8 });
            let status = if ty == pdu::CAPSULE_RESP {
                pdu::le16(b, 22) >> 1
            } else {
                0
            };
            let (ttag, offset, len) = (pdu::le16(b, 10), pdu::le32(b, 12), pdu::le32(b, 16));
            if ty == pdu::C2H_TERM {
                let (fes, fei) = pdu::parse_term(b);
                return Err(LoadError::protocol(format!(
                    "the target terminated the queue (FES {fes:#x}, FEI {fei:#x})"
                )));
            }
            c.b.in_start += f.plen();
            match ty {
                pdu::CAPSULE_RESP => {
                    let s = Self::slot_of(c, cid)?;
                    if status & 0x7FF != 0 {
                        c.fail(s, |write| {
                            let what = if write { "write" } else { "read" };
                            format!("{what}: {}", nvme::status_text(status))
                        });
                    }
                    self.complete(c, s, now);
                    done += 1;
                }
                pdu::C2H_DATA => {
                    let s = Self::slot_of(c, cid)?;
                    if flags & pdu::F_DATA_SUCCESS != 0 {
                        self.complete(c, s, now);
                        done += 1;
                    }
                }
                pdu::R2T => {
                    let s = Self::slot_of(c, cid)?;
                    self.on_r2t(c, s, ttag, offset, len)?;
                }
                t => return Err(LoadError::protocol(format!("unexpected PDU type {t:#x}"))),
            }
        }
    }

    /// Queue 0 is the admin queue: I/O queues count from 1.
    fn conn_name(index: usize) -> String {
        format!("queue {}", index + 1)
    }

    fn close(stream: &TcpStream, _clean: bool) {
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
}

impl NvmfPerfArgs {
    fn check(&self) -> Result<Workload, LoadError> {
        let w = self
            .load
            .workload(tessera_nvmf::target::MAX_TRANSFER as u64)?;
        if self.load.qd == 0 || self.load.qd > 512 {
            return Err(LoadError::invalid("--qd must be 1..512 (the queue size)"));
        }
        if self.queues == 0 || self.queues > 64 {
            return Err(LoadError::invalid("--queues must be 1..64"));
        }
        Ok(w)
    }

    /// Blocks of `bs` bytes to use in a namespace of `ns_size` bytes.
    fn blocks(&self, ns_size: u64, bs: u64) -> Result<u64, LoadError> {
        let size = self.load.size_or(ns_size)?.min(ns_size);
        match size / bs {
            0 => Err(LoadError::invalid(
                "the namespace is smaller than one block",
            )),
            b => Ok(b),
        }
    }
}

/// Run the load on the target at `addr` (host options `o`: host NQN, digests).
pub fn run(addr: &str, mut o: Options, a: NvmfPerfArgs) -> Result<(), LoadError> {
    let w = a.check()?;
    let bs = w.bs;
    o.queue_size = u16_of(a.load.qd.max(32));
    let (hdgst, ddgst) = (o.hdgst, o.ddgst);
    let mut ctrl =
        Controller::connect(addr, &a.nqn, &o, a.queues).map_err(|source| LoadError::Nvme {
            context: format!("connecting to {} at {addr}", a.nqn),
            source,
        })?;
    if ctrl.io.len() < a.queues as usize {
        return Err(LoadError::Protocol(format!(
            "the target granted {} I/O queues",
            ctrl.io.len()
        )));
    }
    let (nblocks, lba) = ctrl
        .namespace_size(a.nsid)
        .map_err(|source| LoadError::Nvme {
            context: format!("namespace {}", a.nsid),
            source,
        })?;
    if bs % lba as u64 != 0 {
        return Err(LoadError::Invalid(format!(
            "--bs must be a multiple of the {lba}-byte LBA"
        )));
    }
    let blocks = a.blocks(nblocks * lba as u64, bs)?;
    eprintln!(
        "nvmf-perf: {} ns {} on {addr} ({} used) — {:?} bs={} qd={} queues={} for {}s",
        a.nqn,
        a.nsid,
        format_size(blocks * bs),
        a.load.pattern,
        format_size(bs),
        a.load.qd,
        a.queues,
        a.load.time
    );
    let conns = std::mem::take(&mut ctrl.io)
        .into_iter()
        .enumerate()
        .map(|(i, q)| {
            let rng = Rng::for_index(i);
            let c = Nvmf::conn(
                &w,
                a.nsid,
                lba,
                blocks,
                a.load.qd,
                q.framing,
                q.maxh2cdata,
                rng,
            );
            (q.stream, c)
        })
        .collect();
    let t = conn::run(&w, conns)?;
    let _ = ctrl.keep_alive();
    ctrl.disconnect();
    println!(
        "workload:   {:?} bs={} qd={} queues={} time={:.1}s digests={}{}",
        a.load.pattern,
        format_size(bs),
        a.load.qd,
        a.queues,
        t.secs(),
        if hdgst { "h" } else { "-" },
        if ddgst { "d" } else { "-" }
    );
    t.print_figures();
    t.print_outcome()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: NvmfPerfArgs,
    }

    fn engine(extra: &[&str], bs: u64, ddgst: bool) -> Conn<Nvmf> {
        let mut argv = vec!["x", "--nqn", "n", "--qd", "4"];
        argv.extend_from_slice(extra);
        let a = Cli::parse_from(argv).a;
        let fr = pdu::Framing {
            hdgst: false,
            ddgst,
            align: 4,
        };
        let w = Workload {
            bs,
            ..a.check().unwrap()
        };
        Nvmf::conn(
            &w,
            a.nsid,
            512,
            100,
            a.load.qd,
            fr,
            128 << 10,
            Rng::for_index(7),
        )
    }

    /// Feed PDUs to the engine; returns completions.
    fn feed(e: &mut Conn<Nvmf>, bytes: &[u8]) -> Result<u64, LoadError> {
        let space = e.core.b.recv_space();
        space[..bytes.len()].copy_from_slice(bytes);
        e.core.b.in_end += bytes.len();
        e.parse(1000)
    }

    /// Split queued bytes into PDUs: (type, flags, cid, offset, length, data).
    fn pdus(b: &[u8]) -> Vec<(u8, u8, u16, u32, u32, Vec<u8>)> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < b.len() {
            let ch = pdu::Ch::parse(&b[at..]);
            let plen = ch.plen as usize;
            let p = &b[at..at + plen];
            let (off, len) = if ch.ty == pdu::H2C_DATA {
                (pdu::le32(p, 12), pdu::le32(p, 16))
            } else {
                (0, 0)
            };
            let data = p[ch.pdo as usize..].to_vec();
            // The command ID: in the SQE of a capsule, else right after the common header.
            let cid = pdu::le16(p, if ch.ty == pdu::CAPSULE_CMD { 10 } else { 8 });
            out.push((ch.ty, ch.flags, cid, off, len, data));
            at += plen;
        }
        out
    }

    #[test]
    fn small_writes_travel_in_the_capsule() {
        let mut e = engine(&["--pattern", "randwrite"], 4096, true);
        e.fill(0);
        let out = e.core.b.out.to_vec(&e.core.b.payload);
        let p = pdus(&out);
        assert_eq!(p.len(), 4);
        for (i, x) in p.iter().enumerate() {
            assert_eq!((x.0, x.2 as usize), (pdu::CAPSULE_CMD, i));
            // Data, then its digest.
            assert_eq!(&x.5[..4096], &e.core.b.payload[..]);
            assert_eq!(x.5[4096..], pdu::crc(&e.core.b.payload).to_le_bytes());
        }
    }

    #[test]
    fn large_writes_answer_r2t_with_h2cdata_pieces() {
        let bs = 300 << 10;
        let mut e = engine(&["--pattern", "randwrite"], bs, true);
        e.fill(0);
        let sent = e.core.b.out.len();
        assert_eq!(sent, 4 * 72, "capsules without data");
        e.core.b.out = conn::SendQueue::default();
        // R2T for the whole of command 2.
        let fr = e.proto.framing;
        let mut r = [0u8; 64];
        let n = fr.r2t(&mut r, 2, 77, 0, u32_of(bs));
        assert_eq!(feed(&mut e, &r[..n]).map_err(|e| e.to_string()), Ok(0));
        let out = e.core.b.out.to_vec(&e.core.b.payload);
        let p = pdus(&out);
        let want = [
            (0u32, 128u32 << 10),
            (128 << 10, 128 << 10),
            (256 << 10, 44 << 10),
        ];
        assert_eq!(p.len(), 3);
        for (x, &(off, len)) in p.iter().zip(&want) {
            assert_eq!((x.0, x.2, x.3, x.4), (pdu::H2C_DATA, 2, off, len));
            let last = off + len == u32_of(bs);
            assert_eq!(x.1 & pdu::F_DATA_LAST != 0, last);
            let d = &e.core.b.payload[off as usize..(off + len) as usize];
            assert_eq!(&x.5[..len as usize], d);
            assert_eq!(x.5[len as usize..], pdu::crc(d).to_le_bytes());
        }
        // A second R2T for the same data, or one for a read, breaks the stream.
        assert!(matches!(feed(&mut e, &r[..n]), Err(LoadError::Protocol(_))));
        let mut e = engine(&["--pattern", "randread"], bs, false);
        e.fill(0);
        assert!(matches!(feed(&mut e, &r[..n]), Err(LoadError::Protocol(_))));
    }
}
