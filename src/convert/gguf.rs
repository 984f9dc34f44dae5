//! A GGUF file read: its metadata (key → value) and its tensor table, over a memory map.
//!
//! The layout (llama.cpp's `docs/gguf.md`, versions 2 and 3; version 1 counted in 32 bits
//! and is not read): little-endian `"GGUF"`, `version: u32`, `tensor_count: u64`,
//! `kv_count: u64`; `kv_count` pairs of (`key: string`, `type: u32`, value); `tensor_count`
//! entries of (`name: string`, `n_dims: u32`, `ne: [u64; n_dims]` fastest dimension first,
//! `type: u32`, `offset: u64`); padding to `general.alignment` (32 by default); the tensor
//! data, each tensor at its `offset` from there. A string is `len: u64` + UTF-8 bytes.
//!
//! Every number in the header is checked before it is used: counts and lengths are bounded
//! by the bytes left in the file (so no allocation is larger than the file), shapes by
//! ggml's four dimensions and `i64` element counts, tensors must lie whole inside the file,
//! aligned, and not overlap. A file that breaks any of this gives one [`Error::file`] naming
//! the file (and the key or tensor), never a panic.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::dequant::GgmlType;
use crate::{Error, Result};

/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: usize = 4;
/// Arrays of arrays nest at most this deep (llama.cpp writes none).
const MAX_DEPTH: usize = 3;
/// `general.alignment` when the file does not set it.
const DEFAULT_ALIGNMENT: u64 = 32;

/// One metadata value (GGUF value types 0..=12).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    /// An array of strings or of arrays.
    Array(Vec<Value>),
    /// An array of numbers or bools (value type `ty`), kept as the file's little-endian
    /// bytes: one byte of memory per byte of file, whatever its element count says;
    /// decoded when asked for ([`Value::numbers`]).
    Numbers { ty: u32, raw: Vec<u8> },
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// An integer value of any width, as `i64` (a `u64` above `i64::MAX` is not one).
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::U8(v) => Some(v as i64),
            Value::I8(v) => Some(v as i64),
            Value::U16(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::U32(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::U64(v) => i64::try_from(v).ok(),
            Value::I64(v) => Some(v),
            _ => None,
        }
    }
    /// A float or integer value as `f64` (an `f32` widened exactly, as Python's `float()`).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
    /// The elements of a number array, each as `f64` (integers wider than 53 bits lose
    /// their low bits; ids and scores do not have them).
    pub fn numbers(&self) -> Option<Vec<f64>> {
        let Value::Numbers { ty, raw } = self else { return None };
        let w = width(*ty)?;
        raw.chunks_exact(w)
            .map(|c| {
                let mut b = [0u8; 8];
                b[..w].copy_from_slice(c);
                Some(match ty {
                    0 | 7 => c[0] as f64,
                    1 => c[0] as i8 as f64,
                    2 => u16::from_le_bytes([b[0], b[1]]) as f64,
                    3 => i16::from_le_bytes([b[0], b[1]]) as f64,
                    4 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
                    5 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
                    6 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
                    10 => u64::from_le_bytes(b) as f64,
                    11 => i64::from_le_bytes(b) as f64,
                    12 => f64::from_le_bytes(b),
                    _ => return None,
                })
            })
            .collect()
    }
    /// How many elements an array has.
    pub fn count(&self) -> Option<usize> {
        match self {
            Value::Array(a) => Some(a.len()),
            Value::Numbers { ty, raw } => Some(raw.len() / width(*ty)?),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Bytes per element of a number or bool value type.
fn width(ty: u32) -> Option<usize> {
    match ty {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

/// One entry of the tensor table, checked: its data lies whole inside the file.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `ne[0]` (a row's length) first. The torch shape is this reversed.
    pub ne: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub start: usize,
    /// Bytes of data: `elements / ty.elements() * ty.block_bytes()`.
    pub bytes: usize,
}

impl TensorInfo {
    /// The shape as torch writes it (slowest dimension first).
    pub fn shape(&self) -> Vec<usize> {
        self.ne.iter().rev().map(|&d| d as usize).collect()
    }
    pub fn elements(&self) -> usize {
        self.ne.iter().product::<u64>() as usize
    }
}

/// An open GGUF file: the checked header over a read-only map of the whole file.
pub struct Gguf {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    map: memmap2::Mmap,
}

impl Gguf {
    /// Maps `path` and reads and checks its header (no tensor data is touched).
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let meta = file.metadata().map_err(|e| Error::io(path, e))?;
        if !meta.is_file() {
            return Err(Error::file(path, "not a regular file"));
        }
        // SAFETY: the map is read-only and private to this process; a file truncated by
        // someone else while it is mapped is outside what any reader can defend against.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let (version, metadata, tensors) = parse(&map, path)?;
        Ok(Self { path: path.to_path_buf(), version, metadata, tensors, map })
    }

    /// A tensor's bytes (checked against the file's length when the header was read).
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        &self.map[t.start..t.start + t.bytes]
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// An error about this file.
    pub fn error(&self, msg: impl Into<String>) -> Error {
        Error::file(&self.path, msg)
    }
}

/// A cursor over the header that turns running off the end into an error naming what was
/// being read.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, msg: impl std::fmt::Display) -> Error {
        Error::file(self.path, format!("{msg} (at byte {})", self.pos))
    }
    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(self.err(format!("truncated: {} needs {n} bytes, {} are left", what(), self.left())));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.u64(what)?;
        if len > self.left() as u64 {
            return Err(self.err(format!("truncated or corrupt: {}: string length {len} runs past the end of the file ({} bytes left)", what(), self.left())));
        }
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.err(format!("{}: string is not UTF-8", what())))
    }

    fn value(&mut self, ty: u32, depth: usize, what: &dyn Fn() -> String) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>(what)?[0]),
            1 => Value::I8(self.array::<1>(what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.err(format!("{}: bool byte {b} is neither 0 nor 1", what()))),
            },
            8 => Value::Str(self.string(what)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(self.err(format!("{}: arrays nested more than {MAX_DEPTH} deep", what())));
                }
                let elem = self.u32(what)?;
                let count = self.u64(what)?;
                // Every element takes at least one byte, so the count is bounded by the file.
                let min = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    t => return Err(self.err(format!("{}: array of unknown value type {t}", what()))),
                };
                if count > (self.left() / min) as u64 {
                    return Err(self.err(format!(
                        "truncated or corrupt: {}: array of {count} elements does not fit in the {} bytes left in the file",
                        what(),
                        self.left()
                    )));
                }
                if let Some(w) = width(elem) {
                    let raw = self.take(count as usize * w, what)?.to_vec();
                    if elem == 7 && raw.iter().any(|&b| b > 1) {
                        return Err(self.err(format!("{}: a bool array holds a byte that is neither 0 nor 1", what())));
                    }
                    return Ok(Value::Numbers { ty: elem, raw });
                }
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem, depth + 1, what)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            t => return Err(self.err(format!("{}: unknown value type {t}", what()))),
        })
    }
}

