//! Test support for `gpushare-isolation`, never shipped in the interposer.
//!
//! - A fake NVIDIA driver: `libcuda.so.1` and `libnvidia-ml.so.1` with simulated GPUs
//!   (`FAKE_GPU_COUNT`, default 1; `FAKE_GPU_MEM_MIB` per GPU, default 16384), built by
//!   `build.rs` from `fake/*.rs` into [`fake_driver_dir`]. Put that directory on
//!   `LD_LIBRARY_PATH` to run a program against it. The same directory holds the fake driver
//!   built again as `libcuda.so.550` (that soname), for a driver opened by path that
//!   `dlopen("libcuda.so.1")` does not find. It also runs kernels as a time-sliced GPU does
//!   (a launch holds its GPU for as many µs as its grid has blocks, one piece of work at a
//!   time across every process sharing `FAKE_GPU_STATE`; events, synchronisation and NVML's
//!   utilization follow), documented in `fake/libcuda.rs`.
//! - The probe, `gpushare-isolation-probe` (`src/main.rs`): reaches the driver by linking, by
//!   `dlopen`+`dlsym` or by `cuGetProcAddress`, runs scripted steps and prints one
//!   machine-readable line per step. Its CLI is documented in `src/main.rs` and by `--help`.

use std::path::Path;

/// The directory holding the fake `libcuda.so.1`, `libnvidia-ml.so.1` and `libcuda.so.550`.
pub fn fake_driver_dir() -> &'static Path {
    Path::new(env!("GPUSHARE_FAKE_DRIVER_DIR"))
}
