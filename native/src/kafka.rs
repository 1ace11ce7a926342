//! librdkafka's transactional producer for capture's Kafka sink, fed whole Arrow buffers.
//!
//! The sink's Python producer (confluent-kafka) costs a `bytes` object, a `produce()` call and a
//! Python delivery callback per record: about 40 % of a connector's time into Kafka. Here the keys
//! and values of a batch arrive as the buffers of two Arrow `binary` arrays (validity bitmap,
//! int32 offsets, data) and a partition per record, and each record is handed to librdkafka from
//! Rust (`rd_kafka_produce`, copied into librdkafka's queue). Delivery reports are aggregated
//! here, per partition, into what the sink needs: the first offset and the count
//! ([`KafkaProducer::take_delivered`]), plus the failures.
//!
//! The transaction protocol is librdkafka's, called exactly as confluent-kafka calls it
//! (`rd_kafka_init_transactions`, `begin`, `commit`, `abort`): the sink's exactly-once rules
//! (the position record in the same transaction, the slot confirmed only after the commit
//! returned) do not change with the producer. librdkafka is the crate `rdkafka-sys`'s bundled
//! source, built statically into this extension; its version is [`librdkafka_version`].
//!
//! Errors: every failing call raises `KafkaCallError(code, name, reason, fatal, retriable,
//! txn_requires_abort)` with librdkafka's error code (the same codes confluent-kafka's
//! `KafkaError` carries), which the Python side turns into the log hierarchy's errors.
//!
//! Threads: blocking calls (init, flush, commit, abort, the produce loop) release the GIL; the
//! delivery callback runs on the thread that serves the queue (flush/poll/commit), the log
//! callback on librdkafka's threads: both only touch the mutex-guarded [`Shared`] state.
//! The producer has one owner thread, as the sink's connector thread.

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use rdkafka_sys as rd;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Mutex;

pyo3::create_exception!(
    tideline_native,
    KafkaCallError,
    PyException,
    "A librdkafka call failed: args = (code, name, reason, fatal, retriable, txn_requires_abort)."
);

/// How many failed delivery reports are kept between two takes (the first is the one raised; the
/// count of all of them is kept too).
const MAX_FAILURES: usize = 64;
/// How many librdkafka log lines are kept between two takes (older ones are counted, not kept).
const MAX_LOGS: usize = 256;
/// A produce call of at least this many records releases the GIL while it hands them over.
const RELEASE_GIL_RECORDS: usize = 2048;
/// How long a produce that found librdkafka's queue full serves delivery reports before retrying.
const QUEUE_FULL_POLL_MS: c_int = 100;

/// One failed delivery report: (code, name, reason, topic, fatal).
type Failure = (i32, String, String, String, bool);
/// librdkafka's log lines kept, (syslog level, facility, message), and how many were dropped.
type Logs = (Vec<(i32, String, String)>, u64);
/// An Arrow binary array's parts as Python hands them over: validity, offsets, data, offset, length.
type ArrowParts = (
    Option<PyBuffer<i8>>,
    PyBuffer<i8>,
    Option<PyBuffer<i8>>,
    usize,
    usize,
);

#[derive(Default)]
struct Delivered {
    /// (topic handle, partition) → (first offset, count) of the records acknowledged.
    placed: HashMap<(usize, i32), (i64, i64)>,
    failures: Vec<Failure>,
    failed: u64,
}

