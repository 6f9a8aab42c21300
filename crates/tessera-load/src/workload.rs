//! What requests a load generator issues: the access pattern, the read/write mix, the
//! random number generator and the data written.

use clap::ValueEnum;
use tessera_io::cast::u8_of;

/// The access pattern of the network load generators (`nbd-perf`, `nvmf perf`).
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
pub enum Pattern {
    Randread,
    Randwrite,
    Randrw,
}

/// A xorshift64 generator: cheap enough to call once per request.
#[derive(Clone, Copy, Debug)]
pub struct Rng(u64);

impl Rng {
    /// The generator of connection (or core) `index` of a run: every one draws its own
    /// sequence, the same from run to run.
    pub fn for_index(index: usize) -> Rng {
        Rng(0x9E37_79B9_7F4A_7C15 ^ (index as u64 + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93))
    }

    /// The same generator with its low bit set.
    pub fn odd(self) -> Rng {
        Rng(self.0 | 1)
    }

    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Does a request drawn as `r` write, given the read percentage of a mixed pattern?
#[inline]
pub fn mixed_is_write(r: u64, rwmix_read: u64) -> bool {
    (r >> 40) % 100 >= rwmix_read
}

/// The data every writer sends: `len` bytes of a fixed, non-repeating-per-block pattern.
pub fn payload(len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    fill_payload(&mut v);
    v
}

/// Fill `b` with the data of [`payload`].
pub fn fill_payload(b: &mut [u8]) {
    for (i, x) in b.iter_mut().enumerate() {
        *x = u8_of(i * 131 % 251);
    }
}
