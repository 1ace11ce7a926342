//! Tideline's native capture core: wal2json format-version 2 payloads or pgoutput row messages →
//! change-event envelopes and record keys, a whole run of payloads per call (see `capture/native/core.py`
//! for how it is driven and `docs/capture.md` for what is native and what falls back).
//!
//! Contract: for every payload it handles, the bytes it returns are exactly those the Python
//! reference path (`capture.decoders.wal2json` or `capture.decoders.pgoutput` → `capture.events` →
//! `capture.converters.JsonConverter`, or `AvroConverter` with [`ValueFormat::Avro`]: see `avro.rs`)
//! would produce. Each plugin's reader turns a payload into a plugin-neutral [`Change`] (row images
//! of columns converted to the core's format); [`build`] makes its events. Anything it is not sure
//! about — a record that is not an INSERT/UPDATE/DELETE, a
//! table not registered, a type it does not convert, a malformed or unusual field, a row big enough
//! to be TOASTed, a missing (unchanged TOAST) column, a key change — makes it stop *before* that
//! payload and say so: the caller runs that payload through the Python path and calls again. It
//! never raises for bad input; the Python path raises the reference error.

mod avro;
mod convert;
mod json;
mod kafka;
mod pgoutput;
mod snapshot;
mod stream;

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use convert::{Kind, NOT_NATIVE};
use json::{parse_obj, parse_record, raw_i64, raw_str, Obj, Record};
use pgoutput::{RelColumn, Relation};

const VERSION: &str = "tideline-0.1";
pub(crate) const TOAST_MIN_ROW_BYTES: usize = 1024;
const XLOG_BODY: usize = 25; // b"w" and three Int64 (data start, WAL end, send time): then the payload
pub(crate) const UNAVAILABLE: &str = "__debezium_unavailable_value";

/// What the core knows of one captured table (registered from its `TableInfo`).
struct Table {
    id: usize,
    schema: String,
    name: String,
    qualified: String,
    columns: Vec<String>,
    key: Vec<String>,
    toastable: Vec<String>,
    replica_full: bool,
    avro: Option<avro::AvroTable>, // what its Avro keys and values are written with (Avro only)
}

/// One converted column of a row image: its name and its value in the core's format (JSON text, or
/// the Avro encoding of its row field, union branch included).
#[derive(Clone)]
pub(crate) struct Col<'a> {
    pub name: std::borrow::Cow<'a, str>,
    pub value: Vec<u8>,
    pub size: usize, // capture.events.ToastCache.size_of's measure of the Python value
    pub unavailable: bool, // a text value equal to the UNAVAILABLE marker
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    Insert,
    Update,
    Delete,
}

/// A row change as a plugin gives it (capture.messages.ChangeMessage's part that matters here): the new
/// row (``columns``) and the old key or row (``identity``), each None when the payload has none.
pub(crate) struct Change<'a> {
    pub action: Action,
    pub lsn: u64,
    pub after: Option<Vec<Col<'a>>>,
    pub identity: Option<Vec<Col<'a>>>,
}

/// Which plugin's payloads the core reads: `tideline_native.Plugin`, the counterpart of
/// `capture.messages.Plugin`'s members whose capabilities say the core decodes them (mapped in one
/// place, `capture/native/handle.py`). A Python enum, not a string: a plugin without a member here
/// cannot reach the core (no string is ever read as wal2json).
#[pyclass(eq, hash, frozen, module = "tideline_native")]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Plugin {
    /// wal2json format-version 2 records
    #[pyo3(name = "WAL2JSON")]
    Wal2json,
    /// pgoutput protocol messages (row messages decoded with the Relation messages given)
    #[pyo3(name = "PGOUTPUT")]
    Pgoutput,
}

/// The format the core writes keys and values in: `tideline_native.ValueFormat`, the counterpart of
/// `capture.config.ValueFormat` (mapped with [`Plugin`]).
#[pyclass(eq, hash, frozen, module = "tideline_native")]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum ValueFormat {
    /// JSON envelopes and keys (capture.converters.JsonConverter)
    #[pyo3(name = "JSON")]
    Json,
    /// Confluent-framed Avro (avro.rs): a table's changes are handled once its layout is registered
    #[pyo3(name = "AVRO")]
    Avro,
}

/// Outputs of one table within one call: its records' keys and values as Arrow binary arrays (no Python
/// object per record), and the key-state changes in order (key, deleted), handed over as two key sets.
struct Out {
    table: usize,
    count: i64,
    keys: BinaryColumn,
    values: BinaryColumn,
    nbytes: usize,
    keystate: Vec<(Vec<u8>, bool)>,
}

/// A set of keys as the key state applies it in one SQL statement (capture.keystate.KeySet): the keys back
/// to back, and a JSON array with one integer per key, ``start << 32 | length`` (``start`` 1-based, as
/// SQLite's ``substr`` counts a blob's bytes).
type KeySet<'py> = (Bound<'py, PyBytes>, String);

