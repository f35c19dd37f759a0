//! HF checkpoints: a folder with config.json and one model.safetensors, or shards listed by
//! model.safetensors.index.json. Headers are parsed and validated by the `safetensors` crate; this file
//! reads config.json and names the tensor at fault when the crate refuses a header.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

use safetensors::tensor::{SafeTensorError, SafeTensors};
use serde_json::{Map, Value};

use super::{Checkpoint, Format, MappedFile, TensorInfo, TokenizerSource};
use crate::model::{Arch, AttentionConfig, ModelConfig, RopeScaling, SlidingWindow, names};
use crate::status::{Error, Result};
use crate::tensor::DType;
use crate::tokenizer::special::SpecialTokens;
use crate::{bail, err};

pub const CONFIG: &str = "config.json";
pub const SINGLE: &str = "model.safetensors";
pub const INDEX: &str = "model.safetensors.index.json";
pub const TOKENIZER: &str = "tokenizer.json";

/// Opens an HF folder: config.json, then the weights, then checks every tensor against the config.
pub fn open_folder(dir: &Path) -> Result<Checkpoint> {
    let config_path = dir.join(CONFIG);
    let mut config = parse_config(&read_json(&config_path)?, &config_path.display().to_string())?;

    let single = dir.join(SINGLE);
    let index = dir.join(INDEX);
    let (shards, weight_map, location) = if single.is_file() {
        (vec![single.clone()], None, single.display().to_string())
    } else if index.is_file() {
        let (shards, map) = parse_index(dir, &index)?;
        (shards, Some(map), index.display().to_string())
    } else {
        bail!(IoError, "{}: neither {SINGLE} nor {INDEX} is there", dir.display());
    };

    let mut files = Vec::with_capacity(shards.len());
    let mut tensors: BTreeMap<String, TensorInfo> = BTreeMap::new();
    let mut unsupported = BTreeMap::new();
    for (index_of_file, path) in shards.iter().enumerate() {
        let mapped = MappedFile::open(path)?;
        let file = path.display().to_string();
        let (header_len, metadata) =
            SafeTensors::read_metadata(&mapped.map).map_err(|e| describe_error(e, &mapped.map, &file))?;
        let data_start = 8 + header_len;
        for name in metadata.offset_keys() {
            let info = metadata.info(&name).expect("offset_keys come from the metadata");
            let Some(dtype) = DType::from_safetensors(info.dtype) else {
                unsupported.insert(name, info.dtype.to_string());
                continue;
            };
            if let Some(first) = tensors.get(&name) {
                let other = shards[first.file].display();
                bail!(BadModel, "{file}: tensor {name} is also in {other}");
            }
            let (start, end) = info.data_offsets;
            let t = TensorInfo {
                name: name.clone(),
                dtype,
                shape: info.shape.clone(),
                file: index_of_file,
                offset: data_start + start,
                bytes: end - start,
            };
            tensors.insert(name, t);
        }
        files.push(mapped);
    }
    if let Some(map) = weight_map {
        for (name, shard) in map {
            let held = tensors.get(&name).map(|t| &shards[t.file]);
            if held != Some(&dir.join(&shard)) && !unsupported.contains_key(&name) {
                bail!(BadModel, "{location}: tensor {name} is listed in {shard}, which does not hold it");
            }
        }
    }

    config.tied |= !tensors.contains_key(names::LM_HEAD);
    super::check_tensors(&config, &tensors, &files, &location, &unsupported)?;
    if config.arch.traits().hf_norms_plus_one {
        norms_plus_one(&config, &mut tensors, &mut files, &location)?;
    }

    let tokenizer_path = dir.join(TOKENIZER);
    let tokenizer =
        // Anything there by that name is read (and a FIFO or a device refused), not silently skipped.
        if tokenizer_path.exists() { TokenizerSource::Json(tokenizer_path) } else { TokenizerSource::None };
    let special = special_tokens(dir)?;
    Ok(Checkpoint { path: dir.to_path_buf(), format: Format::Safetensors, config, tensors, files, tokenizer, special })
}

