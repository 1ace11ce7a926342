//! Column values of wal2json format-version 2 → their JSON in the envelope, per type OID, exactly as
//! `capture.pgtypes` converts and `capture.pgtypes.dumps_values` writes them (its mapping table).
//!
//! Only built-in types with a fixed OID are converted here, and only in the forms PostgreSQL
//! prints under the connector's session settings; a value in any other form returns None (the
//! payload takes the Python path, which converts it or raises the reference error). Not converted
//! natively at all: arrays, interval, types without a fixed OID (enums, domains, extensions).

use serde::de::IgnoredAny;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Int,
    Numeric,
    Float,
    Bool,
    Text,
    Json,
    Uuid,
    Bytea,
    Date,
    Timestamp,
    Timestamptz,
    Time,
    Timetz,
    NotNative,
}

pub const NOT_NATIVE: Kind = Kind::NotNative;

/// A plugin's value of one column.
#[derive(Clone, Copy)]
pub enum Input<'t> {
    Null,
    Wal2json(&'t str), // the raw JSON token
    Text(&'t str),     // pgoutput: the type's text output
}

/// How a non-null value of the type with this OID is converted (capture.pgtypes._TYPES).
pub fn kind_of(oid: i64) -> Kind {
    match oid {
        20 | 21 | 23 | 26 => Kind::Int,
        1700 => Kind::Numeric,
        700 | 701 => Kind::Float,
        16 => Kind::Bool,
        25 | 1043 | 1042 | 19 | 18 | 603 => Kind::Text,
        114 | 3802 => Kind::Json,
        2950 => Kind::Uuid,
        17 => Kind::Bytea,
        1082 => Kind::Date,
        1114 => Kind::Timestamp,
        1184 => Kind::Timestamptz,
        1083 => Kind::Time,
        1266 => Kind::Timetz,
        _ => Kind::NotNative,
    }
}

/// Write the JSON of a non-null raw wal2json value; returns its size as `ToastCache.size_of` counts it.
pub fn value(kind: Kind, raw: &str, out: &mut Vec<u8>) -> Option<usize> {
    const OTHER: usize = 16; // size_of's measure of a value that is not a string, bytes or JSON
    match kind {
        Kind::Int => {
            // orjson reads integers in [-2^63, 2^64) as ints (beyond: floats, which the reference refuses)
            let digits = raw.strip_prefix('-').unwrap_or(raw);
            if raw == "-0"
                || digits.is_empty()
                || digits.len() > 20
                || !digits.bytes().all(|b| b.is_ascii_digit())
            {
                return None;
            }
            let v: i128 = raw.parse().ok()?;
            if !(-(1i128 << 63)..1i128 << 64).contains(&v) {
                return None;
            }
            out.extend_from_slice(raw.as_bytes());
            Some(OTHER)
        }
        Kind::Numeric => {
            if raw == "-0" || !plain_decimal(raw) {
                return None;
            }
            out.push(b'"');
            out.extend_from_slice(raw.as_bytes());
            out.push(b'"');
            Some(OTHER)
        }
        Kind::Float => {
            let value = float_of(raw)?;
            write_f64(out, value).then_some(OTHER)
        }
        Kind::Bool => {
            if raw != "true" && raw != "false" {
                return None;
            }
            out.extend_from_slice(raw.as_bytes());
            Some(OTHER)
        }
        Kind::Bytea => {
            let text = string(raw)?;
            bytea_hex(text.strip_prefix("\\x").unwrap_or(&text), out)
        }
        _ => text_kind(kind, &string(raw)?, out),
    }
}

/// Write the JSON of a non-null pgoutput TupleData text value (the type's output function's text, under the
/// connector's session settings); its size as `ToastCache.size_of` counts it. None: a form the Python path
/// must judge (capture.pgtypes.text_converter converts it, or raises the reference error).
pub fn text_value(kind: Kind, text: &str, out: &mut Vec<u8>) -> Option<usize> {
    const OTHER: usize = 16;
    match kind {
        Kind::Int => {
            // int(text): only the canonical digits are copied as they are (no sign on zero, no leading zero)
            let digits = text.strip_prefix('-').unwrap_or(text);
            if digits.is_empty()
                || digits.len() > 20
                || !digits.bytes().all(|b| b.is_ascii_digit())
                || (digits.len() > 1 && digits.starts_with('0'))
                || text == "-0"
            {
                return None;
            }
            let v: i128 = text.parse().ok()?;
            if !(-(1i128 << 63)..1i128 << 64).contains(&v) {
                return None;
            }
            out.extend_from_slice(text.as_bytes());
            Some(OTHER)
        }
        Kind::Numeric => {
            // format(Decimal(text), "f"): the same digits for a plain decimal without leading zeros
            let plain = plain_decimal(text) && {
                let int = text.strip_prefix('-').unwrap_or(text);
                let int = int.split_once('.').map_or(int, |(i, _)| i);
                int.len() == 1 || !int.starts_with('0')
            };
            if !plain && !matches!(text, "NaN" | "Infinity" | "-Infinity") {
                return None;
            }
            out.push(b'"');
            out.extend_from_slice(text.as_bytes());
            out.push(b'"');
            Some(OTHER)
        }
        Kind::Float => {
            if matches!(text, "NaN" | "Infinity" | "-Infinity") {
                out.push(b'"'); // NonFiniteFloat: written as a string
                out.extend_from_slice(text.as_bytes());
                out.push(b'"');
                return Some(OTHER);
            }
            // float(text) and Rust agree on these characters (no words, blanks or underscores)
            if text.is_empty()
                || !text
                    .bytes()
                    .all(|b| matches!(b, b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-'))
            {
                return None;
            }
            let value: f64 = text.parse().ok()?;
            write_f64(out, value).then_some(OTHER)
        }
        Kind::Bool => {
            out.extend_from_slice(match text {
                "t" | "true" => b"true",
                "f" | "false" => b"false",
                _ => return None,
            });
            Some(OTHER)
        }
        Kind::Bytea => bytea_hex(text.strip_prefix("\\x")?, out),
        _ => text_kind(kind, text, out),
    }
}

/// Hex digits (an even number, nothing else) → the bytes as base64 JSON; their count.
fn bytea_hex(hex: &str, out: &mut Vec<u8>) -> Option<usize> {
    let hex = hex.as_bytes();
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let mut bytes = Vec::with_capacity(hex.len() / 2);
    for pair in hex.chunks(2) {
        bytes.push(hex_digit(pair[0])? << 4 | hex_digit(pair[1])?);
    }
    out.push(b'"');
    base64(out, &bytes);
    out.push(b'"');
    Some(bytes.len())
}

/// The kinds both plugins give as the type's text (wal2json inside a JSON string).
fn text_kind(kind: Kind, text: &str, out: &mut Vec<u8>) -> Option<usize> {
    const OTHER: usize = 16;
    match kind {
        Kind::Text => {
            crate::json::write_str(out, text);
            Some(text.chars().count())
        }
        Kind::Json => {
            serde_json::from_str::<IgnoredAny>(text).ok()?;
            out.extend_from_slice(text.as_bytes());
            Some(text.chars().count())
        }
        Kind::Uuid => {
            let b = text.as_bytes();
            if b.len() != 36 {
                return None;
            }
            out.push(b'"');
            for (i, &c) in b.iter().enumerate() {
                if matches!(i, 8 | 13 | 18 | 23) {
                    if c != b'-' {
                        return None;
                    }
                    out.push(c);
                } else if c.is_ascii_hexdigit() {
                    out.push(c.to_ascii_lowercase());
                } else {
                    return None;
                }
            }
            out.push(b'"');
            Some(OTHER)
        }
        Kind::Date => {
            let b = text.as_bytes();
            if b.len() != 10 || date(b).is_none() {
                return None;
            }
            out.push(b'"');
            out.extend_from_slice(b);
            out.push(b'"');
            Some(OTHER)
        }
        Kind::Timestamp | Kind::Timestamptz => {
            let b = text.as_bytes();
            if b.len() < 19 || (b[10] != b' ' && b[10] != b'T') {
                return None;
            }
            date(&b[..10])?;
            let (clock, rest) = clock(&b[11..])?;
            let zone = offset(rest)?;
            if zone.is_some() != (kind == Kind::Timestamptz) {
                return None;
            }
            out.push(b'"');
            out.extend_from_slice(&b[..10]);
            out.push(b'T');
            write_clock(out, clock);
            write_offset(out, zone);
            out.push(b'"');
            Some(OTHER)
        }
        Kind::Time | Kind::Timetz => {
            let (clock, rest) = clock(text.as_bytes())?;
            let zone = offset(rest)?;
            if zone.is_some() != (kind == Kind::Timetz) {
                return None;
            }
            out.push(b'"');
            write_clock(out, clock);
            write_offset(out, zone);
            out.push(b'"');
            Some(OTHER)
        }
        _ => None,
    }
}

fn string(raw: &str) -> Option<std::borrow::Cow<'_, str>> {
    crate::json::str_of(raw)
}

/// `-?digits(.digits)?`: the numeric output text (no exponent, no NaN).
fn plain_decimal(t: &str) -> bool {
    let t = t.strip_prefix('-').unwrap_or(t);
    let (int, frac) = match t.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (t, None),
    };
    !int.is_empty()
        && int.bytes().all(|b| b.is_ascii_digit())
        && frac.is_none_or(|f| !f.is_empty() && f.bytes().all(|b| b.is_ascii_digit()))
}

/// A JSON number token as a double the way the reference reads it: an integer token becomes an int
/// first (so -0 is +0.0), a fraction a correctly rounded double.
fn float_of(t: &str) -> Option<f64> {
    let is_int = !t.bytes().any(|b| matches!(b, b'.' | b'e' | b'E'));
    let value: f64 = t.parse().ok()?;
    if !value.is_finite() {
        return None;
    }
    Some(if is_int && value == 0.0 { 0.0 } else { value })
}

/// A finite double as orjson writes it: the shortest round-trip digits, fixed notation for decimal
/// exponents -5..15 (".0" when integral), otherwise `d.ddde+XX` / `d.ddde-X`. False: not finite.
pub fn write_f64(out: &mut Vec<u8>, value: f64) -> bool {
    if !value.is_finite() {
        return false;
    }
    let mut buf = ryu::Buffer::new();
    let text = buf.format_finite(value);
    let (negative, body) = match text.strip_prefix('-') {
        Some(b) => (true, b),
        None => (false, text),
    };
    let (mantissa, exp10) = match body.split_once('e') {
        Some((m, e)) => (m, e.parse::<i32>().expect("ryu writes an integer exponent")),
        None => (body, 0),
    };
    let (int_part, frac_part) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let mut digits: Vec<u8> = int_part.bytes().chain(frac_part.bytes()).collect();
    let mut point = int_part.len() as i32 + exp10; // digits before the decimal point
    while digits.len() > 1 && digits[0] == b'0' {
        digits.remove(0);
        point -= 1;
    }
    while digits.len() > 1 && digits[digits.len() - 1] == b'0' {
        digits.pop();
    }
    if negative {
        out.push(b'-');
    }
    if digits == b"0" {
        out.extend_from_slice(b"0.0");
        return true;
    }
    let e = point - 1; // scientific exponent
    if (-5..16).contains(&e) {
        if e >= 0 {
            let int_len = (e + 1) as usize;
            for i in 0..int_len {
                out.push(*digits.get(i).unwrap_or(&b'0'));
            }
            out.push(b'.');
            if digits.len() > int_len {
                out.extend_from_slice(&digits[int_len..]);
            } else {
                out.push(b'0');
            }
        } else {
            out.extend_from_slice(b"0.");
            for _ in 0..(-e - 1) {
                out.push(b'0');
            }
            out.extend_from_slice(&digits);
        }
    } else {
        out.push(digits[0]);
        if digits.len() > 1 {
            out.push(b'.');
            out.extend_from_slice(&digits[1..]);
        }
        out.extend_from_slice(format!("e{}{}", if e > 0 { "+" } else { "-" }, e.abs()).as_bytes());
    }
    true
}

pub(crate) fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

fn base64(out: &mut Vec<u8>, bytes: &[u8]) {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for chunk in bytes.chunks(3) {
        let n = (chunk[0] as u32) << 16
            | (*chunk.get(1).unwrap_or(&0) as u32) << 8
            | *chunk.get(2).unwrap_or(&0) as u32;
        out.push(ALPHABET[(n >> 18) as usize & 63]);
        out.push(ALPHABET[(n >> 12) as usize & 63]);
        out.push(if chunk.len() > 1 {
            ALPHABET[(n >> 6) as usize & 63]
        } else {
            b'='
        });
        out.push(if chunk.len() > 2 {
            ALPHABET[n as usize & 63]
        } else {
            b'='
        });
    }
}

fn number(b: &[u8]) -> Option<u32> {
    if b.is_empty() || !b.iter().all(|c| c.is_ascii_digit()) {
        return None;
    }
    Some(b.iter().fold(0u32, |n, c| n * 10 + (c - b'0') as u32))
}

/// `YYYY-MM-DD` with a real calendar date in years 1–9999 (what Python's date can hold).
pub(crate) fn date(b: &[u8]) -> Option<(u32, u32, u32)> {
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return None;
    }
    let (y, m, d) = (number(&b[..4])?, number(&b[5..7])?, number(&b[8..10])?);
    let leap = y % 4 == 0 && (y % 100 != 0 || y % 400 == 0);
    let days = match m {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return None,
    };
    (y >= 1 && d >= 1 && d <= days).then_some((y, m, d))
}

