"""json.dumps's text at its defaults, with the encoder set up once for a fan-out's many values.

json.dumps builds a JSONEncoder and then its C encoder for every call: eight Python calls
per value (cProfile), five values per job in a fan-out before this (the message's body and
envelope, the ledger row's args and kwargs). The encoder below is built once and called
directly: the same C encoder json.dumps ends in, so the same text, byte for byte.
"""

from __future__ import annotations

import json
import json.encoder
from collections.abc import Callable
from typing import Any

Dumps = Callable[[Any], str]

_PROBE = [1, 2.5, -(10**30), True, None, {"é\n": ["ü", {"a": []}]}, "\\ \"'", ""]


def dumper(
    default: Callable[[Any], Any] | None = None, separators: tuple[str, str] | None = None
) -> Dumps:
    """A function returning json.dumps(value, default=default, separators=separators)'s text
    (ensure_ascii; ", " and ": " unless `separators` says otherwise), without json.dumps's
    per-call set-up. It keeps no state between calls (thread-safe) and checks no circular
    references: a value that contains itself raises RecursionError where json.dumps raises
    ValueError (both refuse it). Where the interpreter has no C encoder (or a different one),
    it is json.dumps's own encoder."""
    encoder = json.JSONEncoder(default=default, separators=separators)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return encoder.encode
    try:
        # json.JSONEncoder.iterencode's own call, with no markers (no circular check)
        encode = make(
            None,
            encoder.default,
            json.encoder.encode_basestring_ascii,
            None,
            encoder.key_separator,
            encoder.item_separator,
            False,
            False,
            True,
        )
    except TypeError:  # another interpreter's signature
        return encoder.encode
    join = "".join

    def dumps(value: Any) -> str:
        return join(encode(value, 0))

    if dumps(_PROBE) != encoder.encode(_PROBE):
        return encoder.encode
    return dumps


dumps = dumper()
compact = dumper(separators=(",", ":"))
