//! The strict parse of a GGUF file's header, metadata and tensor infos, and the metadata values'
//! encoding for the writers.

use std::collections::HashSet;

use super::{DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
use crate::status::Result;
use crate::tensor::{DType, supported_names};
use crate::{bail, err};

/// Names of the ggml types a file may hold, for messages about the ones this crate does not read.
fn ggml_type_name(ggml_type: u32) -> Option<&'static str> {
    const NAMES: [&str; 42] = [
        "F32", "F16", "Q4_0", "Q4_1", "", "", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
        "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32",
        "I64", "F64", "IQ1_M", "BF16", "", "", "", "TQ1_0", "TQ2_0", "", "", "", "MXFP4", "NVFP4", "Q1_0",
    ];
    NAMES.get(ggml_type as usize).copied().filter(|n| !n.is_empty())
}

/// One metadata value. Arrays hold one scalar type (nested arrays are refused, as llama.cpp does).
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    U64(u64),
    I64(i64),
    F64(f64),
    ArrayU8(Vec<u8>),
    ArrayI8(Vec<i8>),
    ArrayU16(Vec<u16>),
    ArrayI16(Vec<i16>),
    ArrayU32(Vec<u32>),
    ArrayI32(Vec<i32>),
    ArrayF32(Vec<f32>),
    ArrayBool(Vec<bool>),
    ArrayString(Vec<String>),
    ArrayU64(Vec<u64>),
    ArrayI64(Vec<i64>),
    ArrayF64(Vec<f64>),
}

/// GGUF value type ids.
const T_U8: u32 = 0;
const T_I8: u32 = 1;
const T_U16: u32 = 2;
const T_I16: u32 = 3;
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const T_I64: u32 = 11;
const T_F64: u32 = 12;

