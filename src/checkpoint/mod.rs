//! Checkpoints on disk: HF safetensors folders and GGUF files, mapped read-only and validated before
//! anything in them is trusted. Both formats end up as the same `Checkpoint`: a `ModelConfig`, tensors
//! under their canonical HF names, and the mappings their bytes live in.

pub mod gguf;
pub mod safetensors;
#[cfg(feature = "fixtures")]
pub mod write;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::model::{self, ModelConfig, RopeScaling, TensorRef, TensorSource, names};
use crate::status::Result;
use crate::tensor::{DType, first_non_finite_scale, supported_names};
use crate::{bail, err};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Safetensors,
    Gguf,
}

/// Where one tensor's bytes are: validated at open to lie inside its file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Canonical HF name (GGUF names are mapped onto these).
    pub name: String,
    pub dtype: DType,
    /// Outermost first: a [out, in] matrix has `out` rows of `in` values.
    pub shape: Vec<usize>,
    /// Index into `Checkpoint::files`.
    pub file: usize,
    /// Absolute byte offset in that file.
    pub offset: usize,
    pub bytes: usize,
}

impl TensorInfo {
    pub fn rows(&self) -> usize {
        model::shape_rows(&self.shape)
    }

    pub fn cols(&self) -> usize {
        model::shape_cols(&self.shape)
    }

    /// Bytes of one row in the stored format.
    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.cols()).expect("validated at open")
    }
}

/// Opens `path` for reading if it is a regular file; IO_ERROR for a FIFO, a device, a socket or a
/// folder. The open does not block: a FIFO without a writer would otherwise hold the caller forever.
pub fn open_regular(path: &Path) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| err!(IoError, "{}: {e}", path.display()))?;
    let meta = file.metadata().map_err(|e| err!(IoError, "{}: {e}", path.display()))?;
    if !meta.is_file() {
        bail!(IoError, "{}: not a regular file", path.display());
    }
    Ok(file)
}

/// The whole of a regular file (see `open_regular`).
pub fn read_regular(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    open_regular(path)?.read_to_end(&mut bytes).map_err(|e| err!(IoError, "{}: {e}", path.display()))?;
    Ok(bytes)
}

/// One file of a checkpoint, mapped read-only (PROT_READ).
pub struct MappedFile {
    pub path: PathBuf,
    pub map: Mmap,
}

impl MappedFile {
    pub fn open(path: &Path) -> Result<MappedFile> {
        let file = open_regular(path)?;
        // SAFETY: a read-only mapping; another process truncating the file while it is mapped would
        // fault on access, which no reader of a shared file can rule out.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| err!(IoError, "{}: mmap: {e}", path.display()))?;
        Ok(MappedFile { path: path.to_path_buf(), map })
    }
}

impl std::fmt::Debug for MappedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedFile").field("path", &self.path).field("len", &self.map.len()).finish()
    }
}

/// Where the text tokenizer comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum TokenizerSource {
    None,
    /// tokenizer.json beside the weights.
    Json(PathBuf),
    /// The tokenizer.ggml.* keys of a GGUF file.
    GgufBpe {
        /// tokenizer.ggml.model ("gpt2", "llama", ...).
        model: String,
        /// tokenizer.ggml.pre, the pre-tokenizer's name.
        pre: Option<String>,
        tokens: Vec<String>,
        merges: Vec<String>,
        token_types: Vec<i32>,
    },
    /// A GGUF SentencePiece vocabulary (`tokenizer.ggml.model` "llama").
    GgufSpm {
        tokens: Vec<String>,
        /// tokenizer.ggml.scores (empty when absent).
        scores: Vec<f32>,
        token_types: Vec<i32>,
        /// tokenizer.ggml.add_space_prefix (default true).
        add_space_prefix: bool,
    },
}

/// A model on disk: its config, its tensors by canonical name, and the mappings that hold their bytes.
#[derive(Debug)]
pub struct Checkpoint {
    /// The folder (HF) or the .gguf file.
    pub path: PathBuf,
    pub format: Format,
    pub config: ModelConfig,
    pub tensors: BTreeMap<String, TensorInfo>,
    pub files: Vec<MappedFile>,
    pub tokenizer: TokenizerSource,
    /// What the files say about BOS, EOS, end of generation and the chat template.
    pub special: crate::tokenizer::special::SpecialTokens,
}

/// Name of the extra tensor holding llama.cpp's per-frequency rope divisors (GGUF `rope_freqs.weight`).
pub const ROPE_FREQS: &str = "rope_freqs";

