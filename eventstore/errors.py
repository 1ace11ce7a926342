"""One error hierarchy for the whole log, rooted in :class:`TidelineError`.

Messages name what was wrong (file, byte position, topic, option) so that the
CLI can print them as one line and an operator can act on them.
"""

from __future__ import annotations

from pathlib import Path


class TidelineError(Exception):
    """Root of every error Tideline raises on purpose."""


class ConfigError(TidelineError):
    """A topic or log setting is missing, unknown or out of range."""


class UnknownTopicError(TidelineError):
    """The named topic does not exist in this log directory."""

    def __init__(self, topic: str) -> None:
        super().__init__(f"unknown topic {topic!r}")
        self.topic = topic


class TopicExistsError(TidelineError):
    """``create_topic`` was asked for a name that is already taken."""

    def __init__(self, topic: str) -> None:
        super().__init__(f"topic {topic!r} already exists")
        self.topic = topic


class InvalidRecordError(TidelineError):
    """A record cannot be appended (e.g. keyless record on a compacted topic, too large)."""


class OffsetOutOfRangeError(TidelineError):
    """A fetch asked for an offset below the log start or above the log end."""


class CorruptLogError(TidelineError):
    """Stored data failed validation where it cannot be a torn tail.

    Nothing is modified when this is raised: the operator must inspect the file
    (``path`` at byte ``position``), restore it, or remove the segment by hand.
    """

    def __init__(self, path: Path, position: int, reason: str) -> None:
        super().__init__(f"corrupt log data in {path} at byte {position}: {reason}")
        self.path = path
        self.position = position
        self.reason = reason


class LogStorageError(TidelineError):
    """Writing the log's files failed (disk full, I/O error): the batch was not stored.

    The partition cut whatever part of the batch reached the file, so nothing acknowledged
    is affected and no segment is left damaged; appends succeed again once the cause is
    gone (free space). ``errno`` is the operating system's error number (``errno.ENOSPC``).
    """

    def __init__(self, path: Path, error: OSError, *, what: str = "the batch was not stored") -> None:
        super().__init__(
            f"cannot write {path}: {error.strerror or error} ({what}; "
            + ("free space on that file system, then retry)" if error.errno == 28 else "check the disk, then retry)")
        )
        self.path = path
        self.errno = error.errno


class CorruptCheckpointError(TidelineError):
    """A small persisted state file has a bad version or checksum."""

    def __init__(self, path: Path, expected: object, found: object) -> None:
        super().__init__(f"checkpoint {path} is invalid: expected {expected}, found {found}")
        self.path = path
        self.expected = expected
        self.found = found


class RetriableError(TidelineError):
    """A transient failure: the same request may be retried (the producer does so itself)."""


class ProducerFencedError(TidelineError):
    """A newer epoch of this transactional producer exists: this instance must stop."""


class OutOfOrderSequenceError(TidelineError):
    """A batch's sequence number is not the next one expected for its producer."""


class InvalidTxnStateError(TidelineError):
    """An operation does not fit the state of the transaction (or of the producer's partition)."""


class TransactionAbortedError(TidelineError):
    """A record could not be sent because its transaction was aborted."""


class CommitFailedError(TidelineError):
    """A group member tried to commit a partition it does not own (the group rebalanced)."""


class WakeupError(TidelineError):
    """``Consumer.wakeup()`` was called: the blocking ``poll`` returns by raising this."""


class KafkaUnavailableError(TidelineError):
    """No broker of the given bootstrap servers answered in time: check the address and that Kafka runs.

    Defined here, with the other errors, rather than in eventstore.kafka: code that only classifies errors
    (capture.errors) need not import the Kafka client."""
