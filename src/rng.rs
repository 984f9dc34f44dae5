//! A tiny deterministic PRNG, identical on every machine: data order and the synthetic
//! world must not depend on libtorch's generator or the platform.

/// SplitMix64 (Steele, Lea & Flood 2014): tiny, full-period, good enough statistically for
/// shuffling and picking, and trivially reproducible.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// Derive independent streams from one seed, so adding draws to one phase of generation
    /// does not reshuffle every later phase.
    pub fn new(seed: u64, stream: u64) -> Self {
        let mut r = SplitMix64(seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03));
        r.next_u64();
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`). Multiply-shift (Lemire) keeps the bias negligible for
    /// the small `n` used here without a rejection loop.
    pub fn below(&mut self, n: usize) -> usize {
        debug_assert!(n > 0);
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }

    /// Fisher–Yates.
    pub fn shuffle<T>(&mut self, xs: &mut [T]) {
        for i in (1..xs.len()).rev() {
            let j = self.below(i + 1);
            xs.swap(i, j);
        }
    }
}


/// Runs `draw` right after seeding libtorch's generator, holding a process-wide lock.
///
/// libtorch has one global CPU generator per process. A `manual_seed` followed by draws is
/// only reproducible if no other thread seeds or draws in between: parallel tests, or a
/// server's requests, would otherwise change an editor's initialisation from run to run
/// (seen in CI as a single-device run whose losses left its twin's after the first
/// optimiser step). Every libtorch draw in the crate goes through here.
pub fn torch_seeded<T>(seed: i64, draw: impl FnOnce() -> T) -> T {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _held = LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    tch::manual_seed(seed);
    draw()
}
