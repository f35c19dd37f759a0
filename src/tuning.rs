//! The settings that change how fast the engine runs, never what it computes, and the one place the
//! library reads the environment. `Engine::init_fit` resolves a `Tuning` once (`Tuning::from_env`, then
//! the engine options that override it) and passes it down to the backend it loads: the CPU backend's
//! thread count, and on CUDA the graphs, the decode products' kernels, the attention grid, the product
//! library, and the launchers' own settings (`kernels/hostembed_kernels.cuh`'s `hostembed_tuning`).
//! Nothing below the engine reads a variable; tests and benchmarks that build a backend directly pass
//! `Tuning::default()` or `Tuning::from_env()`.
//!
//! Every variable here is for measuring one way against another: each setting gives the same bits.

/// The environment variable that sets the CPU backend's thread count (a positive number).
pub const CPU_THREADS_ENV: &str = "HOSTEMBED_CPU_THREADS";
/// "0" keeps every CUDA decode product on the matrix-vector kernels.
pub const MMV_ENV: &str = "HOSTEMBED_MMV";
/// "0" turns off the CUDA graphs of decode passes.
pub const CUDA_GRAPHS_ENV: &str = "HOSTEMBED_CUDA_GRAPHS";
/// The parts the split attention cuts a context into (1 to `MAX_ATTENTION_PARTS`).
pub const ATTENTION_PARTS_ENV: &str = "HOSTEMBED_ATTENTION_PARTS";
/// "full" gives every attention part a block of its own.
pub const ATTENTION_GRID_ENV: &str = "HOSTEMBED_ATTENTION_GRID";
/// "0": no cuBLASLt; a file name: that library instead of the default names.
pub const CUBLASLT_ENV: &str = "HOSTEMBED_CUBLASLT";
/// "0": launches never overlap the kernel before them.
pub const PDL_ENV: &str = "HOSTEMBED_PDL";
/// "0": the tensor-core decode products never stage their weights; "all": always.
pub const MMV_STAGE_ENV: &str = "HOSTEMBED_MMV_STAGE";
/// The tokens one integer decode product launch takes (1 to the kernel's most).
pub const MMVQ_TOKENS_ENV: &str = "HOSTEMBED_MMVQ_TOKENS";
/// "0": the half decode products convert their activations in every block instead of once.
pub const MMV_PREP_ENV: &str = "HOSTEMBED_MMV_PREP";
/// "0": the block formats' decode products of more than 8 tokens take the streamed integer kernel (16
/// tokens a launch) instead of the tile kernel (all of a pass's tokens against one read of the weights).
pub const MMV_TC_BLOCKS_ENV: &str = "HOSTEMBED_MMV_TC_BLOCKS";
/// "0": half decode products of more than 8 tokens take mma.sync instead of Hopper's warpgroup products on
/// an sm_90 card (the same bits; the default, "1", measured 1.27x on the 64-token F16 product); "2": the
/// pipelined warpgroup kernel (slower).
pub const MMV_WGMMA_ENV: &str = "HOSTEMBED_MMV_WGMMA";
/// "0": a prompt chunk's flash attention never cuts its context in parts (one block a query tile and head).
pub const FLASH_PARTS_ENV: &str = "HOSTEMBED_FLASH_PARTS";
/// "0": decode attention always takes the kernel with more loads in flight a thread; "1": always the one
/// with twice the blocks a multiprocessor (unset: by the launch's block count).
pub const ATTENTION_WIDE_ENV: &str = "HOSTEMBED_ATTENTION_WIDE";
/// "0": on CUDA, a model's sliding-window layers share the one KV pool instead of keeping only their window
/// in a pool of their own, as on the CPU.
pub const CUDA_LOCAL_POOL_ENV: &str = "HOSTEMBED_CUDA_LOCAL_POOL";
/// "0": on CUDA, prompt chunks of head size 256 (Gemma 3's) take the split kernel instead of flash attention
/// with a 16-bit cache (on by default since a card ran its test).
pub const FLASH_HEAD_256_ENV: &str = "HOSTEMBED_FLASH_HEAD_256";
/// "1": an engine of `options.devices` N > 1 runs its N ranks on `options.device` alone, meeting through
/// the host instead of NCCL (no graphs; its sums in rank order, which NCCL's need not match bit for bit):
/// the split's code path on a one-card machine.
pub const SPLIT_ONE_DEVICE_ENV: &str = "HOSTEMBED_SPLIT_ONE_DEVICE";
/// "0": a Mixture-of-Experts layer's prompt rows take the warp-a-row expert kernels instead of the grouped
/// tensor-core products.
pub const MOE_GROUPED_ENV: &str = "HOSTEMBED_MOE_GROUPED";
/// "0": a Mixture-of-Experts layer's decode rows in a block format take the warp-a-row expert kernels
/// (kernels/moe.cu) instead of the integer decode product's (kernels/moe_mmv.cu).
pub const MOE_MMV_ENV: &str = "HOSTEMBED_MOE_MMV";
/// "1": a Mixture-of-Experts decode piece's down product has its chosen experts' rows fetched into L2 while
/// the gate and up product runs (their ids are final by then), a hint that changes no bits.
pub const MOE_PREFETCH_ENV: &str = "HOSTEMBED_MOE_PREFETCH";
/// Which small last steps run in the last block to finish of the kernel before them instead of as a launch
/// of their own: "0" none, "1" all, or a comma list of `route` (a Mixture-of-Experts piece's route, in the router's
/// launch), `sums` (its rows' weighted sums of their experts, in the down product's) and `attention` (the
/// combine of one-part contexts, in the split kernel); unset, the default (`FusedTails::DEFAULT`).
pub const FUSED_TAILS_ENV: &str = "HOSTEMBED_FUSED_TAILS";
/// How a Mixture-of-Experts decode product cuts an expert's columns: "fill", "waves" or "one"
/// (`MoeMmvCut`); unset or anything else, the default.
pub const MOE_MMV_CUT_ENV: &str = "HOSTEMBED_MOE_MMV_CUT";