/// Gemma's RMSNorm multiplies by (1 + w): each norm weight w becomes the multiplier 1 + w (in f32, as
/// HF forms it), in an anonymous read-only mapping the checkpoint holds beside its files, so the
/// backends read the multiplier as they read a GGUF file's (whose converter stored w + 1).
fn norms_plus_one(
    config: &ModelConfig,
    tensors: &mut BTreeMap<String, TensorInfo>,
    files: &mut Vec<MappedFile>,
    location: &str,
) -> Result<()> {
    let norms: Vec<String> = super::expected_tensors(config)
        .into_iter()
        .map(|(name, _)| name)
        .filter(|name| name.ends_with("norm.weight"))
        .collect();
    let bytes: usize = norms.iter().map(|n| tensors[n].cols() * 4).sum();
    let mut map = memmap2::MmapMut::map_anon(bytes.max(1)).map_err(|e| err!(NoRoom, "{location}: {e}"))?;
    let mut offset = 0;
    for name in &norms {
        let t = &tensors[name];
        let mut values = vec![0f32; t.cols()];
        crate::tensor::decode_row(t.dtype, &files[t.file].map[t.offset..t.offset + t.bytes], &mut values);
        for (out, v) in map[offset..offset + values.len() * 4].chunks_exact_mut(4).zip(&values) {
            out.copy_from_slice(&(1.0 + v).to_le_bytes());
        }
        let t = tensors.get_mut(name).expect("listed above");
        (t.dtype, t.file, t.offset, t.bytes) = (DType::F32, files.len(), offset, values.len() * 4);
        offset += values.len() * 4;
    }
    let map = map.make_read_only().map_err(|e| err!(IoError, "{location}: {e}"))?;
    files.push(MappedFile { path: PathBuf::from(format!("{location} (norm weights + 1)")), map });
    Ok(())
}

pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
pub const GENERATION_CONFIG: &str = "generation_config.json";
pub const CHAT_TEMPLATE: &str = "chat_template.jinja";

/// What tokenizer_config.json, generation_config.json, chat_template.jinja and config.json say about
/// special tokens; each file is optional, one that is there must parse.
fn special_tokens(dir: &Path) -> Result<SpecialTokens> {
    let optional_json = |name: &str| -> Result<Option<(Value, String)>> {
        let path = dir.join(name);
        if !path.exists() {
            return Ok(None);
        }
        Ok(Some((read_json(&path)?, path.display().to_string())))
    };
    let mut special = SpecialTokens::default();
    // Every eos id config.json and generation_config.json list ends a generation.
    for name in [CONFIG, GENERATION_CONFIG] {
        if let Some((json, file)) = optional_json(name)? {
            match json.get("eos_token_id") {
                None | Some(Value::Null) => {}
                Some(Value::Array(ids)) => {
                    for id in ids {
                        special.eog.push(json_id(id, &file)?);
                    }
                }
                Some(id) => special.eog.push(json_id(id, &file)?),
            }
        }
    }
    if let Some((json, file)) = optional_json(TOKENIZER_CONFIG)? {
        let flag = |key: &str| -> Result<Option<bool>> {
            match json.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Bool(b)) => Ok(Some(*b)),
                Some(v) => bail!(BadModel, "{file}: {key} is {v}, expected true or false"),
            }
        };
        special.add_bos = flag("add_bos_token")?;
        special.add_eos = flag("add_eos_token")?;
        // A token is its text, or an AddedToken object with the text in "content".
        let text = |key: &str| -> Result<Option<String>> {
            match json.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(v) => match v.get("content").and_then(Value::as_str) {
                    Some(s) => Ok(Some(s.to_string())),
                    None => bail!(BadModel, "{file}: {key} is neither a string nor an object with \"content\""),
                },
            }
        };
        special.bos_text = text("bos_token")?;
        special.eos_text = text("eos_token")?;
        special.chat_template = match json.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            // Several named templates: the one named "default", as transformers picks.
            Some(Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_string),
            Some(v) => bail!(BadModel, "{file}: chat_template is {v}, expected a string or a list of named templates"),
        };
    }
    let jinja = dir.join(CHAT_TEMPLATE);
    if jinja.exists() {
        let bytes = super::read_regular(&jinja)?;
        let text = String::from_utf8(bytes).map_err(|_| err!(BadModel, "{}: not UTF-8", jinja.display()))?;
        special.chat_template = Some(text);
    }
    Ok(special)
}

