//! The planner's short-horizon forecast of the arrival rate: Holt's double exponential
//! smoothing (level and trend) over the rate divided by a daily shape, so the smoother only
//! has to follow how today differs from the usual day (busier, quieter, a ramp), while the
//! shape carries the time-of-day swing. Without a shape it is plain Holt.
//!
//! Invariants: forecasts are finite and never negative; the shape is normalised so its
//! largest value is 1 and its values are floored at [`DailyShape::FLOOR`], so a quiet hour
//! never divides a rate by (almost) zero.

use serde::Serialize;

use crate::error::{invalid, BenchError};

/// Seconds in a day: the shape's period.
pub const DAY_S: f64 = 86_400.0;

/// The usual day's relative arrival rate by time of day: evenly spaced samples over 24 h,
/// linearly interpolated and wrapping at midnight.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DailyShape {
    samples: Vec<f64>,
}

impl DailyShape {
    /// The smallest relative value kept (after normalising the peak to 1).
    pub const FLOOR: f64 = 0.01;

    /// A shape from samples (e.g. yesterday's mean rate per 10 minutes). Needs at least two
    /// finite, non-negative samples with a positive maximum.
    pub fn new(samples: Vec<f64>) -> Result<Self, BenchError> {
        if samples.len() < 2 {
            return Err(invalid("daily shape", "needs at least two samples"));
        }
        if samples.iter().any(|v| !(v.is_finite() && *v >= 0.0)) {
            return Err(invalid("daily shape", "samples must be finite and >= 0"));
        }
        let max = samples.iter().copied().fold(0.0f64, f64::max);
        if max <= 0.0 {
            return Err(invalid("daily shape", "needs a positive sample"));
        }
        Ok(Self {
            samples: samples.iter().map(|v| (v / max).max(Self::FLOOR)).collect(),
        })
    }

    /// The relative rate at `t_s` seconds (time of day is `t_s` modulo a day).
    pub fn at(&self, t_s: f64) -> f64 {
        let n = self.samples.len();
        let x = t_s.rem_euclid(DAY_S) / DAY_S * n as f64;
        let i = (x.floor() as usize).min(n - 1);
        let f = x - i as f64;
        self.samples[i] * (1.0 - f) + self.samples[(i + 1) % n] * f
    }
}

/// Holt's linear smoother over the (de-seasonalised) arrival rate.
#[derive(Debug, Clone, Serialize)]
pub struct Forecaster {
    alpha: f64,
    beta: f64,
    shape: Option<DailyShape>,
    level: Option<f64>,
    /// Change of the de-seasonalised level per second.
    trend: f64,
    last_t: f64,
}

impl Forecaster {
    /// `alpha` weighs a new observation into the level, `beta` a new slope into the trend
    /// (both in (0, 1]).
    pub fn new(alpha: f64, beta: f64, shape: Option<DailyShape>) -> Result<Self, BenchError> {
        for (name, v) in [("forecast alpha", alpha), ("forecast beta", beta)] {
            if !(v > 0.0 && v <= 1.0) {
                return Err(invalid(name, format!("{v} must be in (0, 1]")));
            }
        }
        Ok(Self {
            alpha,
            beta,
            shape,
            level: None,
            trend: 0.0,
            last_t: 0.0,
        })
    }

    fn season(&self, t: f64) -> f64 {
        self.shape.as_ref().map_or(1.0, |s| s.at(t))
    }

    /// Take the rate observed over the interval ending at `t_s`. Observations must move
    /// forward in time; one at or before the last is folded into the level without a trend.
    pub fn observe(&mut self, t_s: f64, rate: f64) {
        let x = rate.max(0.0) / self.season(t_s);
        match self.level {
            None => self.level = Some(x),
            Some(level) => {
                let dt = t_s - self.last_t;
                if dt <= 0.0 {
                    self.level = Some(level + self.alpha * (x - level));
                    return;
                }
                let predicted = level + self.trend * dt;
                let new_level = predicted + self.alpha * (x - predicted);
                let slope = (new_level - level) / dt;
                self.trend += self.beta * (slope - self.trend);
                self.level = Some(new_level);
            }
        }
        self.last_t = t_s;
    }

    /// The smoothed current rate (0 before any observation).
    pub fn now(&self) -> f64 {
        self.at(self.last_t)
    }

    /// The forecast rate at absolute time `t_s` (>= the last observation).
    pub fn at(&self, t_s: f64) -> f64 {
        let Some(level) = self.level else { return 0.0 };
        let h = (t_s - self.last_t).max(0.0);
        ((level + self.trend * h).max(0.0) * self.season(t_s)).max(0.0)
    }

    /// The highest forecast rate over the next `horizon_s` seconds (sampled every minute
    /// and at both ends), so a peak inside the horizon is not missed.
    pub fn peak_within(&self, horizon_s: f64) -> f64 {
        let steps = (horizon_s / 60.0).ceil().max(1.0) as usize;
        (0..=steps)
            .map(|k| self.at(self.last_t + horizon_s * k as f64 / steps as f64))
            .fold(0.0, f64::max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_interpolates_wraps_and_floors() {
        let s = DailyShape::new(vec![0.0, 2.0, 4.0, 2.0]).unwrap();
        assert_eq!(s.at(0.0), DailyShape::FLOOR);
        assert_eq!(s.at(DAY_S / 2.0), 1.0);
        assert!((s.at(DAY_S * 5.0 / 8.0) - 0.75).abs() < 1e-12);
        assert_eq!(s.at(DAY_S + DAY_S / 2.0), 1.0);
        assert!(DailyShape::new(vec![1.0]).is_err());
        assert!(DailyShape::new(vec![0.0, 0.0]).is_err());
        assert!(DailyShape::new(vec![1.0, f64::NAN]).is_err());
    }

    #[test]
    fn holt_follows_a_ramp_ahead() {
        let mut f = Forecaster::new(0.5, 0.3, None).unwrap();
        for k in 0..40 {
            f.observe(k as f64 * 30.0, 100.0 + k as f64 * 3.0);
        }
        // The ramp gains 0.1 turns/s per second: 10 minutes ahead is 60 turns/s more.
        let ahead = f.at(39.0 * 30.0 + 600.0);
        assert!((ahead - (217.0 + 60.0)).abs() < 3.0, "{ahead}");
        assert!(f.peak_within(600.0) >= ahead - 1e-9);
    }

    #[test]
    fn shape_carries_the_time_of_day() {
        // Traffic exactly follows the shape at twice its scale: the forecast an hour ahead
        // is the shape there, scaled.
        let shape = DailyShape::new((0..24).map(|h| 1.0 + h as f64).collect()).unwrap();
        let mut f = Forecaster::new(0.3, 0.1, Some(shape.clone())).unwrap();
        for k in 0..120 {
            let t = k as f64 * 30.0;
            f.observe(t, 200.0 * shape.at(t));
        }
        let t = 119.0 * 30.0 + 3_600.0;
        assert!(
            (f.at(t) - 200.0 * shape.at(t)).abs() < 1.0,
            "{} vs {}",
            f.at(t),
            200.0 * shape.at(t)
        );
        assert!(Forecaster::new(0.0, 0.5, None).is_err());
    }
}