/// The parts the attention kernel cuts one token's context into by default. Fixed, so that a token's
/// parts (and so its bits) depend on its own context length only: 32 parts of 512 positions at 16k, 8
/// blocks a kv head's part for the Llama-3 shape fill a 132-SM card with one stream.
pub const ATTENTION_PARTS: usize = 32;
/// The most parts `ATTENTION_PARTS_ENV` may ask for.
pub const MAX_ATTENTION_PARTS: usize = 1024;
/// The most threads the CPU backend starts; each holds scratch the plan counts.
pub const MAX_CPU_THREADS: usize = 256;

/// Which cuBLASLt the CUDA backend's prompt products load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cublaslt {
    /// The library's usual file names, newest first.
    Default,
    /// This file.
    File(String),
    /// None: the products run on the library's own tensor-core kernel.
    Off,
}

/// When the tensor-core decode products stage their weights in shared memory (the same bits either way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmvStage {
    /// Where each format measured faster so.
    Measured,
    Never,
    Always,
}

/// How a Mixture-of-Experts decode product cuts each chosen expert's columns into ranges (each range a
/// block's, the ranges' sums added in order by the last; any cut serves every batch alike, so a stream's
/// bits depend on the cut and never on the batch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeMmvCut {
    /// Enough ranges that one token's experts fill the card's target block count, rounded up
    /// (Qwen3-30B-A3B's gate and up: 288 blocks where 264 are resident at once).
    Fill,
    /// Rounded down instead: one token's launch stays one wave of blocks, as the dense products' cut (the
    /// default: 12 of Qwen3-30B-A3B's layers, one stream, 1,032 -> 1,078 tok/s on the H100).
    Waves,
    /// One range: no split sums.
    One,
}

/// Which kernels' small last steps run in the last block to finish of the kernel before them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedTails {
    /// A Mixture-of-Experts decode piece's route, in the router's launch.
    pub route: bool,
    /// Its rows' weighted sums of their experts' outputs, in the down product's launch.
    pub sums: bool,
    /// Decode attention's combine where every context of the launch is one part, in the split kernel.
    pub attention: bool,
}

impl FusedTails {
    pub const ALL: FusedTails = FusedTails { route: true, sums: true, attention: true };
    pub const NONE: FusedTails = FusedTails { route: false, sums: false, attention: false };
    /// The attention's combine only: with the route and the sums fused, the Qwen3-30B-A3B Q4_K_M file's
    /// streams at 512-token caches (where attention's tail does not apply) ran 3-8% slower on the H100
    /// (252 / 1,388 / 2,334 against 265 / 1,432 / 2,539 tok/s at 1 / 16 / 64).
    pub const DEFAULT: FusedTails = FusedTails { route: false, sums: false, attention: true };

