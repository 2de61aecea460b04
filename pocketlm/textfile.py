"""Reading the UTF-8 text files users hand to pocketlm (corpora, task files, chats), with one-line
errors that say what is wrong and where."""

from __future__ import annotations

from pathlib import Path

from .errors import PocketError

__all__ = ["checked_text", "jsonl_lines", "read_stdin_text", "read_text_file"]


def read_text_file(path: str | Path, *, what: str = "text file") -> str:
    """The text of ``path``: a leading byte-order mark dropped, line ends as ``\\n``.

    Refuses a missing path, a folder, a FIFO or device, an empty file, a binary file (a NUL
    byte) and bytes that are not UTF-8, naming the file and the line and byte offset of the
    problem.
    """
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():
        # a FIFO or device would block (or never end) instead of being read once
        raise PocketError(f"{path}: not a regular file, expected a {what}")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise PocketError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise PocketError(f"{path}: is a folder, expected a {what}") from None
    except OSError as e:
        raise PocketError(f"{path}: cannot read: {e.strerror or e}") from None
    if not raw.strip():
        raise PocketError(f"{path}: the file is empty")
    return _text_of(raw, str(path), what)


def _text_of(raw: bytes, where: str, what: str) -> str:
    """``raw`` as text, as every text file is read: a NUL byte (binary data) and bytes that are
    not UTF-8 refused naming ``where``; a leading byte-order mark dropped, line ends as ``\n``."""
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise PocketError(f"{where}: looks like a binary file (NUL byte at byte offset {nul}), "
                          f"not a UTF-8 {what}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise PocketError(
            f"{where}:{line}: not UTF-8 text (invalid byte 0x{raw[e.start]:02x} at byte offset "
            f"{e.start}); convert it with `iconv -t UTF-8`") from None
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def checked_text(text: str, what: str) -> str:
    """``text`` (a command-line argument, a line read from the terminal) if it is valid text.

    Python reads undecodable bytes in argv and stdin as lone surrogates (surrogateescape);
    they are named here, instead of failing deep in the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PocketError(f"{what} is not UTF-8 text: an undecodable byte at character "
                          f"{exc.start}; use UTF-8") from None
    return text


def read_stdin_text(what: str = "text") -> str:
    """All of stdin as text, read as a text file is (:func:`read_text_file`: a NUL byte or
    bytes that are not UTF-8 are an error that says where, a byte-order mark is dropped, line
    ends become ``\n``): piping a file in or naming it gives the same text. (Python's own text
    stdin would hand undecodable bytes on as lone surrogates, refused far from their source.)"""
    import sys

    if sys.stdin is None:  # started with it closed (`<&-`)
        raise PocketError("stdin is closed: there is no text to read; pipe the text in, or "
                          "give it as an argument or a file")
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, str):
        data = checked_text(data, "stdin").encode("utf-8")
    return _text_of(data, "stdin", what)


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSON Lines text, split at ``\n`` only.

    ``str.splitlines()`` also splits at U+2028, U+2029, U+0085 and other separators, which JSON
    leaves unescaped inside strings (``json.dumps(..., ensure_ascii=False)`` writes them as they
    are): a record holding one would be cut in two and lost as two malformed lines."""
    return text.split("\n")


def json_problem(exc: BaseException) -> str:
    """What is wrong with a JSON (or YAML) text that failed to parse, in a few words: nested
    past Python's recursion limit is a RecursionError, an integer of more than 4,300 digits a
    ValueError whose text runs on."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc).split(";")[0]  # "Exceeds the limit (4300 digits) for integer string ..."


def json_line(line: str):
    """One JSON Lines record parsed; a ValueError saying what is wrong with it
    (:func:`json_problem`), for every way a line can be malformed."""
    import json

    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg})") from None
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not valid JSON ({json_problem(e)})") from None