impl GgufValue {
    pub fn type_name(&self) -> &'static str {
        use GgufValue::*;
        match self {
            U8(_) => "u8",
            I8(_) => "i8",
            U16(_) => "u16",
            I16(_) => "i16",
            U32(_) => "u32",
            I32(_) => "i32",
            F32(_) => "f32",
            Bool(_) => "bool",
            String(_) => "string",
            U64(_) => "u64",
            I64(_) => "i64",
            F64(_) => "f64",
            ArrayU8(_) => "array of u8",
            ArrayI8(_) => "array of i8",
            ArrayU16(_) => "array of u16",
            ArrayI16(_) => "array of i16",
            ArrayU32(_) => "array of u32",
            ArrayI32(_) => "array of i32",
            ArrayF32(_) => "array of f32",
            ArrayBool(_) => "array of bool",
            ArrayString(_) => "array of string",
            ArrayU64(_) => "array of u64",
            ArrayI64(_) => "array of i64",
            ArrayF64(_) => "array of f64",
        }
    }

    /// A non-negative integer scalar of any width.
    pub fn as_u64(&self) -> Option<u64> {
        use GgufValue::*;
        match *self {
            U8(v) => Some(v as u64),
            U16(v) => Some(v as u64),
            U32(v) => Some(v as u64),
            U64(v) => Some(v),
            I8(v) => u64::try_from(v).ok(),
            I16(v) => u64::try_from(v).ok(),
            I32(v) => u64::try_from(v).ok(),
            I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// A number: float scalars, and integers where a file wrote one.
    pub fn as_f64(&self) -> Option<f64> {
        use GgufValue::*;
        match *self {
            F32(v) => Some(v as f64),
            F64(v) => Some(v),
            I8(v) => Some(v as f64),
            I16(v) => Some(v as f64),
            I32(v) => Some(v as f64),
            I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// The value as a message shows it: scalars as themselves, arrays by their length.
    pub fn brief(&self) -> String {
        use GgufValue::*;
        match self {
            U8(v) => v.to_string(),
            I8(v) => v.to_string(),
            U16(v) => v.to_string(),
            I16(v) => v.to_string(),
            U32(v) => v.to_string(),
            I32(v) => v.to_string(),
            F32(v) => v.to_string(),
            Bool(v) => v.to_string(),
            String(s) => format!("{s:?}"),
            U64(v) => v.to_string(),
            I64(v) => v.to_string(),
            F64(v) => v.to_string(),
            ArrayU8(a) => format!("[{} items]", a.len()),
            ArrayI8(a) => format!("[{} items]", a.len()),
            ArrayU16(a) => format!("[{} items]", a.len()),
            ArrayI16(a) => format!("[{} items]", a.len()),
            ArrayU32(a) => format!("[{} items]", a.len()),
            ArrayI32(a) => format!("[{} items]", a.len()),
            ArrayF32(a) => format!("[{} items]", a.len()),
            ArrayBool(a) => format!("[{} items]", a.len()),
            ArrayString(a) => format!("[{} items]", a.len()),
            ArrayU64(a) => format!("[{} items]", a.len()),
            ArrayI64(a) => format!("[{} items]", a.len()),
            ArrayF64(a) => format!("[{} items]", a.len()),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// Appends the value's type id and payload, as they appear after a key.
    #[cfg(feature = "fixtures")]
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        use GgufValue::*;
        fn array<T>(out: &mut Vec<u8>, elem: u32, items: &[T], mut put: impl FnMut(&mut Vec<u8>, &T)) {
            out.extend_from_slice(&T_ARRAY.to_le_bytes());
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            items.iter().for_each(|v| put(out, v));
        }
        let scalar = |out: &mut Vec<u8>, t: u32, bytes: &[u8]| {
            out.extend_from_slice(&t.to_le_bytes());
            out.extend_from_slice(bytes);
        };
        match self {
            U8(v) => scalar(out, T_U8, &v.to_le_bytes()),
            I8(v) => scalar(out, T_I8, &v.to_le_bytes()),
            U16(v) => scalar(out, T_U16, &v.to_le_bytes()),
            I16(v) => scalar(out, T_I16, &v.to_le_bytes()),
            U32(v) => scalar(out, T_U32, &v.to_le_bytes()),
            I32(v) => scalar(out, T_I32, &v.to_le_bytes()),
            F32(v) => scalar(out, T_F32, &v.to_le_bytes()),
            Bool(v) => scalar(out, T_BOOL, &[*v as u8]),
            String(s) => {
                out.extend_from_slice(&T_STRING.to_le_bytes());
                put_string(out, s);
            }
            U64(v) => scalar(out, T_U64, &v.to_le_bytes()),
            I64(v) => scalar(out, T_I64, &v.to_le_bytes()),
            F64(v) => scalar(out, T_F64, &v.to_le_bytes()),
            ArrayU8(a) => array(out, T_U8, a, |o, v| o.extend_from_slice(&v.to_le_bytes())),
            ArrayI8(a) => array(out, T_I8, a, |o, v| o.extend_from_slice(&v.to_le_bytes())),
            ArrayU16(a) => array(out, T_U16, a, |o, v| o.extend_from_slice(&v.to_le_bytes())),
            ArrayI16(a) => array(out, T_I16, a, |o, v| o.extend_from_slice(&v.to_le_bytes())),
            ArrayU32(a) => array(out, T_U32, a, |o, v| o.extend_from_slice(&v.to_le_bytes())),
            ArrayI32(a) => array(out, T_I32, a, |o, v| o.extend_from_slice(&v.to_le_bytes())),
            ArrayF32(a) => array(out, T_F32, a, |o, v| o.extend_from_slice(&v.to_le_bytes())),
            ArrayBool(a) => array(out, T_BOOL, a, |o, v| o.push(*v as u8)),
            ArrayString(a) => array(out, T_STRING, a, |o, v| put_string(o, v)),
            ArrayU64(a) => array(out, T_U64, a, |o, v| o.extend_from_slice(&v.to_le_bytes())),
            ArrayI64(a) => array(out, T_I64, a, |o, v| o.extend_from_slice(&v.to_le_bytes())),
            ArrayF64(a) => array(out, T_F64, a, |o, v| o.extend_from_slice(&v.to_le_bytes())),
        }
    }
}

/// A GGUF string: u64 length, then UTF-8 bytes.
#[cfg(feature = "fixtures")]
pub(crate) fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// One tensor info, validated: its bytes lie inside the file, aligned, and overlap no other tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensor {
    /// The name as stored (llama.cpp spelling).
    pub name: String,
    /// ggml order: innermost (columns) first.
    pub dims: Vec<u64>,
    pub dtype: DType,
    /// Relative to the data section, as stored.
    pub offset: u64,
    /// Absolute offset in the file.
    pub start: usize,
    pub bytes: usize,
}

/// A parsed GGUF file: metadata in file order and tensor infos.
#[derive(Clone, Debug)]
pub struct GgufFile {
    pub version: u32,
    pub alignment: u64,
    pub metadata: Vec<(String, GgufValue)>,
    pub tensors: Vec<GgufTensor>,
    /// Absolute offset of the data section.
    pub data_start: usize,
}

/// Reads little-endian values from the file, every read bounded by what is left; `ctx` names the
/// entry being read so an error can say where it went wrong.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    file: &'a str,
    ctx: String,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            bail!(
                BadModel,
                "{}: {}: {n} bytes needed at offset {}, the file ends {} bytes later",
                self.file,
                self.ctx,
                self.pos,
                self.remaining()
            );
        }
        let bytes = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count of items at least `min_item_bytes` each, bounded by the bytes left.
    fn count(&mut self, what: &str, min_item_bytes: usize) -> Result<usize> {
        let n = self.u64()?;
        let fits = self.remaining() / min_item_bytes.max(1);
        if n > fits as u64 {
            bail!(
                BadModel,
                "{}: {}: {what} {n} cannot fit in the {} bytes left in the file",
                self.file,
                self.ctx,
                self.remaining()
            );
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String> {
        let len = self.count("string length", 1)?;
        let bytes = self.take(len)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_string()),
            Err(e) => bail!(BadModel, "{}: {}: string is not UTF-8 ({e})", self.file, self.ctx),
        }
    }

    fn scalars<T, const N: usize>(&mut self, n: usize, from: fn([u8; N]) -> T) -> Result<Vec<T>> {
        let bytes = self.take(n * N)?;
        Ok(bytes.chunks_exact(N).map(|c| from(c.try_into().expect("chunks of N"))).collect())
    }

    fn bool(&mut self) -> Result<bool> {
        match self.array::<1>()?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => bail!(BadModel, "{}: {}: bool byte {b} is neither 0 nor 1", self.file, self.ctx),
        }
    }

    fn value(&mut self, value_type: u32) -> Result<GgufValue> {
        use GgufValue::*;
        Ok(match value_type {
            T_U8 => U8(self.array::<1>()?[0]),
            T_I8 => I8(self.array::<1>()?[0] as i8),
            T_U16 => U16(u16::from_le_bytes(self.array()?)),
            T_I16 => I16(i16::from_le_bytes(self.array()?)),
            T_U32 => U32(self.u32()?),
            T_I32 => I32(i32::from_le_bytes(self.array()?)),
            T_F32 => F32(f32::from_le_bytes(self.array()?)),
            T_BOOL => Bool(self.bool()?),
            T_STRING => String(self.string()?),
            T_U64 => U64(self.u64()?),
            T_I64 => I64(i64::from_le_bytes(self.array()?)),
            T_F64 => F64(f64::from_le_bytes(self.array()?)),
            T_ARRAY => self.array_value()?,
            t => bail!(BadModel, "{}: {}: unknown value type {t}", self.file, self.ctx),
        })
    }

    fn array_value(&mut self) -> Result<GgufValue> {
        use GgufValue::*;
        let elem = self.u32()?;
        let min_bytes = match elem {
            T_U8 | T_I8 | T_BOOL => 1,
            T_U16 | T_I16 => 2,
            T_U32 | T_I32 | T_F32 => 4,
            T_U64 | T_I64 | T_F64 | T_STRING => 8,
            T_ARRAY => bail!(BadModel, "{}: {}: nested arrays are not supported", self.file, self.ctx),
            t => bail!(BadModel, "{}: {}: unknown array element type {t}", self.file, self.ctx),
        };
        let n = self.count("array length", min_bytes)?;
        Ok(match elem {
            T_U8 => ArrayU8(self.scalars(n, |b: [u8; 1]| b[0])?),
            T_I8 => ArrayI8(self.scalars(n, |b: [u8; 1]| b[0] as i8)?),
            T_U16 => ArrayU16(self.scalars(n, u16::from_le_bytes)?),
            T_I16 => ArrayI16(self.scalars(n, i16::from_le_bytes)?),
            T_U32 => ArrayU32(self.scalars(n, u32::from_le_bytes)?),
            T_I32 => ArrayI32(self.scalars(n, i32::from_le_bytes)?),
            T_F32 => ArrayF32(self.scalars(n, f32::from_le_bytes)?),
            T_U64 => ArrayU64(self.scalars(n, u64::from_le_bytes)?),
            T_I64 => ArrayI64(self.scalars(n, i64::from_le_bytes)?),
            T_F64 => ArrayF64(self.scalars(n, f64::from_le_bytes)?),
            T_BOOL => ArrayBool((0..n).map(|_| self.bool()).collect::<Result<_>>()?),
            _ => ArrayString((0..n).map(|_| self.string()).collect::<Result<_>>()?),
        })
    }
}

