//! Builds the fake driver (`fake/libcuda.rs`, `fake/libnvidia-ml.rs`) into `$OUT_DIR` as
//! `libcuda.so.1` and `libnvidia-ml.so.1` (their sonames), with `libcuda.so` and
//! `libnvidia-ml.so` links for the linker, so that the probe links to the driver by name as a
//! real program does; and `fake/libcuda.rs` again as `libcuda.so.550` (its soname too, no
//! link), a driver that a program opens by path and that `dlopen("libcuda.so.1")` never
//! finds (a compat driver, a `NUMBA_CUDA_DRIVER` target). Only the probe links them: nothing
//! here reaches the interposer's `.so`.

use std::path::Path;
use std::process::Command;

fn main() {
    let out = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    let out = Path::new(&out);
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    // The probe's target (cargo sets TARGET for build scripts), so that it can link them.
    let target = std::env::var("TARGET").expect("cargo sets TARGET");
    for (source, soname) in [
        ("fake/libcuda.rs", "libcuda.so.1"),
        ("fake/libnvidia-ml.rs", "libnvidia-ml.so.1"),
        ("fake/libcuda.rs", "libcuda.so.550"),
    ] {
        println!("cargo:rerun-if-changed={source}");
        println!("cargo:rerun-if-changed=fake/state.rs");
        println!("cargo:rerun-if-changed=fake/abi.rs");
        let status = Command::new(&rustc)
            .args(["--edition", "2021", "--crate-type", "cdylib"])
            .args(["-C", "opt-level=2"])
            .args(["--crate-name", &soname.replace(['.', '-'], "_")])
            .args(["--target", &target])
            .args(["-C", &format!("link-arg=-Wl,-soname,{soname}")])
            // Its own references (cuGetProcAddress's answers) bind to its own functions, as
            // in the real driver, not to an interposer's functions of the same name.
            .args(["-C", "link-arg=-Wl,-Bsymbolic"])
            .arg("-o")
            .arg(out.join(soname))
            .arg(source)
            .status()
            .expect("running rustc for the fake driver");
        assert!(status.success(), "rustc failed on {source}");
        // The linker's name (`libcuda.so`) for the soname-`.1` libraries.
        if let Some(link) = soname.strip_suffix(".1") {
            let link = out.join(link);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(soname, &link).expect("linking the fake driver");
        }
    }
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-env=GPUSHARE_FAKE_DRIVER_DIR={}", out.display());
}