/// The key-state changes of a run as two key sets, the keys put (small rows: nothing to keep) and the keys
/// deleted: each key in at most one of them, as its last change in the run left it (None: an empty set).
#[allow(clippy::type_complexity)]
fn key_sets<'py>(
    py: Python<'py>,
    changes: &[(Vec<u8>, bool)],
) -> PyResult<(Option<KeySet<'py>>, Option<KeySet<'py>>)> {
    let mut seen: std::collections::HashSet<&[u8]> = std::collections::HashSet::new();
    let mut sets: [(Vec<u8>, String); 2] =
        [(Vec::new(), String::new()), (Vec::new(), String::new())];
    for (key, deleted) in changes.iter().rev() {
        if !seen.insert(key.as_slice()) {
            continue; // a later change of the key decides
        }
        let (data, spans) = &mut sets[usize::from(*deleted)];
        let start = u64::try_from(data.len() + 1).expect("usize fits u64");
        let length = u64::try_from(key.len()).expect("usize fits u64");
        if start >= 1 << 31 || length >= 1 << 32 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "key sets: a key of {length} bytes at byte {start} (the spans hold 31-bit starts)"
            )));
        }
        spans.push(if spans.is_empty() { '[' } else { ',' });
        spans.push_str(itoa::Buffer::new().format(start << 32 | length));
        data.extend_from_slice(key);
    }
    let [puts, deletes] = sets.map(|(data, mut spans)| {
        (!spans.is_empty()).then(|| {
            spans.push(']');
            (PyBytes::new(py, &data), spans)
        })
    });
    Ok((puts, deletes))
}

/// An Arrow binary array under construction: the values back to back, ``len + 1`` little-endian i32 offsets
/// (the first 0), and a validity bitmap (bit ``i`` of byte ``i / 8`` set: value ``i`` is not null).
struct BinaryColumn {
    data: Vec<u8>,
    offsets: Vec<u8>,
    validity: Vec<u8>,
    len: usize,
    nulls: usize,
}

/// ``(data, offsets, validity or None when nothing is null, null count, length)`` of a :class:`BinaryColumn`.
type ColumnBuffers<'py> = (
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Option<Bound<'py, PyBytes>>,
    usize,
    usize,
);

impl BinaryColumn {
    fn new() -> Self {
        BinaryColumn {
            data: Vec::new(),
            offsets: 0i32.to_le_bytes().to_vec(),
            validity: Vec::new(),
            len: 0,
            nulls: 0,
        }
    }

    /// Whether ``more`` bytes of values still fit the i32 offsets of an Arrow binary array.
    fn fits(&self, more: usize) -> bool {
        self.data.len().saturating_add(more) <= i32::MAX as usize
    }

    fn push(&mut self, value: Option<&[u8]>) {
        if self.len.is_multiple_of(8) {
            self.validity.push(0);
        }
        match value {
            Some(v) => {
                self.data.extend_from_slice(v);
                self.validity[self.len / 8] |= 1 << (self.len % 8);
            }
            None => self.nulls += 1,
        }
        self.len += 1;
        let end =
            i32::try_from(self.data.len()).expect("checked by fits() before the change was taken");
        self.offsets.extend_from_slice(&end.to_le_bytes());
    }

    fn into_buffers(self, py: Python<'_>) -> ColumnBuffers<'_> {
        let validity = (self.nulls > 0).then(|| PyBytes::new(py, &self.validity));
        (
            PyBytes::new(py, &self.data),
            PyBytes::new(py, &self.offsets),
            validity,
            self.nulls,
            self.len,
        )
    }
}

/// A change the core produced (built before any state moves, so a late fallback changes nothing).
struct Built {
    table: usize,
    values: Vec<Option<Vec<u8>>>, // the change's events in order, all under ``key``
    key: Option<Vec<u8>>,
    keystate: Option<bool>, // Some(false): put, Some(true): delete
    counted: bool,
}

/// ``(handled, index, total_order, per_table_counts, outputs)`` of one ``process`` call.
type Processed = (usize, i64, i64, Vec<(String, i64)>, Vec<PyObject>);

#[pyclass(module = "tideline_native")]
struct Core {
    prefix: String,
    db: String,
    plugin: Plugin,
    by_name: HashMap<(String, String), usize>,
    tables: Vec<Option<Table>>,
    relations: HashMap<u32, Relation>, // pgoutput: relation OID → its Relation message and table
    value_format: ValueFormat,         // Avro: tables handled only once their layout is registered
}

/// The format the core writes a table's values in, with what it needs for it.
#[derive(Clone, Copy)]
pub(crate) enum Format<'t> {
    Json,
    Avro(&'t avro::AvroTable),
}

#[pymethods]
impl Core {
    /// ``plugin``: :class:`Plugin` (whose payloads :meth:`process` reads); ``value_format``:
    /// :class:`ValueFormat` (Avro: a table's changes are handled once :meth:`register_avro` gave its
    /// layout). Both required, as members of these enums: anything else is a TypeError.
    #[new]
    #[pyo3(signature = (prefix, db, plugin, value_format))]
    fn new(prefix: String, db: String, plugin: Plugin, value_format: ValueFormat) -> Self {
        Core {
            prefix,
            db,
            plugin,
            by_name: HashMap::new(),
            tables: Vec::new(),
            relations: HashMap::new(),
            value_format,
        }
    }

