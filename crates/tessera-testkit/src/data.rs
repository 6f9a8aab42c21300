//! Reproducible randomness and test data.

/// xorshift64: reproducible randomness for the model tests.
pub struct Rng(pub u64);

impl Rng {
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Whether every byte is zero. Checked 64 bytes at a time with an OR, which the compiler
/// vectorises: the model checker asks this of every sector it reads and of every write's
/// old contents, and a byte-at-a-time `all` was a fifth of its time.
pub fn is_zero(bytes: &[u8]) -> bool {
    let mut chunks = bytes.chunks_exact(64);
    chunks.all(|c| c.iter().fold(0, |acc, &b| acc | b) == 0)
        && chunks.remainder().iter().all(|&b| b == 0)
}

/// `len` bytes of the xorshift stream that starts from `x` (made odd).
fn stream(x: u64, len: usize) -> Vec<u8> {
    let mut r = Rng(x | 1);
    (0..len).map(|_| r.next().to_le_bytes()[0]).collect()
}

/// `len` bytes that depend on `seed` only: different seeds, different data.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    stream(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15), len)
}

/// `len` bytes of garbage that depend on `seed` only, eight bytes per step of the
/// stream: for filling whole devices, where [`pattern`]'s byte per step was a quarter
/// of the model checker's time on the runs that replace devices.
pub fn garbage(seed: u64, len: usize) -> Vec<u8> {
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&r.next().to_le_bytes());
    }
    out.truncate(len);
    out
}

/// The contents of block `i` at generation `gen` (the `gen`-th version written there):
/// different blocks and different generations hold different data.
pub fn block(i: usize, gen: u64, len: usize) -> Vec<u8> {
    stream(
        (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ gen.wrapping_mul(31),
        len,
    )
}

/// A 4 KiB block that says what it is: `block` and `gen` in its first 16 bytes, then a
/// stream seeded by both; generation 0 is all zeros (never written). Crash tests write
/// these and [`decode_stamped`] tells, from a block read back, which write landed or
/// that it is torn or misplaced.
pub fn stamped(block: u64, gen: u64) -> Vec<u8> {
    if gen == 0 {
        return vec![0; 4096];
    }
    let mut b = Vec::with_capacity(4096);
    b.extend_from_slice(&block.to_le_bytes());
    b.extend_from_slice(&gen.to_le_bytes());
    let mut r = Rng((block.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ gen.wrapping_mul(0xc2b2_ae3d_27d4_eb4f))
        | 1);
    while b.len() < 4096 {
        b.extend_from_slice(&r.next().to_le_bytes());
    }
    b
}

/// What is wrong with a block that should hold a [`stamped`] generation.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadBlock {
    /// The header names another block: data written at another offset.
    #[error("holds the header of block {block} (generation {gen:#x})")]
    Misplaced { block: u64, gen: u64 },
    /// The header is right but the rest differs from that generation's pattern.
    #[error("header says generation {gen:#x} but {bytes_wrong} bytes differ from its pattern (torn or mixed write)")]
    Torn { gen: u64, bytes_wrong: usize },
}

/// Which generation a [`stamped`] block read back at `block` holds (0: zeros), or what
/// is wrong with it.
pub fn decode_stamped(block: u64, data: &[u8]) -> Result<u64, BadBlock> {
    if is_zero(data) {
        return Ok(0);
    }
    let b = u64::from_le_bytes(data[0..8].try_into().expect("8 bytes"));
    let g = u64::from_le_bytes(data[8..16].try_into().expect("8 bytes"));
    if b != block {
        return Err(BadBlock::Misplaced { block: b, gen: g });
    }
    let good = stamped(block, g);
    if data != good.as_slice() {
        let bad = data.iter().zip(&good).filter(|(a, b)| a != b).count();
        return Err(BadBlock::Torn {
            gen: g,
            bytes_wrong: bad,
        });
    }
    Ok(g)
}

/// Fail the test unless `got` is `want`, naming `what` and the first byte that differs
/// (not the whole buffers, which may be megabytes).
pub fn assert_same_bytes(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length differs");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i} ({:#04x} != expected {:#04x})",
            got[i], want[i]
        );
    }
}

#[cfg(test)]
mod tests {
    use super::is_zero;

    #[test]
    fn is_zero_sees_one_nonzero_byte_anywhere() {
        for len in [0, 1, 63, 64, 65, 512, 4096 + 7] {
            let mut v = vec![0u8; len];
            assert!(is_zero(&v), "len {len}");
            for at in 0..len {
                v[at] = 0x80;
                assert!(!is_zero(&v), "len {len}, byte {at}");
                v[at] = 0;
            }
        }
    }
}
