//! Snapshot reads in bulk: rows of `COPY … TO STDOUT` (text format) → their `after` images and record
//! keys as JSON, and those images → whole envelopes with their event indexes (see
//! `capture/snapshot_readers.py` for how the two halves are driven, and `docs/capture.md`).
//!
//! Contract: for every row it encodes, [`SnapshotEncoder::encode`] writes the bytes the Python
//! reference (`capture.snapshot_readers.copy_row_columns` → `capture.events.EventEncoder.read_record`
//! → `capture.converters.JsonConverter`) writes for the `after` image and the key. A row it is not
//! sure about — a field count that is not the table's, text that is not UTF-8, a bad escape, a value
//! in a form [`convert::text_value`] does not convert, a row big enough to be TOASTed (its TOAST-able
//! values go to the key state, which only the Python path builds) — is left empty and listed as a
//! fallback: the caller encodes that row with the Python path. It never raises for bad rows.
//!
//! Output buffers are Arrow binary layouts: little-endian 32-bit offsets (below 2^31) (`rows + 1`, the first 0) and
//! the concatenated bytes, so the caller wraps them as Arrow arrays without a Python object per row.
//!
//! COPY text format (PostgreSQL's `CopyAttributeOutText`): one row per line ending in `\n`, fields
//! separated by `\t`, `\N` for NULL; in a value a backslash starts an escape: `\\`, `\b`, `\f`,
//! `\n`, `\r`, `\t`, `\v`, an octal `\ooo` (1-3 digits) or a hex `\xhh` (1-2 digits); any other
//! character after a backslash stands for itself.

use std::borrow::Cow;
use std::ffi::{c_char, c_int, c_void};

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::convert::{self, Kind, NOT_NATIVE};
use crate::{json, TOAST_MIN_ROW_BYTES, UNAVAILABLE};

/// One table's snapshot rows → `after` images and keys (the reader-process half).
#[pyclass(module = "tideline_native")]
pub struct SnapshotEncoder {
    names: Vec<String>,
    labels: Vec<Vec<u8>>, // per column: `{"name":` for the first, `,"name":` after (an image's JSON)
    key_labels: Vec<Vec<u8>>, // likewise per key column, for the record key
    kinds: Vec<Kind>,
    key: Vec<usize>,      // positions of the key columns, in key order
    toastable: Vec<bool>, // per column
}

/// ``(afters, after_offsets, keys, key_offsets, fallback)`` of one ``encode`` call.
type Encoded<'py> = (
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Option<Bound<'py, PyBytes>>,
    Option<Bound<'py, PyBytes>>,
    Vec<usize>,
);

#[pymethods]
impl SnapshotEncoder {
    /// ``names``/``type_oids``: the table's columns in select order; ``key``: its key columns (empty: keyless);
    /// ``toastable``: its TOAST-able columns. A column whose type is not converted here is a ValueError
    /// (the caller checks :meth:`converts` first).
    #[new]
    fn new(
        names: Vec<String>,
        type_oids: Vec<i64>,
        key: Vec<String>,
        toastable: Vec<String>,
    ) -> PyResult<Self> {
        let err = |m: String| pyo3::exceptions::PyValueError::new_err(m);
        if names.len() != type_oids.len() {
            return Err(err(
                "SnapshotEncoder: names and type_oids differ in length".into()
            ));
        }
        let mut kinds = Vec::with_capacity(names.len());
        for (name, oid) in names.iter().zip(&type_oids) {
            let kind = convert::kind_of(*oid);
            if kind == NOT_NATIVE {
                return Err(err(format!(
                    "SnapshotEncoder: column {name:?} has type OID {oid}, not converted natively"
                )));
            }
            kinds.push(kind);
        }
        if names
            .iter()
            .enumerate()
            .any(|(i, n)| names[..i].contains(n))
        {
            return Err(err("SnapshotEncoder: a column name appears twice".into()));
        }
        let position = |k: &String| names.iter().position(|n| n == k);
        let key = key
            .iter()
            .map(|k| {
                position(k).ok_or_else(|| {
                    err(format!("SnapshotEncoder: key column {k:?} is not a column"))
                })
            })
            .collect::<PyResult<Vec<usize>>>()?;
        let toastable = names.iter().map(|n| toastable.contains(n)).collect();
        let label = |n: usize, name: &str| {
            let mut l = vec![if n == 0 { b'{' } else { b',' }];
            json::write_str(&mut l, name);
            l.push(b':');
            l
        };
        let labels = names
            .iter()
            .enumerate()
            .map(|(n, name)| label(n, name))
            .collect();
        let key_labels = key
            .iter()
            .enumerate()
            .map(|(n, &c)| label(n, &names[c]))
            .collect();
        Ok(SnapshotEncoder {
            labels,
            key_labels,
            names,
            kinds,
            key,
            toastable,
        })
    }