    /// pgoutput: the Relation message the Python decoder holds for ``oid`` (column names, type OIDs,
    /// replica identity key flags), whose changes go to the registered table ``table_id``. A relation
    /// with a column named twice is not registered (its changes take the Python path).
    fn register_relation(
        &mut self,
        oid: u32,
        table_id: usize,
        names: Vec<String>,
        type_oids: Vec<i64>,
        key_flags: Vec<bool>,
    ) -> PyResult<()> {
        if names.len() != type_oids.len() || names.len() != key_flags.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "register_relation: names, type_oids and key_flags differ in length",
            ));
        }
        self.relations.remove(&oid);
        if names
            .iter()
            .enumerate()
            .any(|(i, n)| names[..i].contains(n))
        {
            return Ok(());
        }
        let columns = names
            .into_iter()
            .zip(type_oids)
            .zip(key_flags)
            .map(|((name, oid), is_key)| RelColumn {
                name,
                oid,
                kind: convert::kind_of(oid),
                is_key,
            })
            .collect();
        self.relations.insert(
            oid,
            Relation {
                table: table_id,
                columns,
            },
        );
        Ok(())
    }

    /// pgoutput: forget a relation (the Python decoder read a new Relation message for it).
    fn forget_relation(&mut self, oid: u32) {
        self.relations.remove(&oid);
    }

    /// Register (or replace) a table the core may handle; ``table_id`` is the caller's handle for it.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (table_id, schema, name, columns, key, toastable, replica_identity))]
    fn register_table(
        &mut self,
        table_id: usize,
        schema: String,
        name: String,
        columns: Vec<String>,
        key: Vec<String>,
        toastable: Vec<String>,
        replica_identity: &str,
    ) {
        let qualified = format!("{schema}.{name}");
        self.by_name
            .insert((schema.clone(), name.clone()), table_id);
        if self.tables.len() <= table_id {
            self.tables.resize_with(table_id + 1, || None);
        }
        self.tables[table_id] = Some(Table {
            id: table_id,
            schema,
            name,
            qualified,
            columns,
            key,
            toastable,
            replica_full: replica_identity == "f",
            avro: None,
        });
    }

    /// Avro: how a registered table's keys and values are written (after each :meth:`register_table` of it).
    /// ``columns``: per row field in order ``(name, type OID, kind, precision, scale, null branch, value
    /// branch)`` (kind: ``schemas.pgavro.Kind``'s value, or anything else for a kind only NULL is written
    /// of; branches: the union indexes, -1 for none); ``envelope``: ``(name, null branch, value branch)``
    /// per envelope field in order; ``source`` and ``transaction``: ``(name, "string" | "long", null branch,
    /// value branch)`` per field in order.
    #[allow(clippy::too_many_arguments)]
    fn register_avro(
        &mut self,
        table_id: usize,
        key_id: u32,
        value_id: u32,
        columns: Vec<AvroColumnArgs>,
        envelope: Vec<(String, i64, i64)>,
        source: Vec<(String, String, i64, i64)>,
        transaction: Vec<(String, String, i64, i64)>,
    ) -> PyResult<()> {
        let bad = |what: &str, name: &str| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "register_avro: unknown {what} {name:?}"
            ))
        };
        let scalar = |name: &str| avro::Scalar::named(name).ok_or_else(|| bad("field type", name));
        let columns = columns
            .into_iter()
            .map(
                |(name, oid, type_name, kind, precision, scale, null, value)| avro::AvroColumn {
                    name,
                    oid,
                    type_name,
                    kind: avro::AvroKind::named(&kind, precision, scale),
                    layout: avro::Layout::of(null, value),
                },
            )
            .collect();
        let envelope = envelope
            .into_iter()
            .map(|(name, null, value)| {
                let layout = avro::Layout::of(null, value);
                Ok(match name.as_str() {
                    "before" => avro::EnvelopeField::Before(layout),
                    "after" => avro::EnvelopeField::After(layout),
                    "source" => avro::EnvelopeField::Source(layout),
                    "op" => avro::EnvelopeField::Op(layout),
                    "ts_ms" => avro::EnvelopeField::TsMs(layout),
                    "transaction" => avro::EnvelopeField::Transaction(layout),
                    other => return Err(bad("envelope field", other)),
                })
            })
            .collect::<PyResult<_>>()?;
        let source = source
            .into_iter()
            .map(|(name, kind, null, value)| {
                let field = match name.as_str() {
                    "version" => avro::SourceField::Version,
                    "connector" => avro::SourceField::Connector,
                    "name" => avro::SourceField::Name,
                    "ts_ms" => avro::SourceField::TsMs,
                    "snapshot" => avro::SourceField::Snapshot,
                    "db" => avro::SourceField::Db,
                    "schema" => avro::SourceField::Schema,
                    "table" => avro::SourceField::Table,
                    "txId" => avro::SourceField::TxId,
                    "commit_lsn" => avro::SourceField::CommitLsn,
                    "lsn" => avro::SourceField::Lsn,
                    "event_index" => avro::SourceField::EventIndex,
                    other => return Err(bad("source field", other)),
                };
                Ok((field, scalar(&kind)?, avro::Layout::of(null, value)))
            })
            .collect::<PyResult<_>>()?;
        let transaction = transaction
            .into_iter()
            .map(|(name, kind, null, value)| {
                let field = match name.as_str() {
                    "id" => avro::TxnField::Id,
                    "total_order" => avro::TxnField::TotalOrder,
                    "data_collection_order" => avro::TxnField::DataCollectionOrder,
                    other => return Err(bad("transaction field", other)),
                };
                Ok((field, scalar(&kind)?, avro::Layout::of(null, value)))
            })
            .collect::<PyResult<_>>()?;
        let table = self
            .tables
            .get_mut(table_id)
            .and_then(|t| t.as_mut())
            .ok_or_else(|| {
                pyo3::exceptions::PyValueError::new_err(format!(
                    "register_avro: table {table_id} is not registered"
                ))
            })?;
        table.avro = Some(avro::AvroTable {
            key_id,
            value_id,
            columns,
            envelope,
            source,
            transaction,
        });
        Ok(())
    }

    /// Forget a table (the caller's catalog no longer lets the core handle it).
    fn unregister_table(&mut self, schema: String, name: String) {
        if let Some(id) = self.by_name.remove(&(schema, name)) {
            if let Some(slot) = self.tables.get_mut(id) {
                *slot = None;
            }
            self.relations.retain(|_, r| r.table != id);
        }
    }

    /// Handle the messages of a run from ``start`` on until one needs the Python path, or ``limit`` are
    /// handled. The run is one buffer, ``data``, and where each message starts in it and the last ends,
    /// ``offsets`` (native-endian u32: what :func:`read_xlog` returns). Each is an XLogData message as it
    /// came: b"w", Int64 data start (a pgoutput row message's LSN), Int64 WAL end, Int64 send time, then the
    /// plugin's payload.
    ///
    /// Returns ``(handled, index, total_order, per_table_counts, outputs)``; ``outputs`` is a list of
    /// ``(table_id, changes, keys, values, nbytes, puts, deletes)``: ``keys`` and ``values`` the records' as
    /// Arrow binary arrays' buffers ``(data, offsets, validity or None, null count, length)`` (a keyless
    /// table's keys all null, a tombstone's value null); ``puts`` and ``deletes`` the key state's changes as
    /// two key sets (:func:`key_sets`; None: empty). Every change with a key drops that key from the TOAST
    /// cache (its row is small): the caller takes them from ``keys``.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (data, offsets, start, limit, xid, commit_lsn, ts_ms, snapshot, total_order, per_table, index, now_ms))]
    fn process<'py>(
        &self,
        py: Python<'py>,
        data: &[u8],
        offsets: &[u8],
        start: usize,
        limit: usize,
        xid: Option<i64>,
        commit_lsn: u64,
        ts_ms: i64,
        snapshot: &str,
        mut total_order: i64,
        per_table: &Bound<'py, PyDict>,
        mut index: i64,
        now_ms: i64,
    ) -> PyResult<Processed> {
        let mut outs: Vec<Out> = Vec::new();
        let mut slot_of: HashMap<usize, usize> = HashMap::new();
        let mut counts: HashMap<usize, i64> = HashMap::new();
        let mut sources: HashMap<usize, Source> = HashMap::new();
        let mut handled = 0usize;
        let count = (offsets.len() / 4).saturating_sub(1);
        let end = count.min(start.saturating_add(limit));
        let mut i = start;
        while i < end {
            let Some(message) = stream::message(data, offsets, i) else {
                break;
            };
            if message.len() < XLOG_BODY || message[0] != b'w' {
                break;
            }
            let data_start = u64::from_be_bytes(message[1..9].try_into().expect("8 bytes"));
            let payload = &message[XLOG_BODY..];
            let record; // wal2json: the parsed record the change borrows from
            let (table_id, change) = match self.plugin {
                Plugin::Wal2json => {
                    let Some(rec) = parse_record(payload) else {
                        break;
                    };
                    record = rec;
                    let Some(table_id) = self.route(&record.obj) else {
                        break;
                    };
                    let Some(format) = self.format_of(table_id) else {
                        break;
                    };
                    let Some(change) = wal2json_change(&record, format) else {
                        break;
                    };
                    (table_id, change)
                }
                Plugin::Pgoutput => {
                    let lsn = data_start;
                    let Some(relation) =
                        pgoutput::relation_oid(payload).and_then(|oid| self.relations.get(&oid))
                    else {
                        break;
                    };
                    let Some(format) = self.format_of(relation.table) else {
                        break;
                    };
                    let Some(change) = pgoutput::change(payload, lsn, relation, format) else {
                        break;
                    };
                    (relation.table, change)
                }
            };
            let table = self.tables[table_id]
                .as_ref()
                .expect("routed to a registered table");
            // the table's count in the transaction before this change (its data_collection_order - 1)
            let before_count = match counts.get(&table_id) {
                Some(n) => *n,
                None => match per_table.get_item(&table.qualified)? {
                    Some(v) => v.extract::<i64>()?,
                    None => 0,
                },
            };
            let source = match sources.entry(table_id) {
                Entry::Occupied(found) => found.into_mut(),
                Entry::Vacant(slot) => {
                    match self.source_of(table, ts_ms, snapshot, xid, commit_lsn) {
                        Some(source) => slot.insert(source),
                        None => break,
                    }
                }
            };
            let position = Position {
                xid,
                commit_lsn,
                total_order,
                table_count: before_count,
                index,
                now_ms,
            };
            let Some(built) = build(change, table, source, &position) else {
                break;
            };
            // the table's arrays must still hold the change (i32 offsets); else it starts the next run
            let size: usize = built
                .values
                .iter()
                .map(|v| v.as_ref().map_or(0, Vec::len))
                .sum();
            let key_size = built.key.as_ref().map_or(0, Vec::len) * built.values.len();
            if let Some(&slot) = slot_of.get(&built.table) {
                if !outs[slot].values.fits(size) || !outs[slot].keys.fits(key_size) {
                    break;
                }
            }
            // commit the change's effects
            index += 1;
            if built.counted {
                total_order += 1;
                counts.insert(table_id, before_count + 1);
            }
            let slot = *slot_of.entry(built.table).or_insert_with(|| {
                outs.push(Out {
                    table: built.table,
                    count: 0,
                    keys: BinaryColumn::new(),
                    values: BinaryColumn::new(),
                    nbytes: 0,
                    keystate: Vec::new(),
                });
                outs.len() - 1
            });
            let out = &mut outs[slot];
            out.count += 1;
            let key = built.key.as_deref();
            for v in &built.values {
                out.nbytes += key.map_or(0, <[u8]>::len) + v.as_ref().map_or(0, Vec::len);
                out.keys.push(key);
                out.values.push(v.as_deref());
            }
            if let (Some(key), Some(delete)) = (key, built.keystate) {
                out.keystate.push((key.to_vec(), delete));
            }
            handled += 1;
            i += 1;
        }
        let mut per_table_counts = Vec::with_capacity(counts.len());
        for (id, n) in counts {
            let table = self.tables[id]
                .as_ref()
                .expect("counted a registered table");
            per_table_counts.push((table.qualified.clone(), n));
        }
        let mut outputs = Vec::with_capacity(outs.len());
        for o in outs {
            let (puts, deletes) = key_sets(py, &o.keystate)?;
            let tuple = (
                o.table,
                o.count,
                o.keys.into_buffers(py),
                o.values.into_buffers(py),
                o.nbytes,
                puts,
                deletes,
            );
            outputs.push(tuple.into_pyobject(py)?.into_any().unbind());
        }
        Ok((handled, index, total_order, per_table_counts, outputs))
    }

    /// The JSON text of a string as the Python path writes it (orjson's escaping); for tests.
    #[staticmethod]
    fn json_string(text: &str) -> Vec<u8> {
        let mut out = Vec::new();
        json::write_str(&mut out, text);
        out
    }

    /// A double as the Python path writes it (orjson's shortest form); for tests.
    #[staticmethod]
    fn json_float(value: f64) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        convert::write_f64(&mut out, value).then_some(out)
    }
}

