//! The shapes of a load backlog: how much GPU memory each pod asks for, on how many GPUs,
//! in what proportions. One written form (`1:30,2:30,4:25,8:10,2x8:5`) for `realload --mix`,
//! and a fixed interleaved order, so two runs (and the two drains of one round) draw the same
//! pods and any stretch of a backlog keeps the mix's proportions.

/// One pod shape of a backlog: `gpus` GPUs of one node with `gib_per_gpu` on each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// GPUs the pod spreads over (the `<domain>/gpus` annotation when above 1).
    pub gpus: u32,
    /// GiB on each of them.
    pub gib_per_gpu: u64,
    /// How often the shape is drawn, relative to the others.
    pub weight: u32,
}

impl Shape {
    /// The pod's `example.com/gpu-mem`: its total over its GPUs.
    pub fn total_gib(&self) -> u64 {
        self.gib_per_gpu * u64::from(self.gpus)
    }
}

/// The shapes of a backlog, written `GIB[:WEIGHT]` or `GPUSxGIB[:WEIGHT]`, comma-separated:
/// `1:30,2:30,4:25,8:10,2x8:5` is 30 % 1 GiB pods, …, and 5 % pods with 8 GiB on each of two.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mix {
    shapes: Vec<Shape>,
}

impl Mix {
    /// Every pod the same: `gib` on one GPU.
    pub fn uniform(gib: u64) -> Self {
        Mix {
            shapes: vec![Shape {
                gpus: 1,
                gib_per_gpu: gib,
                weight: 1,
            }],
        }
    }

    /// Parses `GIB[:WEIGHT]` or `GPUSxGIB[:WEIGHT]`, comma-separated.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut shapes = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (shape, weight) = part.split_once(':').unwrap_or((part, "1"));
            let (gpus, gib) = shape.split_once('x').unwrap_or(("1", shape));
            let number = |what: &str, value: &str| {
                value.parse::<u64>().ok().filter(|n| *n > 0).ok_or_else(|| {
                    format!("{part}: {what} {value:?} is not a whole number above 0")
                })
            };
            let gpus = number("GPU count", gpus)?;
            let gpus = u32::try_from(gpus)
                .ok()
                .filter(|g| *g <= gpushare_contract::MAX_GPUS_PER_POD)
                .ok_or_else(|| {
                    format!(
                        "{part}: at most {} GPUs a pod",
                        gpushare_contract::MAX_GPUS_PER_POD
                    )
                })?;
            let gib_per_gpu = number("GiB", gib)?;
            let weight = u32::try_from(number("weight", weight)?)
                .map_err(|_| format!("{part}: weight too large"))?;
            shapes.push(Shape {
                gpus,
                gib_per_gpu,
                weight,
            });
        }
        if shapes.is_empty() {
            return Err("a mix needs at least one shape".to_owned());
        }
        Ok(Mix { shapes })
    }

    /// The shapes, as given.
    pub fn shapes(&self) -> &[Shape] {
        &self.shapes
    }

    /// Whether some shape spreads over more than one GPU.
    pub fn has_multi_gpu(&self) -> bool {
        self.shapes.iter().any(|s| s.gpus > 1)
    }

    /// The shape of pod `index`: the weights laid out on a line, walked in steps of a prime
    /// larger than any sane total, so shapes interleave and each takes its weight's share of
    /// every `total` consecutive pods.
    pub fn shape_of(&self, index: usize) -> Shape {
        let total: u64 = self.shapes.iter().map(|s| u64::from(s.weight)).sum();
        let mut slot = (index as u64).wrapping_mul(7_919) % total;
        for shape in &self.shapes {
            if slot < u64::from(shape.weight) {
                return *shape;
            }
            slot -= u64::from(shape.weight);
        }
        self.shapes[0]
    }

    /// GiB the first `count` pods ask for together.
    pub fn total_gib(&self, count: usize) -> u64 {
        (0..count).map(|i| self.shape_of(i).total_gib()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_read_with_their_gpus_and_weights() {
        let mix = Mix::parse("1:30, 2x8:5,4").unwrap();
        let shape = |gpus, gib_per_gpu, weight| Shape {
            gpus,
            gib_per_gpu,
            weight,
        };
        assert_eq!(
            mix.shapes(),
            [shape(1, 1, 30), shape(2, 8, 5), shape(1, 4, 1)]
        );
        assert!(mix.has_multi_gpu());
        assert_eq!(mix.shapes()[1].total_gib(), 16);
    }

    #[test]
    fn malformed_shapes_say_which_part() {
        assert!(Mix::parse("").unwrap_err().contains("at least one shape"));
        for bad in ["0", "4:0", "x4", "17x1", "4.5", "2x", "a:1"] {
            let error = Mix::parse(&format!("2:1,{bad}")).unwrap_err();
            assert!(error.starts_with(&format!("{bad}: ")), "{bad}: {error}");
        }
        assert!(Mix::parse("17x1").unwrap_err().contains("at most 16 GPUs"));
    }

    #[test]
    fn each_stretch_of_a_backlog_keeps_the_weights() {
        let mix = Mix::parse("1:30,2:30,4:25,8:10,2x8:5").unwrap();
        for start in [0, 100, 1_000, 39_900] {
            let mut seen = std::collections::BTreeMap::new();
            for i in start..start + 100 {
                let shape = mix.shape_of(i);
                *seen.entry((shape.gpus, shape.gib_per_gpu)).or_insert(0) += 1;
            }
            let counts: Vec<u32> = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)]
                .iter()
                .map(|k| seen.get(k).copied().unwrap_or(0))
                .collect();
            assert_eq!(counts, [30, 30, 25, 10, 5], "pods {start}..{}", start + 100);
        }
        // Interleaved, not in runs: the first ten pods are not all one shape.
        let first: std::collections::BTreeSet<u64> =
            (0..10).map(|i| mix.shape_of(i).gib_per_gpu).collect();
        assert!(first.len() > 2, "{first:?}");
        assert_eq!(Mix::uniform(4).total_gib(10), 40);
    }
}
