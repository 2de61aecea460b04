"""Helpers that craft the damaged inputs the reader tests feed to pocketlm."""

from __future__ import annotations

import zlib


def stored_zlib(text: bytes, n: int) -> bytes:
    """A zlib stream of exactly ``n`` bytes (stored blocks, no compression) that inflates to
    ``text`` followed by spaces: compressed content of a given length, for a tensor whose size
    an edit must keep."""
    pad = n - 11 - len(text)
    while True:
        out = zlib.compress(text + b" " * pad, 0)
        if len(out) == n:
            return out
        pad -= len(out) - n
