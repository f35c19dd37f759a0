//! GGUF files as llama.cpp's converter lays them out: its names, keys and Q/K row permutation, expert
//! stacks, `rope_freqs.weight` for Llama 3 scaling; and a file's dequantized copy.

use std::borrow::Cow;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::synthetic::{Recipe, sampled_bytes, synthetic_bytes};
use super::{OwnedTensor, io_error, stored_bytes};
use crate::checkpoint::gguf::{self, DEFAULT_ALIGNMENT, GgufValue};
use crate::checkpoint::{ROPE_FREQS, expected_tensors, llama3_rope_factors};
use crate::model::{Arch, ModelConfig, RopeScaling, names};
use crate::status::Result;
use crate::tensor::DType;
use crate::{bail, err};

/// llama.cpp's converter permutation of llama Q/K rows: within each head, rows (i, i + d/2) of HF's
/// layout become the adjacent pair (2i, 2i + 1), so rotating adjacent pairs equals HF's half rotation.
/// `row_bytes` is the size of one row (one element for a bias).
pub fn permute_qk_rows(data: &[u8], row_bytes: usize, heads: usize) -> Vec<u8> {
    reorder_qk_rows(data, row_bytes, heads, false)
}

/// The inverse of `permute_qk_rows`: GGUF llama order back to HF order.
pub fn unpermute_qk_rows(data: &[u8], row_bytes: usize, heads: usize) -> Vec<u8> {
    reorder_qk_rows(data, row_bytes, heads, true)
}