/// What librdkafka's callbacks write and the producer's calls take.
#[derive(Default)]
struct Shared {
    delivered: Mutex<Delivered>,
    logs: Mutex<Logs>,
    /// topic handle → name, for the delivery reports (handles live as long as the producer)
    names: Mutex<HashMap<usize, String>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

fn err_name(code: i32) -> String {
    cstr(unsafe { rd::rd_kafka_err2name(code_to_err(code)) })
}

fn err_str(code: i32) -> String {
    cstr(unsafe { rd::rd_kafka_err2str(code_to_err(code)) })
}

/// librdkafka's error codes are a C enum; the bindings' Rust enum holds every code of the bundled version.
fn code_to_err(code: i32) -> rd::rd_kafka_resp_err_t {
    unsafe { std::mem::transmute::<i32, rd::rd_kafka_resp_err_t>(code) }
}

/// The client's fatal error (fencing, …) when there is one: (code, reason).
fn fatal_error(rk: *mut rd::rd_kafka_t) -> Option<(i32, String)> {
    let mut buf = [0 as c_char; 512];
    let code = unsafe { rd::rd_kafka_fatal_error(rk, buf.as_mut_ptr(), buf.len()) } as i32;
    (code != 0).then(|| (code, cstr(buf.as_ptr())))
}

unsafe extern "C" fn on_delivery(
    rk: *mut rd::rd_kafka_t,
    msg: *const rd::rd_kafka_message_t,
    opaque: *mut c_void,
) {
    let shared = &*(opaque as *const Shared);
    let msg = &*msg;
    let code = msg.err as i32;
    let rkt = msg.rkt as usize;
    if code == 0 {
        let mut d = lock(&shared.delivered);
        let entry = d
            .placed
            .entry((rkt, msg.partition))
            .or_insert((msg.offset, 0));
        entry.0 = entry.0.min(msg.offset);
        entry.1 += 1;
        return;
    }
    let (code, reason, fatal) = match (code
        == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__FATAL as i32)
        .then(|| fatal_error(rk))
        .flatten()
    {
        Some((fatal_code, reason)) => (fatal_code, reason, true),
        None => (code, err_str(code), false), // (message_errstr reads a consumer's payload: not this)
    };
    let mut d = lock(&shared.delivered);
    d.failed += 1;
    if d.failures.len() < MAX_FAILURES {
        let topic = cstr(rd::rd_kafka_topic_name(msg.rkt));
        d.failures
            .push((code, err_name(code), reason, topic, fatal));
    }
}

unsafe extern "C" fn on_log(
    rk: *const rd::rd_kafka_t,
    level: c_int,
    fac: *const c_char,
    buf: *const c_char,
) {
    let opaque = rd::rd_kafka_opaque(rk);
    if opaque.is_null() {
        return; // during rd_kafka_new, before the opaque is set
    }
    let shared = &*(opaque as *const Shared);
    let mut logs = lock(&shared.logs);
    if logs.0.len() < MAX_LOGS {
        logs.0.push((level, cstr(fac), cstr(buf)));
    } else {
        logs.1 += 1;
    }
}

fn call_error(
    code: i32,
    reason: String,
    fatal: bool,
    retriable: bool,
    txn_requires_abort: bool,
) -> PyErr {
    KafkaCallError::new_err((
        code,
        err_name(code),
        reason,
        fatal,
        retriable,
        txn_requires_abort,
    ))
}

/// A failed transactional call's `rd_kafka_error_t`, as plain data (built where the GIL is released).
struct Failed {
    code: i32,
    reason: String,
    fatal: bool,
    retriable: bool,
    txn_requires_abort: bool,
}

/// Takes an `rd_kafka_error_t` (and frees it); None for none.
fn take_error(error: *mut rd::rd_kafka_error_t) -> Option<Failed> {
    if error.is_null() {
        return None;
    }
    let failed = unsafe {
        Failed {
            code: rd::rd_kafka_error_code(error) as i32,
            reason: cstr(rd::rd_kafka_error_string(error)),
            fatal: rd::rd_kafka_error_is_fatal(error) != 0,
            retriable: rd::rd_kafka_error_is_retriable(error) != 0,
            txn_requires_abort: rd::rd_kafka_error_txn_requires_abort(error) != 0,
        }
    };
    unsafe { rd::rd_kafka_error_destroy(error) };
    Some(failed)
}

fn check(failed: Option<Failed>) -> PyResult<()> {
    match failed {
        None => Ok(()),
        Some(f) => Err(call_error(
            f.code,
            f.reason,
            f.fatal,
            f.retriable,
            f.txn_requires_abort,
        )),
    }
}

/// A raw pointer handed to a thread that releases the GIL (the producer outlives the call).
#[derive(Clone, Copy)]
struct Rk(*mut rd::rd_kafka_t);
unsafe impl Send for Rk {}

impl Rk {
    /// The pointer (a method: a closure that calls it captures the whole `Rk`, which is `Send`).
    fn get(self) -> *mut rd::rd_kafka_t {
        self.0
    }
}

/// One Arrow `binary` array as its buffers: validity bitmap (None: no nulls), int32 offsets, data.
struct BinaryArray {
    validity: Option<PyBuffer<i8>>,
    offsets: PyBuffer<i8>,
    data: Option<PyBuffer<i8>>,
    offset: usize,
    len: usize,
}

impl BinaryArray {
    fn from_py(parts: &Bound<'_, PyAny>, what: &str) -> PyResult<Self> {
        let (validity, offsets, data, offset, len): ArrowParts = parts.extract()?;
        let array = BinaryArray {
            validity,
            offsets,
            data,
            offset,
            len,
        };
        let need = (offset + len + 1) * 4;
        if array.offsets.len_bytes() < need {
            return Err(PyValueError::new_err(format!(
                "{what}: the offsets buffer holds {} bytes, {need} needed",
                array.offsets.len_bytes()
            )));
        }
        if let Some(v) = &array.validity {
            if v.len_bytes() * 8 < offset + len {
                return Err(PyValueError::new_err(format!(
                    "{what}: the validity bitmap is too short"
                )));
            }
        }
        let end = array.raw_offset(offset + len) as usize;
        if array.data.as_ref().map_or(0, |d| d.len_bytes()) < end {
            return Err(PyValueError::new_err(format!(
                "{what}: the data buffer ends before offset {end}"
            )));
        }
        Ok(array)
    }