fn json_id(id: &Value, file: &str) -> Result<u32> {
    id.as_u64()
        .and_then(|id| u32::try_from(id).ok())
        .ok_or_else(|| err!(BadModel, "{file}: eos_token_id holds {id}, not a token id"))
}

fn read_json(path: &Path) -> Result<Value> {
    let text = super::read_regular(path)?;
    serde_json::from_slice(&text).map_err(|e| err!(BadModel, "{}: not valid JSON: {e}", path.display()))
}

/// The shard files of an index (sorted, each a plain name inside `dir`) and its name -> shard map.
fn parse_index(dir: &Path, index: &Path) -> Result<(Vec<PathBuf>, BTreeMap<String, String>)> {
    let file = index.display();
    let json = read_json(index)?;
    let Some(map) = json.get("weight_map").and_then(Value::as_object) else {
        bail!(BadModel, "{file}: key weight_map is missing or not an object");
    };
    let mut weight_map = BTreeMap::new();
    let mut shard_names = BTreeSet::new();
    for (name, shard) in map {
        let Some(shard) = shard.as_str() else {
            bail!(BadModel, "{file}: weight_map.{name} = {shard} is not a file name");
        };
        let mut parts = Path::new(shard).components();
        if !matches!((parts.next(), parts.next()), (Some(Component::Normal(_)), None)) {
            bail!(BadModel, "{file}: weight_map.{name} = \"{shard}\" is not a file in this folder");
        }
        shard_names.insert(shard.to_string());
        weight_map.insert(name.clone(), shard.to_string());
    }
    if shard_names.is_empty() {
        bail!(BadModel, "{file}: weight_map lists no tensors");
    }
    Ok((shard_names.iter().map(|s| dir.join(s)).collect(), weight_map))
}

/// The crate's error, with the tensor at fault named when the header shows which one it is.
fn describe_error(e: SafeTensorError, buf: &[u8], file: &str) -> Error {
    if let SafeTensorError::InvalidOffset(name) = &e {
        return err!(BadModel, "{file}: tensor {name}: data offsets do not follow the previous tensor's ({e})");
    }
    match find_bad_entry(buf) {
        // The crate's own words would repeat the JSON error already given.
        Some((name, why)) if matches!(e, SafeTensorError::InvalidHeaderDeserialization(_)) => {
            err!(BadModel, "{file}: tensor {name}: {why}")
        }
        Some((name, why)) => err!(BadModel, "{file}: tensor {name}: {why} ({e})"),
        None => err!(BadModel, "{file}: not a valid safetensors file: {e}"),
    }
}