fn reorder_qk_rows(data: &[u8], row_bytes: usize, heads: usize, inverse: bool) -> Vec<u8> {
    let rows = data.len() / row_bytes;
    assert!(
        rows * row_bytes == data.len() && rows.is_multiple_of(2 * heads),
        "{rows} rows do not split into {heads} heads"
    );
    let half = rows / heads / 2;
    let mut out = vec![0u8; data.len()];
    for h in 0..heads {
        for j in 0..half {
            for t in 0..2 {
                let hf = h * 2 * half + t * half + j;
                let gguf = h * 2 * half + 2 * j + t;
                let (dst, src) = if inverse { (hf, gguf) } else { (gguf, hf) };
                out[dst * row_bytes..(dst + 1) * row_bytes]
                    .copy_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    out
}

/// The head count whose rows llama.cpp permutes in `canonical` (Q and K, weights and biases, of the
/// architectures whose GGUF files rotate adjacent pairs).
fn permuted_heads(cfg: &ModelConfig, canonical: &str) -> Option<usize> {
    if !cfg.arch.traits().gguf_rope_interleaved {
        return None;
    }
    let part = canonical.strip_prefix("model.layers.")?.split_once('.')?.1;
    match part {
        names::Q | names::Q_BIAS => Some(cfg.heads),
        names::K | names::K_BIAS => Some(cfg.kv_heads),
        _ => None,
    }
}

/// One tensor to write into a GGUF file.
struct GgufEntry<'a> {
    gguf_name: String,
    canonical: String,
    dtype: DType,
    shape: Vec<usize>,
    data: GgufData<'a>,
}

enum GgufData<'a> {
    Bytes(&'a [u8]),
    Owned(Vec<u8>),
    /// Generated as the fill says, one tensor at a time as the file is written.
    Generated(Fill),
    /// A layer's experts of one role stacked, expert 0 first, as llama.cpp stores them.
    Experts(Vec<GgufEntry<'a>>),
}

impl GgufEntry<'_> {
    /// The bytes as stored in GGUF (llama Q/K rows permuted).
    fn bytes(&self, cfg: &ModelConfig) -> Cow<'_, [u8]> {
        let hf: Cow<[u8]> = match &self.data {
            GgufData::Bytes(b) => Cow::Borrowed(b),
            GgufData::Owned(v) => Cow::Borrowed(v),
            GgufData::Generated(Fill::Formula { seed }) => {
                Cow::Owned(synthetic_bytes(&self.canonical, &self.shape, self.dtype, *seed))
            }
            GgufData::Generated(Fill::SampledRows { seed }) => {
                Cow::Owned(sampled_bytes(&self.canonical, &self.shape, self.dtype, *seed))
            }
            GgufData::Experts(experts) => Cow::Owned(experts.iter().flat_map(|e| e.bytes(cfg).into_owned()).collect()),
        };
        if cfg.arch.traits().hf_norms_plus_one && self.canonical.ends_with("norm.weight") {
            return Cow::Owned(plus_one(&hf, self.dtype));
        }
        match permuted_heads(cfg, &self.canonical) {
            None => hf,
            Some(heads) => {
                let cols = if self.shape.len() < 2 { 1 } else { *self.shape.last().unwrap_or(&1) };
                let row_bytes = self.dtype.row_bytes(cols).expect("checked before writing");
                Cow::Owned(permute_qk_rows(&hf, row_bytes, heads))
            }
        }
    }
}

/// An F32 norm weight w stored as w + 1, as llama.cpp's converter stores Gemma's norms.
fn plus_one(data: &[u8], dtype: DType) -> Vec<u8> {
    assert_eq!(dtype, DType::F32, "norm weights are written F32");
    data.chunks_exact(4)
        .flat_map(|b| (f32::from_le_bytes(b.try_into().expect("4 bytes")) + 1.0).to_le_bytes())
        .collect()
}

fn u32_of(what: &str, v: usize) -> Result<GgufValue> {
    u32::try_from(v).map(GgufValue::U32).map_err(|_| err!(InvalidArgument, "{what} = {v} does not fit a GGUF u32"))
}

/// Consecutive entries of one expert stack (`gguf::expert_stack_of`) made one stacked entry of shape
/// [experts, rows, cols], as the weight table lists them; INVALID_ARGUMENT where given experts differ in
/// format or shape, or come out of order or with one left out.
fn stack_experts(entries: Vec<GgufEntry<'_>>) -> Result<Vec<GgufEntry<'_>>> {
    let mut out: Vec<GgufEntry> = Vec::with_capacity(entries.len());
    for e in entries {
        let Some((stack, index)) = gguf::expert_stack_of(&e.canonical) else {
            out.push(e);
            continue;
        };
        match out.last_mut() {
            Some(last) if last.gguf_name == stack => {
                let GgufData::Experts(experts) = &mut last.data else { unreachable!("a stack holds experts") };
                if index != experts.len() || e.dtype != last.dtype || e.shape[..] != last.shape[1..] {
                    bail!(
                        InvalidArgument,
                        "tensor {}: not the next expert of {stack} in its format and shape",
                        e.canonical
                    );
                }
                experts.push(e);
                last.shape[0] += 1;
            }
            _ if index != 0 => {
                bail!(InvalidArgument, "tensor {}: the experts of {stack} before it are not given", e.canonical)
            }
            _ => {
                let mut shape = vec![1];
                shape.extend_from_slice(&e.shape);
                out.push(GgufEntry {
                    gguf_name: stack.clone(),
                    canonical: stack,
                    dtype: e.dtype,
                    shape,
                    data: GgufData::Experts(vec![e]),
                });
            }
        }
    }
    Ok(out)
}

/// The metadata llama.cpp's converter writes for `cfg` (general.*, `{arch}.*`, bos/eos ids; a
/// Mixture of Experts' `expert_*` keys).
pub fn gguf_metadata(cfg: &ModelConfig) -> Result<Vec<(String, GgufValue)>> {
    let arch = cfg.arch.gguf_name();
    let key = |k: &str| format!("{arch}.{k}");
    let mut kv = vec![
        ("general.architecture".to_string(), GgufValue::String(arch.to_string())),
        ("general.alignment".to_string(), GgufValue::U32(DEFAULT_ALIGNMENT as u32)),
        (key("vocab_size"), u32_of("vocab", cfg.vocab)?),
        (key("context_length"), u32_of("max_position", cfg.max_position)?),
        (key("embedding_length"), u32_of("hidden", cfg.hidden)?),
        (key("block_count"), u32_of("layers", cfg.layers)?),
        // llama.cpp reads a Mixtral's experts as feed_forward_length wide.
        (
            key("feed_forward_length"),
            u32_of("intermediate", if cfg.arch == Arch::Mixtral { cfg.ffn_width() } else { cfg.intermediate })?,
        ),
        (key("attention.head_count"), u32_of("heads", cfg.heads)?),
        (key("attention.head_count_kv"), u32_of("kv_heads", cfg.kv_heads)?),
        (key("attention.key_length"), u32_of("head_dim", cfg.head_dim)?),
        (key("attention.value_length"), u32_of("head_dim", cfg.head_dim)?),
        (key("rope.dimension_count"), u32_of("head_dim", cfg.head_dim)?),
        (key("rope.freq_base"), GgufValue::F32(cfg.rope_theta)),
        (key("attention.layer_norm_rms_epsilon"), GgufValue::F32(cfg.rms_eps)),
    ];
    match cfg.rope_scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => {
            kv.push((key("rope.scaling.type"), GgufValue::String("linear".to_string())));
            kv.push((key("rope.scaling.factor"), GgufValue::F32(factor)));
        }
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
            kv.push((gguf::KEY_LLAMA3_FACTOR.to_string(), GgufValue::F32(factor)));
            kv.push((gguf::KEY_LLAMA3_LOW.to_string(), GgufValue::F32(low_freq_factor)));
            kv.push((gguf::KEY_LLAMA3_HIGH.to_string(), GgufValue::F32(high_freq_factor)));
            kv.push((gguf::KEY_LLAMA3_ORIGINAL.to_string(), GgufValue::U32(original_max_position)));
        }
    }
    if cfg.arch == Arch::Gemma3
        && let Some(s) = cfg.attention.sliding
    {
        // llama.cpp reads no more: every sixth layer global, a local base of 10000, the query scaling
        // by the layer count (see `gemma3_attention` in gguf/open.rs).
        kv.push((key("attention.sliding_window"), u32_of("sliding window", s.window)?));
    }
    if let Some(m) = cfg.moe {
        kv.push((key("expert_count"), u32_of("experts", m.experts)?));
        kv.push((key("expert_used_count"), u32_of("experts used", m.used)?));
        if cfg.arch != Arch::Mixtral {
            kv.push((key("expert_feed_forward_length"), u32_of("expert width", m.intermediate)?));
        }
        if !m.norm_topk {
            kv.push((key("expert_weights_norm"), GgufValue::Bool(false)));
        }
    }
    if let Some(bos) = cfg.bos {
        kv.push(("tokenizer.ggml.bos_token_id".to_string(), GgufValue::U32(bos)));
    }
    if let Some(eos) = cfg.eos {
        kv.push(("tokenizer.ggml.eos_token_id".to_string(), GgufValue::U32(eos)));
    }
    Ok(kv)
}

