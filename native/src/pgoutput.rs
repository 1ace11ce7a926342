//! pgoutput row messages (Insert, Update, Delete) → a plugin-neutral [`Change`], read exactly as
//! `capture.decoders.pgoutput.decoder` reads them (its docstring has the byte layouts):
//!
//! ```text
//!   I  Int32 relation OID, Byte1 'N', TupleData (new row)
//!   U  Int32 relation OID, optional (Byte1 'K' old key | 'O' old row, TupleData), Byte1 'N', TupleData
//!   D  Int32 relation OID, Byte1 'K' | 'O', TupleData (old key / old row)
//!   TupleData  Int16 column count, per column Byte1 kind: 'n' NULL, 'u' unchanged TOAST,
//!              't' Int32 length + the type's text output ('b' binary is never asked for)
//! ```
//!
//! Only the messages of a top-level transaction come here (no `[xid]` prefix: a streamed
//! transaction's messages are spilled by the Python decoder and replayed through it). The
//! relation is the one the Python decoder last read for that OID: `capture/native/core.py` registers
//! it (after the Python path handled a change of the table) and forgets it whenever the decoder
//! reads a new Relation message. Anything the reference would refuse or that this reader is not
//! sure about — an unknown relation OID, a wrong column count, a truncated or over-long message,
//! a binary or unknown column kind, text that is not UTF-8, a type or a form of value not
//! converted here — gives None: the message takes the Python path.

use std::borrow::Cow;

use crate::convert::{Input, Kind, NOT_NATIVE};
use crate::{Action, Change, Col, Format};

/// One column of a registered Relation message.
pub struct RelColumn {
    pub name: String,
    pub oid: i64,
    pub kind: Kind,
    pub is_key: bool, // flags & 1: part of the replica identity key
}

/// A Relation message as the Python decoder holds it, with the caller's table handle.
pub struct Relation {
    pub table: usize,
    pub columns: Vec<RelColumn>,
}

/// A cursor over one message.
struct Reader<'p> {
    data: &'p [u8],
}

impl<'p> Reader<'p> {
    fn take(&mut self, n: usize) -> Option<&'p [u8]> {
        if self.data.len() < n {
            return None;
        }
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        Some(head)
    }

    fn byte(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }

    fn uint16(&mut self) -> Option<usize> {
        let b = self.take(2)?;
        Some(u16::from_be_bytes([b[0], b[1]]) as usize)
    }

    fn uint32(&mut self) -> Option<u32> {
        let b = self.take(4)?;
        Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
}

/// The relation OID of a row message (None: not an I/U/D message, or too short).
pub fn relation_oid(payload: &[u8]) -> Option<u32> {
    if !matches!(payload.first(), Some(b'I' | b'U' | b'D')) || payload.len() < 5 {
        return None;
    }
    Some(u32::from_be_bytes([
        payload[1], payload[2], payload[3], payload[4],
    ]))
}

/// The change of an I/U/D message of ``relation`` at ``lsn`` (the XLogData WAL start), or None.
pub fn change<'r>(
    payload: &[u8],
    lsn: u64,
    relation: &'r Relation,
    format: Format,
) -> Option<Change<'r>> {
    let mut r = Reader { data: payload };
    let tag = r.byte()?;
    r.uint32()?; // relation OID: the caller looked it up
    let (action, after, identity) = match tag {
        b'I' => {
            if r.byte()? != b'N' {
                return None;
            }
            (
                Action::Insert,
                Some(tuple(&mut r, relation, false, format)?),
                None,
            )
        }
        b'U' => {
            let mut marker = r.byte()?;
            let mut identity = None;
            if marker == b'K' || marker == b'O' {
                identity = Some(tuple(&mut r, relation, marker == b'K', format)?);
                marker = r.byte()?;
            }
            if marker != b'N' {
                return None;
            }
            let after = tuple(&mut r, relation, false, format)?;
            // no old tuple: the key did not change; the reference takes the new row's key columns
            let identity = identity.unwrap_or_else(|| {
                after
                    .iter()
                    .filter(|c| {
                        relation
                            .columns
                            .iter()
                            .any(|rc| rc.is_key && rc.name == c.name)
                    })
                    .cloned()
                    .collect()
            });
            (Action::Update, Some(after), Some(identity))
        }
        b'D' => {
            let marker = r.byte()?;
            if marker != b'K' && marker != b'O' {
                return None;
            }
            (
                Action::Delete,
                None,
                Some(tuple(&mut r, relation, marker == b'K', format)?),
            )
        }
        _ => return None,
    };
    if !r.data.is_empty() {
        return None; // bytes left over: the reference raises
    }
    Some(Change {
        action,
        lsn,
        after,
        identity,
    })
}

/// TupleData → columns: NULL is null, text converted, an unchanged TOAST value → None (the Python path); a 'K' tuple
/// keeps its key columns only (the others are NULL there, and not converted).
fn tuple<'r>(
    r: &mut Reader,
    relation: &'r Relation,
    keys_only: bool,
    format: Format,
) -> Option<Vec<Col<'r>>> {
    if r.uint16()? != relation.columns.len() {
        return None;
    }
    let mut out = Vec::with_capacity(relation.columns.len());
    for (position, column) in relation.columns.iter().enumerate() {
        let input = match r.byte()? {
            b't' => {
                let length = r.uint32()? as usize;
                let raw = r.take(length)?;
                if keys_only && !column.is_key {
                    continue;
                }
                if column.kind == NOT_NATIVE {
                    return None;
                }
                Input::Text(std::str::from_utf8(raw).ok()?)
            }
            b'n' => {
                if keys_only && !column.is_key {
                    continue;
                }
                Input::Null
            }
            // unchanged TOAST: the Python path fills it, from the columns of the Relation message in force (left
            // out here, a change could pass for one of a catalog that lacks the column: capture.shapes)
            b'u' => return None,
            _ => return None, // binary ('b') or unknown: the reference raises
        };
        let name = Cow::Borrowed(column.name.as_str());
        out.push(crate::column(
            name, position, column.oid, None, input, format,
        )?);
    }
    Some(out)
}