type Parsed = (u32, BTreeMap<String, Value>, Vec<TensorInfo>);

fn parse(buf: &[u8], path: &Path) -> Result<Parsed> {
    let mut c = Cursor { buf, pos: 0, path };
    let magic = c.take(4, &|| "the magic".into()).map_err(|_| Error::file(path, "not a GGUF file: shorter than its magic"))?;
    if magic != b"GGUF" {
        return Err(Error::file(path, format!("not a GGUF file: the magic is {magic:02x?}, not \"GGUF\"")));
    }
    let version = c.u32(&|| "the version".into())?;
    if !(2..=3).contains(&version) {
        return Err(Error::file(path, format!("GGUF version {version} is not supported (versions 2 and 3 are)")));
    }
    let tensor_count = c.u64(&|| "the tensor count".into())?;
    let kv_count = c.u64(&|| "the metadata count".into())?;
    // A pair takes at least 13 bytes (key length, type, one byte of value), a tensor entry
    // at least 24 (name length, n_dims, type, offset).
    if kv_count > (c.left() / 13) as u64 {
        return Err(c.err(format!("truncated or corrupt: {kv_count} metadata entries cannot fit in a file of {} bytes", buf.len())));
    }
    if tensor_count > (c.left() / 24) as u64 {
        return Err(c.err(format!("truncated or corrupt: {tensor_count} tensors cannot fit in a file of {} bytes", buf.len())));
    }

    let mut metadata = BTreeMap::new();
    for i in 0..kv_count {
        let key = c.string(&|| format!("the key of metadata entry {i}"))?;
        let what = || format!("metadata {key:?}");
        let ty = c.u32(&what)?;
        let value = c.value(ty, 0, &what)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(c.err(format!("metadata key {key:?} appears twice")));
        }
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) if *a != 0 && a.is_power_of_two() => *a as u64,
        Some(v) => return Err(Error::file(path, format!("general.alignment {v:?} is not a power of two (u32)"))),
    };

    struct Raw {
        name: String,
        ne: Vec<u64>,
        ty: GgmlType,
        offset: u64,
        bytes: u64,
    }
    let mut raw = Vec::with_capacity(tensor_count as usize);
    let mut names = std::collections::HashSet::new();
    for i in 0..tensor_count {
        let name = c.string(&|| format!("the name of tensor {i}"))?;
        let what = || format!("tensor {name:?}");
        let bad = |msg: String| Error::file(path, format!("tensor {name:?}: {msg}"));
        if !names.insert(name.clone()) {
            return Err(bad("appears twice in the tensor table".into()));
        }
        let n_dims = c.u32(&what)? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(bad(format!("{n_dims} dimensions (ggml has 1 to {MAX_DIMS})")));
        }
        let mut ne = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            ne.push(c.u64(&what)?);
        }
        let ty_id = c.u32(&what)?;
        let offset = c.u64(&what)?;
        let ty = GgmlType::from_id(ty_id).map_err(&bad)?;
        let elements = ne
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d).filter(|&n| n <= i64::MAX as u64))
            .ok_or_else(|| bad(format!("shape {ne:?} has more elements than an i64 counts")))?;
        if ne[0] % ty.elements() as u64 != 0 {
            return Err(bad(format!("rows of {} values are not whole {} blocks of {}", ne[0], ty.name(), ty.elements())));
        }
        let bytes = (elements / ty.elements() as u64)
            .checked_mul(ty.block_bytes() as u64)
            .ok_or_else(|| bad(format!("shape {ne:?} is too large")))?;
        if offset % alignment != 0 {
            return Err(bad(format!("data offset {offset} is not a multiple of the alignment {alignment}")));
        }
        raw.push(Raw { name, ne, ty, offset, bytes });
    }

    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let file_len = buf.len() as u64;
    let mut tensors = Vec::with_capacity(raw.len());
    for r in raw {
        let start = data_start.checked_add(r.offset);
        let end = start.and_then(|s| s.checked_add(r.bytes));
        match (start, end) {
            (Some(start), Some(end)) if end <= file_len => tensors.push(TensorInfo {
                name: r.name,
                ne: r.ne,
                ty: r.ty,
                start: start as usize,
                bytes: r.bytes as usize,
            }),
            _ => {
                return Err(Error::file(
                    path,
                    format!(
                        "tensor {:?}: its {} bytes at data offset {} lie past the end of the file ({file_len} bytes, data from byte {data_start})",
                        r.name, r.bytes, r.offset
                    ),
                ))
            }
        }
    }
    // Two tensors sharing bytes is a header that lies about its offsets.
    let mut order: Vec<&TensorInfo> = tensors.iter().filter(|t| t.bytes > 0).collect();
    order.sort_by_key(|t| t.start);
    for w in order.windows(2) {
        if w[0].start + w[0].bytes > w[1].start {
            return Err(Error::file(path, format!("tensors {:?} and {:?} overlap in the file", w[0].name, w[1].name)));
        }
    }
    Ok((version, metadata, tensors))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF header with `kv` (key, type, value bytes) and one F32 tensor `t` of `n` values.
    fn file(kv: &[(&str, u32, Vec<u8>)], n: u64) -> Vec<u8> {
        let s = |b: &mut Vec<u8>, t: &str| {
            b.extend((t.len() as u64).to_le_bytes());
            b.extend(t.as_bytes());
        };
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.extend((kv.len() as u64).to_le_bytes());
        for (k, ty, v) in kv {
            s(&mut b, k);
            b.extend(ty.to_le_bytes());
            b.extend(v);
        }
        s(&mut b, "t");
        b.extend(1u32.to_le_bytes());
        b.extend(n.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
        b.extend(std::iter::repeat_n(0u8, 4 * n as usize));
        b
    }

    fn parse_err(bytes: &[u8]) -> String {
        parse(bytes, Path::new("x.gguf")).err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn a_small_file_parses() {
        let arr: Vec<u8> = [5u32.to_le_bytes().to_vec(), 3u64.to_le_bytes().to_vec(), [1i32, -2, 3].iter().flat_map(|v| v.to_le_bytes()).collect()].concat();
        let (v, meta, tensors) = parse(&file(&[("a", 7, vec![1]), ("ids", 9, arr)], 8), Path::new("x.gguf")).unwrap();
        assert_eq!(v, 3);
        assert_eq!(meta["a"], Value::Bool(true));
        assert_eq!(meta["ids"].numbers(), Some(vec![1.0, -2.0, 3.0]));
        assert_eq!(meta["ids"].count(), Some(3));
        assert_eq!((tensors[0].bytes, tensors[0].shape()), (32, vec![8]));
    }

    #[test]
    fn lying_metadata_is_refused() {
        assert!(parse_err(&file(&[("a", 7, vec![2])], 8)).contains("neither 0 nor 1"));
        assert!(parse_err(&file(&[("a", 4, vec![0; 4]), ("a", 4, vec![0; 4])], 8)).contains("appears twice"));
        assert!(parse_err(&file(&[("a", 13, vec![])], 8)).contains("unknown value type 13"));
        assert!(parse_err(&file(&[("general.alignment", 4, 24u32.to_le_bytes().to_vec())], 8)).contains("power of two"));
        // Arrays of arrays of arrays of arrays.
        let mut nested = Vec::new();
        for _ in 0..4 {
            nested.extend(9u32.to_le_bytes());
            nested.extend(1u64.to_le_bytes());
        }
        nested.extend(4u32.to_le_bytes());
        nested.extend(0u64.to_le_bytes());
        assert!(parse_err(&file(&[("a", 9, nested)], 8)).contains("nested"));
        let mut bad_utf8 = 2u64.to_le_bytes().to_vec();
        bad_utf8.extend([0xff, 0xfe]);
        assert!(parse_err(&file(&[("a", 8, bad_utf8)], 8)).contains("not UTF-8"));
    }
}