/// The llama3 `rope_freqs.weight` entry llama.cpp's converter adds for llama models.
fn rope_freqs_entry(cfg: &ModelConfig) -> Option<GgufEntry<'static>> {
    if cfg.arch.gguf_name() != "llama" {
        return None;
    }
    let factors = llama3_rope_factors(cfg)?;
    Some(GgufEntry {
        gguf_name: "rope_freqs.weight".to_string(),
        canonical: ROPE_FREQS.to_string(),
        dtype: DType::F32,
        shape: vec![factors.len()],
        data: GgufData::Owned(factors.iter().flat_map(|f| f.to_le_bytes()).collect()),
    })
}

/// Writes a GGUF v3 file: metadata from `cfg` (then `extra_kv`, which replaces a generated key of the
/// same name), tensors under llama.cpp's names with their data 32-byte aligned, llama Q/K rows permuted
/// as llama.cpp's converter does, and `rope_freqs.weight` for llama with Llama 3 scaling.
pub fn write_gguf(
    path: &Path,
    cfg: &ModelConfig,
    tensors: &[OwnedTensor],
    extra_kv: &[(String, GgufValue)],
) -> Result<()> {
    write_gguf_as(path, cfg, tensors, extra_kv, true)
}

/// `write_gguf` with each expert its own tensor (`blk.N.ffn_gate.E.weight`), as llama.cpp wrote
/// Mixtral before it stacked experts: the files of that time, which the reader takes too.
pub fn write_gguf_experts_apart(
    path: &Path,
    cfg: &ModelConfig,
    tensors: &[OwnedTensor],
    extra_kv: &[(String, GgufValue)],
) -> Result<()> {
    write_gguf_as(path, cfg, tensors, extra_kv, false)
}

fn write_gguf_as(
    path: &Path,
    cfg: &ModelConfig,
    tensors: &[OwnedTensor],
    extra_kv: &[(String, GgufValue)],
    stacked: bool,
) -> Result<()> {
    let mut entries = Vec::with_capacity(tensors.len() + 1);
    for t in tensors {
        t.check()?;
        let expert = |name: &str| match stacked {
            true => gguf::expert_stack_of(name).map(|s| s.0),
            false => gguf::expert_tensor_name_of(name),
        };
        let gguf_name = gguf::gguf_name_in(cfg.arch, &t.name)
            .or_else(|| expert(&t.name))
            .ok_or_else(|| err!(InvalidArgument, "tensor {} has no GGUF name", t.name))?;
        entries.push(GgufEntry {
            gguf_name,
            canonical: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            data: GgufData::Bytes(&t.data),
        });
    }
    if !tensors.iter().any(|t| t.name == ROPE_FREQS) {
        entries.extend(rope_freqs_entry(cfg));
    }
    let entries = if stacked { stack_experts(entries)? } else { entries };
    write_gguf_entries(path, cfg, &entries, extra_kv)
}