    /// "0": none; "1": all; else the comma list's names (unknown names are ignored).
    fn parse(v: &str) -> FusedTails {
        match v.trim() {
            "0" => FusedTails::NONE,
            "1" => FusedTails::ALL,
            list => {
                let has = |name: &str| list.split(',').any(|n| n.trim() == name);
                FusedTails { route: has("route"), sums: has("sums"), attention: has("attention") }
            }
        }
    }

    /// Whether any tail is fused (only then does `GpuModel::tail_counters` hand out counters).
    pub fn any(self) -> bool {
        self.route || self.sums || self.attention
    }
}

/// How the engine runs, resolved once at its creation. `Default` is every setting as shipped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// The CPU backend's threads (1 to `MAX_CPU_THREADS`).
    pub cpu_threads: usize,
    /// Whether passes of single tokens replay CUDA graphs.
    pub cuda_graphs: bool,
    /// Whether CUDA decode rows take the batch-invariant tensor-core products where a weight's format has them.
    pub mmv: bool,
    /// Whether passes of 16 or more single tokens share tensor-core products (not batch invariant): the
    /// engine's `options.batch_tensor_cores`.
    pub batch_tensor_cores: bool,
    /// The parts the split attention cuts a token's context into.
    pub attention_parts: usize,
    /// Whether every attention part is a block of its own (else the parts a context fills).
    pub attention_grid_full: bool,
    pub cublaslt: Cublaslt,
    /// Whether a launch may overlap the kernel before it (programmatic dependent launch, sm_90 and newer).
    pub overlap: bool,
    pub mmv_stage: MmvStage,
    /// Tokens one integer decode product launch takes; 0 is the kernel's own choice.
    pub mmvq_tokens: u32,
    /// Whether half decode products of many tokens convert their activations once.
    pub mmv_prep: bool,
    /// Which kernel block-format decode products of more than 8 tokens take, all with the same bits: 0 the
    /// streamed integer kernel, 1 the tile kernel (at 64 tokens 1.7-2x faster on the H100), 2 the tile
    /// kernel with two warps a row set, each half the token tiles (twice the warps at half the registers; in a
    /// build with `HOSTEMBED_KERNEL_DEFINES=-DMMV_TUNING_KERNELS=1`, else the tile kernel).
    pub mmv_tc_blocks: u32,
    /// Whether half decode products of more than 8 tokens take Hopper's warpgroup products on an sm_90
    /// card (the mma.sync kernel's bits, which the kernel tests check): 0 no, 1 yes (the default: 1.27x
    /// on the 64-token F16 product, 64 F16 streams 4,137 -> 4,990 tok/s on the H100), 2 the pipelined
    /// kernel (slower than either).
    pub mmv_wgmma: u32,
    /// Whether a short prompt chunk's flash attention cuts a long context in parts to fill the card.
    pub flash_parts: bool,
    /// Whether a Mixture-of-Experts layer's prompt rows take the grouped tensor-core products.
    pub moe_grouped: bool,
    /// Whether a Mixture-of-Experts layer's decode rows in a block format take the integer decode product
    /// (kernels/moe_mmv.cu; each slot's bits its own, as the warp-a-row kernels' are).
    pub moe_mmv: bool,
    /// Which small last steps run in the last block to finish of the kernel before them (one launch fewer
    /// each, the same bits).
    pub fused_tails: FusedTails,
    /// Whether a Mixture-of-Experts decode piece's down product has its experts' rows fetched into L2 while
    /// the gate and up product runs (off until measured on a card).
    pub moe_prefetch: bool,
    /// How those products cut an expert's columns.
    pub moe_mmv_cut: MoeMmvCut,
    /// Which decode attention kernel: the one with twice the blocks a multiprocessor (true), the one with
    /// more loads in flight a thread (false), or by the launch's block count (None).
    pub attention_wide: Option<bool>,
    /// Whether a CUDA model's sliding-window layers keep only their window in a KV pool of their own
    /// (the same kernels and bits, less memory; `HOSTEMBED_CUDA_LOCAL_POOL=0` keeps one pool).
    pub cuda_local_pool: bool,
    /// Whether prompt chunks of head size 256 take flash attention (a 16-bit cache; the split kernel
    /// with an 8-bit one).
    pub flash_head_256: bool,
    /// Whether a tensor-parallel engine's ranks all share `options.device` (for checking the split on one
    /// card: the same shards and sums, slower).
    pub split_one_device: bool,
}

