//! The GGUF v2/v3 format: header reader (every metadata value type, tensor infos,
//! alignment), header writer, the byte size of each ggml tensor type (block layouts of
//! llama.cpp's `ggml-common.h`), and [`GgufFile`], a memory-mapped file whose tensors are
//! byte slices of the map (weights stay quantized, untouched, in the page cache).

use std::collections::BTreeMap;
use std::io::{BufReader, Read};
use std::path::Path;

use super::ggml::type_info;
use anyhow::{Context, Result, bail};

/// `GGUF` little-endian.
const MAGIC: u32 = 0x4655_4747;

/// Largest string or array the reader accepts: guards against reading garbage lengths.
const MAX_LENGTH: u64 = 1 << 28;
/// The most items (tensors, array items, string bytes) allocated before any is read.
const PREALLOCATE_ITEMS: usize = 4096;
/// Arrays of arrays nest at most this deep (real files nest none).
const MAX_ARRAY_DEPTH: usize = 4;

/// One metadata value.
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
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// The value as an unsigned integer when it is an integer type ≥ 0.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a string slice when it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
}

/// One tensor's header entry.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions, innermost first (GGUF order: `ne[0]` is the row length).
    pub dims: Vec<u64>,
    /// ggml type id (`GGML_TYPE_*`).
    pub type_id: u32,
    /// Offset of the data from the start of the data section, in bytes.
    pub offset_bytes: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Bytes of the data. Errors: an unsupported type id, or a row not a whole number of blocks.
    pub fn n_bytes(&self) -> Result<u64> {
        let (block_elements, block_bytes, type_name) =
            type_info(self.type_id).with_context(|| {
                format!(
                    "tensor `{}` has unsupported ggml type id {}",
                    self.name, self.type_id
                )
            })?;
        let n = self.n_elements();
        if !n.is_multiple_of(block_elements) {
            bail!(
                "tensor `{}` ({type_name}) has {n} elements, not a multiple of its block size {block_elements}",
                self.name
            );
        }
        Ok(n / block_elements * block_bytes)
    }

    /// The type's name (`Q4_1`), or `type <id>` when unknown.
    pub fn type_name(&self) -> String {
        type_info(self.type_id).map_or(format!("type {}", self.type_id), |(_, _, name)| {
            name.to_string()
        })
    }
}

/// A parsed GGUF header.
#[derive(Clone, Debug)]
pub struct Header {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    /// `general.alignment`, default 32.
    pub alignment_bytes: u64,
    /// Where the tensor data section starts: the header's end rounded up to the alignment.
    pub data_offset_bytes: u64,
}

impl Header {
    /// Reads the header of the file at `path`. Errors: not GGUF, an unsupported version, or a
    /// truncated or corrupt header (each naming the file).
    pub fn read_file(path: &Path) -> Result<Header> {
        let file = std::fs::File::open(path)
            .with_context(|| format!("failed to open `{}`", path.display()))?;
        Header::read(&mut BufReader::new(file))
            .with_context(|| format!("failed to read the GGUF header of `{}`", path.display()))
    }

