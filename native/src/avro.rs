//! Avro values for `--value-format avro`: column values, keys and envelopes in Avro's binary encoding,
//! framed as Confluent does (magic byte 0, the 4-byte big-endian schema id, the datum), exactly as
//! `capture.avro.AvroEncoder` (→ `schemas.pgvalues` → fastavro through `schemas.wire.AvroWire`)
//! writes them.
//!
//! What the encoding needs comes from Python per table ([`AvroTable`], `capture/native/avro.py`): the
//! registered key and value schema ids, per column its Avro kind (`schemas.pgavro.Kind`), its type OID
//! in the catalog and where `null` and the value sit in its union, and the envelope's, `source`'s and
//! `transaction`'s field order with their unions. The core re-derives nothing from schema text.
//!
//! A value is first read and checked by the JSON converter (`convert.rs`, the forms the JSON path
//! accepts) into its canonical JSON text, which this module turns into Avro; text and bytea are read
//! directly. Anything else — a column whose payload type OID differs from the catalog's (the Python
//! path reads the catalog again), NULL in a NOT NULL field, a numeric that does not fit its
//! `decimal(p,s)` or needs more than 38 digits, an integer outside its Avro type, a float too large
//! for `float` — gives None: the change takes the Python path.
//!
//! Avro binary (the spec): int and long as zig-zag varints; float and double as IEEE little-endian;
//! string and bytes as a long length then the bytes; a union as the long index of its branch then
//! the branch's value; an enum as the long index of its symbol; a record as its fields in order.

use std::borrow::Cow;

use crate::convert::{self, Input, Kind};
use crate::json;
use crate::UNAVAILABLE;

/// How a non-null value of a column is written (`schemas.pgavro.Kind` of a scalar column).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum AvroKind {
    Int,
    Long,
    Float,
    Double,
    Boolean,
    String,
    Json,
    Uuid,
    Timetz,
    Bytes,
    Decimal { precision: u32, scale: u32 },
    VariableDecimal,
    Date,
    Timestamp,
    Timestamptz,
    Time,
    NotNative, // interval, arrays: only NULL is written natively
}

impl AvroKind {
    /// The kind of `schemas.pgavro.Kind`'s value name (anything else: not native).
    pub fn named(name: &str, precision: u32, scale: u32) -> AvroKind {
        match name {
            "int" => AvroKind::Int,
            "long" => AvroKind::Long,
            "float" => AvroKind::Float,
            "double" => AvroKind::Double,
            "boolean" => AvroKind::Boolean,
            "string" => AvroKind::String,
            "json" => AvroKind::Json,
            "uuid" => AvroKind::Uuid,
            "timetz" => AvroKind::Timetz,
            "bytes" => AvroKind::Bytes,
            "decimal" => AvroKind::Decimal { precision, scale },
            "variable_decimal" => AvroKind::VariableDecimal,
            "date" => AvroKind::Date,
            "timestamp" => AvroKind::Timestamp,
            "timestamptz" => AvroKind::Timestamptz,
            "time" => AvroKind::Time,
            _ => AvroKind::NotNative,
        }
    }

    /// Whether a value the plugin gives as ``kind`` is written as this Avro kind.
    fn reads(self, kind: Kind) -> bool {
        matches!(
            (self, kind),
            (AvroKind::Int | AvroKind::Long, Kind::Int)
                | (AvroKind::Float | AvroKind::Double, Kind::Float)
                | (AvroKind::Boolean, Kind::Bool)
                | (AvroKind::String, Kind::Text)
                | (AvroKind::Json, Kind::Json)
                | (AvroKind::Uuid, Kind::Uuid)
                | (AvroKind::Timetz, Kind::Timetz)
                | (AvroKind::Bytes, Kind::Bytea)
                | (
                    AvroKind::Decimal { .. } | AvroKind::VariableDecimal,
                    Kind::Numeric
                )
                | (AvroKind::Date, Kind::Date)
                | (AvroKind::Timestamp, Kind::Timestamp)
                | (AvroKind::Timestamptz, Kind::Timestamptz)
                | (AvroKind::Time, Kind::Time)
        )
    }
}