/// Re-reads a header the crate refused, entry by entry, to find the first tensor that is wrong.
fn find_bad_entry(buf: &[u8]) -> Option<(String, String)> {
    let header_len = usize::try_from(u64::from_le_bytes(buf.get(..8)?.try_into().ok()?)).ok()?;
    let header = buf.get(8..8usize.checked_add(header_len)?)?;
    let data_len = buf.len() - 8 - header_len;
    let entries: Map<String, Value> = serde_json::from_slice(header).ok()?;
    let mut infos = Vec::new();
    for (name, entry) in entries {
        if name == "__metadata__" {
            continue;
        }
        match serde_json::from_value::<safetensors::tensor::TensorInfo>(entry) {
            Ok(info) => infos.push((name, info)),
            Err(e) => return Some((name, e.to_string())),
        }
    }
    infos.sort_by_key(|(_, info)| info.data_offsets);
    let mut expected_start = 0;
    for (name, info) in infos {
        let (start, end) = info.data_offsets;
        if start != expected_start || end < start {
            return Some((name, format!("data offsets [{start}, {end}) do not follow the previous tensor's")));
        }
        let bits = info.shape.iter().try_fold(info.dtype.bitsize(), |acc, &d| acc.checked_mul(d));
        if bits.map(|b| b / 8) != Some(end - start) {
            let (dtype, shape) = (info.dtype, &info.shape);
            return Some((
                name,
                format!("{} bytes in its data offsets, but {shape:?} of {dtype} differs", end - start),
            ));
        }
        if end > data_len {
            return Some((name, format!("its data ends at {end}, past the {data_len} data bytes the file holds")));
        }
        expected_start = end;
    }
    None
}

/// Typed access to one JSON object; every miss or mistyped value a `BAD_MODEL` naming file and key.
struct Keys<'a> {
    obj: &'a Map<String, Value>,
    file: &'a str,
    prefix: &'a str,
}

impl<'a> Keys<'a> {
    /// The value, with JSON null read as absent.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn bad(&self, key: &str, v: &Value, expected: &str) -> Error {
        err!(BadModel, "{}: key {}{key} = {v} is not {expected}", self.file, self.prefix)
    }

    fn missing(&self, key: &str) -> Error {
        err!(BadModel, "{}: key {}{key} is missing", self.file, self.prefix)
    }

    fn usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
                Some(n) => Ok(Some(n)),
                None => Err(self.bad(key, v, "a non-negative integer")),
            },
        }
    }

    fn req_usize(&self, key: &str) -> Result<usize> {
        self.usize(key)?.ok_or_else(|| self.missing(key))
    }

    fn f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(|f| Some(f as f32)).ok_or_else(|| self.bad(key, v, "a number")),
        }
    }

    fn req_f32(&self, key: &str) -> Result<f32> {
        self.f32(key)?.ok_or_else(|| self.missing(key))
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.bad(key, v, "true or false")),
        }
    }

    fn str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.bad(key, v, "a string")),
        }
    }

    /// A token id given as an integer or a list (the first one is taken).
    fn token_id(&self, key: &str) -> Result<Option<u32>> {
        let first = match self.get(key) {
            None => return Ok(None),
            Some(Value::Array(ids)) => match ids.first() {
                None => return Ok(None),
                Some(id) => id,
            },
            Some(id) => id,
        };
        match first.as_u64().and_then(|id| u32::try_from(id).ok()) {
            Some(id) => Ok(Some(id)),
            None => Err(self.bad(key, first, "a token id")),
        }
    }

    fn object(&self, key: &str) -> Result<Option<Keys<'a>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(obj)) => Ok(Some(Keys { obj, file: self.file, prefix: key_prefix(key) })),
            Some(v) => Err(self.bad(key, v, "an object")),
        }
    }
}

/// The prefix messages give keys nested in the object at `key`.
fn key_prefix(key: &str) -> &'static str {
    match key {
        "rope_parameters" => "rope_parameters.",
        "full_attention" => "rope_parameters.full_attention.",
        "sliding_attention" => "rope_parameters.sliding_attention.",
        _ => "rope_scaling.",
    }
}