impl Core {
    /// The format a registered table's values are written in (None: not registered, or Avro without its layout).
    fn format_of(&self, table_id: usize) -> Option<Format<'_>> {
        let table = self.tables.get(table_id)?.as_ref()?;
        match self.value_format {
            ValueFormat::Json => Some(Format::Json),
            ValueFormat::Avro => table.avro.as_ref().map(Format::Avro),
        }
    }

    /// A table's `source` for one call (None: a value its Avro schema cannot hold).
    fn source_of(
        &self,
        table: &Table,
        ts_ms: i64,
        snapshot: &str,
        xid: Option<i64>,
        commit_lsn: u64,
    ) -> Option<Source> {
        let Some(spec) = &table.avro else {
            return Some(Source::Json(source_prefix_of(
                &self.prefix,
                &self.db,
                table,
                ts_ms,
                snapshot,
                xid,
                commit_lsn,
            )));
        };
        let values = avro::SourceValues {
            version: VERSION,
            name: &self.prefix,
            ts_ms,
            snapshot,
            db: &self.db,
            schema: &table.schema,
            table: &table.name,
            xid,
            commit_lsn: i64::try_from(commit_lsn).ok()?,
        };
        avro::SourceTemplate::new(&spec.source, &values).map(Source::Avro)
    }

    /// The registered table a payload is a row change of (None: not an I/U/D record of one).
    fn route(&self, obj: &Obj) -> Option<usize> {
        let action = raw_str(obj.get("action")?)?;
        if !matches!(&*action, "I" | "U" | "D") {
            return None;
        }
        let schema = raw_str(obj.get("schema")?)?;
        let table = raw_str(obj.get("table")?)?;
        let id = *self
            .by_name
            .get(&(schema.into_owned(), table.into_owned()))?;
        self.tables.get(id)?.as_ref().map(|t| t.id)
    }
}

