// The fake driver's device-wide state, shared by every process that names the same file in
// `FAKE_GPU_STATE`. Included (`include!`) by `libcuda.rs` and `libnvidia-ml.rs`; std only.
//
// The format (text, one line per process that holds device memory; `#` lines are comments):
//
//     # gpushare fake GPU state v1: PID START_TIME BYTES_ON_GPU0 BYTES_ON_GPU1 ...
//     4242 1234567 3221225472 0
//
// PID and START_TIME (field 22 of /proc/PID/stat) name a process; the bytes are what it holds
// on each physical GPU (index = physical GPU, not CUDA ordinal): its contexts, allocations,
// pool and graph-pool reservations. Every read-modify-write holds an exclusive `flock` on the
// file. A line whose process is gone (no /proc/PID/stat, a zombie, or another start time) is
// dropped: the real driver frees a process's memory when it dies. A process with nothing on
// the device has no line. A new program image (exec) writes its line afresh at `cuInit`.

#[allow(dead_code)]
mod state {
    use std::io::{Read, Seek, Write};
    use std::path::Path;

    /// One process's line.
    pub struct Entry {
        pub pid: u32,
        pub start: u64,
        pub used: Vec<u64>,
    }

    /// The start time of a live (not zombie) process, from /proc/PID/stat.
    pub fn start_time(pid: u32) -> Option<u64> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let rest = &stat[stat.rfind(')')? + 1..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if matches!(fields.first(), Some(&"Z") | Some(&"X") | None) {
            return None;
        }
        fields.get(19)?.parse().ok()
    }

    pub fn parse(text: &str) -> Vec<Entry> {
        text.lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| {
                let mut words = l.split_whitespace();
                let pid = words.next()?.parse().ok()?;
                let start = words.next()?.parse().ok()?;
                let used = words.map(|w| w.parse().unwrap_or(0)).collect();
                Some(Entry { pid, start, used })
            })
            .collect()
    }

    fn render(entries: &[Entry]) -> String {
        let mut text =
            String::from("# gpushare fake GPU state v1: PID START_TIME BYTES_ON_GPU0 BYTES_ON_GPU1 ...\n");
        for e in entries.iter().filter(|e| e.used.iter().any(|&b| b > 0)) {
            text.push_str(&format!("{} {}", e.pid, e.start));
            for b in &e.used {
                text.push_str(&format!(" {b}"));
            }
            text.push('\n');
        }
        text
    }

    /// Runs `f` on the live entries under the file's lock and writes back what it leaves.
    pub fn update<T>(path: &Path, f: impl FnOnce(&mut Vec<Entry>) -> T) -> std::io::Result<T> {
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        file.lock()?;
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        let mut entries: Vec<Entry> = parse(&text)
            .into_iter()
            .filter(|e| start_time(e.pid) == Some(e.start))
            .collect();
        let result = f(&mut entries);
        let text = render(&entries);
        file.set_len(0)?;
        file.seek(std::io::SeekFrom::Start(0))?;
        file.write_all(text.as_bytes())?;
        file.unlock()?;
        Ok(result)
    }

    /// What the live processes hold on each of `gpus` physical GPUs.
    pub fn device_used(path: &Path, gpus: usize) -> Vec<u64> {
        update(path, |entries| {
            let mut used = vec![0u64; gpus];
            for e in entries.iter() {
                for (u, b) in used.iter_mut().zip(&e.used) {
                    *u += b;
                }
            }
            used
        })
        .unwrap_or_else(|_| vec![0; gpus])
    }
}