    /// Whether values of the type with this OID are converted here.
    #[staticmethod]
    fn converts(type_oid: i64) -> bool {
        convert::kind_of(type_oid) != NOT_NATIVE
    }

    /// ``rows``: COPY text lines (bytes, each ending in ``\n``). Returns ``(afters, after_offsets, keys,
    /// key_offsets, fallback)``: the `after` images and keys as Arrow binary buffers (keys None for a
    /// keyless table), a fallback row's entries empty, and the fallback rows' positions.
    fn encode<'py>(&self, py: Python<'py>, rows: &Bound<'py, PyList>) -> PyResult<Encoded<'py>> {
        let mut batch = Batch::new(!self.key.is_empty(), rows.len(), self.names.len());
        for row in rows.iter() {
            let view: PyBuffer<u8>; // a memoryview: psycopg's get_copy_data gives each line as one
            let line: &[u8] = match row.downcast::<PyBytes>() {
                Ok(b) => b.as_bytes(),
                Err(_) => {
                    view = PyBuffer::<u8>::get(&row)?;
                    if !view.is_c_contiguous() {
                        return Err(pyo3::exceptions::PyValueError::new_err(
                            "a row is not a contiguous buffer",
                        ));
                    }
                    // SAFETY: a C-contiguous buffer of len_bytes() bytes, held (and not written: psycopg's
                    // rows are read-only) while `view` lives, which outlives every use of `line` below.
                    unsafe {
                        std::slice::from_raw_parts(view.buf_ptr() as *const u8, view.len_bytes())
                    }
                }
            };
            batch.push(self, line)?;
        }
        Ok(batch.into_py(py))
    }

    /// Reads the next lines of the ``COPY … TO STDOUT`` (text format) running on the libpq connection at
    /// address ``conn`` — up to ``max_rows``, fewer once they hold ``max_bytes`` — and encodes those between
    /// the first and the last as :meth:`encode` does, without the GIL and without a Python object per line.
    ///
    /// Returns ``(status, first, last, encoded, fallback_lines)``: ``status`` 1 when more lines may follow,
    /// 0 when the COPY's data ended, -1 when libpq reported an error (the caller reads the connection's
    /// results for it, as after any COPY); ``first`` and ``last`` the first and last lines read (None: none
    /// read / only one); ``encoded`` as :meth:`encode` returns it for the lines between; ``fallback_lines``
    /// the fallback rows' lines, in the order of their positions.
    ///
    /// The caller's contract (``capture.snapshot_readers.NativeCopy`` keeps it): ``conn`` is a live ``PGconn``
    /// of this process in the COPY OUT state that no other thread uses meanwhile, and ``get_copy_data`` and
    /// ``free_mem`` are the addresses of that libpq's ``PQgetCopyData`` and ``PQfreemem``.
    #[allow(clippy::type_complexity)]
    fn read_copy<'py>(
        &self,
        py: Python<'py>,
        conn: usize,
        get_copy_data: usize,
        free_mem: usize,
        max_rows: usize,
        max_bytes: usize,
    ) -> PyResult<(
        i32,
        Option<Bound<'py, PyBytes>>,
        Option<Bound<'py, PyBytes>>,
        Encoded<'py>,
        Vec<Bound<'py, PyBytes>>,
    )> {
        if conn == 0 || get_copy_data == 0 || free_mem == 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "read_copy: a null connection or function address",
            ));
        }
        if max_rows == 0 || max_bytes == 0 {
            // a call that may read nothing would return "more to come" forever
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "read_copy: max_rows ({max_rows}) and max_bytes ({max_bytes}) must be at least 1"
            )));
        }
        type GetCopyData = unsafe extern "C" fn(*mut c_void, *mut *mut c_char, c_int) -> c_int;
        type FreeMem = unsafe extern "C" fn(*mut c_void);
        // SAFETY: the caller's contract above: the addresses are those functions of the libpq that owns `conn`.
        let (get, free) = unsafe {
            (
                std::mem::transmute::<usize, GetCopyData>(get_copy_data),
                std::mem::transmute::<usize, FreeMem>(free_mem),
            )
        };
        let read = py.allow_threads(|| -> PyResult<CopyRead> {
            let mut batch = Batch::new(
                !self.key.is_empty(),
                max_rows.min(1 << 16),
                self.names.len(),
            );
            let mut first: Option<Vec<u8>> = None;
            let mut held: Option<Vec<u8>> = None; // the latest line: the last, unless another comes
            let mut fallback_lines = Vec::new();
            let (mut rows, mut bytes, mut status) = (0usize, 0usize, 1i32);
            while rows < max_rows && bytes < max_bytes {
                let mut buf: *mut c_char = std::ptr::null_mut();
                // SAFETY: the contract above; blocking mode (async 0), so it returns a line, -1 or -2.
                let n = unsafe { get(conn as *mut c_void, &mut buf, 0) };
                if n <= 0 || buf.is_null() {
                    status = if n == -1 { 0 } else { -1 };
                    break;
                }
                // SAFETY: libpq's buffer of n bytes, ours until PQfreemem below.
                let line = unsafe { std::slice::from_raw_parts(buf as *const u8, n as usize) };
                let mut took = || -> PyResult<()> {
                    if first.is_none() {
                        first = Some(line.to_vec());
                    } else if let Some(prev) = held.as_mut() {
                        if !batch.push(self, prev)? {
                            fallback_lines.push(prev.clone());
                        }
                        prev.clear();
                        prev.extend_from_slice(line);
                    } else {
                        held = Some(line.to_vec());
                    }
                    Ok(())
                };
                let took = took();
                // SAFETY: the buffer PQgetCopyData allocated, freed once (also when the line failed: 2 GiB).
                unsafe { free(buf as *mut c_void) };
                took?;
                rows += 1;
                bytes += n as usize;
            }
            Ok(CopyRead {
                status,
                first,
                last: held,
                batch,
                fallback_lines,
            })
        })?;
        let bytes_of = |b: Option<Vec<u8>>| b.map(|b| PyBytes::new(py, &b));
        let fallback_lines = read
            .fallback_lines
            .iter()
            .map(|l| PyBytes::new(py, l))
            .collect();
        Ok((
            read.status,
            bytes_of(read.first),
            bytes_of(read.last),
            read.batch.into_py(py),
            fallback_lines,
        ))
    }
}