    fn raw_offset(&self, i: usize) -> i32 {
        let p = self.offsets.buf_ptr() as *const u8;
        unsafe { ptr::read_unaligned(p.add(i * 4) as *const i32) }
    }

    /// Record ``i``'s bytes as (pointer, length); a null pointer for a null entry.
    fn get(&self, i: usize) -> (*const u8, usize) {
        let j = self.offset + i;
        if let Some(v) = &self.validity {
            let byte = unsafe { *(v.buf_ptr() as *const u8).add(j / 8) };
            if byte & (1 << (j % 8)) == 0 {
                return (ptr::null(), 0);
            }
        }
        let (start, end) = (self.raw_offset(j), self.raw_offset(j + 1));
        let data = self
            .data
            .as_ref()
            .map_or(ptr::null(), |d| d.buf_ptr() as *const u8);
        if data.is_null() {
            return (b"".as_ptr(), 0);
        }
        (unsafe { data.add(start as usize) }, (end - start) as usize)
    }
}

/// The headers of one record: (name, value or None).
type RecordHeaders = Vec<(String, Option<Vec<u8>>)>;

/// A transactional (or idempotent) librdkafka producer that takes records as Arrow buffers.
#[pyclass(module = "tideline_native")]
pub struct KafkaProducer {
    rk: AtomicPtr<rd::rd_kafka_t>,
    shared: *const Shared,
    topics: Mutex<HashMap<String, usize>>,
}

unsafe impl Send for KafkaProducer {}
unsafe impl Sync for KafkaProducer {}

impl KafkaProducer {
    fn rk(&self) -> PyResult<*mut rd::rd_kafka_t> {
        let rk = self.rk.load(Ordering::Acquire);
        if rk.is_null() {
            return Err(call_error(
                rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__STATE as i32,
                "the producer is closed".into(),
                false,
                false,
                false,
            ));
        }
        Ok(rk)
    }

    fn shared(&self) -> &Shared {
        unsafe { &*self.shared }
    }

    fn topic(&self, rk: *mut rd::rd_kafka_t, name: &str) -> PyResult<*mut rd::rd_kafka_topic_t> {
        let mut topics = lock(&self.topics);
        if let Some(&rkt) = topics.get(name) {
            return Ok(rkt as *mut rd::rd_kafka_topic_t);
        }
        let cname = CString::new(name)
            .map_err(|_| PyValueError::new_err("a topic name holds a NUL byte"))?;
        let rkt = unsafe { rd::rd_kafka_topic_new(rk, cname.as_ptr(), ptr::null_mut()) };
        if rkt.is_null() {
            let code = unsafe { rd::rd_kafka_last_error() } as i32;
            return Err(call_error(
                code,
                format!("topic {name:?}: {}", err_str(code)),
                false,
                false,
                false,
            ));
        }
        topics.insert(name.to_owned(), rkt as usize);
        lock(&self.shared().names).insert(rkt as usize, name.to_owned());
        Ok(rkt)
    }

    /// The error of a failed produce call: the client's fatal error when that is why.
    fn produce_error(rk: *mut rd::rd_kafka_t, code: i32, topic: &str) -> PyErr {
        if code == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__FATAL as i32 {
            if let Some((fatal_code, reason)) = fatal_error(rk) {
                return call_error(fatal_code, reason, true, false, false);
            }
        }
        let abort = code == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__STATE as i32;
        call_error(
            code,
            format!("producing to {topic:?}: {}", err_str(code)),
            false,
            false,
            abort,
        )
    }