impl Checkpoint {
    /// Opens a folder (HF: config.json + safetensors) or a .gguf file. A path to a .safetensors or
    /// config.json file opens the folder that holds it.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        let meta = std::fs::metadata(path).map_err(|e| err!(IoError, "{}: {e}", path.display()))?;
        if meta.is_dir() {
            return safetensors::open_folder(path);
        }
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let is_hf_file = ext == "safetensors" || path.file_name().is_some_and(|n| n == "config.json");
        match path.parent() {
            Some(dir) if is_hf_file => {
                safetensors::open_folder(if dir.as_os_str().is_empty() { Path::new(".") } else { dir })
            }
            _ => gguf::open_file(path),
        }
    }

    /// The tensor by canonical name; `BAD_MODEL` naming the checkpoint and the tensor when absent.
    pub fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors.get(name).ok_or_else(|| err!(BadModel, "{}: tensor {name} is missing", self.path.display()))
    }

    /// The tensor's bytes inside its mapping.
    pub fn bytes_of(&self, t: &TensorInfo) -> &[u8] {
        &self.files[t.file].map[t.offset..t.offset + t.bytes]
    }

    /// The file a tensor lives in.
    pub fn file_of(&self, t: &TensorInfo) -> &MappedFile {
        &self.files[t.file]
    }

    /// The embedding rows, model.embed_tokens.weight (present and [vocab, hidden]: checked at open).
    pub fn embed(&self) -> &TensorInfo {
        &self.tensors[names::EMBED]
    }

    /// The output head: lm_head.weight, or the embedding table when tied.
    pub fn output(&self) -> &TensorInfo {
        if self.config.tied { self.embed() } else { &self.tensors[names::LM_HEAD] }
    }

    /// Bytes, as stored, of every tensor the model uses (rows and an untied head included).
    pub fn weight_bytes(&self) -> u64 {
        let mut used: Vec<String> = expected_tensors(&self.config).into_iter().map(|(n, _)| n).collect();
        used.push(ROPE_FREQS.to_string());
        used.iter().filter_map(|n| self.tensors.get(n)).map(|t| t.bytes as u64).sum()
    }
}

impl TensorSource for Checkpoint {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        let t = self.info(name)?;
        Ok(TensorRef { dtype: t.dtype, shape: &t.shape, bytes: self.bytes_of(t) })
    }

    fn try_tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        let t = self.tensors.get(name)?;
        Some(TensorRef { dtype: t.dtype, shape: &t.shape, bytes: self.bytes_of(t) })
    }
}

/// Every tensor the architecture reads, with its canonical shape, in file order (embedding, layers,
/// final norm, head): the weight table of `model.rs` for this config.
pub fn expected_tensors(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    model::weight_list(cfg).into_iter().map(|w| (w.name, w.shape)).collect()
}

/// Checks that every tensor the config calls for is present with its shape, and that no block of it has
/// a NaN or infinite scale (one pass over the scales: 14 GB/s on a 2-core host, 0.3 s for a 4.6 GB
/// Q4_K_M file in the page cache), and that no tensor belongs to an expert the config does not count.
/// `location` names where tensors live (a file, or a folder of shards); `unsupported` lists tensors
/// skipped for their dtype; `spell` gives a canonical name as the files spell it, for messages.
pub(crate) fn check_tensors(
    cfg: &ModelConfig,
    tensors: &BTreeMap<String, TensorInfo>,
    files: &[MappedFile],
    location: &str,
    unsupported: &BTreeMap<String, String>,
    spell: &dyn Fn(&str) -> String,
) -> Result<()> {
    let experts = cfg.moe.map_or(0, |m| m.experts);
    for name in tensors.keys().chain(unsupported.keys()) {
        if let Some((layer, e)) = names::expert_of(name)
            && (e >= experts || layer >= cfg.layers)
        {
            bail!(
                BadModel,
                "{location}: tensor {} belongs to expert {e} of layer {layer}, but the config gives {} layers of {experts} experts",
                spell(name),
                cfg.layers
            );
        }
    }
    for (name, shape) in expected_tensors(cfg) {
        let shown = spell(&name);
        let Some(t) = tensors.get(&name) else {
            if let Some(dtype) = unsupported.get(&name) {
                bail!(Unsupported, "{location}: tensor {shown} has dtype {dtype}; supported: {}", supported_names());
            }
            bail!(BadModel, "{location}: tensor {shown} is missing");
        };
        let file = || files.get(t.file).map_or(location.to_string(), |f| f.path.display().to_string());
        if t.shape != shape {
            bail!(BadModel, "{}: tensor {shown} has shape {:?}, the config asks for {:?}", file(), t.shape, shape);
        }
        if let Some(f) = files.get(t.file)
            && let Some((block, scale)) = first_non_finite_scale(t.dtype, &f.map[t.offset..t.offset + t.bytes])
        {
            let blocks_a_row = t.row_bytes() / t.dtype.format().block_bytes;
            bail!(
                BadModel,
                "{}: tensor {shown} ({}): block {block} (row {}) has a scale of {scale}",
                file(),
                t.dtype.name(),
                block / blocks_a_row
            );
        }
    }
    Ok(())
}

/// llama.cpp's rope divisors for Llama 3 scaling, one per rotated pair (as its converter computes them).
pub fn llama3_rope_factors(cfg: &ModelConfig) -> Option<Vec<f32>> {
    let RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } = cfg.rope_scaling
    else {
        return None;
    };
    let dim = cfg.head_dim;
    let old_context = original_max_position as f64;
    let (factor, low, high) = (factor as f64, low_freq_factor as f64, high_freq_factor as f64);
    let (low_wavelen, high_wavelen) = (old_context / low, old_context / high);
    let factors = (0..dim / 2)
        .map(|i| {
            // The converter forms the frequencies in f32 before taking wavelengths.
            let freq = 1.0f32 / (cfg.rope_theta.powf((2 * i) as f32 / dim as f32));
            let wavelen = 2.0 * std::f64::consts::PI / freq as f64;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor as f32
            } else {
                let smooth = (old_context / wavelen - low) / (high - low);
                (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
            }
        })
        .collect();
    Some(factors)
}
