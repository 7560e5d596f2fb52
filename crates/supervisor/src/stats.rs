//! Percentiles of timing samples: how `kintsugi run` summarizes reboot
//! times, `kintsugi status` shows them, and the benchmarks report theirs,
//! from an HDR histogram (`hdrhistogram`) with three significant digits:
//! a percentile is within 0.1 % of the sample at its rank. Mean and
//! maximum are exact; the sample count goes beside every percentile
//! printed.

use hdrhistogram::Histogram;

#[derive(Debug, Clone, Copy)]
pub struct Summary {
    pub n: usize,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
    pub max: f64,
}

/// Significant decimal digits the histogram keeps.
const DIGITS: u8 = 3;

impl Summary {
    /// Summarizes samples (any unit, none negative or NaN); `None` if
    /// there are none.
    pub fn of(samples: &[f64]) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        // The histogram counts integers: samples are scaled by a power of
        // ten that gives the smallest positive one 3 digits before the point.
        let smallest = samples
            .iter()
            .copied()
            .filter(|&x| x > 0.0)
            .fold(f64::INFINITY, f64::min);
        let scale = match smallest.is_finite() {
            true => 10f64.powi((3.0 - smallest.log10().floor()).max(0.0) as i32),
            false => 1.0,
        };
        let mut h = Histogram::<u64>::new(DIGITS).ok()?;
        for &x in samples {
            h.record((x.max(0.0) * scale).round() as u64).ok()?;
        }
        let max = samples.iter().copied().fold(0.0, f64::max);
        // A bucket's middle may lie past the largest sample: no percentile
        // is larger than that.
        let at = |q: f64| (h.median_equivalent(h.value_at_quantile(q)) as f64 / scale).min(max);
        Some(Self {
            n: samples.len(),
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            mean: samples.iter().sum::<f64>() / samples.len() as f64,
            max,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= b.abs() * 1e-3
    }

    #[test]
    fn percentiles_are_within_a_thousandth_of_the_ranked_sample() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = Summary::of(&v).unwrap();
        assert!(
            close(s.p50, 50.0) && close(s.p90, 90.0) && close(s.p99, 99.0),
            "{s:?}"
        );
        assert_eq!((s.max, s.n), (100.0, 100));
        assert!((s.mean - 50.5).abs() < 1e-9);
        assert!(Summary::of(&[]).is_none());
        // Small and large units alike.
        let small: Vec<f64> = v.iter().map(|x| x * 1e-4).collect();
        let s = Summary::of(&small).unwrap();
        assert!(close(s.p50, 50e-4) && close(s.p99, 99e-4), "{s:?}");
        let large: Vec<f64> = v.iter().map(|x| x * 1e7 + 0.5).collect();
        let s = Summary::of(&large).unwrap();
        assert!(close(s.p50, 50e7) && close(s.p99, 99e7), "{s:?}");
        let top = Summary::of(&[3001.0, 3001.0]).unwrap();
        assert_eq!(
            (top.p50, top.p99),
            (3001.0, 3001.0),
            "never past the largest"
        );
        let zeros = Summary::of(&[0.0, 0.0]).unwrap();
        assert_eq!((zeros.p50, zeros.max), (0.0, 0.0));
    }
}