/// Hours, minutes, seconds, microseconds.
pub(crate) type Clock = (u32, u32, u32, u32);

/// `HH:MM:SS(.f{1,6})?` at the start: (h, m, s, microseconds) and what follows.
pub(crate) fn clock(b: &[u8]) -> Option<(Clock, &[u8])> {
    if b.len() < 8 || b[2] != b':' || b[5] != b':' {
        return None;
    }
    let (h, m, s) = (number(&b[..2])?, number(&b[3..5])?, number(&b[6..8])?);
    if h > 23 || m > 59 || s > 59 {
        return None;
    }
    let mut rest = &b[8..];
    let mut micros = 0;
    if rest.first() == Some(&b'.') {
        let n = rest[1..].iter().take_while(|c| c.is_ascii_digit()).count();
        if n == 0 || n > 6 {
            return None;
        }
        micros = number(&rest[1..1 + n])? * 10u32.pow(6 - n as u32);
        rest = &rest[1 + n..];
    }
    Some(((h, m, s, micros), rest))
}

/// The rest of a timestamp or time: empty (None inside) or `±HH(:MM(:SS)?)?` as signed seconds.
pub(crate) fn offset(b: &[u8]) -> Option<Option<i32>> {
    if b.is_empty() {
        return Some(None);
    }
    let sign = match b[0] {
        b'+' => 1,
        b'-' => -1,
        _ => return None,
    };
    let b = &b[1..];
    let (h, m, s) = match b.len() {
        2 => (number(b)?, 0, 0),
        5 if b[2] == b':' => (number(&b[..2])?, number(&b[3..5])?, 0),
        8 if b[2] == b':' && b[5] == b':' => {
            (number(&b[..2])?, number(&b[3..5])?, number(&b[6..8])?)
        }
        _ => return None,
    };
    if h > 23 || m > 59 || s > 59 {
        return None;
    }
    Some(Some(sign * (h * 3600 + m * 60 + s) as i32))
}

