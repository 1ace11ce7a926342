//! JSON reading and writing as the Python reference path does it.
//!
//! Reading: a record or column object is an [`Obj`]: its members in order, values left as raw JSON
//! text (validated once by serde_json) and parsed on demand. A member named twice resolves to its
//! last value, as orjson's and the standard library's parsers do. Only JSON objects are objects
//! (serde's derived structs would also accept arrays, which the reference rejects).
//!
//! Writing: [`write_str`] escapes as orjson does: `"` and `\`, the control characters U+0000–U+001F
//! (`\b \t \n \f \r` by name, the rest as `\u00xx`); everything else, U+007F and non-ASCII
//! included, is written as UTF-8 unchanged.

use std::borrow::Cow;
use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

/// A JSON object's members in order, each value as raw JSON.
pub struct Obj<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'a> Obj<'a> {
    /// The member's raw value (the last one of that name), None when absent.
    pub fn get(&self, name: &str) -> Option<&'a RawValue> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| *v)
    }
}

/// A string that borrows from the input when it has no escapes.
struct Str<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Str<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Str<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

impl<'de> Deserialize<'de> for Obj<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Obj<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut members = Vec::with_capacity(map.size_hint().unwrap_or(10));
                while let Some((k, v)) = map.next_entry::<Str<'de>, &'de RawValue>()? {
                    members.push((k.0, v));
                }
                Ok(Obj(members))
            }
        }
        d.deserialize_map(V)
    }
}

/// A wal2json record: its members, with the column arrays parsed in the same pass (the last of a name wins).
pub struct Record<'a> {
    pub obj: Obj<'a>,
    pub columns: Option<Vec<Obj<'a>>>,
    pub identity: Option<Vec<Obj<'a>>>,
}

impl<'de> Deserialize<'de> for Record<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Record<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a wal2json record")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut rec = Record {
                    obj: Obj(Vec::with_capacity(10)),
                    columns: None,
                    identity: None,
                };
                while let Some(k) = map.next_key::<Str<'de>>()? {
                    match &*k.0 {
                        "columns" => rec.columns = Some(map.next_value()?),
                        "identity" => rec.identity = Some(map.next_value()?),
                        _ => {
                            let v = map.next_value::<&'de RawValue>()?;
                            rec.obj.0.push((k.0, v));
                        }
                    }
                }
                Ok(rec)
            }
        }
        d.deserialize_map(V)
    }
}

/// Parse a wal2json record (None: not valid JSON, not UTF-8, not an object, or column arrays that are not
/// arrays of objects).
pub fn parse_record(bytes: &[u8]) -> Option<Record<'_>> {
    serde_json::from_slice(bytes).ok()
}

/// Parse a JSON object (None: not valid JSON, not UTF-8, or not an object).
pub fn parse_obj(bytes: &[u8]) -> Option<Obj<'_>> {
    serde_json::from_slice(bytes).ok()
}

/// A raw value that is a JSON string, decoded (None: anything else).
pub fn raw_str(raw: &RawValue) -> Option<Cow<'_, str>> {
    str_of(raw.get())
}

/// JSON text that is a string, decoded (None: anything else).
pub fn str_of(text: &str) -> Option<Cow<'_, str>> {
    if !text.starts_with('"') {
        return None;
    }
    serde_json::from_str::<Str>(text).ok().map(|s| s.0)
}

/// A raw value that is a JSON integer token fitting an i64 (None: anything else, -0 included).
pub fn raw_i64(raw: &RawValue) -> Option<i64> {
    let t = raw.get();
    let digits = t.strip_prefix('-').unwrap_or(t);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || t == "-0" {
        return None;
    }
    t.parse().ok()
}

/// Write ``text`` as a JSON string, escaped as orjson escapes it.
pub fn write_str(out: &mut Vec<u8>, text: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let bytes = text.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let esc: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\t' => b"\\t",
            b'\r' => b"\\r",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        if esc.is_empty() {
            out.extend_from_slice(b"\\u00");
            out.push(HEX[(b >> 4) as usize]);
            out.push(HEX[(b & 15) as usize]);
        } else {
            out.extend_from_slice(esc);
        }
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}
