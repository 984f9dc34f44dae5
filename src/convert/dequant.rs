//! The ggml tensor types a GGUF import reads, and their block formats turned into `f32`.
//!
//! Every format is dequantised exactly as gguf-py's `gguf/quants.py` (which transformers'
//! GGUF loader calls) and llama.cpp's `dequantize_row_*` do: the block's `f16` scales widened
//! to `f32`, then the same `f32` products and sums in the same order (Rust never fuses a
//! multiply and an add on its own), so the values are bit-identical to the reference's.
//!
//! A tensor is a run of blocks along its rows (`ne[0]`, the fastest dimension); a block of
//! `elements()` values takes `block_bytes()` bytes. The float types are blocks of one value.

/// The ggml tensor types the importer reads, with their ggml ids (`ggml.h`'s `ggml_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    BF16,
}

/// Values in a K-quant super-block.
const QK_K: usize = 256;

/// Every ggml type id's name, for an error that names a type this importer does not read.
const NAMES: &[(u32, &str)] = &[
    (0, "F32"),
    (1, "F16"),
    (2, "Q4_0"),
    (3, "Q4_1"),
    (6, "Q5_0"),
    (7, "Q5_1"),
    (8, "Q8_0"),
    (9, "Q8_1"),
    (10, "Q2_K"),
    (11, "Q3_K"),
    (12, "Q4_K"),
    (13, "Q5_K"),
    (14, "Q6_K"),
    (15, "Q8_K"),
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (20, "IQ4_NL"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (23, "IQ4_XS"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (30, "BF16"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (39, "MXFP4"),
];

impl GgmlType {
    /// The type of ggml id `id`, or why it cannot be read (a type this importer does not
    /// dequantise, or no ggml type at all).
    pub fn from_id(id: u32) -> Result<Self, String> {
        Ok(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            30 => Self::BF16,
            _ => {
                let supported: Vec<&str> = Self::ALL.iter().map(|t| t.name()).collect();
                return Err(match NAMES.iter().find(|(i, _)| *i == id) {
                    Some((_, name)) => format!("tensor type {name} ({id}) is not supported (supported: {})", supported.join(", ")),
                    None => format!("unknown tensor type {id}"),
                });
            }
        })
    }

    pub const ALL: [GgmlType; 11] = [
        Self::F32,
        Self::F16,
        Self::BF16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
        }
    }

    /// Values per block.
    pub fn elements(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => 32,
            Self::Q4K | Self::Q5K | Self::Q6K => QK_K,
        }
    }

    /// Bytes per block (`ggml_type_size`).
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, Self::F32 | Self::F16 | Self::BF16)
    }
}

/// IEEE half to single precision, exactly (numpy's `float16.astype(float32)`): subnormals
/// normalised, infinities kept, a NaN's payload shifted along.
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let mant = (h & 0x3ff) as u32;
    let bits = match (exp, mant) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: shift the mantissa up until its leading one is the implicit bit.
            let mut m = m;
            let mut e: i32 = 127 - 15 + 1;
            while m & 0x400 == 0 {
                m <<= 1;
                e -= 1;
            }
            sign | ((e as u32) << 23) | ((m & 0x3ff) << 13)
        }
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// bfloat16 to f32: the upper half of the single's bits.
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