fn write_clock(out: &mut Vec<u8>, (h, m, s, micros): Clock) {
    two_digits(out, h);
    out.push(b':');
    two_digits(out, m);
    out.push(b':');
    two_digits(out, s);
    if micros != 0 {
        out.push(b'.');
        for p in [100_000, 10_000, 1_000, 100, 10, 1] {
            out.push(b'0' + (micros / p % 10) as u8);
        }
    }
}

/// A number below 100 as two digits (the callers' hours, minutes and seconds are).
fn two_digits(out: &mut Vec<u8>, n: u32) {
    out.push(b'0' + (n / 10 % 10) as u8);
    out.push(b'0' + (n % 10) as u8);
}

fn write_offset(out: &mut Vec<u8>, zone: Option<i32>) {
    let Some(seconds) = zone else { return };
    let sign = if seconds < 0 { '-' } else { '+' };
    let a = seconds.unsigned_abs();
    out.push(sign as u8);
    two_digits(out, a / 3600);
    out.push(b':');
    two_digits(out, a / 60 % 60);
    if a % 60 != 0 {
        out.push(b':');
        two_digits(out, a % 60);
    }
}

/// A transaction's commit time as wal2json writes it: a timestamptz the reference decoder parses.
pub fn commit_timestamp_ok(text: &str) -> bool {
    let b = text.as_bytes();
    if b.len() < 19 || b[10] != b' ' {
        return false;
    }
    let Some((y, _, _)) = date(&b[..10]) else {
        return false;
    };
    let Some((_, rest)) = clock(&b[11..]) else {
        return false;
    };
    (1000..=9998).contains(&y) && matches!(offset(rest), Some(Some(_)))
}

/// `'16/B374D848'` → 0x16B374D848 (1–8 hex digits on each side).
pub fn lsn(text: &str) -> Option<u64> {
    let (high, low) = text.split_once('/')?;
    let part = |p: &str| -> Option<u64> {
        if p.is_empty() || p.len() > 8 || !p.bytes().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        u64::from_str_radix(p, 16).ok()
    };
    Some(part(high)? << 32 | part(low)?)
}