/// Parses and validates a whole GGUF file; `file` names it in messages.
pub fn parse(buf: &[u8], file: &str) -> Result<GgufFile> {
    let mut c = Cursor { buf, pos: 0, file, ctx: "header".to_string() };
    let magic = c.take(4).map_err(|_| err!(BadModel, "{file}: not a GGUF file ({} bytes long)", buf.len()))?;
    if magic != MAGIC {
        bail!(BadModel, "{file}: not a GGUF file (magic {:02x?}, expected \"GGUF\")", magic);
    }
    let version = c.u32()?;
    if version != 2 && version != 3 {
        bail!(BadModel, "{file}: GGUF version {version} is not supported (2 or 3, little-endian)");
    }
    // The smallest tensor info: name length, one dim, n_dims, type, offset.
    let tensor_count = c.count("tensor count", 8 + 4 + 8 + 4 + 8)?;
    // The smallest key/value: key length, value type, one byte of value.
    let kv_count = c.count("metadata count", 8 + 4 + 1)?;

    let mut metadata = Vec::with_capacity(kv_count.min(4096));
    let mut keys = HashSet::new();
    for i in 0..kv_count {
        c.ctx = format!("metadata entry {i}");
        let key = c.string()?;
        c.ctx = format!("key {key}");
        let value_type = c.u32()?;
        let value = c.value(value_type)?;
        if !keys.insert(key.clone()) {
            bail!(BadModel, "{file}: key {key} appears twice");
        }
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => match v.as_u64() {
            Some(a) if a.is_power_of_two() => a,
            _ => bail!(BadModel, "{file}: key general.alignment = {} is not a power of two", v.brief()),
        },
    };

    let mut infos = Vec::with_capacity(tensor_count.min(1 << 16));
    for i in 0..tensor_count {
        c.ctx = format!("tensor info {i}");
        let name = c.string()?;
        c.ctx = format!("tensor {name}");
        let n_dims = c.u32()? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            bail!(BadModel, "{file}: tensor {name}: {n_dims} dimensions (1 to {MAX_DIMS} allowed)");
        }
        let mut dims = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            dims.push(c.u64()?);
        }
        let ggml_type = c.u32()?;
        let offset = c.u64()?;
        infos.push((name, dims, ggml_type, offset));
    }

    let data_start = (c.pos as u64).checked_next_multiple_of(alignment).filter(|&s| s <= buf.len() as u64);
    let data_start = match data_start {
        Some(s) => s as usize,
        None if infos.is_empty() => buf.len(),
        None => bail!(BadModel, "{file}: the tensor data section would start past the end of the file"),
    };

    let mut names = HashSet::new();
    let mut tensors = Vec::with_capacity(infos.len());
    for (name, dims, ggml_type, offset) in infos {
        let t = tensor_extent(file, &name, &dims, ggml_type, offset, alignment, data_start, buf.len())?;
        if !names.insert(name.clone()) {
            bail!(BadModel, "{file}: tensor {name} appears twice");
        }
        tensors.push(GgufTensor { name, dims, dtype: t.0, offset, start: t.1, bytes: t.2 });
    }

    let mut by_start: Vec<&GgufTensor> = tensors.iter().collect();
    by_start.sort_by_key(|t| (t.start, t.bytes));
    for pair in by_start.windows(2) {
        if pair[0].start + pair[0].bytes > pair[1].start {
            bail!(BadModel, "{file}: tensors {} and {} overlap", pair[0].name, pair[1].name);
        }
    }

    Ok(GgufFile { version, alignment, metadata, tensors, data_start })
}

