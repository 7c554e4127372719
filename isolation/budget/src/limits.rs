//! The container's shares, from its environment.
//!
//! - `GPUSHARE_CONTAINER_MEM_GIB=G`: one GPU (CUDA ordinal 0) with a share of G GiB.
//! - `GPUSHARE_GPU_COUNT=N` with `GPUSHARE_CONTAINER_MEM_GIB_PER_GPU=G`: GPUs 0..N, each with
//!   a share of G GiB. These win over `GPUSHARE_CONTAINER_MEM_GIB`.
//! - Neither: no limits, and the interposer changes nothing.
//!
//! G may have a fraction (`1.5`); shares are rounded down to whole MiB. A GPU ordinal past the
//! count has no share: the container was granted none of it.

use crate::layout::MAX_GPUS;

/// One GPU's share (`GPUSHARE_CONTAINER_MEM_GIB`).
pub const ENV_MEM_GIB: &str = "GPUSHARE_CONTAINER_MEM_GIB";
/// How many GPUs the container has (`GPUSHARE_GPU_COUNT`).
pub const ENV_GPU_COUNT: &str = "GPUSHARE_GPU_COUNT";
/// Each GPU's share when `GPUSHARE_GPU_COUNT` is set (`GPUSHARE_CONTAINER_MEM_GIB_PER_GPU`).
pub const ENV_MEM_GIB_PER_GPU: &str = "GPUSHARE_CONTAINER_MEM_GIB_PER_GPU";

/// Why the environment's limits cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// A variable is set but is not a number of the right kind.
    #[error("{name}={value:?} is not {expected}")]
    Invalid {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What it should be.
        expected: &'static str,
    },
    /// `GPUSHARE_GPU_COUNT` without `GPUSHARE_CONTAINER_MEM_GIB_PER_GPU`.
    #[error("{ENV_GPU_COUNT} is set but {ENV_MEM_GIB_PER_GPU} is not")]
    MissingPerGpu,
}

/// Each GPU's share, in bytes, indexed by CUDA ordinal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    shares: Vec<u64>,
}

impl Limits {
    /// Limits of `shares.len()` GPUs (at most [`MAX_GPUS`]; more are cut off).
    pub fn new(mut shares: Vec<u64>) -> Self {
        shares.truncate(MAX_GPUS);
        Self { shares }
    }

    /// The limits the process environment sets, `None` for none.
    pub fn from_env() -> Result<Option<Self>, Error> {
        Self::parse(|name| std::env::var(name).ok())
    }

    /// The limits that `var` (an environment lookup) sets.
    pub fn parse(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, Error> {
        let set = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        if let Some(count) = set(ENV_GPU_COUNT) {
            let count: usize = count
                .trim()
                .parse()
                .ok()
                .filter(|n| (1..=MAX_GPUS).contains(n))
                .ok_or(Error::Invalid {
                    name: ENV_GPU_COUNT,
                    value: count,
                    expected: "a GPU count from 1 to 16",
                })?;
            let per_gpu = set(ENV_MEM_GIB_PER_GPU).ok_or(Error::MissingPerGpu)?;
            let share = gib_to_bytes(ENV_MEM_GIB_PER_GPU, &per_gpu)?;
            return Ok(Some(Self::new(vec![share; count])));
        }
        match set(ENV_MEM_GIB) {
            Some(gib) => Ok(Some(Self::new(vec![gib_to_bytes(ENV_MEM_GIB, &gib)?]))),
            None => Ok(None),
        }
    }

    /// The share of GPU `gpu` (0 past the count).
    pub fn share(&self, gpu: usize) -> u64 {
        self.shares.get(gpu).copied().unwrap_or(0)
    }

    /// Every GPU's share, by ordinal.
    pub fn shares(&self) -> &[u64] {
        &self.shares
    }
}

fn gib_to_bytes(name: &'static str, value: &str) -> Result<u64, Error> {
    let invalid = || Error::Invalid {
        name,
        value: value.to_string(),
        expected: "a positive number of GiB",
    };
    let gib: f64 = value.trim().parse().map_err(|_| invalid())?;
    if !gib.is_finite() || gib <= 0.0 || gib > 1e6 {
        return Err(invalid());
    }
    Ok(((gib * 1024.0).floor() as u64) << 20)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_env as env;

    #[test]
    fn no_variables_no_limits() {
        assert_eq!(Limits::parse(env(&[])), Ok(None));
        assert_eq!(Limits::parse(env(&[(ENV_MEM_GIB, " ")])), Ok(None));
    }

    #[test]
    fn one_gpu_container() {
        let limits = Limits::parse(env(&[(ENV_MEM_GIB, "4")])).unwrap().unwrap();
        assert_eq!(limits.shares(), &[4 << 30]);
        assert_eq!(limits.share(1), 0);
        let half = Limits::parse(env(&[(ENV_MEM_GIB, "1.5")]))
            .unwrap()
            .unwrap();
        assert_eq!(half.shares(), &[1536 << 20]);
    }

    #[test]
    fn several_gpus_win_over_one() {
        let limits = Limits::parse(env(&[
            (ENV_MEM_GIB, "8"),
            (ENV_GPU_COUNT, "2"),
            (ENV_MEM_GIB_PER_GPU, "2"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(limits.shares(), &[2 << 30, 2 << 30]);
    }

    #[test]
    fn bad_values_are_errors() {
        assert!(Limits::parse(env(&[(ENV_MEM_GIB, "four")])).is_err());
        assert!(Limits::parse(env(&[(ENV_MEM_GIB, "-1")])).is_err());
        assert!(Limits::parse(env(&[(ENV_GPU_COUNT, "0"), (ENV_MEM_GIB_PER_GPU, "2")])).is_err());
        assert!(Limits::parse(env(&[(ENV_GPU_COUNT, "17"), (ENV_MEM_GIB_PER_GPU, "2")])).is_err());
        assert_eq!(
            Limits::parse(env(&[(ENV_GPU_COUNT, "2")])),
            Err(Error::MissingPerGpu)
        );
    }
}