fn source_prefix_of(
    prefix: &str,
    db: &str,
    table: &Table,
    ts_ms: i64,
    snapshot: &str,
    xid: Option<i64>,
    commit_lsn: u64,
) -> Vec<u8> {
    let mut s = Vec::with_capacity(256);
    s.extend_from_slice(b"{\"version\":");
    json::write_str(&mut s, VERSION);
    s.extend_from_slice(b",\"connector\":\"postgresql\",\"name\":");
    json::write_str(&mut s, prefix);
    s.extend_from_slice(format!(",\"ts_ms\":{ts_ms},\"snapshot\":").as_bytes());
    json::write_str(&mut s, snapshot);
    s.extend_from_slice(b",\"db\":");
    json::write_str(&mut s, db);
    s.extend_from_slice(b",\"schema\":");
    json::write_str(&mut s, &table.schema);
    s.extend_from_slice(b",\"table\":");
    json::write_str(&mut s, &table.name);
    match xid {
        Some(x) => s.extend_from_slice(format!(",\"txId\":{x}").as_bytes()),
        None => s.extend_from_slice(b",\"txId\":null"),
    }
    s.extend_from_slice(format!(",\"commit_lsn\":{commit_lsn}").as_bytes());
    s
}

/// A wal2json I/U/D record → its change (the columns its action reads, converted), or None when it
/// must take the Python path. The record-level fields are checked as the reference decoder checks them.
fn wal2json_change<'a>(record: &Record<'a>, format: Format) -> Option<Change<'a>> {
    let rec = &record.obj;
    let action = raw_str(rec.get("action")?)?;
    let xid_raw = rec.get("xid")?;
    if xid_raw.get() != "null" {
        raw_i64(xid_raw)?;
    }
    let ts_raw = rec.get("timestamp")?;
    if ts_raw.get() != "null" && !convert::commit_timestamp_ok(&raw_str(ts_raw)?) {
        return None;
    }
    let lsn = convert::lsn(&raw_str(rec.get("lsn")?)?)?;
    raw_str(rec.get("schema")?)?;
    raw_str(rec.get("table")?)?;
    if let Some(pk) = rec.get("pk") {
        let items: Vec<&serde_json::value::RawValue> = serde_json::from_str(pk.get()).ok()?;
        for item in items {
            parse_obj(item.get().as_bytes())?.get("name")?;
        }
    }
    // the reference converts an identity wherever it is (an INSERT's too), and checks its names
    let identity = match &record.identity {
        Some(_) => Some(columns(record.identity.as_ref(), format)?),
        None => None,
    };
    let (action, after) = match &*action {
        "I" => (
            Action::Insert,
            Some(columns(record.columns.as_ref(), format)?),
        ),
        "U" => (
            Action::Update,
            Some(columns(record.columns.as_ref(), format)?),
        ),
        "D" => (Action::Delete, None),
        _ => return None,
    };
    Some(Change {
        action,
        lsn,
        after,
        identity,
    })
}

