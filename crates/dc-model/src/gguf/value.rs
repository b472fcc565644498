//! GGUF metadata values, as parsed from a file's key-value section.
//!
//! Arrays keep their element type (`Vec<u32>`, `Vec<String>`, …) instead of a `Vec` of
//! values, so the memory a hostile file can make us spend stays a small multiple of its size.

/// The type tag of a GGUF metadata value (`gguf_metadata_value_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufType {
    /// 8-bit unsigned integer.
    U8,
    /// 8-bit signed integer.
    I8,
    /// 16-bit unsigned integer.
    U16,
    /// 16-bit signed integer.
    I16,
    /// 32-bit unsigned integer.
    U32,
    /// 32-bit signed integer.
    I32,
    /// IEEE binary32.
    F32,
    /// One byte, 0 or 1.
    Bool,
    /// u64 length, then UTF-8 bytes (no terminator).
    String,
    /// u32 element type, u64 count, then the elements.
    Array,
    /// 64-bit unsigned integer.
    U64,
    /// 64-bit signed integer.
    I64,
    /// IEEE binary64.
    F64,
}

impl GgufType {
    /// The type with tag `id`.
    pub fn from_id(id: u32) -> Option<GgufType> {
        use GgufType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The tag of this type in a file.
    pub fn id(self) -> u32 {
        use GgufType::*;
        match self {
            U8 => 0,
            I8 => 1,
            U16 => 2,
            I16 => 3,
            U32 => 4,
            I32 => 5,
            F32 => 6,
            Bool => 7,
            String => 8,
            Array => 9,
            U64 => 10,
            I64 => 11,
            F64 => 12,
        }
    }

    /// Bytes one value occupies in a file, or `None` for strings and arrays (variable).
    pub fn fixed_size(self) -> Option<u64> {
        use GgufType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float32`.
    F32(f32),
    /// `float64`.
    F64(f64),
    /// `bool`.
    Bool(bool),
    /// `string`.
    String(String),
    /// `array`.
    Array(GgufArray),
}

/// A metadata array: all elements share one type.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufArray {
    /// `uint8` elements.
    U8(Vec<u8>),
    /// `int8` elements.
    I8(Vec<i8>),
    /// `uint16` elements.
    U16(Vec<u16>),
    /// `int16` elements.
    I16(Vec<i16>),
    /// `uint32` elements.
    U32(Vec<u32>),
    /// `int32` elements.
    I32(Vec<i32>),
    /// `uint64` elements.
    U64(Vec<u64>),
    /// `int64` elements.
    I64(Vec<i64>),
    /// `float32` elements.
    F32(Vec<f32>),
    /// `float64` elements.
    F64(Vec<f64>),
    /// `bool` elements.
    Bool(Vec<bool>),
    /// `string` elements.
    String(Vec<String>),
    /// Nested arrays (each with its own element type).
    Array(Vec<GgufArray>),
}

impl GgufValue {
    /// The value's type tag.
    pub fn kind(&self) -> GgufType {
        match self {
            GgufValue::U8(_) => GgufType::U8,
            GgufValue::I8(_) => GgufType::I8,
            GgufValue::U16(_) => GgufType::U16,
            GgufValue::I16(_) => GgufType::I16,
            GgufValue::U32(_) => GgufType::U32,
            GgufValue::I32(_) => GgufType::I32,
            GgufValue::U64(_) => GgufType::U64,
            GgufValue::I64(_) => GgufType::I64,
            GgufValue::F32(_) => GgufType::F32,
            GgufValue::F64(_) => GgufType::F64,
            GgufValue::Bool(_) => GgufType::Bool,
            GgufValue::String(_) => GgufType::String,
            GgufValue::Array(_) => GgufType::Array,
        }
    }

    /// Any integer type as i128 (wide enough for both u64 and i64), else `None`.
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Any integer type that fits in u64.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_integer().and_then(|v| u64::try_from(v).ok())
    }

    /// Any integer type that fits in i64.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_integer().and_then(|v| i64::try_from(v).ok())
    }

    /// A float (f32 widened exactly) or an integer exactly representable in f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(f64::from(v)),
            GgufValue::F64(v) => Some(v),
            _ => {
                let i = self.as_integer()?;
                // 2^53: every integer up to here converts exactly.
                (i.unsigned_abs() <= 1 << 53).then_some(i as f64)
            }
        }
    }

    /// A boolean.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// A string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// An array.
    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// A short description for error messages: the type, and the value if it is a scalar.
    pub fn describe(&self) -> String {
        match self {
            GgufValue::String(s) if s.len() > 40 => format!("string of {} bytes", s.len()),
            GgufValue::String(s) => format!("string {s:?}"),
            GgufValue::Array(a) => format!("array of {} {:?}", a.len(), a.element_type()),
            GgufValue::F32(v) => format!("F32 {v}"),
            GgufValue::F64(v) => format!("F64 {v}"),
            GgufValue::Bool(v) => format!("Bool {v}"),
            other => match other.as_integer() {
                Some(i) => format!("{:?} {i}", other.kind()),
                None => format!("{:?}", other.kind()),
            },
        }
    }
}

impl GgufArray {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::F64(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type tag.
    pub fn element_type(&self) -> GgufType {
        match self {
            GgufArray::U8(_) => GgufType::U8,
            GgufArray::I8(_) => GgufType::I8,
            GgufArray::U16(_) => GgufType::U16,
            GgufArray::I16(_) => GgufType::I16,
            GgufArray::U32(_) => GgufType::U32,
            GgufArray::I32(_) => GgufType::I32,
            GgufArray::U64(_) => GgufType::U64,
            GgufArray::I64(_) => GgufType::I64,
            GgufArray::F32(_) => GgufType::F32,
            GgufArray::F64(_) => GgufType::F64,
            GgufArray::Bool(_) => GgufType::Bool,
            GgufArray::String(_) => GgufType::String,
            GgufArray::Array(_) => GgufType::Array,
        }
    }

    /// String elements, if this is an array of strings.
    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            GgufArray::String(v) => Some(v),
            _ => None,
        }
    }

    /// Integer elements of any width as i64 (`None` if not integers, or a u64 above i64::MAX).
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        fn conv<T: Copy>(v: &[T], f: impl Fn(T) -> Option<i64>) -> Option<Vec<i64>> {
            v.iter().map(|&x| f(x)).collect()
        }
        match self {
            GgufArray::U8(v) => conv(v, |x| Some(x.into())),
            GgufArray::I8(v) => conv(v, |x| Some(x.into())),
            GgufArray::U16(v) => conv(v, |x| Some(x.into())),
            GgufArray::I16(v) => conv(v, |x| Some(x.into())),
            GgufArray::U32(v) => conv(v, |x| Some(x.into())),
            GgufArray::I32(v) => conv(v, |x| Some(x.into())),
            GgufArray::U64(v) => conv(v, |x| i64::try_from(x).ok()),
            GgufArray::I64(v) => Some(v.clone()),
            _ => None,
        }
    }

    /// Float elements widened to f64 (f32 exactly), if this is an array of floats.
    pub fn to_f64_vec(&self) -> Option<Vec<f64>> {
        match self {
            GgufArray::F32(v) => Some(v.iter().map(|&x| f64::from(x)).collect()),
            GgufArray::F64(v) => Some(v.clone()),
            _ => None,
        }
    }
}
