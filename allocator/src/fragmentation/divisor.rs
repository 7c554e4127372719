//! Exact integer division without dividing: the per-GPU loops of the measure take `⌊x / d⌋`
//! thousands of times per scheduling call, for a handful of divisors (each shape's GPU size,
//! CPU and memory) that change only when the workload does. A reciprocal computed once and a
//! multiply with one correction step replace the hardware division; the proof that the
//! result is exact sits on [`Divisor`], and a property test checks it.

/// `⌊x / size⌋` for a shape's GPU size, as the per-GPU loops need it thousands of times per
/// scheduling call: a multiply by the reciprocal and one correction step instead of a
/// hardware division.
///
/// Exact: for `x, d < 2³²` the estimate `x · (1/d)` is below `x / d` by less than `2⁻²⁰`
/// (two roundings of relative error `2⁻⁵³`) and above it by less than the distance to the
/// next integer, so its floor is the quotient or one less, which the correction fixes; other
/// operands divide for real.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Divisor {
    pub(super) d: u64,
    reciprocal: f64,
}

impl Divisor {
    /// Division by zero: never limits in [`cap`].
    pub(super) const ZERO: Divisor = Divisor {
        d: 0,
        reciprocal: 0.0,
    };

    pub(super) fn new(d: u64) -> Self {
        let reciprocal = if d == 0 || d >= 1 << 32 {
            0.0
        } else {
            1.0 / d as f64
        };
        Self { d, reciprocal }
    }

    /// `⌊x / d⌋`; `u64::MAX` when `d` is 0.
    #[inline]
    pub(super) fn div(self, x: u64) -> u64 {
        if self.reciprocal == 0.0 || x >= 1 << 32 {
            return x.checked_div(self.d).unwrap_or(u64::MAX);
        }
        // Through i64: below 2⁵³ the conversions are exact, and single instructions.
        let q = ((x as i64) as f64 * self.reciprocal) as i64 as u64;
        // q ≤ x / d < 2³², d < 2³²: no overflow.
        if (q + 1) * self.d <= x { q + 1 } else { q }
    }
}

/// How many pods needing `need` of a resource fit in `free`, given that the GPUs hold at most
/// `slots` of them: a multiply in the common case where the resource is not the limit, a
/// [`Divisor`] only where it is. `need` 0 never limits.
#[inline]
pub(super) fn cap(slots: u64, free: u64, need: Divisor) -> u64 {
    if need.d == 0 || slots.saturating_mul(need.d) <= free {
        slots
    } else {
        need.div(free)
    }
}

/// [`cap`] of the same `slots` under two amounts of the resource (the host's before and
/// after the pod): the product is computed once.
#[inline]
pub(super) fn cap_before_after(
    slots: u64,
    free: u64,
    free_after: u64,
    need: Divisor,
) -> (u64, u64) {
    if need.d == 0 {
        return (slots, slots);
    }
    let product = slots.saturating_mul(need.d);
    let cap = |free: u64| {
        if product <= free {
            slots
        } else {
            need.div(free)
        }
    };
    (cap(free), cap(free_after))
}

/// `x as f64`, through `i64` where it fits: the same value, one instruction instead of the
/// sequence an unsigned conversion takes.
#[inline]
pub(super) fn to_f64(x: u64) -> f64 {
    match i64::try_from(x) {
        Ok(x) => x as f64,
        Err(_) => x as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #[test]
        fn the_divisor_divides_exactly(x in proptest::prelude::any::<u64>(), d in 0..=1u64 << 40, small in 0..=1u64 << 20) {
            for x in [x, x >> 12, small, small.saturating_mul(d.max(1)), (1 << 52) - 1, 1 << 52] {
                let expected = x.checked_div(d).unwrap_or(u64::MAX);
                proptest::prop_assert_eq!(Divisor::new(d).div(x), expected, "{} / {}", x, d);
            }
        }
    }
}