/// Where a field's null and value sit in its union (None, None: not a union).
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub null: Option<u32>,
    pub value: Option<u32>,
}

impl Layout {
    /// From Python's branch indexes (-1: none).
    pub fn of(null: i64, value: i64) -> Layout {
        let branch = |i: i64| u32::try_from(i).ok();
        Layout {
            null: branch(null),
            value: branch(value),
        }
    }

    /// Write null; None when the field is not nullable.
    fn write_null(self, out: &mut Vec<u8>) -> Option<()> {
        write_long(out, i64::from(self.null?));
        Some(())
    }

    /// Write the union index of the value's branch (``sub``: the branch within a value union, decimal's).
    fn write_branch(self, out: &mut Vec<u8>, sub: u32) -> Option<()> {
        match self.value {
            Some(b) => write_long(out, i64::from(b + sub)),
            None if sub == 0 => {}
            None => return None,
        }
        Some(())
    }
}

/// One field of a table's row record (and, for a key column, of its key record: the same layout).
pub struct AvroColumn {
    pub name: String,
    pub oid: i64,
    /// format_type's name of the column in the registered schema (typmod included): a change that carries
    /// the column under another (wal2json's `type`) takes the Python path, which writes it under its own
    pub type_name: String,
    pub kind: AvroKind,
    pub layout: Layout,
}

/// The envelope's fields.
#[derive(Clone, Copy)]
pub enum EnvelopeField {
    Before(Layout),
    After(Layout),
    Source(Layout),
    Op(Layout),
    TsMs(Layout),
    Transaction(Layout),
}

/// The `source` record's fields.
#[derive(Clone, Copy)]
pub enum SourceField {
    Version,
    Connector,
    Name,
    TsMs,
    Snapshot,
    Db,
    Schema,
    Table,
    TxId,
    CommitLsn,
    Lsn,
    EventIndex,
}

/// The `transaction` record's fields.
#[derive(Clone, Copy)]
pub enum TxnField {
    Id,
    TotalOrder,
    DataCollectionOrder,
}

/// A field's type as Python names it: "string" or "long".
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Scalar {
    String,
    Long,
}

impl Scalar {
    pub fn named(name: &str) -> Option<Scalar> {
        match name {
            "string" => Some(Scalar::String),
            "long" => Some(Scalar::Long),
            _ => None,
        }
    }
}

/// What the core writes a registered table's Avro keys and values with.
pub struct AvroTable {
    pub key_id: u32,
    pub value_id: u32,
    pub columns: Vec<AvroColumn>,
    pub envelope: Vec<EnvelopeField>,
    pub source: Vec<(SourceField, Scalar, Layout)>,
    pub transaction: Vec<(TxnField, Scalar, Layout)>,
}

impl AvroTable {
    /// The column of that name (looked for at ``position`` first: payloads list columns in table order).
    pub fn column(&self, name: &str, position: usize) -> Option<&AvroColumn> {
        match self.columns.get(position) {
            Some(c) if c.name == name => Some(c),
            _ => self.columns.iter().find(|c| c.name == name),
        }
    }
}

