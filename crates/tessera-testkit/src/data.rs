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

/// `len` bytes of the xorshift stream that starts from `x` (made odd).
fn stream(x: u64, len: usize) -> Vec<u8> {
    let mut r = Rng(x | 1);
    (0..len).map(|_| r.next() as u8).collect()
}

/// `len` bytes that depend on `seed` only: different seeds, different data.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    stream(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15), len)
}

/// The contents of block `i` at generation `gen` (the `gen`-th version written there):
/// different blocks and different generations hold different data.
pub fn block(i: usize, gen: u64, len: usize) -> Vec<u8> {
    stream(
        (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ gen.wrapping_mul(31),
        len,
    )
}