/// What one ``read_copy`` call read, before it becomes Python objects.
struct CopyRead {
    status: i32,
    first: Option<Vec<u8>>,
    last: Option<Vec<u8>>,
    batch: Batch,
    fallback_lines: Vec<Vec<u8>>,
}

/// The encoded rows of one batch, as they are added (the buffers :meth:`SnapshotEncoder.encode` returns).
struct Batch {
    keyed: bool,
    rows: usize,
    afters: Vec<u8>,
    after_offsets: Vec<u8>,
    keys: Vec<u8>,
    key_offsets: Vec<u8>,
    fallback: Vec<usize>,
    values: Vec<Option<(usize, usize)>>, // one row's value spans in `scratch`
    scratch: Vec<u8>,
}

impl Batch {
    fn new(keyed: bool, capacity: usize, columns: usize) -> Self {
        let mut batch = Batch {
            keyed,
            rows: 0,
            afters: Vec::with_capacity(capacity * 128),
            after_offsets: Vec::with_capacity(4 * (capacity + 1)),
            keys: Vec::with_capacity(if keyed { capacity * 16 } else { 0 }),
            key_offsets: Vec::with_capacity(if keyed { 4 * (capacity + 1) } else { 0 }),
            fallback: Vec::new(),
            values: Vec::with_capacity(columns),
            scratch: Vec::with_capacity(256),
        };
        batch.after_offsets.extend_from_slice(&0u32.to_le_bytes());
        if keyed {
            batch.key_offsets.extend_from_slice(&0u32.to_le_bytes());
        }
        batch
    }

    /// One line's row, encoded or (false) left empty as a fallback.
    fn push(&mut self, encoder: &SnapshotEncoder, line: &[u8]) -> PyResult<bool> {
        let start = self.afters.len();
        let key_start = self.keys.len();
        let keys = if self.keyed {
            Some(&mut self.keys)
        } else {
            None
        };
        let ok = encoder
            .row(
                line,
                &mut self.values,
                &mut self.scratch,
                &mut self.afters,
                keys,
            )
            .is_some();
        if !ok {
            self.afters.truncate(start);
            self.keys.truncate(key_start);
            self.fallback.push(self.rows);
        }
        self.rows += 1;
        let end = arrow_offset(self.afters.len())?;
        self.after_offsets.extend_from_slice(&end.to_le_bytes());
        if self.keyed {
            let end = arrow_offset(self.keys.len())?;
            self.key_offsets.extend_from_slice(&end.to_le_bytes());
        }
        Ok(ok)
    }

