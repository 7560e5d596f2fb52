//! Percentiles of timing samples: how `kintsugi run` summarizes reboot
//! times and how the benchmarks report theirs.

#[derive(Debug, Clone, Copy)]
pub struct Summary {
    pub n: usize,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
    pub max: f64,
}

impl Summary {
    /// Summarizes samples (any unit); `None` if there are none.
    pub fn of(samples: &[f64]) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        let mut s = samples.to_vec();
        s.sort_by(|a, b| a.total_cmp(b));
        let at = |q: f64| s[((s.len() - 1) as f64 * q).round() as usize];
        Some(Self {
            n: s.len(),
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            mean: s.iter().sum::<f64>() / s.len() as f64,
            max: *s.last().unwrap(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = Summary::of(&v).unwrap();
        assert_eq!((s.p50, s.p99, s.max, s.n), (51.0, 99.0, 100.0, 100));
        assert!((s.mean - 50.5).abs() < 1e-9);
        assert!(Summary::of(&[]).is_none());
    }
}