    fn destroy(&self) {
        let rk = self.rk.swap(ptr::null_mut(), Ordering::AcqRel);
        if rk.is_null() {
            return;
        }
        for (_, rkt) in lock(&self.topics).drain() {
            unsafe { rd::rd_kafka_topic_destroy(rkt as *mut rd::rd_kafka_topic_t) };
        }
        unsafe { rd::rd_kafka_destroy(rk) };
    }
}

const QUEUE_FULL: i32 = rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__QUEUE_FULL as i32;

#[pymethods]
impl KafkaProducer {
    /// ``config``: librdkafka settings as (name, value) strings (``bootstrap.servers``, ``acks``,
    /// ``transactional.id``, …). An unknown or invalid setting raises, naming it.
    #[new]
    fn new(config: Vec<(String, String)>) -> PyResult<Self> {
        let shared = Box::into_raw(Box::<Shared>::default());
        let conf = unsafe { rd::rd_kafka_conf_new() };
        let fail = |reason: String| {
            unsafe { drop(Box::from_raw(shared)) };
            call_error(
                rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__INVALID_ARG as i32,
                reason,
                false,
                false,
                false,
            )
        };
        let mut errstr = [0 as c_char; 512];
        for (name, value) in &config {
            let (Ok(n), Ok(v)) = (CString::new(name.as_str()), CString::new(value.as_str())) else {
                unsafe { rd::rd_kafka_conf_destroy(conf) };
                return Err(fail(format!("setting {name:?} holds a NUL byte")));
            };
            let res = unsafe {
                rd::rd_kafka_conf_set(
                    conf,
                    n.as_ptr(),
                    v.as_ptr(),
                    errstr.as_mut_ptr(),
                    errstr.len(),
                )
            };
            if res != rd::rd_kafka_conf_res_t::RD_KAFKA_CONF_OK {
                unsafe { rd::rd_kafka_conf_destroy(conf) };
                return Err(fail(cstr(errstr.as_ptr())));
            }
        }
        unsafe {
            rd::rd_kafka_conf_set_dr_msg_cb(conf, Some(on_delivery));
            rd::rd_kafka_conf_set_log_cb(conf, Some(on_log));
            rd::rd_kafka_conf_set_opaque(conf, shared as *mut c_void);
        }
        let rk = unsafe {
            rd::rd_kafka_new(
                rd::rd_kafka_type_t::RD_KAFKA_PRODUCER,
                conf,
                errstr.as_mut_ptr(),
                errstr.len(),
            )
        };
        if rk.is_null() {
            unsafe { rd::rd_kafka_conf_destroy(conf) }; // not taken over on failure
            return Err(fail(cstr(errstr.as_ptr())));
        }
        Ok(KafkaProducer {
            rk: AtomicPtr::new(rk),
            shared,
            topics: Mutex::new(HashMap::new()),
        })
    }

    fn init_transactions(&self, py: Python<'_>, timeout_ms: i32) -> PyResult<()> {
        let rk = Rk(self.rk()?);
        check(py.allow_threads(move || {
            take_error(unsafe { rd::rd_kafka_init_transactions(rk.get(), timeout_ms) })
        }))
    }

    fn begin_transaction(&self) -> PyResult<()> {
        check(take_error(unsafe {
            rd::rd_kafka_begin_transaction(self.rk()?)
        }))
    }

    /// Flushes (serving the delivery reports), then commits; raises as librdkafka does.
    fn commit_transaction(&self, py: Python<'_>, timeout_ms: i32) -> PyResult<()> {
        let rk = Rk(self.rk()?);
        check(py.allow_threads(move || {
            take_error(unsafe { rd::rd_kafka_commit_transaction(rk.get(), timeout_ms) })
        }))
    }

    fn abort_transaction(&self, py: Python<'_>, timeout_ms: i32) -> PyResult<()> {
        let rk = Rk(self.rk()?);
        check(py.allow_threads(move || {
            take_error(unsafe { rd::rd_kafka_abort_transaction(rk.get(), timeout_ms) })
        }))
    }

