"""A json/jsonb column value as its text: carried through capture unparsed, written as raw JSON.

Defined here, in the lowest layer, because both capture (which makes these values) and
schemas.pgvalues (which turns capture's values into Avro) handle it.
"""

from __future__ import annotations


class JsonText:
    """A json/jsonb value as the server printed it: written into envelopes as is (raw JSON).

    Equal when the texts are equal; ``str()`` is the text. Immutable by convention.
    """

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"JsonText({self.text!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JsonText) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __len__(self) -> int:
        return len(self.text)

    def __reduce__(self) -> tuple[type[JsonText], tuple[str]]:
        return (JsonText, (self.text,))
