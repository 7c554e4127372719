//! What DRA mode's programs agree on about our devices: their names and the capacity they
//! offer. The DRA plugin publishes them (`gpushare-dra-plugin`'s slice), kube-scheduler
//! allocates them, and the extender reads them back to rank nodes.

/// The capacity every device offers and every claim consumes, counted in bytes (a whole
/// number of GiB under our request policy).
pub const MEMORY: &str = "memory";

/// The capacity of compute every device offers: [`crate::request::COMPUTE_PER_GPU`] units, a
/// percent of the GPU's SM time each. A claim that names none consumes none (the request
/// policy's default is 0): memory-only claims get no compute guarantee and no cap, as pods
/// without `gpu-compute` in extender mode.
pub const COMPUTE: &str = "compute";

/// The device name of GPU `index`: a DNS label, stable across restarts.
pub fn device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// The GPU index a device name stands for, if it is one of ours.
pub fn device_index(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("gpu-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_round_trip() {
        assert_eq!(device_index(&device_name(7)), Some(7));
        for other in ["gpu-", "gpu-x", "cpu-1", "gpu--1", "gpu-+1"] {
            assert_eq!(device_index(other), None, "{other}");
        }
    }
}
