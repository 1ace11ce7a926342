//! The replication stream's messages read with libpq's own calls, a run at a time: one buffer and its
//! offsets, no Python object per message (capture.replication.ReplicationConnection.read_run drives it).

use std::ffi::{c_char, c_int, c_void};

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::XLOG_BODY;

/// ``(status, data, offsets, ahead)`` of one :func:`read_xlog` call.
type XLogRead<'py> = (
    i32,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Option<Bound<'py, PyBytes>>,
);

/// Reads the XLogData messages that have arrived already on the replication connection at address ``conn``
/// (copy-both mode), without waiting: what libpq has buffered, then what the socket holds (one
/// ``PQconsumeInput``, which never blocks), until ``limit`` messages or ``max_bytes`` are read, or another
/// message (a keepalive) comes.
///
/// Returns ``(status, data, offsets, ahead)``: ``data`` the messages as they came (b"w", the header, the
/// payload), ``first`` (when given) before them; ``offsets`` where each starts in ``data`` and where the
/// last ends (native-endian u32, one more than the messages); ``ahead`` the message that stopped the read
/// (a keepalive, or anything not an XLogData message), for the caller to read as usual; ``status`` 1 when
/// the stream goes on, -1 when it ended (the server's CopyDone), -2 when libpq reported an error (the
/// caller reads the connection's error and results, as after any copy).
///
/// The caller's contract (``ReplicationConnection`` keeps it): ``conn`` is a live ``PGconn`` of this
/// process in the COPY BOTH state that no other thread uses meanwhile, and ``get_copy_data``,
/// ``free_mem`` and ``consume_input`` are the addresses of that libpq's ``PQgetCopyData``, ``PQfreemem``
/// and ``PQconsumeInput``.
#[pyfunction]
#[pyo3(signature = (conn, get_copy_data, free_mem, consume_input, first, limit, max_bytes))]
#[allow(clippy::too_many_arguments)]
pub fn read_xlog<'py>(
    py: Python<'py>,
    conn: usize,
    get_copy_data: usize,
    free_mem: usize,
    consume_input: usize,
    first: Option<&[u8]>,
    limit: usize,
    max_bytes: usize,
) -> PyResult<XLogRead<'py>> {
    if conn == 0 || get_copy_data == 0 || free_mem == 0 || consume_input == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "read_xlog: a null connection or function address",
        ));
    }
    type GetCopyData = unsafe extern "C" fn(*mut c_void, *mut *mut c_char, c_int) -> c_int;
    type FreeMem = unsafe extern "C" fn(*mut c_void);
    type ConsumeInput = unsafe extern "C" fn(*mut c_void) -> c_int;
    // SAFETY: the caller's contract above: the addresses are those functions of the libpq that owns `conn`.
    let (get, free, consume) = unsafe {
        (
            std::mem::transmute::<usize, GetCopyData>(get_copy_data),
            std::mem::transmute::<usize, FreeMem>(free_mem),
            std::mem::transmute::<usize, ConsumeInput>(consume_input),
        )
    };
    let mut data: Vec<u8> = Vec::with_capacity(64 << 10);
    let mut offsets: Vec<u32> = Vec::with_capacity(limit.min(4096) + 2);
    offsets.push(0);
    if let Some(first) = first {
        data.extend_from_slice(first);
        offsets.push(offset(data.len())?);
    }
    let mut ahead: Option<Vec<u8>> = None;
    let mut status = 1i32;
    let mut consumed = false; // the socket was read once: what it held is in libpq's buffer now
    while offsets.len() <= limit && data.len() < max_bytes {
        let mut buf: *mut c_char = std::ptr::null_mut();
        // SAFETY: the contract above; async mode (1): a message, 0 when none is complete, -1 or -2.
        let n = unsafe { get(conn as *mut c_void, &mut buf, 1) };
        if n == 0 {
            if consumed {
                break;
            }
            consumed = true;
            // SAFETY: the contract above; libpq's socket is non-blocking: this reads what has arrived.
            if unsafe { consume(conn as *mut c_void) } == 0 {
                status = -2;
                break;
            }
            continue;
        }
        if n < 0 || buf.is_null() {
            status = if n == -1 { -1 } else { -2 };
            break;
        }
        // SAFETY: libpq's buffer of n bytes, ours until PQfreemem below.
        let message = unsafe { std::slice::from_raw_parts(buf as *const u8, n as usize) };
        let xlog = message.len() >= XLOG_BODY && message[0] == b'w';
        if xlog {
            data.extend_from_slice(message);
        } else {
            ahead = Some(message.to_vec());
        }
        // SAFETY: the buffer PQgetCopyData allocated, freed once.
        unsafe { free(buf as *mut c_void) };
        if !xlog {
            break;
        }
        offsets.push(offset(data.len())?);
    }
    let offset_bytes: Vec<u8> = offsets.iter().flat_map(|o| o.to_ne_bytes()).collect();
    Ok((
        status,
        PyBytes::new(py, &data),
        PyBytes::new(py, &offset_bytes),
        ahead.map(|a| PyBytes::new(py, &a)),
    ))
}

/// An offset into a run's buffer (the caller bounds a run far below 4 GiB).
fn offset(n: usize) -> PyResult<u32> {
    u32::try_from(n).map_err(|_| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "read_xlog: a run of {n} bytes (at most 4 GiB)"
        ))
    })
}

/// The ``i``-th message of a run: ``data[offsets[i]..offsets[i + 1]]`` (None: out of range or malformed offsets).
pub(crate) fn message<'a>(data: &'a [u8], offsets: &[u8], i: usize) -> Option<&'a [u8]> {
    let at = |j: usize| -> Option<usize> {
        let b = offsets.get(j * 4..j * 4 + 4)?;
        Some(u32::from_ne_bytes(b.try_into().ok()?) as usize)
    };
    data.get(at(i)?..at(i + 1)?)
}