fn half(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Dequantises `bytes` (whole blocks of `ty`) into `out`: `out.len()` must be
/// `bytes.len() / ty.block_bytes() * ty.elements()` (the caller checked the sizes against the
/// tensor's shape; a mismatch is a bug and panics on the slice bounds).
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    assert_eq!(bytes.len() / ty.block_bytes() * ty.elements(), out.len(), "dequantize: sizes checked by the reader");
    let blocks = bytes.chunks_exact(ty.block_bytes()).zip(out.chunks_exact_mut(ty.elements()));
    match ty {
        GgmlType::F32 => {
            for (b, o) in blocks {
                o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (b, o) in blocks {
                o[0] = half(b, 0);
            }
        }
        GgmlType::BF16 => {
            for (b, o) in blocks {
                o[0] = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        GgmlType::Q4_0 => blocks.for_each(|(b, o)| q4_0(b, o)),
        GgmlType::Q4_1 => blocks.for_each(|(b, o)| q4_1(b, o)),
        GgmlType::Q5_0 => blocks.for_each(|(b, o)| q5_0(b, o)),
        GgmlType::Q5_1 => blocks.for_each(|(b, o)| q5_1(b, o)),
        GgmlType::Q8_0 => blocks.for_each(|(b, o)| q8_0(b, o)),
        GgmlType::Q4K => blocks.for_each(|(b, o)| q4_k(b, o)),
        GgmlType::Q5K => blocks.for_each(|(b, o)| q5_k(b, o)),
        GgmlType::Q6K => blocks.for_each(|(b, o)| q6_k(b, o)),
    }
}

/// `{d: f16, qs: [u8; 16]}`: value `j` is the low nibble of `qs[j]`, value `j + 16` the high
/// one; `x = d * (q - 8)`.
fn q4_0(b: &[u8], o: &mut [f32]) {
    let d = half(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        o[j] = d * ((qs[j] & 0x0f) as i32 - 8) as f32;
        o[j + 16] = d * ((qs[j] >> 4) as i32 - 8) as f32;
    }
}

/// `{d: f16, m: f16, qs: [u8; 16]}`: `x = d * q + m`.
fn q4_1(b: &[u8], o: &mut [f32]) {
    let d = half(b, 0);
    let m = half(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        o[j] = d * (qs[j] & 0x0f) as f32 + m;
        o[j + 16] = d * (qs[j] >> 4) as f32 + m;
    }
}

/// `{d: f16, qh: u32, qs: [u8; 16]}`: bit `j` of `qh` is the fifth bit of value `j`;
/// `x = d * (q - 16)`.
fn q5_0(b: &[u8], o: &mut [f32]) {
    let d = half(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let lo = (qs[j] & 0x0f) as u32 | (((qh >> j) & 1) << 4);
        let hi = (qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
        o[j] = d * (lo as i32 - 16) as f32;
        o[j + 16] = d * (hi as i32 - 16) as f32;
    }
}

/// `{d: f16, m: f16, qh: u32, qs: [u8; 16]}`: `x = d * q + m`.
fn q5_1(b: &[u8], o: &mut [f32]) {
    let d = half(b, 0);
    let m = half(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let lo = (qs[j] & 0x0f) as u32 | (((qh >> j) & 1) << 4);
        let hi = (qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
        o[j] = d * lo as f32 + m;
        o[j + 16] = d * hi as f32 + m;
    }
}

/// `{d: f16, qs: [i8; 32]}`: `x = q * d`.
fn q8_0(b: &[u8], o: &mut [f32]) {
    let d = half(b, 0);
    for j in 0..32 {
        o[j] = (b[2 + j] as i8) as f32 * d;
    }
}

/// The eight 6-bit (scale, min) pairs of a Q4_K / Q5_K super-block, packed in 12 bytes
/// (llama.cpp's `get_scale_min_k4`): pairs 0..4 in the low six bits of bytes 0..4 / 4..8,
/// pairs 4..8 from the nibbles of bytes 8..12 and the top two bits of bytes 0..8.
fn scale_min_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 0x3f;
        mn[j] = s[j + 4] & 0x3f;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
    (sc, mn)
}

/// `{d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]}`, 256 values in eight sub-blocks
/// of 32: sub-block `2i` is the low nibbles of `qs[32i..32i+32]`, `2i + 1` the high ones;
/// `x = (d * sc) * q - (dmin * m)`.
fn q4_k(b: &[u8], o: &mut [f32]) {
    let d = half(b, 0);
    let dmin = half(b, 2);
    let (sc, mn) = scale_min_k4(&b[4..16]);
    let qs = &b[16..144];
    for s in 0..8 {
        let ds = d * sc[s] as f32;
        let dm = dmin * mn[s] as f32;
        let (chunk, shift) = (s / 2, 4 * (s % 2));
        for l in 0..32 {
            let q = (qs[chunk * 32 + l] >> shift) & 0x0f;
            o[s * 32 + l] = ds * q as f32 - dm;
        }
    }
}

/// `{d, dmin, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]}`: Q4_K's nibbles with a fifth
/// bit, bit `s` of `qh[l]` for value `l` of sub-block `s`.
fn q5_k(b: &[u8], o: &mut [f32]) {
    let d = half(b, 0);
    let dmin = half(b, 2);
    let (sc, mn) = scale_min_k4(&b[4..16]);
    let qh = &b[16..48];
    let qs = &b[48..176];
    for s in 0..8 {
        let ds = d * sc[s] as f32;
        let dm = dmin * mn[s] as f32;
        let (chunk, shift) = (s / 2, 4 * (s % 2));
        for l in 0..32 {
            let q = ((qs[chunk * 32 + l] >> shift) & 0x0f) | (((qh[l] >> s) & 1) << 4);
            o[s * 32 + l] = ds * q as f32 - dm;
        }
    }
}

/// `{ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16}`: two halves of 128 values;
/// value `o` of half `h` has its low four bits in `ql[64h + o % 64] >> 4 * (o / 64)` and its
/// top two in `qh[32h + o % 32] >> 2 * (o / 32)`; `x = (d * scale[o / 16]) * (q - 32)`.
fn q6_k(b: &[u8], o: &mut [f32]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let scales = &b[192..208];
    let d = half(b, 208);
    for h in 0..2 {
        for i in 0..128 {
            let lo = (ql[64 * h + i % 64] >> (4 * (i / 64))) & 0x0f;
            let hi = (qh[32 * h + i % 32] >> (2 * (i / 32))) & 0x03;
            let q = (lo | (hi << 4)) as i32 - 32;
            let at = 128 * h + i;
            let ds = d * (scales[at / 16] as i8) as f32;
            o[at] = ds * q as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_widen_exactly() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x03ff), 1023.0 * 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x8000).to_bits(), 0x8000_0000);
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        // Every normal half round-trips through f32 -> f16 by truncation of the low bits.
        for h in 0x0400u16..0x7c00 {
            let f = f16_to_f32(h).to_bits();
            assert_eq!(((f >> 23) - 127 + 15) as u16, h >> 10);
            assert_eq!(((f >> 13) & 0x3ff) as u16, h & 0x3ff);
        }
    }

    #[test]
    fn q4_0_block() {
        let mut b = vec![0x00, 0x3c]; // d = 1
        b.extend((0..16).map(|j| (j as u8) | (((15 - j) as u8) << 4)));
        let mut o = [0f32; 32];
        dequantize(GgmlType::Q4_0, &b, &mut o);
        for j in 0..16 {
            assert_eq!(o[j], j as f32 - 8.0);
            assert_eq!(o[j + 16], (15 - j) as f32 - 8.0);
        }
    }

    #[test]
    fn q8_0_and_q5_0_blocks() {
        let mut b = vec![0x00, 0x40]; // d = 2
        b.extend((0..32).map(|j| (j as i8 - 16) as u8));
        let mut o = [0f32; 32];
        dequantize(GgmlType::Q8_0, &b, &mut o);
        assert!(o.iter().enumerate().all(|(j, &x)| x == 2.0 * (j as f32 - 16.0)));
        // Q5_0 with every fifth bit set and zero nibbles: q = 16 - 16 = 0.
        let mut b = vec![0x00, 0x3c, 0xff, 0xff, 0xff, 0xff];
        b.extend([0u8; 16]);
        dequantize(GgmlType::Q5_0, &b, &mut o);
        assert!(o.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn unknown_and_unsupported_types_are_named() {
        assert_eq!(GgmlType::from_id(99).unwrap_err(), "unknown tensor type 99");
        assert!(GgmlType::from_id(10).unwrap_err().contains("Q2_K"));
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(NAMES.iter().find(|(_, n)| *n == t.name()).unwrap().0).unwrap(), t);
        }
    }
}