/// Reads config.json (`file` names it in messages) into a `ModelConfig`.
pub fn parse_config(json: &Value, file: &str) -> Result<ModelConfig> {
    let Some(obj) = json.as_object() else {
        bail!(BadModel, "{file}: the top level is not a JSON object");
    };
    let j = Keys { obj, file, prefix: "" };
    let model_type = j.str("model_type")?.ok_or_else(|| j.missing("model_type"))?;
    let arch = Arch::from_hf_model_type(model_type).ok_or_else(|| {
        err!(Unsupported, "{file}: model_type \"{model_type}\" is not supported ({})", Arch::supported_hf_model_types())
    })?;

    let activation = arch.traits().activation;
    for key in ["hidden_act", "hidden_activation"] {
        if let Some(act) = j.str(key)?
            && !activation.hf_names().contains(&act)
        {
            bail!(
                Unsupported,
                "{file}: {key} \"{act}\" is not supported for {model_type} ({})",
                activation.hf_names().join(", ")
            );
        }
    }
    let attention_bias = j.bool("attention_bias")?.unwrap_or(false);
    if attention_bias && !arch.traits().qkv_bias {
        bail!(
            Unsupported,
            "{file}: attention_bias = true (biases on q/k/v and o_proj) is not supported for {model_type}"
        );
    }
    if j.bool("mlp_bias")?.unwrap_or(false) {
        bail!(Unsupported, "{file}: mlp_bias = true is not supported");
    }
    if j.bool("use_sliding_window")?.unwrap_or(false) {
        bail!(Unsupported, "{file}: use_sliding_window = true is not supported");
    }

    let hidden = j.req_usize("hidden_size")?;
    let heads = j.req_usize("num_attention_heads")?;
    if heads == 0 {
        bail!(BadModel, "{file}: key num_attention_heads is 0");
    }
    let head_dim = match j.usize("head_dim")? {
        Some(d) => d,
        None if hidden % heads == 0 => hidden / heads,
        None => bail!(BadModel, "{file}: key head_dim is missing and {hidden} is not a multiple of {heads} heads"),
    };

    // transformers 5 gives Gemma 3 one rope_parameters object a layer type.
    let by_layer_type = match j.object("rope_parameters")? {
        Some(p) => Some((p.object("full_attention")?, p.object("sliding_attention")?))
            .filter(|(f, s)| f.is_some() || s.is_some()),
        None => None,
    };
    let (rope_theta, rope_scaling) = match (&by_layer_type, j.object("rope_parameters")?) {
        (Some((Some(full), _)), _) => (full.f32("rope_theta")?.unwrap_or(10000.0), parse_rope_scaling(full)?),
        (Some((None, _)), _) => (j.f32("rope_theta")?.unwrap_or(10000.0), RopeScaling::None),
        (None, Some(params)) => (params.f32("rope_theta")?.unwrap_or(10000.0), parse_rope_scaling(&params)?),
        (None, None) => {
            let scaling = match j.object("rope_scaling")? {
                Some(s) => parse_rope_scaling(&s)?,
                None => RopeScaling::None,
            };
            (j.f32("rope_theta")?.unwrap_or(10000.0), scaling)
        }
    };
    let layers = j.req_usize("num_hidden_layers")?;
    let attention = match arch {
        Arch::Gemma3 => {
            let local_theta = match &by_layer_type {
                Some((_, Some(local))) => {
                    if parse_rope_scaling(local)? != RopeScaling::None {
                        bail!(Unsupported, "{file}: rope scaling on the sliding-window layers is not supported");
                    }
                    local.f32("rope_theta")?.unwrap_or(10000.0)
                }
                _ => j.f32("rope_local_base_freq")?.unwrap_or(10000.0),
            };
            gemma3_attention(&j, layers, local_theta)?
        }
        _ => AttentionConfig::default(),
    };

    let config = ModelConfig {
        arch,
        vocab: j.req_usize("vocab_size")?,
        hidden,
        layers,
        heads,
        kv_heads: j.usize("num_key_value_heads")?.unwrap_or(heads),
        head_dim,
        intermediate: j.req_usize("intermediate_size")?,
        rms_eps: j.req_f32("rms_norm_eps")?,
        rope_theta,
        rope_scaling,
        rope_interleaved: false,
        max_position: j.req_usize("max_position_embeddings")?,
        tied: j.bool("tie_word_embeddings")?.unwrap_or(false),
        qkv_bias: arch.traits().qkv_bias,
        qk_norm: arch.traits().qk_norm,
        attention,
        bos: j.token_id("bos_token_id")?,
        eos: j.token_id("eos_token_id")?,
    };
    config.check(file)?;
    Ok(config)
}