/// A table's `source` within one call: the JSON path's text up to the change's LSN, or the Avro template.
enum Source {
    Json(Vec<u8>),
    Avro(avro::SourceTemplate),
}

/// The transaction's and the change's counters an event carries.
struct Position {
    xid: Option<i64>,
    commit_lsn: u64,
    total_order: i64,
    table_count: i64,
    index: i64,
    now_ms: i64,
}

/// The events of one row change of ``table``, or None when it must take the Python path.
fn build(change: Change, table: &Table, source: &Source, at: &Position) -> Option<Built> {
    let lsn = change.lsn;
    let (order, per_table) = (at.total_order + 1, at.table_count + 1);
    let render =
        |op: &str, before: Option<&Vec<Col>>, after: Option<&Vec<Col>>| -> Option<Vec<u8>> {
            match source {
                Source::Json(prefix) => {
                    let mut s = Vec::with_capacity(prefix.len() + 48);
                    s.extend_from_slice(prefix);
                    s.extend_from_slice(b",\"lsn\":");
                    write_int(&mut s, lsn);
                    s.extend_from_slice(b",\"event_index\":");
                    write_int(&mut s, at.index);
                    s.push(b'}');
                    let txn = at.xid.map(|x| {
                        let mut t = Vec::with_capacity(96);
                        t.extend_from_slice(b"{\"id\":\"");
                        write_int(&mut t, x);
                        t.push(b':');
                        write_int(&mut t, at.commit_lsn);
                        t.extend_from_slice(b"\",\"total_order\":");
                        write_int(&mut t, order);
                        t.extend_from_slice(b",\"data_collection_order\":");
                        write_int(&mut t, per_table);
                        t.push(b'}');
                        t
                    });
                    Some(envelope(
                        op.as_bytes(),
                        before,
                        after,
                        &s,
                        txn.as_deref(),
                        at.now_ms,
                    ))
                }
                Source::Avro(template) => {
                    let id = at.xid.map(|x| format!("{x}:{}", at.commit_lsn));
                    let change = avro::Change {
                        op,
                        before,
                        after,
                        lsn: i64::try_from(lsn).ok()?,
                        index: at.index,
                        now_ms: at.now_ms,
                        transaction: id.as_deref().map(|id| (id, order, per_table)),
                    };
                    avro::envelope(table.avro.as_ref()?, template, &change)
                }
            }
        };
    // the record key (Some(None): a keyless table's; None: the Python path must write it)
    let key_of = |image: &Vec<Col>| -> Option<Option<Vec<u8>>> {
        if table.key.is_empty() {
            return Some(None);
        }
        match source {
            Source::Json(_) => Some(json_key(table, image)),
            Source::Avro(_) => Some(Some(avro::key(table.avro.as_ref()?, &table.key, image)?)),
        }
    };
    let counted = at.xid.is_some();
    let known = |c: &Col| table.columns.iter().any(|k| *k == c.name);
    match change.action {
        Action::Insert => {
            let after = change.after?;
            if after.len() != table.columns.len() || !after.iter().all(known) {
                return None; // the table changed: the Python path reads the catalog again
            }
            if let Some(identity) = &change.identity {
                if !identity.iter().all(known) {
                    return None;
                }
            }
            let key = key_of(&after)?;
            if key.is_some() && toast_sized(table, &after)? {
                return None;
            }
            let value = render("c", None, Some(&after))?;
            let keystate = key.as_ref().map(|_| false);
            Some(Built {
                table: table.id,
                values: vec![Some(value)],
                key,
                keystate,
                counted,
            })
        }
        Action::Delete => {
            if table.key.is_empty() {
                return None;
            }
            let before = change.identity?;
            if !before.iter().all(known) {
                return None;
            }
            let key = key_of(&before)??;
            let value = render("d", Some(&before), None)?;
            Some(Built {
                table: table.id,
                values: vec![Some(value), None],
                key: Some(key),
                keystate: Some(true),
                counted,
            })
        }
        Action::Update => {
            if table.key.is_empty() {
                return None;
            }
            let after = change.after?;
            if after.len() != table.columns.len() || !after.iter().all(known) {
                return None; // an unchanged TOAST column left out, or the table changed
            }
            let identity = change.identity.filter(|cols| !cols.is_empty());
            if let Some(cols) = &identity {
                if !cols.iter().all(known) {
                    return None;
                }
            }
            let old_key = key_of(identity.as_ref().unwrap_or(&after))??;
            let key = key_of(&after)??;
            if key != old_key || toast_sized(table, &after)? {
                return None; // a key change, or a row big enough to be TOASTed
            }
            let before = if table.replica_full {
                identity.as_ref()
            } else {
                None
            };
            let value = render("u", before, Some(&after))?;
            Some(Built {
                table: table.id,
                values: vec![Some(value)],
                key: Some(key),
                keystate: None,
                counted,
            })
        }
    }
}

