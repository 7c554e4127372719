//! The NVML backend on a real GPU machine. Ignored by default: run with
//! `cargo test -p gpushare-device-plugin --test nvml -- --ignored` where a GPU is present.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use gpushare_device_plugin::backend::GpuBackend;
use gpushare_device_plugin::backend::nvml::NvmlBackend;

#[test]
#[ignore = "needs an NVIDIA GPU and driver"]
fn nvml_lists_gpus_and_watches_health() -> anyhow::Result<()> {
    let backend = NvmlBackend::new()?;
    let gpus = backend.gpus()?;
    println!("{}", gpushare_contract::inventory::encode(&gpus));
    assert!(!gpus.is_empty(), "NVML found no GPUs");
    for gpu in &gpus {
        assert!(gpu.uuid.starts_with("GPU-"), "{}", gpu.uuid);
        assert!(gpu.mem_gib > 0 && gpu.healthy);
    }
    // The event loop starts, reports nothing on a healthy GPU, and stops when asked.
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut reports = Vec::new();
            let result =
                backend.watch_health(&stop, &mut |index, healthy| reports.push((index, healthy)));
            (result.map_err(|e| e.to_string()), reports)
        })
    };
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    let (result, reports) = watcher
        .join()
        .map_err(|_| anyhow::anyhow!("health thread panicked"))?;
    assert_eq!(result, Ok(()));
    assert!(reports.is_empty(), "{reports:?}");
    Ok(())
}

#[test]
fn missing_nvml_is_a_clear_error_or_works() {
    // On a machine without the driver this must be an error that says what to do; on a GPU
    // machine it simply works.
    if let Err(err) = NvmlBackend::new() {
        let text = err.to_string();
        assert!(
            text.contains("libnvidia-ml.so") && text.contains("--gpu-backend simulated"),
            "{text}"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU and driver"]
fn nvml_lists_process_memory() -> anyhow::Result<()> {
    use gpushare_device_plugin::backend::MemoryUser;
    let backend = NvmlBackend::new()?;
    let gpus = backend.gpus()?;
    let uses = backend
        .memory_in_use()?
        .ok_or_else(|| anyhow::anyhow!("NVML always measures"))?;
    for use_ in &uses {
        println!("{use_:?}");
        let gpu = use_
            .gpu
            .ok_or_else(|| anyhow::anyhow!("no GPU: {use_:?}"))?;
        assert!(gpus.iter().any(|g| g.index == gpu), "{use_:?}");
        assert!(
            matches!(use_.user, MemoryUser::Process(pid) if pid > 0),
            "{use_:?}"
        );
    }
    for gpu in &gpus {
        let used: u64 = uses
            .iter()
            .filter(|u| u.gpu == Some(gpu.index))
            .map(|u| u.bytes)
            .sum();
        assert!(
            used <= (gpu.mem_gib + 1) << 30,
            "GPU {}: {used} bytes",
            gpu.index
        );
    }
    Ok(())
}