/// A column value as its row field's encoding (union branch included); its size as
/// `ToastCache.size_of` counts it, and whether it is the unavailable-TOAST placeholder text.
/// None: the change takes the Python path.
pub fn column_value(
    column: &AvroColumn,
    oid: i64,
    input: Input,
    out: &mut Vec<u8>,
) -> Option<(usize, bool)> {
    if oid != column.oid {
        return None; // the column's type changed: the Python path reads the catalog again
    }
    let layout = column.layout;
    let kind = convert::kind_of(oid);
    match input {
        Input::Null => {
            layout.write_null(out)?;
            return Some((16, false));
        }
        _ if !column.kind.reads(kind) => return None,
        _ => {}
    }
    match kind {
        Kind::Text => {
            let text = match input {
                Input::Wal2json(raw) => json::str_of(raw)?,
                Input::Text(t) => Cow::Borrowed(t),
                Input::Null => return None,
            };
            layout.write_branch(out, 0)?;
            write_bytes(out, text.as_bytes());
            Some((text.chars().count(), text == UNAVAILABLE))
        }
        Kind::Bytea => {
            let bytes = match input {
                Input::Wal2json(raw) => {
                    let text = json::str_of(raw)?;
                    hex(text.strip_prefix("\\x").unwrap_or(&text))?
                }
                Input::Text(t) => hex(t.strip_prefix("\\x")?)?,
                Input::Null => return None,
            };
            layout.write_branch(out, 0)?;
            write_bytes(out, &bytes);
            Some((bytes.len(), false))
        }
        _ => {
            let mut canonical = Vec::with_capacity(40);
            let size = match input {
                Input::Wal2json(raw) => convert::value(kind, raw, &mut canonical)?,
                Input::Text(t) => convert::text_value(kind, t, &mut canonical)?,
                Input::Null => return None,
            };
            from_canonical(column.kind, layout, &canonical, out)?;
            Some((size, false))
        }
    }
}

/// A value in the JSON path's canonical form (`convert.rs`'s output) → its Avro field encoding.
fn from_canonical(kind: AvroKind, layout: Layout, json: &[u8], out: &mut Vec<u8>) -> Option<()> {
    let text = std::str::from_utf8(json).ok()?;
    let quoted = text
        .strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .unwrap_or(text);
    match kind {
        AvroKind::Int | AvroKind::Long => {
            let v: i64 = text.parse().ok()?;
            if kind == AvroKind::Int && i32::try_from(v).is_err() {
                return None;
            }
            layout.write_branch(out, 0)?;
            write_long(out, v);
        }
        AvroKind::Float | AvroKind::Double => {
            let v = match quoted {
                "NaN" => f64::NAN,
                "Infinity" => f64::INFINITY,
                "-Infinity" => f64::NEG_INFINITY,
                _ => text.parse().ok()?,
            };
            layout.write_branch(out, 0)?;
            if kind == AvroKind::Double {
                out.extend_from_slice(&v.to_le_bytes());
            } else {
                let f = v as f32; // as the Python path's C float: rounded to nearest
                if f.is_infinite() && v.is_finite() {
                    return None; // too large for float: the Python path decides
                }
                let f = if f.is_nan() { f32::NAN } else { f };
                out.extend_from_slice(&f.to_le_bytes());
            }
        }
        AvroKind::Boolean => {
            layout.write_branch(out, 0)?;
            out.push(u8::from(text == "true"));
        }
        AvroKind::Json => {
            layout.write_branch(out, 0)?;
            write_bytes(out, json); // the JSON text itself
        }
        AvroKind::Uuid | AvroKind::Timetz | AvroKind::String => {
            layout.write_branch(out, 0)?;
            write_bytes(out, quoted.as_bytes());
        }
        AvroKind::Decimal { precision, scale } => {
            if let Some(symbol) = special(quoted) {
                layout.write_branch(out, 1)?; // the DecimalSpecial branch, after decimal's
                write_long(out, symbol);
                return Some(());
            }
            let (unscaled, own_scale) = decimal(quoted)?;
            if own_scale > scale {
                return None; // more fraction digits than the scale: the Python path raises
            }
            let unscaled = unscaled.checked_mul(10i128.checked_pow(scale - own_scale)?)?;
            if digits(unscaled) > precision {
                return None;
            }
            layout.write_branch(out, 0)?;
            write_bytes(out, &twos_complement(unscaled));
        }
        AvroKind::VariableDecimal => {
            layout.write_branch(out, 0)?;
            if let Some(symbol) = special(quoted) {
                write_long(out, 0); // scale
                write_long(out, 0); // value: no bytes
                write_long(out, 1); // special: the enum branch of ["null", DecimalSpecial]
                write_long(out, symbol);
                return Some(());
            }
            let (unscaled, scale) = decimal(quoted)?;
            write_long(out, i64::from(scale));
            write_bytes(out, &twos_complement(unscaled));
            write_long(out, 0); // special: null
        }
        AvroKind::Date => {
            let (y, m, d) = convert::date(quoted.as_bytes())?;
            layout.write_branch(out, 0)?;
            write_long(out, days_from_civil(y, m, d));
        }
        AvroKind::Timestamp | AvroKind::Timestamptz => {
            let b = quoted.as_bytes();
            if b.len() < 19 || b[10] != b'T' {
                return None;
            }
            let (y, m, d) = convert::date(&b[..10])?;
            let (clock, rest) = convert::clock(&b[11..])?;
            let zone = convert::offset(rest)?;
            let micros = days_from_civil(y, m, d) * MICROS_PER_DAY + clock_micros(clock)
                - i64::from(zone.unwrap_or(0)) * 1_000_000;
            layout.write_branch(out, 0)?;
            write_long(out, micros);
        }
        AvroKind::Time => {
            let (clock, rest) = convert::clock(quoted.as_bytes())?;
            if !rest.is_empty() {
                return None;
            }
            layout.write_branch(out, 0)?;
            write_long(out, clock_micros(clock));
        }
        AvroKind::Bytes | AvroKind::NotNative => return None, // bytea is read directly
    }
    Some(())
}

