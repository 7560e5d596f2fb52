//! The work `spin.work` does, shared by its server (spinner) and its
//! clients, which check every result against their own computation.

/// Rounds of xorshift per unit: about a microsecond on the project's VMs.
const ROUNDS: u32 = 256;

/// The checksum of `units` units of work on `seed`.
pub fn checksum(seed: u64, units: u32) -> u64 {
    let mut x = seed | 1;
    for _ in 0..units {
        for _ in 0..ROUNDS {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
        }
        x = std::hint::black_box(x);
    }
    x
}

#[cfg(test)]
mod tests {
    #[test]
    fn checksum_depends_on_seed_and_units() {
        assert_eq!(super::checksum(7, 3), super::checksum(7, 3));
        assert_ne!(super::checksum(7, 3), super::checksum(7, 4));
        assert_ne!(super::checksum(7, 3), super::checksum(8, 3));
    }
}