    fn into_py(self, py: Python<'_>) -> Encoded<'_> {
        (
            PyBytes::new(py, &self.afters),
            PyBytes::new(py, &self.after_offsets),
            self.keyed.then(|| PyBytes::new(py, &self.keys)),
            self.keyed.then(|| PyBytes::new(py, &self.key_offsets)),
            self.fallback,
        )
    }
}

impl SnapshotEncoder {
    /// One line → its `after` JSON appended to ``afters`` and its key to ``keys``; None: a fallback row.
    fn row(
        &self,
        line: &[u8],
        values: &mut Vec<Option<(usize, usize)>>,
        scratch: &mut Vec<u8>,
        afters: &mut Vec<u8>,
        keys: Option<&mut Vec<u8>>,
    ) -> Option<()> {
        let line = line.strip_suffix(b"\n")?;
        // each value's JSON goes to `scratch`; `values` holds its span there (None: NULL)
        values.clear();
        scratch.clear();
        let mut toast_total = 0usize;
        let mut fields = line.split(|&b| b == b'\t');
        for (c, kind) in self.kinds.iter().enumerate() {
            let field = fields.next()?;
            if field == b"\\N" {
                values.push(None);
                if self.toastable[c] {
                    toast_total += 16; // ToastCache.size_of's measure of None
                }
                continue;
            }
            let text = unescape(field)?;
            let start = scratch.len();
            let size = convert::text_value(*kind, &text, scratch)?;
            if self.toastable[c] {
                if matches!(kind, Kind::Text) && text == UNAVAILABLE {
                    return None;
                }
                toast_total += size;
            }
            values.push(Some((start, scratch.len())));
        }
        if fields.next().is_some() || (!self.key.is_empty() && toast_total >= TOAST_MIN_ROW_BYTES) {
            return None; // a field too many, or a row big enough to be TOASTed (its values go to the key state)
        }
        let json_of = |v: &Option<(usize, usize)>| -> &[u8] {
            match v {
                Some((s, e)) => &scratch[*s..*e],
                None => b"null",
            }
        };
        for (label, value) in self.labels.iter().zip(values.iter()) {
            afters.extend_from_slice(label);
            afters.extend_from_slice(json_of(value));
        }
        afters.push(b'}');
        if let Some(keys) = keys {
            for (label, &c) in self.key_labels.iter().zip(self.key.iter()) {
                keys.extend_from_slice(label);
                keys.extend_from_slice(json_of(&values[c]));
            }
            keys.push(b'}');
        }
        Some(())
    }
}

/// A COPY text field's value (see the module docs); None: not UTF-8, or an escape that yields none.
fn unescape(field: &[u8]) -> Option<Cow<'_, str>> {
    if !field.contains(&b'\\') {
        return std::str::from_utf8(field).ok().map(Cow::Borrowed);
    }
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        let b = field[i];
        i += 1;
        if b != b'\\' {
            out.push(b);
            continue;
        }
        let c = *field.get(i)?;
        i += 1;
        match c {
            b'b' => out.push(0x08),
            b'f' => out.push(0x0c),
            b'n' => out.push(b'\n'),
            b'r' => out.push(b'\r'),
            b't' => out.push(b'\t'),
            b'v' => out.push(0x0b),
            b'0'..=b'7' => {
                let mut v = u32::from(c - b'0');
                for _ in 0..2 {
                    match field.get(i) {
                        Some(&d @ b'0'..=b'7') => {
                            v = v * 8 + u32::from(d - b'0');
                            i += 1;
                        }
                        _ => break,
                    }
                }
                out.push(v as u8); // PostgreSQL keeps the low byte, as here
            }
            b'x' if field.get(i).is_some_and(u8::is_ascii_hexdigit) => {
                let mut v = 0u32;
                for _ in 0..2 {
                    match field.get(i) {
                        Some(d) if d.is_ascii_hexdigit() => {
                            v = v * 16 + (*d as char).to_digit(16)?;
                            i += 1;
                        }
                        _ => break,
                    }
                }
                out.push(v as u8);
            }
            other => out.push(other),
        }
    }
    String::from_utf8(out).ok().map(Cow::Owned)
}