const MICROS_PER_DAY: i64 = 86_400_000_000;

fn clock_micros((h, m, s, micros): convert::Clock) -> i64 {
    ((i64::from(h) * 60 + i64::from(m)) * 60 + i64::from(s)) * 1_000_000 + i64::from(micros)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (`schemas.pgtime.days_from_civil`).
fn days_from_civil(year: u32, month: u32, day: u32) -> i64 {
    let (year, month, day) = (i64::from(year), i64::from(month), i64::from(day));
    let y = year - i64::from(month <= 2);
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// NaN, Infinity, -Infinity → their DecimalSpecial symbol index.
fn special(text: &str) -> Option<i64> {
    match text {
        "NaN" => Some(0),
        "Infinity" => Some(1),
        "-Infinity" => Some(2),
        _ => None,
    }
}

/// `-?digits(.digits)?` → (unscaled, scale); None beyond 38 significant digits.
fn decimal(text: &str) -> Option<(i128, u32)> {
    let (negative, body) = match text.strip_prefix('-') {
        Some(b) => (true, b),
        None => (false, text),
    };
    let (int, frac) = body.split_once('.').unwrap_or((body, ""));
    let mut unscaled: i128 = 0;
    let mut significant = 0;
    for b in int.bytes().chain(frac.bytes()) {
        if !b.is_ascii_digit() {
            return None;
        }
        if unscaled != 0 || b != b'0' {
            significant += 1;
            if significant > 38 {
                return None;
            }
        }
        unscaled = unscaled * 10 + i128::from(b - b'0');
    }
    let scale = u32::try_from(frac.len()).ok()?;
    Some((if negative { -unscaled } else { unscaled }, scale))
}

/// The number of decimal digits of |n| (1 for 0), as `len(str(abs(n)))`.
fn digits(n: i128) -> u32 {
    let mut n = n.unsigned_abs();
    let mut count = 1;
    while n >= 10 {
        n /= 10;
        count += 1;
    }
    count
}

/// `n.to_bytes((n.bit_length() + 8) // 8, "big", signed=True)` (`schemas.pgvalues._int_bytes`).
fn twos_complement(n: i128) -> Vec<u8> {
    let bit_length = 128 - n.unsigned_abs().leading_zeros() as usize;
    let len = (bit_length + 8) / 8;
    n.to_be_bytes()[16 - len..].to_vec()
}

/// Hex digits (an even number, nothing else) → bytes.
fn hex(text: &str) -> Option<Vec<u8>> {
    let b = text.as_bytes();
    if !b.len().is_multiple_of(2) {
        return None;
    }
    b.chunks(2)
        .map(|pair| Some(convert::hex_digit(pair[0])? << 4 | convert::hex_digit(pair[1])?))
        .collect()
}

/// A long (or int) as a zig-zag varint.
pub fn write_long(out: &mut Vec<u8>, n: i64) {
    let mut z = ((n << 1) ^ (n >> 63)) as u64;
    while z >= 0x80 {
        out.push((z as u8 & 0x7f) | 0x80);
        z >>= 7;
    }
    out.push(z as u8);
}

/// Bytes or a string: the length, then the bytes.
pub fn write_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    write_long(out, bytes.len() as i64);
    out.extend_from_slice(bytes);
}

/// Confluent's framing: magic byte 0, the schema id (4 bytes, big-endian).
pub fn frame(schema_id: u32, capacity: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(capacity);
    out.push(0);
    out.extend_from_slice(&schema_id.to_be_bytes());
    out
}

/// A scalar field: a string or a long, in its union if it has one.
fn write_scalar(out: &mut Vec<u8>, scalar: Scalar, layout: Layout, value: Field) -> Option<()> {
    match value {
        Field::Null => layout.write_null(out),
        Field::Str(s) if scalar == Scalar::String => {
            layout.write_branch(out, 0)?;
            write_bytes(out, s.as_bytes());
            Some(())
        }
        Field::Long(n) if scalar == Scalar::Long => {
            layout.write_branch(out, 0)?;
            write_long(out, n);
            Some(())
        }
        _ => None,
    }
}

/// A `source` or `transaction` field's value.
#[derive(Clone, Copy)]
pub enum Field<'v> {
    Null,
    Str(&'v str),
    Long(i64),
}

/// The `source` record of one table within one call, written once up to the per-change fields.
pub struct SourceTemplate {
    parts: Vec<Part>,
}

enum Part {
    Bytes(Vec<u8>),
    Lsn(Layout),
    EventIndex(Layout),
}

/// What a `source` record says apart from the change's LSN and event index.
pub struct SourceValues<'v> {
    pub version: &'v str,
    pub name: &'v str,
    pub ts_ms: i64,
    pub snapshot: &'v str,
    pub db: &'v str,
    pub schema: &'v str,
    pub table: &'v str,
    pub xid: Option<i64>,
    pub commit_lsn: i64,
}