/// Gemma 3's query scaling and sliding window: query_pre_attn_scalar, sliding_window, and which layers
/// slide (`layer_types`, or every layer but each `sliding_window_pattern`th); refuses soft-capping and
/// bidirectional attention, which this engine does not compute.
fn gemma3_attention(j: &Keys, layers: usize, local_theta: f32) -> Result<AttentionConfig> {
    let file = j.file;
    for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if let Some(v) = j.f32(key)? {
            bail!(Unsupported, "{file}: {key} = {v} is not supported");
        }
    }
    if j.bool("use_bidirectional_attention")?.unwrap_or(false) {
        bail!(Unsupported, "{file}: use_bidirectional_attention = true is not supported");
    }
    let query_scale_base = Some(j.f32("query_pre_attn_scalar")?.unwrap_or(256.0));
    let Some(window) = j.usize("sliding_window")? else {
        return Ok(AttentionConfig { query_scale_base, sliding: None });
    };
    let pattern = j.usize("sliding_window_pattern")?.unwrap_or(6);
    let global: Vec<bool> = match j.get("layer_types") {
        None => (0..layers).map(|l| pattern > 0 && (l + 1) % pattern == 0).collect(),
        Some(Value::Array(types)) if types.len() == layers => types
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok(true),
                Some("sliding_attention") => Ok(false),
                _ => Err(j.bad("layer_types", t, "\"full_attention\" or \"sliding_attention\"")),
            })
            .collect::<Result<_>>()?,
        Some(v) => return Err(j.bad("layer_types", v, &format!("a list of {layers} layer types"))),
    };
    if global.iter().all(|&g| g) {
        return Ok(AttentionConfig { query_scale_base, sliding: None });
    }
    // Global layers at every `global_every`th layer, as Gemma 3 places them; with none, past the last.
    let global_every = global.iter().position(|&g| g).map_or(layers + 1, |first| first + 1);
    if global.iter().enumerate().any(|(l, &g)| g != (l + 1).is_multiple_of(global_every)) {
        bail!(Unsupported, "{file}: layer_types are not a global layer every {global_every} layers");
    }
    Ok(AttentionConfig {
        query_scale_base,
        sliding: Some(SlidingWindow { window, global_every, rope_theta: local_theta }),
    })
}

/// rope_scaling (or transformers 5's rope_parameters): default, linear or llama3.
fn parse_rope_scaling(s: &Keys) -> Result<RopeScaling> {
    let kind = match s.str("rope_type")? {
        Some(kind) => Some(kind),
        None => s.str("type")?,
    };
    Ok(match kind {
        None | Some("default") => RopeScaling::None,
        Some("linear") => RopeScaling::Linear { factor: s.req_f32("factor")? },
        Some("llama3") => RopeScaling::Llama3 {
            factor: s.req_f32("factor")?,
            low_freq_factor: s.req_f32("low_freq_factor")?,
            high_freq_factor: s.req_f32("high_freq_factor")?,
            original_max_position: match u32::try_from(s.req_usize("original_max_position_embeddings")?) {
                Ok(n) => n,
                Err(_) => bail!(BadModel, "{}: key {}original_max_position_embeddings is too large", s.file, s.prefix),
            },
        },
        Some(other) => bail!(
            Unsupported,
            "{}: {}rope_type \"{other}\" is not supported (default, linear, llama3)",
            s.file,
            s.prefix
        ),
    })
}