/// :meth:`Core.register_avro`'s description of one row field: (name, type OID, type name, kind, precision,
/// scale, null branch, value branch).
type AvroColumnArgs = (String, i64, String, String, u32, u32, i64, i64);

/// Whether the row's TOAST-able values are big enough to be cached (None: a value the Python path must judge).
fn toast_sized(table: &Table, after: &[Col]) -> Option<bool> {
    if table.toastable.is_empty() {
        return Some(false);
    }
    let mut total = 0usize;
    for c in after {
        if table.toastable.iter().any(|t| *t == c.name) {
            if c.unavailable {
                return None;
            }
            total += c.size;
        }
    }
    Some(total >= TOAST_MIN_ROW_BYTES)
}

/// A record's column array, converted; None when absent or on anything unusual.
fn columns<'a>(items: Option<&Vec<Obj<'a>>>, format: Format) -> Option<Vec<Col<'a>>> {
    let items = items?;
    let mut out: Vec<Col<'a>> = Vec::with_capacity(items.len());
    for (position, obj) in items.iter().enumerate() {
        let name = raw_str(obj.get("name")?)?;
        let type_name = raw_str(obj.get("type")?)?;
        let oid = raw_i64(obj.get("typeoid")?)?;
        let value = obj.get("value")?;
        if out.iter().any(|c| c.name == name) {
            return None; // a duplicate column name: the reference keeps the first position, the last value
        }
        let input = if value.get() == "null" {
            convert::Input::Null
        } else {
            convert::Input::Wal2json(value.get())
        };
        out.push(column(
            name,
            position,
            oid,
            Some(&type_name),
            input,
            format,
        )?);
    }
    Some(out)
}