/// The dtype, absolute start and byte size of one tensor, checked against its type, the alignment
/// and the file's length.
#[allow(clippy::too_many_arguments)]
fn tensor_extent(
    file: &str,
    name: &str,
    dims: &[u64],
    ggml_type: u32,
    offset: u64,
    alignment: u64,
    data_start: usize,
    file_len: usize,
) -> Result<(DType, usize, usize)> {
    let Some(dtype) = DType::from_ggml_type(ggml_type) else {
        match ggml_type_name(ggml_type) {
            Some(t) => bail!(Unsupported, "{file}: tensor {name} has type {t}; supported: {}", supported_names()),
            None => bail!(BadModel, "{file}: tensor {name} has unknown type {ggml_type}"),
        }
    };
    if dims.contains(&0) {
        bail!(BadModel, "{file}: tensor {name} has an empty dimension {dims:?}");
    }
    let cols = usize::try_from(dims[0]).ok();
    let block = dtype.format().block_values;
    if let Some(c) = cols
        && !c.is_multiple_of(block)
    {
        bail!(
            BadModel,
            "{file}: tensor {name}: rows of {c} values are not a whole number of {} blocks ({block} values)",
            dtype.name()
        );
    }
    let rows = dims[1..].iter().try_fold(1usize, |acc, &d| acc.checked_mul(usize::try_from(d).ok()?));
    let row_bytes = cols.and_then(|c| dtype.row_bytes(c));
    let Some(bytes) = rows.zip(row_bytes).and_then(|(r, rb)| r.checked_mul(rb)) else {
        bail!(
            BadModel,
            "{file}: tensor {name}: {dims:?} of {} is not a whole number of rows or overflows",
            dtype.name()
        );
    };
    if !offset.is_multiple_of(alignment) {
        bail!(BadModel, "{file}: tensor {name}: offset {offset} is not a multiple of the alignment {alignment}");
    }
    let start = (data_start as u64).checked_add(offset);
    let end = start.and_then(|s| s.checked_add(bytes as u64));
    match (start, end) {
        (Some(s), Some(e)) if e <= file_len as u64 => Ok((dtype, s as usize, bytes)),
        _ => bail!(
            BadModel,
            "{file}: tensor {name}: {bytes} bytes at data offset {offset} run past the end of the file ({file_len} bytes)"
        ),
    }
}