/// The bytes of ``obj``: a bytes object as it is, or any other C-contiguous buffer (a memoryview of what a reader
/// sent, an Arrow buffer), held in ``view`` while the slice is used. The caller must not let the buffer be written
/// meanwhile (the connector's received buffers belong to one batch and are never written again).
fn buffer_bytes<'a>(
    obj: &'a Bound<'_, PyAny>,
    view: &'a mut Option<PyBuffer<u8>>,
) -> PyResult<&'a [u8]> {
    if let Ok(b) = obj.downcast::<PyBytes>() {
        return Ok(b.as_bytes());
    }
    let held = view.insert(PyBuffer::<u8>::get(obj)?);
    if !held.is_c_contiguous() {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "splice_reads: a buffer is not contiguous",
        ));
    }
    // SAFETY: a C-contiguous buffer of len_bytes() bytes, held by `view` (which outlives the slice) and not
    // written while the slice is used (see above).
    Ok(unsafe { std::slice::from_raw_parts(held.buf_ptr() as *const u8, held.len_bytes()) })
}

/// The connector's half: `after` images (Arrow binary buffers) → whole snapshot-read envelopes, numbered.
///
/// Value ``i`` is ``lead + after_i + mid + (first_index + i) + tail``: ``lead`` ends in `"after":`,
/// ``mid`` runs from after the image to `"event_index":`, ``tail`` from the index's closing brace to
/// the envelope's end (the caller cuts the three from an envelope the Python path rendered). Returns
/// the values as Arrow binary buffers ``(data, offsets)``. A ValueError for offsets that do not fit
/// ``afters`` (``rows + 1`` ascending `u32`s within it).
#[pyfunction]
pub fn splice_reads<'py>(
    py: Python<'py>,
    lead: &[u8],
    afters: &Bound<'py, PyAny>,
    after_offsets: &Bound<'py, PyAny>,
    mid: &[u8],
    first_index: i64,
    tail: &[u8],
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
    let (mut afters_view, mut offsets_view) = (None, None);
    let afters = buffer_bytes(afters, &mut afters_view)?;
    let after_offsets = buffer_bytes(after_offsets, &mut offsets_view)?;
    let bad =
        || pyo3::exceptions::PyValueError::new_err("splice_reads: offsets do not fit the images");
    if after_offsets.len() < 4 || !after_offsets.len().is_multiple_of(4) {
        return Err(bad());
    }
    let offsets: Vec<usize> = after_offsets
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .collect();
    if offsets[0] != 0
        || offsets.windows(2).any(|w| w[0] > w[1])
        || *offsets.last().unwrap_or(&0) > afters.len()
    {
        return Err(bad());
    }
    if first_index < 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "splice_reads: a negative first index",
        ));
    }
    let rows = offsets.len() - 1;
    let fixed = lead.len() + mid.len() + tail.len();
    let mut ends: Vec<u8> = Vec::with_capacity(4 * (rows + 1));
    ends.extend_from_slice(&0u32.to_le_bytes());
    let mut total = 0usize;
    for (i, w) in offsets.windows(2).enumerate() {
        total += fixed + (w[1] - w[0]) + digits(first_index as u64 + i as u64);
        let end = arrow_offset(total)?;
        ends.extend_from_slice(&end.to_le_bytes());
    }
    // written straight into the bytes object: the values are most of what the log writes, copied once here;
    // without the GIL (the new object is not shared yet, the inputs are immutable bytes), so the connector's
    // append thread runs meanwhile
    let data = PyBytes::new_with(py, total, |out: &mut [u8]| {
        py.allow_threads(|| {
            let mut at = 0usize;
            let mut put = |part: &[u8]| {
                out[at..at + part.len()].copy_from_slice(part);
                at += part.len();
            };
            let mut number = itoa::Buffer::new();
            for (i, w) in offsets.windows(2).enumerate() {
                put(lead);
                put(&afters[w[0]..w[1]]);
                put(mid);
                put(number.format(first_index as u64 + i as u64).as_bytes());
                put(tail);
            }
        });
        Ok(())
    })?;
    Ok((data, PyBytes::new(py, &ends)))
}

/// An Arrow binary offset (a signed 32-bit value, so at most 2 GiB of data per array), as its `u32` bits.
fn arrow_offset(n: usize) -> PyResult<u32> {
    i32::try_from(n).map(|v| v as u32).map_err(|_| {
        pyo3::exceptions::PyValueError::new_err(
            "a batch's data exceeds 2 GiB, the most one Arrow binary array holds",
        )
    })
}

/// Decimal digits of ``n``.
fn digits(n: u64) -> usize {
    n.checked_ilog10().map_or(1, |d| d as usize + 1)
}