    /// Queue records to ``topic``: ``partitions`` an int32 buffer with one partition per record;
    /// ``keys`` and ``values`` the parts of two Arrow binary arrays as
    /// ``(validity or None, offsets, data or None, offset, length)`` (a null value is a tombstone, a
    /// null key a keyless record); ``headers``: None, or per record None or ``[(name, value or None)]``.
    /// Returns when every record is queued (librdkafka copies them); the acknowledgements come with
    /// :meth:`take_delivered` after a flush or commit. A full queue is drained by serving reports.
    #[pyo3(signature = (topic, partitions, keys, values, headers=None))]
    fn produce(
        &self,
        py: Python<'_>,
        topic: &str,
        partitions: PyBuffer<i32>,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        headers: Option<Vec<Option<RecordHeaders>>>,
    ) -> PyResult<usize> {
        let rk = self.rk()?;
        let keys = BinaryArray::from_py(keys, "keys")?;
        let values = BinaryArray::from_py(values, "values")?;
        let n = values.len;
        if keys.len != n || partitions.item_count() != n {
            return Err(PyValueError::new_err(format!(
                "{} keys and {} partitions for {n} values",
                keys.len,
                partitions.item_count()
            )));
        }
        if let Some(h) = &headers {
            if h.len() != n {
                return Err(PyValueError::new_err(format!(
                    "{} headers for {n} values",
                    h.len()
                )));
            }
        }
        let rkt = self.topic(rk, topic)?;
        let parts = partitions.buf_ptr() as usize; // a plain address: the buffer outlives the call
        let (rk, rkt) = (Rk(rk), Rk(rkt as *mut rd::rd_kafka_t));
        let produce_all = move || -> Result<usize, (i32, usize)> {
            let (rk, rkt) = (rk, rkt.get() as *mut rd::rd_kafka_topic_t);
            let mut names: Vec<CString> = Vec::new();
            for i in 0..n {
                let partition = unsafe { ptr::read_unaligned((parts as *const i32).add(i)) };
                let (kp, kl) = keys.get(i);
                let (vp, vl) = values.get(i);
                let record_headers = headers.as_ref().and_then(|h| h[i].as_ref());
                loop {
                    let code = match record_headers {
                        None => {
                            let rc = unsafe {
                                rd::rd_kafka_produce(
                                    rkt,
                                    partition,
                                    rd::RD_KAFKA_MSG_F_COPY,
                                    vp as *mut c_void,
                                    vl,
                                    kp as *const c_void,
                                    kl,
                                    ptr::null_mut(),
                                )
                            };
                            if rc == 0 {
                                0
                            } else {
                                unsafe { rd::rd_kafka_last_error() as i32 }
                            }
                        }
                        Some(hs) => {
                            names.clear();
                            for (name, _) in hs {
                                names.push(
                                    CString::new(name.replace('\0', ""))
                                        .expect("NUL bytes removed"),
                                );
                            }
                            let mut vus = Vec::with_capacity(5 + hs.len());
                            vus.push(vu_rkt(rkt));
                            vus.push(vu_i32(
                                rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_PARTITION,
                                partition,
                            ));
                            vus.push(vu_mem(rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_VALUE, vp, vl));
                            vus.push(vu_mem(rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_KEY, kp, kl));
                            vus.push(vu_i32(
                                rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_MSGFLAGS,
                                rd::RD_KAFKA_MSG_F_COPY,
                            ));
                            for ((_, value), name) in hs.iter().zip(&names) {
                                vus.push(vu_header(name, value.as_deref()));
                            }
                            let error = unsafe {
                                rd::rd_kafka_produceva(rk.get(), vus.as_ptr(), vus.len())
                            };
                            if error.is_null() {
                                0
                            } else {
                                let code = unsafe { rd::rd_kafka_error_code(error) } as i32;
                                unsafe { rd::rd_kafka_error_destroy(error) };
                                code
                            }
                        }
                    };
                    match code {
                        0 => break,
                        QUEUE_FULL => {
                            unsafe { rd::rd_kafka_poll(rk.get(), QUEUE_FULL_POLL_MS) };
                        }
                        _ => return Err((code, i)),
                    }
                }
            }
            Ok(n)
        };
        // Releasing the GIL costs up to a switch interval (5 ms) to take it back when another thread holds it:
        // worth it only for a batch long enough to take that long; a position record or a few changes keep it.
        let result = if n >= RELEASE_GIL_RECORDS {
            py.allow_threads(produce_all)
        } else {
            produce_all()
        };
        result.map_err(|(code, _)| Self::produce_error(rk.get(), code, topic))
    }