impl SourceTemplate {
    /// None: a value the schema cannot hold (the Python path raises).
    pub fn new(
        fields: &[(SourceField, Scalar, Layout)],
        v: &SourceValues,
    ) -> Option<SourceTemplate> {
        let mut parts = Vec::new();
        let mut bytes = Vec::with_capacity(128);
        for &(field, scalar, layout) in fields {
            let value = match field {
                SourceField::Version => Field::Str(v.version),
                SourceField::Connector => Field::Str("postgresql"),
                SourceField::Name => Field::Str(v.name),
                SourceField::TsMs => Field::Long(v.ts_ms),
                SourceField::Snapshot => Field::Str(v.snapshot),
                SourceField::Db => Field::Str(v.db),
                SourceField::Schema => Field::Str(v.schema),
                SourceField::Table => Field::Str(v.table),
                SourceField::TxId => v.xid.map_or(Field::Null, Field::Long),
                SourceField::CommitLsn => Field::Long(v.commit_lsn),
                SourceField::Lsn | SourceField::EventIndex => {
                    if scalar != Scalar::Long {
                        return None;
                    }
                    parts.push(Part::Bytes(std::mem::take(&mut bytes)));
                    parts.push(match field {
                        SourceField::Lsn => Part::Lsn(layout),
                        _ => Part::EventIndex(layout),
                    });
                    continue;
                }
            };
            write_scalar(&mut bytes, scalar, layout, value)?;
        }
        parts.push(Part::Bytes(bytes));
        Some(SourceTemplate { parts })
    }