impl Default for Tuning {
    fn default() -> Tuning {
        Tuning {
            cpu_threads: available_cores().min(MAX_CPU_THREADS),
            cuda_graphs: true,
            mmv: true,
            batch_tensor_cores: false,
            attention_parts: ATTENTION_PARTS,
            attention_grid_full: false,
            cublaslt: Cublaslt::Default,
            overlap: true,
            mmv_stage: MmvStage::Measured,
            mmvq_tokens: 0,
            mmv_prep: true,
            mmv_tc_blocks: 1,
            mmv_wgmma: 1,
            flash_parts: true,
            moe_grouped: true,
            moe_mmv: true,
            fused_tails: FusedTails::DEFAULT,
            moe_prefetch: false,
            moe_mmv_cut: MoeMmvCut::Waves,
            attention_wide: None,
            cuda_local_pool: true,
            flash_head_256: true,
            split_one_device: false,
        }
    }
}

/// The cores this process may use.
fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The value of environment variable `name`, where it is set and UTF-8: the library's only read of
/// the environment.
pub(crate) fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

impl Tuning {
    /// The settings the environment asks for (each variable unset, or not understood, is the default).
    pub fn from_env() -> Tuning {
        Tuning::from_vars(env_var)
    }

    /// The settings the variables `var` gives say (`var(name)`: the value, or None where unset).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Tuning {
        let d = Tuning::default();
        let off = |name| var(name).is_some_and(|v| v.starts_with('0'));
        Tuning {
            cpu_threads: cpu_threads(var(CPU_THREADS_ENV).as_deref(), available_cores()),
            cuda_graphs: var(CUDA_GRAPHS_ENV).is_none_or(|v| v != "0"),
            mmv: var(MMV_ENV).is_none_or(|v| v != "0"),
            batch_tensor_cores: d.batch_tensor_cores,
            attention_parts: var(ATTENTION_PARTS_ENV)
                .and_then(|v| v.parse().ok())
                .filter(|p| (1..=MAX_ATTENTION_PARTS).contains(p))
                .unwrap_or(d.attention_parts),
            attention_grid_full: var(ATTENTION_GRID_ENV).is_some_and(|v| v == "full"),
            cublaslt: match var(CUBLASLT_ENV) {
                Some(v) if v == "0" => Cublaslt::Off,
                Some(v) if !v.is_empty() => Cublaslt::File(v),
                _ => Cublaslt::Default,
            },
            overlap: !off(PDL_ENV),
            mmv_stage: match var(MMV_STAGE_ENV) {
                Some(v) if v.starts_with('0') => MmvStage::Never,
                Some(v) if v.starts_with('a') => MmvStage::Always,
                _ => MmvStage::Measured,
            },
            // Out of range is the kernel's own choice, which it checks again against its most.
            mmvq_tokens: var(MMVQ_TOKENS_ENV).and_then(|v| v.trim().parse().ok()).unwrap_or(0),
            mmv_prep: !off(MMV_PREP_ENV),
            mmv_tc_blocks: var(MMV_TC_BLOCKS_ENV)
                .and_then(|v| v.trim().parse().ok())
                .filter(|&m| m <= 2)
                .unwrap_or(d.mmv_tc_blocks),
            mmv_wgmma: var(MMV_WGMMA_ENV)
                .and_then(|v| v.trim().parse().ok())
                .filter(|&m| m <= 2)
                .unwrap_or(d.mmv_wgmma),
            flash_parts: !off(FLASH_PARTS_ENV),
            moe_grouped: !off(MOE_GROUPED_ENV),
            moe_mmv: !off(MOE_MMV_ENV),
            fused_tails: var(FUSED_TAILS_ENV).map_or(FusedTails::DEFAULT, |v| FusedTails::parse(&v)),
            moe_prefetch: var(MOE_PREFETCH_ENV).map_or(d.moe_prefetch, |v| v.trim() == "1"),
            moe_mmv_cut: match var(MOE_MMV_CUT_ENV).as_deref().map(str::trim) {
                Some("fill") => MoeMmvCut::Fill,
                Some("waves") => MoeMmvCut::Waves,
                Some("one") => MoeMmvCut::One,
                _ => d.moe_mmv_cut,
            },
            attention_wide: var(ATTENTION_WIDE_ENV).and_then(|v| match v.trim() {
                "0" => Some(false),
                "1" => Some(true),
                _ => None,
            }),
            cuda_local_pool: var(CUDA_LOCAL_POOL_ENV).map_or(d.cuda_local_pool, |v| v.trim() != "0"),
            flash_head_256: var(FLASH_HEAD_256_ENV).map_or(d.flash_head_256, |v| v.trim() != "0"),
            split_one_device: var(SPLIT_ONE_DEVICE_ENV).map_or(d.split_one_device, |v| v.trim() == "1"),
        }
    }
}

