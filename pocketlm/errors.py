"""The error hierarchy.

Every error that a user can cause derives from :class:`PocketError`. Messages name the file,
tensor or field involved, what was found, what was expected, and how to fix it. The CLI prints
``str(error)`` as one line and exits with code 1.
"""

from __future__ import annotations


class PocketError(Exception):
    """Base class of every error pocketlm raises on purpose. ``param``, where known: the field
    of the request it came from (the server names it in its 400)."""

    def __init__(self, *args, param: str | None = None):
        super().__init__(*args)
        self.param = param


class FormatError(PocketError):
    """A model file is truncated, corrupt, or not the kind of file it claims to be."""


class ChecksumError(FormatError):
    """A tensor's bytes do not match the checksum recorded when the file was written."""


class UnsupportedError(PocketError):
    """The input is well formed but uses something pocketlm does not support (yet)."""


class ModelNotFoundError(PocketError):
    """A model name or path that resolves to nothing."""


class ContextLengthError(PocketError):
    """A prompt (plus the tokens to generate) does not fit in the model's context."""


class SamplingError(PocketError, ValueError):
    """An invalid generation or sampling parameter (NaN, negative, out of range)."""


class FetchError(PocketError):
    """Fetching or assembling a registry model failed (network, size or checksum mismatch)."""


class KernelError(PocketError, ValueError):
    """A kernel was handed arrays of the wrong dtype, shape, layout or alignment."""


class TextError(PocketError, ValueError):
    """Text that is not valid Unicode (a lone surrogate, undecodable bytes) or not text at all."""


class TokenIdError(PocketError, ValueError):
    """A token id that is not an integer in the model's vocabulary."""


class GrammarError(PocketError, ValueError):
    """A JSON schema, regular expression or grammar that cannot constrain generation (does not
    compile, uses what is not supported, cannot be satisfied), or one that no token can
    continue. ``param`` names the field it came from (``json_schema``, ``regex``, ``grammar``,
    or the server's ``response_format`` / ``tools``)."""


def refuse_empty(flag: str, value, what: str = "a path") -> None:
    """Refuse ``flag`` given as an empty string (an unset shell variable), which would
    otherwise mean the working folder, the default, or quietly nothing; None (not given)
    passes."""
    if value is not None and not str(value).strip():
        raise PocketError(f"{flag} is empty (an unset shell variable?): give {what}")
