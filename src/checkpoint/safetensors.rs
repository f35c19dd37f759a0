//! HF checkpoints: a folder with config.json and one model.safetensors, or shards listed by
//! model.safetensors.index.json. Headers are parsed and validated by the `safetensors` crate; this file
//! names the tensor at fault when the crate refuses a header, and `config.rs` reads config.json.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

use safetensors::tensor::{SafeTensorError, SafeTensors};
use serde_json::{Map, Value};

use super::{Checkpoint, Format, MappedFile, TensorInfo, TokenizerSource};
use crate::model::{Arch, ModelConfig, names};
use crate::status::{Error, Result};
use crate::tensor::DType;
use crate::tokenizer::special::SpecialTokens;
use crate::{bail, err};

mod config;
pub use config::parse_config;

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
        for stored in metadata.offset_keys() {
            let info = metadata.info(&stored).expect("offset_keys come from the metadata");
            let name = mixtral_name(&stored, false).unwrap_or(stored);
            let Some(dtype) = DType::from_safetensors(info.dtype) else {
                unsupported.insert(name, info.dtype.to_string());
                continue;
            };
            if let Some(first) = tensors.get(&name) {
                let other = shards[first.file].display();
                bail!(BadModel, "{file}: tensor {name} is also in {other} (or under another spelling)");
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
        for (stored, shard) in map {
            let name = mixtral_name(&stored, false).unwrap_or(stored);
            let held = tensors.get(&name).map(|t| &shards[t.file]);
            if held != Some(&dir.join(&shard)) && !unsupported.contains_key(&name) {
                bail!(BadModel, "{location}: tensor {name} is listed in {shard}, which does not hold it");
            }
        }
    }

    config.tied |= !tensors.contains_key(names::LM_HEAD);
    let mixtral = config.arch == Arch::Mixtral;
    let spell = |name: &str| mixtral.then(|| mixtral_name(name, true)).flatten().unwrap_or_else(|| name.to_string());
    super::check_tensors(&config, &tensors, &files, &location, &unsupported, &spell)?;
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

/// A layer tensor's name in Mixtral's spelling (`to_mixtral`) or the canonical one: the reader keeps
/// every tensor under its canonical name, whichever a folder uses. None when the two spell it alike.
pub fn mixtral_name(name: &str, to_mixtral: bool) -> Option<String> {
    let (layer, part) = name.strip_prefix("model.layers.")?.split_once('.')?;
    let i = layer.parse::<usize>().ok().filter(|i| i.to_string() == layer)?;
    names::mixtral_swap(part, to_mixtral).map(|p| names::layer(i, &p))
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