/// The thread count for a setting of HOSTEMBED_CPU_THREADS (anything but a positive number is no
/// setting) on a host with `cores` cores.
pub fn cpu_threads(setting: Option<&str>, cores: usize) -> usize {
    let set = setting.and_then(|v| v.trim().parse::<usize>().ok()).filter(|&n| n > 0);
    set.unwrap_or(cores).clamp(1, MAX_CPU_THREADS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(pairs: &[(&str, &str)]) -> Tuning {
        let pairs: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Tuning::from_vars(|name| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    #[test]
    fn no_variables_is_the_default() {
        assert_eq!(with(&[]), Tuning { cpu_threads: cpu_threads(None, available_cores()), ..Tuning::default() });
    }

    /// Each variable as the benchmark scripts set it, read as the kernels and backends read it before.
    #[test]
    fn each_variable_sets_its_field() {
        let d = Tuning::default();
        assert_eq!(with(&[(CPU_THREADS_ENV, "3")]).cpu_threads, 3);
        assert!(!with(&[(CUDA_GRAPHS_ENV, "0")]).cuda_graphs && with(&[(CUDA_GRAPHS_ENV, "1")]).cuda_graphs);
        assert!(!with(&[(MMV_ENV, "0")]).mmv && with(&[(MMV_ENV, "yes")]).mmv);
        assert_eq!(with(&[(ATTENTION_PARTS_ENV, "64")]).attention_parts, 64);
        assert_eq!(with(&[(ATTENTION_PARTS_ENV, "0")]).attention_parts, ATTENTION_PARTS);
        assert_eq!(with(&[(ATTENTION_PARTS_ENV, "1025")]).attention_parts, ATTENTION_PARTS);
        assert!(with(&[(ATTENTION_GRID_ENV, "full")]).attention_grid_full);
        assert!(!with(&[(ATTENTION_GRID_ENV, "fitted")]).attention_grid_full);
        assert_eq!(with(&[(CUBLASLT_ENV, "0")]).cublaslt, Cublaslt::Off);
        assert_eq!(with(&[(CUBLASLT_ENV, "")]).cublaslt, Cublaslt::Default);
        assert_eq!(with(&[(CUBLASLT_ENV, "libx.so")]).cublaslt, Cublaslt::File("libx.so".into()));
        assert!(!with(&[(PDL_ENV, "0")]).overlap && with(&[(PDL_ENV, "1")]).overlap);
        assert_eq!(with(&[(MMV_STAGE_ENV, "0")]).mmv_stage, MmvStage::Never);
        assert_eq!(with(&[(MMV_STAGE_ENV, "all")]).mmv_stage, MmvStage::Always);
        assert_eq!(with(&[(MMV_STAGE_ENV, "1")]).mmv_stage, MmvStage::Measured);
        assert_eq!(with(&[(MMVQ_TOKENS_ENV, "16")]).mmvq_tokens, 16);
        assert_eq!(with(&[(MMVQ_TOKENS_ENV, "many")]).mmvq_tokens, 0);
        assert!(!with(&[(MMV_PREP_ENV, "0")]).mmv_prep && with(&[(MMV_PREP_ENV, "1")]).mmv_prep);
        assert_eq!(with(&[(MMV_TC_BLOCKS_ENV, "0")]).mmv_tc_blocks, 0);
        assert_eq!(with(&[(MMV_TC_BLOCKS_ENV, "2")]).mmv_tc_blocks, 2);
        assert_eq!(with(&[(MMV_TC_BLOCKS_ENV, "3")]).mmv_tc_blocks, d.mmv_tc_blocks);
        assert_eq!(d.mmv_tc_blocks, 1);
        assert_eq!(with(&[(MMV_WGMMA_ENV, "0")]).mmv_wgmma, 0);
        assert_eq!(with(&[(MMV_WGMMA_ENV, "2")]).mmv_wgmma, 2);
        assert_eq!(with(&[(MMV_WGMMA_ENV, "3")]).mmv_wgmma, d.mmv_wgmma);
        assert_eq!(with(&[(MMV_WGMMA_ENV, "1")]).mmv_wgmma, 1);
        assert_eq!(d.mmv_wgmma, 1);
        assert_eq!(with(&[(ATTENTION_WIDE_ENV, "0")]).attention_wide, Some(false));
        assert_eq!(with(&[(ATTENTION_WIDE_ENV, "1")]).attention_wide, Some(true));
        assert_eq!(with(&[(ATTENTION_WIDE_ENV, "auto")]).attention_wide, None);
        assert_eq!(d.attention_wide, None);
        assert!(d.cuda_local_pool && !with(&[(CUDA_LOCAL_POOL_ENV, "0")]).cuda_local_pool);
        assert!(d.moe_mmv && !with(&[(MOE_MMV_ENV, "0")]).moe_mmv);
        assert_eq!(d.fused_tails, FusedTails::DEFAULT);
        assert!(!with(&[(FUSED_TAILS_ENV, "0")]).fused_tails.any());
        let route_and_sums = FusedTails { route: true, sums: true, attention: false };
        assert_eq!(with(&[(FUSED_TAILS_ENV, "sums, route")]).fused_tails, route_and_sums);
        assert_eq!(
            with(&[(FUSED_TAILS_ENV, "attention")]).fused_tails,
            FusedTails { attention: true, ..FusedTails::NONE }
        );
        assert_eq!(with(&[(FUSED_TAILS_ENV, "1")]).fused_tails, FusedTails::ALL);
        assert!(!d.moe_prefetch && with(&[(MOE_PREFETCH_ENV, "1")]).moe_prefetch);
        assert_eq!(with(&[(MOE_MMV_CUT_ENV, "waves")]).moe_mmv_cut, MoeMmvCut::Waves);
        assert_eq!(with(&[(MOE_MMV_CUT_ENV, " one")]).moe_mmv_cut, MoeMmvCut::One);
        assert_eq!(with(&[(MOE_MMV_CUT_ENV, "fill")]).moe_mmv_cut, MoeMmvCut::Fill);
        assert_eq!(with(&[(MOE_MMV_CUT_ENV, "2")]).moe_mmv_cut, d.moe_mmv_cut);
        assert_eq!(d.moe_mmv_cut, MoeMmvCut::Waves);
        assert!(d.flash_head_256 && !with(&[(FLASH_HEAD_256_ENV, "0")]).flash_head_256);
        // The engine option's variable is the engine's to read with the option, not a tuning variable.
        assert_eq!(with(&[("HOSTEMBED_BATCH_TENSOR_CORES", "1")]).batch_tensor_cores, d.batch_tensor_cores);
    }

    #[test]
    fn a_thread_setting_is_a_positive_number() {
        assert_eq!(cpu_threads(Some("3"), 8), 3);
        assert_eq!(cpu_threads(Some(" 5 "), 8), 5);
        for bad in ["0", "-2", "many", ""] {
            assert_eq!(cpu_threads(Some(bad), 8), 8, "{bad:?}");
        }
        assert_eq!(cpu_threads(None, 8), 8);
        assert_eq!(cpu_threads(Some("100000"), 8), MAX_CPU_THREADS);
        assert_eq!(cpu_threads(None, 0), 1);
    }

    /// The files under `dir` whose names end in one of `exts`, into `out`.
    fn sources(dir: &std::path::Path, exts: &[&str], out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                sources(&path, exts, out);
            } else if path.extension().is_some_and(|e| exts.iter().any(|x| e == *x)) {
                out.push(path);
            }
        }
    }

    /// No module below the engine reads the environment (GpuModel once read a variable the engine option
    /// should have decided): only `env_var` here does, and the kernels call no getenv.
    #[test]
    fn only_this_module_reads_the_environment() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files = Vec::new();
        sources(&root.join("src"), &["rs"], &mut files);
        sources(&root.join("kernels"), &["cu", "cuh", "h"], &mut files);
        assert!(files.len() > 50, "{} files", files.len());
        let reads = ["env::var(", "env::var_os(", "env::vars(", "getenv("];
        let mut found = Vec::new();
        for f in &files {
            let text = std::fs::read_to_string(f).unwrap();
            let name = f.strip_prefix(root).unwrap();
            for (i, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap();
                if reads.iter().any(|r| code.contains(r)) && name != std::path::Path::new("src/tuning.rs") {
                    found.push(format!("{}:{}: {}", name.display(), i + 1, line.trim()));
                }
            }
        }
        assert!(found.is_empty(), "the environment is read below the engine:\n{}", found.join("\n"));
    }
}