/// One column's value in the table's format (None: the Python path must convert it).
pub(crate) fn column<'a>(
    name: std::borrow::Cow<'a, str>,
    position: usize,
    oid: i64,
    type_name: Option<&str>,
    input: convert::Input,
    format: Format,
) -> Option<Col<'a>> {
    let mut value = Vec::new();
    let (size, unavailable) = match format {
        Format::Avro(table) => {
            let spec = table.column(&name, position)?;
            if type_name.is_some_and(|t| t != spec.type_name) {
                return None; // another type than the schema's (ALTER COLUMN … TYPE): capture.shapes decides
            }
            avro::column_value(spec, oid, input, &mut value)?
        }
        Format::Json => {
            let kind = convert::kind_of(oid);
            match input {
                convert::Input::Null => {
                    value.extend_from_slice(b"null");
                    (16, false)
                }
                _ if kind == NOT_NATIVE => return None,
                convert::Input::Wal2json(raw) => {
                    let size = convert::value(kind, raw, &mut value)?;
                    let unavailable =
                        matches!(kind, Kind::Text) && json::str_of(raw)? == UNAVAILABLE;
                    (size, unavailable)
                }
                convert::Input::Text(text) => {
                    let size = convert::text_value(kind, text, &mut value)?;
                    (size, kind == Kind::Text && text == UNAVAILABLE)
                }
            }
        }
    };
    Some(Col {
        name,
        value,
        size,
        unavailable,
    })
}

/// The record key: JSON ``{<key column>: value, …}`` in key order (null for a column the image lacks).
fn json_key(table: &Table, image: &[Col]) -> Option<Vec<u8>> {
    if table.key.is_empty() {
        return None;
    }
    let mut out = Vec::with_capacity(32);
    out.push(b'{');
    for (n, k) in table.key.iter().enumerate() {
        if n > 0 {
            out.push(b',');
        }
        json::write_str(&mut out, k);
        out.push(b':');
        match image.iter().find(|c| c.name == k.as_str()) {
            Some(c) => out.extend_from_slice(&c.value),
            None => out.extend_from_slice(b"null"),
        }
    }
    out.push(b'}');
    Some(out)
}

fn image_json(out: &mut Vec<u8>, image: Option<&Vec<Col>>) {
    match image {
        None => out.extend_from_slice(b"null"),
        Some(cols) => {
            out.push(b'{');
            for (n, c) in cols.iter().enumerate() {
                if n > 0 {
                    out.push(b',');
                }
                json::write_str(out, &c.name);
                out.push(b':');
                out.extend_from_slice(&c.value);
            }
            out.push(b'}');
        }
    }
}

fn envelope(
    op: &[u8],
    before: Option<&Vec<Col>>,
    after: Option<&Vec<Col>>,
    source: &[u8],
    txn: Option<&[u8]>,
    now_ms: i64,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(b"{\"before\":");
    image_json(&mut out, before);
    out.extend_from_slice(b",\"after\":");
    image_json(&mut out, after);
    out.extend_from_slice(b",\"source\":");
    out.extend_from_slice(source);
    out.extend_from_slice(b",\"op\":\"");
    out.extend_from_slice(op);
    out.extend_from_slice(b"\",\"ts_ms\":");
    write_int(&mut out, now_ms);
    out.extend_from_slice(b",\"transaction\":");
    out.extend_from_slice(txn.unwrap_or(b"null"));
    out.push(b'}');
    out
}

#[pymodule]
fn tideline_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Core>()?;
    m.add_class::<Plugin>()?;
    m.add_class::<ValueFormat>()?;
    m.add_class::<snapshot::SnapshotEncoder>()?;
    m.add_function(wrap_pyfunction!(snapshot::splice_reads, m)?)?;
    m.add_function(wrap_pyfunction!(stream::read_xlog, m)?)?;
    m.add_class::<kafka::KafkaProducer>()?;
    m.add("KafkaCallError", m.py().get_type::<kafka::KafkaCallError>())?;
    m.add_function(wrap_pyfunction!(kafka::librdkafka_version, m)?)?;
    m.add("VERSION", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

/// An integer's decimal digits, written without an intermediate string.
pub(crate) fn write_int(out: &mut Vec<u8>, n: impl std::fmt::Display) {
    use std::io::Write;
    write!(out, "{n}").expect("writing to a Vec cannot fail");
}