    fn write(&self, out: &mut Vec<u8>, lsn: i64, index: i64) -> Option<()> {
        for part in &self.parts {
            match part {
                Part::Bytes(b) => out.extend_from_slice(b),
                Part::Lsn(layout) => write_scalar(out, Scalar::Long, *layout, Field::Long(lsn))?,
                Part::EventIndex(layout) => {
                    write_scalar(out, Scalar::Long, *layout, Field::Long(index))?
                }
            }
        }
        Some(())
    }
}

/// One row image: the converted columns of the change (each already its field's encoding).
pub type Image<'c, 'a> = Option<&'c Vec<crate::Col<'a>>>;

/// The record key: the key columns' encodings in key order; None when one is missing.
pub fn key(table: &AvroTable, key: &[String], image: &[crate::Col]) -> Option<Vec<u8>> {
    let mut out = frame(table.key_id, 32);
    for k in key {
        let c = image.iter().find(|c| c.name == k.as_str())?;
        out.extend_from_slice(&c.value);
    }
    Some(out)
}

/// The row record of an image: every column in schema order, NULL for one the image lacks.
fn row(out: &mut Vec<u8>, table: &AvroTable, image: &[crate::Col]) -> Option<()> {
    for (i, column) in table.columns.iter().enumerate() {
        let found = match image.get(i) {
            Some(c) if c.name == column.name.as_str() => Some(c),
            _ => image.iter().find(|c| c.name == column.name.as_str()),
        };
        match found {
            Some(c) => out.extend_from_slice(&c.value),
            None => column.layout.write_null(out)?,
        }
    }
    Some(())
}

fn image(out: &mut Vec<u8>, table: &AvroTable, layout: Layout, image: Image) -> Option<()> {
    match image {
        None => layout.write_null(out),
        Some(cols) => {
            layout.write_branch(out, 0)?;
            row(out, table, cols)
        }
    }
}

/// The per-change parts of an envelope.
pub struct Change<'c, 'a> {
    pub op: &'c str,
    pub before: Image<'c, 'a>,
    pub after: Image<'c, 'a>,
    pub lsn: i64,
    pub index: i64,
    pub now_ms: i64,
    pub transaction: Option<(&'c str, i64, i64)>, // id, total_order, data_collection_order
}

/// The framed envelope of a change; None when a value does not fit the schema.
pub fn envelope(table: &AvroTable, source: &SourceTemplate, c: &Change) -> Option<Vec<u8>> {
    let mut out = frame(table.value_id, 512);
    for field in &table.envelope {
        match *field {
            EnvelopeField::Before(layout) => image(&mut out, table, layout, c.before)?,
            EnvelopeField::After(layout) => image(&mut out, table, layout, c.after)?,
            EnvelopeField::Source(layout) => {
                layout.write_branch(&mut out, 0)?;
                source.write(&mut out, c.lsn, c.index)?;
            }
            EnvelopeField::Op(layout) => {
                write_scalar(&mut out, Scalar::String, layout, Field::Str(c.op))?
            }
            EnvelopeField::TsMs(layout) => {
                write_scalar(&mut out, Scalar::Long, layout, Field::Long(c.now_ms))?
            }
            EnvelopeField::Transaction(layout) => match c.transaction {
                None => layout.write_null(&mut out)?,
                Some((id, total, per_table)) => {
                    layout.write_branch(&mut out, 0)?;
                    for &(f, scalar, l) in &table.transaction {
                        let value = match f {
                            TxnField::Id => Field::Str(id),
                            TxnField::TotalOrder => Field::Long(total),
                            TxnField::DataCollectionOrder => Field::Long(per_table),
                        };
                        write_scalar(&mut out, scalar, l, value)?;
                    }
                }
            },
        }
    }
    Some(out)
}