    /// Reads a header from `reader`, positioned at the start of the file.
    pub fn read(reader: &mut impl Read) -> Result<Header> {
        let mut r = Reader {
            inner: reader,
            position: 0,
        };
        let magic = r
            .u32()
            .context("file is empty or shorter than a GGUF magic")?;
        if magic != MAGIC {
            bail!("not a GGUF file (magic {magic:#010x}, expected `GGUF`)");
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            bail!("GGUF version {version} is not supported (2 and 3 are)");
        }
        let n_tensors = r.u64()?;
        let n_metadata = r.u64()?;
        if n_tensors > MAX_LENGTH || n_metadata > MAX_LENGTH {
            bail!("corrupt GGUF header: {n_tensors} tensors, {n_metadata} metadata entries");
        }
        let mut metadata = BTreeMap::new();
        for _ in 0..n_metadata {
            let key = r.string()?;
            let type_id = r.u32()?;
            let value = r
                .value(type_id, 0)
                .with_context(|| format!("bad metadata value for `{key}`"))?;
            metadata.insert(key, value);
        }
        // Counts come from the file: grow with the data read, never allocate up front by them
        // (a corrupt count would ask for gigabytes).
        let mut tensors = Vec::with_capacity((n_tensors as usize).min(PREALLOCATE_ITEMS));
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()?;
            if n_dims > 8 {
                bail!("tensor `{name}` claims {n_dims} dimensions");
            }
            let dims = (0..n_dims).map(|_| r.u64()).collect::<Result<Vec<_>>>()?;
            let type_id = r.u32()?;
            let offset_bytes = r.u64()?;
            tensors.push(TensorInfo {
                name,
                dims,
                type_id,
                offset_bytes,
            });
        }
        let alignment_bytes = metadata
            .get("general.alignment")
            .and_then(Value::as_u64)
            .unwrap_or(32);
        if alignment_bytes == 0 {
            bail!("GGUF `general.alignment` is 0");
        }
        let data_offset_bytes = r.position.div_ceil(alignment_bytes) * alignment_bytes;
        Ok(Header {
            version,
            metadata,
            tensors,
            alignment_bytes,
            data_offset_bytes,
        })
    }

    /// A metadata integer. Errors name the key.
    pub fn u64(&self, key: &str) -> Result<u64> {
        self.metadata
            .get(key)
            .and_then(Value::as_u64)
            .with_context(|| format!("GGUF metadata key `{key}` is missing or not an integer"))
    }

    /// A metadata string. Errors name the key.
    pub fn str(&self, key: &str) -> Result<&str> {
        self.metadata
            .get(key)
            .and_then(Value::as_str)
            .with_context(|| format!("GGUF metadata key `{key}` is missing or not a string"))
    }
}

/// A GGUF file mapped into memory: its header and the bytes of each tensor.
pub struct GgufFile {
    pub header: Header,
    map: memmap2::Mmap,
}

impl GgufFile {
    /// Maps `path` and reads its header. Errors: not GGUF, a truncated header, or tensor
    /// data that runs past the end of the file (a truncated download), naming the tensor.
    pub fn open(path: &std::path::Path) -> Result<GgufFile> {
        let header = Header::read_file(path)?;
        let file = std::fs::File::open(path)
            .with_context(|| format!("failed to open `{}`", path.display()))?;
        // SAFETY: the map is read-only; a concurrent writer could change weights under us,
        // which the format cannot guard against (llama.cpp maps the same way).
        let map = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("failed to map `{}`", path.display()))?;
        for tensor in &header.tensors {
            let end = header.data_offset_bytes + tensor.offset_bytes + tensor.n_bytes()?;
            if end > map.len() as u64 {
                bail!(
                    "`{}` is truncated: tensor `{}` ends at byte {end} but the file has {} bytes",
                    path.display(),
                    tensor.name,
                    map.len()
                );
            }
        }
        Ok(GgufFile { header, map })
    }

    /// The tensor info of `name` and the byte range of its data in [`GgufFile::data`].
    /// Errors: no such tensor.
    pub fn tensor_range(&self, name: &str) -> Result<(&TensorInfo, std::ops::Range<usize>)> {
        let info = self
            .header
            .tensors
            .iter()
            .find(|t| t.name == name)
            .with_context(|| format!("the GGUF file has no tensor `{name}`"))?;
        let start = (self.header.data_offset_bytes + info.offset_bytes) as usize;
        Ok((info, start..start + info.n_bytes()? as usize))
    }

    /// The tensor info and data of `name`. Errors: no such tensor.
    pub fn tensor(&self, name: &str) -> Result<(&TensorInfo, &[u8])> {
        let (info, range) = self.tensor_range(name)?;
        Ok((info, &self.map[range]))
    }

    /// The whole mapped file.
    pub fn data(&self) -> &[u8] {
        &self.map
    }

    /// Whether the file has a tensor `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.header.tensors.iter().any(|t| t.name == name)
    }
}

struct Reader<'a, R: Read> {
    inner: &'a mut R,
    /// Bytes consumed so far: where the header ends.
    position: u64,
}