/// `write_gguf` for `synthetic_weights(cfg, seed, recipe)`, one tensor generated at a time as the file
/// is written, so a model far larger than memory can be written.
pub fn write_synthetic_gguf(path: &Path, cfg: &ModelConfig, seed: u64, recipe: impl Into<Recipe>) -> Result<()> {
    write_synthetic_gguf_kv(path, cfg, seed, recipe, &[])
}

/// `write_synthetic_gguf` with `extra_kv` after the generated metadata (a tokenizer's keys), as
/// `write_gguf` takes them.
pub fn write_synthetic_gguf_kv(
    path: &Path,
    cfg: &ModelConfig,
    seed: u64,
    recipe: impl Into<Recipe>,
    extra_kv: &[(String, GgufValue)],
) -> Result<()> {
    write_generated_gguf(path, cfg, Fill::Formula { seed }, recipe.into(), extra_kv)
}

/// What fills a generated file's tensors.
#[derive(Clone, Copy, Debug)]
pub enum Fill {
    /// `synthetic_weights`' formula for every tensor.
    Formula { seed: u64 },
    /// The formula for float formats and vectors; a block format's matrix repeats 64 random rows of its
    /// own, as `MemSource::benchmark`'s do (for benchmarks: the large shapes' files at the disk's speed
    /// rather than the encoder's).
    SampledRows { seed: u64 },
}

/// `write_synthetic_gguf_kv` filled as `fill` says.
pub fn write_generated_gguf(
    path: &Path,
    cfg: &ModelConfig,
    fill: Fill,
    recipe: Recipe,
    extra_kv: &[(String, GgufValue)],
) -> Result<()> {
    let mut entries: Vec<GgufEntry> = expected_tensors(cfg)
        .into_iter()
        .map(|(canonical, shape)| GgufEntry {
            gguf_name: gguf::gguf_name_in(cfg.arch, &canonical)
                .or_else(|| gguf::expert_stack_of(&canonical).map(|s| s.0))
                .expect("every expected tensor has a GGUF name"),
            dtype: recipe.dtype(cfg, &canonical, &shape),
            canonical,
            shape,
            data: GgufData::Generated(fill),
        })
        .collect();
    entries.extend(rope_freqs_entry(cfg));
    write_gguf_entries(path, cfg, &stack_experts(entries)?, extra_kv)
}

