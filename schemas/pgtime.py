"""Postgres dates and timestamps beyond Python's range, as Avro day and microsecond counts.

Capture keeps values Python's ``datetime`` cannot hold as Postgres's text (DateStyle
ISO, TimeZone UTC): ``'infinity'``, ``'-infinity'``, BC dates (``'0044-03-15 BC'``,
``'0044-03-15 12:00:00.5+00 BC'``), years after 9999, and ``time '24:00:00'``. Avro's
``date`` (days since 1970-01-01) and ``*-timestamp-micros`` (µs since 1970-01-01T00:00)
hold all of them on the proleptic Gregorian calendar (astronomical year numbering:
1 BC is year 0); ±infinity are the extreme values of the type, as Postgres stores them
(``DT_NOBEGIN``/``DT_NOEND``). This module converts both ways, so decoding writes back
the exact text capture had.

Thread-safety: pure functions.
"""

from __future__ import annotations

import re

from schemas.errors import ValueConversionError

DATE_INFINITY = 2**31 - 1
DATE_NEG_INFINITY = -(2**31)
TIMESTAMP_INFINITY = 2**63 - 1
TIMESTAMP_NEG_INFINITY = -(2**63)
MICROS_PER_DAY = 86_400_000_000

_TEXT = re.compile(
    r"^(\d{4,})-(\d\d)-(\d\d)"  # year (≥ 4 digits), month, day
    r"(?: (\d\d):(\d\d):(\d\d)(\.\d{1,6})?)?"  # time of day, fraction
    r"([+-]\d\d(?::\d\d){0,2})?"  # UTC offset (timestamptz)
    r"( BC)?$"
)


def days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date (astronomical year)."""
    y = year - (month <= 2)
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    return era * 146097 + yoe * 365 + yoe // 4 - yoe // 100 + doy - 719468


def civil_from_days(days: int) -> tuple[int, int, int]:
    """``(year, month, day)`` of a day count since 1970-01-01 (astronomical year)."""
    z = days + 719468
    era = z // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + (3 if mp < 10 else -9)
    return yoe + era * 400 + (month <= 2), month, day


def _offset_seconds(text: str) -> int:
    sign = -1 if text[0] == "-" else 1
    parts = [int(p) for p in text[1:].split(":")]
    parts += [0] * (3 - len(parts))
    return sign * (parts[0] * 3600 + parts[1] * 60 + parts[2])


def _parse(text: str) -> tuple[int, int]:
    """``(days, micros into the day, UTC-adjusted)`` of a Postgres date/timestamp text."""
    m = _TEXT.match(text)
    if m is None:
        raise ValueConversionError(f"not a Postgres date/timestamp text: {text[:40]!r}")
    year = int(m.group(1))
    if m.group(9):
        year = 1 - year  # 1 BC is year 0
    days = days_from_civil(year, int(m.group(2)), int(m.group(3)))
    micros = 0
    if m.group(4):
        fraction = (m.group(7) or ".")[1:].ljust(6, "0")
        micros = ((int(m.group(4)) * 60 + int(m.group(5))) * 60 + int(m.group(6))) * 1_000_000 + int(fraction)
    if m.group(8):
        micros -= _offset_seconds(m.group(8)) * 1_000_000
    return days, micros


def date_text_to_days(text: str) -> int:
    if text == "infinity":
        return DATE_INFINITY
    if text == "-infinity":
        return DATE_NEG_INFINITY
    return _parse(text)[0]


def timestamp_text_to_micros(text: str) -> int:
    if text == "infinity":
        return TIMESTAMP_INFINITY
    if text == "-infinity":
        return TIMESTAMP_NEG_INFINITY
    days, micros = _parse(text)
    value = days * MICROS_PER_DAY + micros
    if not TIMESTAMP_NEG_INFINITY < value < TIMESTAMP_INFINITY:
        # Postgres counts µs from 2000 in 64 bits; from 1970 its last ~30 years (after
        # 294247-01-10) do not fit Avro's long: refuse rather than wrap or clamp.
        raise ValueError(f"timestamp {text!r} is beyond Avro timestamp-micros (64-bit µs since 1970)")
    return value


def _year_text(year: int) -> tuple[str, str]:
    return (f"{year:04d}", "") if year > 0 else (f"{1 - year:04d}", " BC")


def days_to_date_text(days: int) -> str:
    """Postgres's text of a date outside Python's range (or ±infinity)."""
    if days == DATE_INFINITY:
        return "infinity"
    if days == DATE_NEG_INFINITY:
        return "-infinity"
    year, month, day = civil_from_days(days)
    y, era = _year_text(year)
    return f"{y}-{month:02d}-{day:02d}{era}"


def micros_to_timestamp_text(micros: int, *, utc: bool) -> str:
    """Postgres's text of a timestamp outside Python's range; ``utc``: timestamptz in a UTC session."""
    if micros == TIMESTAMP_INFINITY:
        return "infinity"
    if micros == TIMESTAMP_NEG_INFINITY:
        return "-infinity"
    days, in_day = divmod(micros, MICROS_PER_DAY)
    year, month, day = civil_from_days(days)
    seconds, fraction = divmod(in_day, 1_000_000)
    y, era = _year_text(year)
    frac = f".{fraction:06d}".rstrip("0") if fraction else ""
    zone = "+00" if utc else ""
    clock = f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    return f"{y}-{month:02d}-{day:02d} {clock}{frac}{zone}{era}"