impl<R: Read> Reader<'_, R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut buffer = [0u8; N];
        self.inner
            .read_exact(&mut buffer)
            .context("file is truncated")?;
        self.position += N as u64;
        Ok(buffer)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }
    fn string(&mut self) -> Result<String> {
        let length = self.u64()?;
        if length > MAX_LENGTH {
            bail!("corrupt GGUF header: a string of {length} bytes");
        }
        // Read as the data comes (a hostile length cannot allocate more than the file holds).
        let mut buffer = Vec::with_capacity((length as usize).min(PREALLOCATE_ITEMS));
        (&mut self.inner)
            .take(length)
            .read_to_end(&mut buffer)
            .context("file is truncated")?;
        if buffer.len() as u64 != length {
            bail!("file is truncated");
        }
        self.position += length;
        String::from_utf8(buffer).context("a GGUF string is not UTF-8")
    }
    /// A metadata value of `type_id`, inside `depth` enclosing arrays.
    fn value(&mut self, type_id: u32, depth: usize) -> Result<Value> {
        Ok(match type_id {
            0 => Value::U8(u8::from_le_bytes(self.bytes()?)),
            1 => Value::I8(i8::from_le_bytes(self.bytes()?)),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => Value::Bool(u8::from_le_bytes(self.bytes()?) != 0),
            8 => Value::String(self.string()?),
            9 => {
                let item_type = self.u32()?;
                let length = self.u64()?;
                if length > MAX_LENGTH {
                    bail!("corrupt GGUF header: an array of {length} items");
                }
                if item_type == 9 && depth >= MAX_ARRAY_DEPTH {
                    bail!("corrupt GGUF header: arrays nested deeper than {MAX_ARRAY_DEPTH}");
                }
                let mut items = Vec::with_capacity((length as usize).min(PREALLOCATE_ITEMS));
                for _ in 0..length {
                    items.push(self.value(item_type, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            other => bail!("unknown GGUF metadata value type {other}"),
        })
    }
}

/// Encodes a GGUF v3 header (metadata then tensor infos; no alignment padding or tensor
/// data), the inverse of [`Header::read`]. Used to write synthetic models and test files.
pub fn encode_header(metadata: &[(&str, Value)], tensors: &[TensorInfo]) -> Vec<u8> {
    fn string(out: &mut Vec<u8>, text: &str) {
        out.extend((text.len() as u64).to_le_bytes());
        out.extend(text.as_bytes());
    }
    fn type_id(value: &Value) -> u32 {
        match value {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }
    fn encode_value(out: &mut Vec<u8>, value: &Value) {
        match value {
            Value::U8(v) => out.extend(v.to_le_bytes()),
            Value::I8(v) => out.extend(v.to_le_bytes()),
            Value::U16(v) => out.extend(v.to_le_bytes()),
            Value::I16(v) => out.extend(v.to_le_bytes()),
            Value::U32(v) => out.extend(v.to_le_bytes()),
            Value::I32(v) => out.extend(v.to_le_bytes()),
            Value::F32(v) => out.extend(v.to_le_bytes()),
            Value::Bool(v) => out.push(u8::from(*v)),
            Value::String(v) => string(out, v),
            Value::Array(items) => {
                // An empty array is written as an array of u8.
                out.extend(items.first().map_or(0, type_id).to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for item in items {
                    encode_value(out, item);
                }
            }
            Value::U64(v) => out.extend(v.to_le_bytes()),
            Value::I64(v) => out.extend(v.to_le_bytes()),
            Value::F64(v) => out.extend(v.to_le_bytes()),
        }
    }
    let mut out = Vec::new();
    out.extend(MAGIC.to_le_bytes());
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((metadata.len() as u64).to_le_bytes());
    for (key, item) in metadata {
        string(&mut out, key);
        out.extend(type_id(item).to_le_bytes());
        encode_value(&mut out, item);
    }
    for tensor in tensors {
        string(&mut out, &tensor.name);
        out.extend((tensor.dims.len() as u32).to_le_bytes());
        for dim in &tensor.dims {
            out.extend(dim.to_le_bytes());
        }
        out.extend(tensor.type_id.to_le_bytes());
        out.extend(tensor.offset_bytes.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, dims: &[u64], type_id: u32) -> TensorInfo {
        TensorInfo {
            name: name.to_string(),
            dims: dims.to_vec(),
            type_id,
            offset_bytes: 0,
        }
    }

    #[test]
    fn reads_metadata_and_tensor_sizes() {
        let metadata = [
            ("general.architecture", Value::String("llama".into())),
            ("llama.block_count", Value::U32(2)),
            ("general.alignment", Value::U32(64)),
            (
                "tokenizer.ggml.scores",
                Value::Array(vec![Value::F32(-1.5), Value::F32(0.0)]),
            ),
        ];
        let tensors = [
            tensor("token_embd.weight", &[64, 100], 3),
            tensor("output_norm.weight", &[64], 0),
        ];
        let bytes = encode_header(&metadata, &tensors);
        let header = Header::read(&mut bytes.as_slice()).expect("valid header");
        assert_eq!(header.version, 3);
        assert_eq!(header.u64("llama.block_count").expect("present"), 2);
        assert_eq!(header.alignment_bytes, 64);
        // Q4_1: 6400 elements = 200 blocks of 20 bytes.
        assert_eq!(header.tensors[0].n_bytes().expect("known type"), 4000);
        assert_eq!(header.tensors[1].n_bytes().expect("known type"), 256);
        assert_eq!(header.tensors[0].type_name(), "Q4_1");
        // Every value reads back as written.
        for (key, value) in metadata {
            assert_eq!(header.metadata[key], value, "{key}");
        }
    }

    #[test]
    fn data_section_starts_after_the_aligned_header() {
        let metadata = [
            ("general.architecture", Value::String("llama".into())),
            (
                "tokenizer.ggml.tokens",
                Value::Array(vec![Value::String("a".into()), Value::String("bcd".into())]),
            ),
        ];
        let bytes = encode_header(&metadata, &[tensor("t", &[32], 0)]);
        let header = Header::read(&mut bytes.as_slice()).expect("valid header");
        assert_eq!(
            header.data_offset_bytes,
            (bytes.len() as u64).div_ceil(32) * 32
        );
    }

    #[test]
    fn rejects_non_gguf_and_truncated_files() {
        let error = Header::read(&mut &b"PK\x03\x04 not gguf at all"[..]).expect_err("not GGUF");
        assert!(error.to_string().contains("not a GGUF file"), "{error}");
        let bytes = encode_header(
            &[("general.architecture", Value::String("llama".into()))],
            &[],
        );
        let error = Header::read(&mut &bytes[..bytes.len() - 3]).expect_err("truncated");
        assert!(format!("{error:#}").contains("truncated"), "{error:#}");
    }

    #[test]
    fn unsupported_tensor_types_are_named() {
        let info = TensorInfo {
            name: "blk.0.ffn_up.weight".into(),
            dims: vec![256],
            type_id: 99,
            offset_bytes: 0,
        };
        let error = info.n_bytes().expect_err("unknown type");
        assert!(error.to_string().contains("blk.0.ffn_up.weight"), "{error}");
    }

    /// Inputs `cargo fuzz` found (fuzz/fuzz_targets/gguf_header.rs), kept as regressions: a
    /// count or length field from the file must not size an allocation before the data is
    /// there, and arrays must not nest without end.
    #[test]
    fn hostile_counts_and_nesting_are_errors_not_allocations() {
        // 28 bytes claiming 0x0600_0047 tensors: once a 6 GiB `Vec::with_capacity`.
        let oom = b"GGUF\x03\x00\x00\x00G\x00\x00\x06\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00";
        assert!(Header::read(&mut std::io::Cursor::new(&oom[..])).is_err());
        // One metadata string claiming 2^28 - 1 bytes, with 3 there.
        let mut long_string = b"GGUF\x03\x00\x00\x00".to_vec();
        long_string.extend(0u64.to_le_bytes());
        long_string.extend(1u64.to_le_bytes());
        long_string.extend(((1u64 << 28) - 1).to_le_bytes());
        long_string.extend(b"key");
        assert!(Header::read(&mut std::io::Cursor::new(long_string)).is_err());
        // An array of arrays of arrays …, 1000 deep.
        let mut nested = b"GGUF\x03\x00\x00\x00".to_vec();
        nested.extend(0u64.to_le_bytes());
        nested.extend(1u64.to_le_bytes());
        nested.extend(1u64.to_le_bytes());
        nested.push(b'k');
        nested.extend(9u32.to_le_bytes());
        for _ in 0..1000 {
            nested.extend(9u32.to_le_bytes());
            nested.extend(1u64.to_le_bytes());
        }
        let error = Header::read(&mut std::io::Cursor::new(nested)).expect_err("too deep");
        assert!(format!("{error:#}").contains("nested deeper"), "{error:#}");
    }
}