fn write_gguf_entries(
    path: &Path,
    cfg: &ModelConfig,
    entries: &[GgufEntry],
    extra_kv: &[(String, GgufValue)],
) -> Result<()> {
    let mut kv: Vec<(String, GgufValue)> = Vec::new();
    for (k, v) in extra_kv {
        if kv.iter().any(|(seen, _)| seen == k) {
            bail!(InvalidArgument, "GGUF key {k} is given twice");
        }
        kv.push((k.clone(), v.clone()));
    }
    let generated = gguf_metadata(cfg)?;
    let mut metadata: Vec<(String, GgufValue)> =
        generated.into_iter().filter(|(k, _)| !kv.iter().any(|(extra, _)| extra == k)).collect();
    metadata.extend(kv);

    let align = DEFAULT_ALIGNMENT as usize;
    let mut header = Vec::new();
    header.extend_from_slice(gguf::MAGIC);
    header.extend_from_slice(&gguf::VERSION.to_le_bytes());
    header.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    header.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in &metadata {
        gguf::put_string(&mut header, k);
        v.encode(&mut header);
    }
    let mut offset = 0usize;
    let mut sizes = Vec::with_capacity(entries.len());
    for e in entries {
        if entries.iter().filter(|o| o.gguf_name == e.gguf_name).count() > 1 {
            bail!(InvalidArgument, "tensor {} is given twice", e.canonical);
        }
        if e.shape.is_empty() || e.shape.len() > gguf::MAX_DIMS {
            bail!(InvalidArgument, "tensor {}: GGUF holds 1 to 4 dimensions, not {:?}", e.canonical, e.shape);
        }
        let bytes = stored_bytes(e.dtype, &e.shape).ok_or_else(|| {
            err!(InvalidArgument, "tensor {}: {:?} rows are not whole {} blocks", e.canonical, e.shape, e.dtype.name())
        })?;
        let cols = if e.shape.len() < 2 { 1 } else { e.shape[e.shape.len() - 1] };
        if let Some(heads) = permuted_heads(cfg, &e.canonical)
            && (e.shape[0] % (2 * heads) != 0 || e.dtype.row_bytes(cols).is_none())
        {
            bail!(
                InvalidArgument,
                "tensor {}: {} rows do not split into {heads} heads of pairs",
                e.canonical,
                e.shape[0]
            );
        }
        gguf::put_string(&mut header, &e.gguf_name);
        header.extend_from_slice(&(e.shape.len() as u32).to_le_bytes());
        for d in e.shape.iter().rev() {
            header.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        header.extend_from_slice(&e.dtype.ggml_type().to_le_bytes());
        header.extend_from_slice(&(offset as u64).to_le_bytes());
        sizes.push(bytes);
        offset = (offset + bytes).next_multiple_of(align);
    }
    header.resize(header.len().next_multiple_of(align), 0);

    // Written beside the target and renamed over it, so a reader mapping the old file never sees it shrink.
    let tmp = PathBuf::from(format!("{}.tmp{}", path.display(), std::process::id()));
    let result = (|| -> Result<()> {
        let file = File::create(&tmp).map_err(|e| io_error(&tmp, e))?;
        let mut out = BufWriter::with_capacity(8 << 20, file);
        out.write_all(&header).map_err(|e| io_error(&tmp, e))?;
        let zeros = [0u8; DEFAULT_ALIGNMENT as usize];
        for (e, size) in entries.iter().zip(&sizes) {
            let bytes = e.bytes(cfg);
            debug_assert_eq!(bytes.len(), *size);
            out.write_all(&bytes).map_err(|e| io_error(&tmp, e))?;
            out.write_all(&zeros[..size.next_multiple_of(align) - size]).map_err(|e| io_error(&tmp, e))?;
        }
        out.into_inner().map_err(|e| io_error(&tmp, e.error()))?.sync_all().map_err(|e| io_error(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| io_error(path, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// The GGUF file at `src` rewritten at `dst` with every tensor decoded to F32 as stored (each row by the
/// format's own decoder, so the values are exactly those a backend computes with): the same metadata,
/// names, shapes and order (llama's Q/K rows stay permuted). The exact F32 model of a quantized file.
pub fn write_gguf_dequantized(src: &Path, dst: &Path) -> Result<()> {
    let bytes = std::fs::read(src).map_err(|e| io_error(src, e))?;
    let g = gguf::parse(&bytes, &src.display().to_string())?;
    let align = g.alignment as usize;
    let mut header = Vec::new();
    header.extend_from_slice(gguf::MAGIC);
    header.extend_from_slice(&gguf::VERSION.to_le_bytes());
    header.extend_from_slice(&(g.tensors.len() as u64).to_le_bytes());
    header.extend_from_slice(&(g.metadata.len() as u64).to_le_bytes());
    for (k, v) in &g.metadata {
        gguf::put_string(&mut header, k);
        v.encode(&mut header);
    }
    let mut offset = 0usize;
    for t in &g.tensors {
        let values = t.dims.iter().product::<u64>() as usize;
        gguf::put_string(&mut header, &t.name);
        header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            header.extend_from_slice(&d.to_le_bytes());
        }
        header.extend_from_slice(&DType::F32.ggml_type().to_le_bytes());
        header.extend_from_slice(&(offset as u64).to_le_bytes());
        offset = (offset + values * 4).next_multiple_of(align);
    }
    header.resize(header.len().next_multiple_of(align), 0);
    let file = File::create(dst).map_err(|e| io_error(dst, e))?;
    let mut out = BufWriter::with_capacity(8 << 20, file);
    out.write_all(&header).map_err(|e| io_error(dst, e))?;
    for t in &g.tensors {
        let cols = t.dims[0] as usize;
        let row_bytes = t.dtype.row_bytes(cols).ok_or_else(|| err!(BadModel, "tensor {}: rows of {cols}", t.name))?;
        let (mut row, mut le) = (vec![0f32; cols], Vec::with_capacity(cols * 4));
        for stored in bytes[t.start..t.start + t.bytes].chunks_exact(row_bytes) {
            crate::tensor::decode_row(t.dtype, stored, &mut row);
            le.clear();
            le.extend(row.iter().flat_map(|v| v.to_le_bytes()));
            out.write_all(&le).map_err(|e| io_error(dst, e))?;
        }
        let size = t.bytes / row_bytes * cols * 4;
        out.write_all(&vec![0u8; size.next_multiple_of(align) - size]).map_err(|e| io_error(dst, e))?;
    }
    out.into_inner().map_err(|e| io_error(dst, e.error()))?.sync_all().map_err(|e| io_error(dst, e))
}