    /// Serve delivery reports already there (no wait; the GIL kept: see `RELEASE_GIL_RECORDS`).
    fn poll(&self) -> PyResult<()> {
        unsafe { rd::rd_kafka_poll(self.rk()?, 0) };
        Ok(())
    }

    /// Wait up to ``timeout_ms`` until every queued record is acknowledged (or failed), serving the
    /// reports; returns how many are still queued. A fatal error (fencing) raises.
    fn flush(&self, py: Python<'_>, timeout_ms: i32) -> PyResult<i32> {
        let rk = Rk(self.rk()?);
        let left = py.allow_threads(move || unsafe {
            rd::rd_kafka_flush(rk.get(), timeout_ms);
            rd::rd_kafka_outq_len(rk.get())
        });
        if let Some((code, reason)) = fatal_error(rk.get()) {
            return Err(call_error(code, reason, true, false, false));
        }
        Ok(left)
    }

    /// What was acknowledged and what failed since the last take:
    /// ``([(topic, partition, first offset, count)], [(code, name, reason, topic, fatal)], failed count)``.
    #[allow(clippy::type_complexity)]
    fn take_delivered(&self) -> (Vec<(String, i32, i64, i64)>, Vec<Failure>, u64) {
        let taken = std::mem::take(&mut *lock(&self.shared().delivered));
        let names = lock(&self.shared().names);
        let mut placed: Vec<(String, i32, i64, i64)> = taken
            .placed
            .into_iter()
            .map(|((rkt, p), (first, count))| {
                let name = names.get(&rkt).cloned().unwrap_or_else(|| {
                    cstr(unsafe { rd::rd_kafka_topic_name(rkt as *const rd::rd_kafka_topic_t) })
                });
                (name, p, first, count)
            })
            .collect();
        placed.sort();
        (placed, taken.failures, taken.failed)
    }

    /// librdkafka's log lines since the last take, ``[(syslog level, facility, message)]``, and how
    /// many were dropped past the buffer's size.
    fn take_logs(&self) -> Logs {
        std::mem::take(&mut *lock(&self.shared().logs))
    }

    /// Release the client (it waits for librdkafka's threads; queued records not flushed are dropped).
    fn close(&self, py: Python<'_>) {
        py.allow_threads(|| self.destroy());
    }
}

impl Drop for KafkaProducer {
    fn drop(&mut self) {
        self.destroy();
        unsafe { drop(Box::from_raw(self.shared as *mut Shared)) };
    }
}

fn vu_rkt(rkt: *mut rd::rd_kafka_topic_t) -> rd::rd_kafka_vu_t {
    rd::rd_kafka_vu_t {
        vtype: rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_RKT,
        u: rd::rd_kafka_vu_s__bindgen_ty_1 { rkt },
    }
}

fn vu_i32(vtype: rd::rd_kafka_vtype_t, i: i32) -> rd::rd_kafka_vu_t {
    rd::rd_kafka_vu_t {
        vtype,
        u: rd::rd_kafka_vu_s__bindgen_ty_1 { i32_: i },
    }
}

fn vu_mem(vtype: rd::rd_kafka_vtype_t, p: *const u8, size: usize) -> rd::rd_kafka_vu_t {
    let mem = rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_1 {
        ptr: p as *mut c_void,
        size,
    };
    rd::rd_kafka_vu_t {
        vtype,
        u: rd::rd_kafka_vu_s__bindgen_ty_1 { mem },
    }
}

fn vu_header(name: &CString, value: Option<&[u8]>) -> rd::rd_kafka_vu_t {
    let (val, size) = match value {
        Some(v) => (v.as_ptr() as *const c_void, v.len() as isize),
        None => (ptr::null(), 0),
    };
    let header = rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_2 {
        name: name.as_ptr(),
        val,
        size,
    };
    rd::rd_kafka_vu_t {
        vtype: rd::rd_kafka_vtype_t::RD_KAFKA_VTYPE_HEADER,
        u: rd::rd_kafka_vu_s__bindgen_ty_1 { header },
    }
}

/// The bundled librdkafka's version string (e.g. "2.12.1").
#[pyfunction]
pub fn librdkafka_version() -> String {
    cstr(unsafe { rd::rd_kafka_version_str() })
}
