//! `gpushare-isolation-probe-dl`: the probe's steps (documented in `main.rs`) without linking
//! the driver, so that it starts where no `libcuda.so.1` is found by soname; it reaches the
//! driver with `--via dlsym`, `getproc` or `path:FILE` only.

mod probe;

fn main() {
    probe::main(None);
}
