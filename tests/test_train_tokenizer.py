"""Tokenizer training (pocketlm.train.tokenizer_train): round trips, script boundaries,
special tokens, saving and reloading, bad input, determinism, and the vocabulary comparison."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pocketlm.errors import PocketError
from pocketlm.tokenizer import Tokenizer
from pocketlm.train.tokenizer_train import (
    _READ_CHUNK,
    CHATML_TEMPLATE,
    DEFAULT_SPECIAL_TOKENS,
    TokenizerTrainingError,
    _check_file,
    chars_per_token,
    compare_tokenizers,
    embedding_bytes,
    load_trained_tokenizer,
    train_tokenizer,
)

HAN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")
LATIN = re.compile(r"[A-Za-z]")
DIGIT = re.compile(r"[0-9]")

_ZH_WORDS = ["我们", "模型", "训练", "中文", "数据", "手机", "应用", "内存", "速度", "今天",
             "天气", "很好", "学习", "语言", "小", "的", "是", "在", "了", "和"]
_EN_WORDS = ["the", "model", "runs", "on", "a", "phone", "with", "small", "memory", "and",
             "fast", "decode", "tokens", "per", "second", "we", "train", "it", "data", "app"]
_ZH_PUNCT = ["，", "。", "！", "？", "、", "：", "“", "”"]


def _corpus(n_lines: int, seed: int) -> str:
    """Mixed zh+en lines with code, digits and emoji; Han words glued to Latin words often."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        kind = rng.random()
        if kind < 0.4:
            words = [rng.choice(_ZH_WORDS) for _ in range(rng.randint(4, 12))]
            line = "".join(words) + rng.choice(_ZH_PUNCT)
        elif kind < 0.7:
            words = [rng.choice(_EN_WORDS) for _ in range(rng.randint(4, 12))]
            line = " ".join(words).capitalize() + rng.choice([".", "!", "?", ","])
        elif kind < 0.9:  # glued: 用Python训练model3次
            parts = []
            for _ in range(rng.randint(3, 8)):
                parts.append(rng.choice(_ZH_WORDS))
                parts.append(rng.choice(_EN_WORDS) + str(rng.randint(0, 999)))
            line = "".join(parts)
        else:
            line = f"def f(x): return x * {rng.randint(0, 99)}  # 注释 😀"
        lines.append(line)
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "train.txt"
    path.write_text(_corpus(3000, seed=1), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(corpus_file, tmp_path_factory) -> tuple[Tokenizer, Path]:
    out = tmp_path_factory.mktemp("tok")
    tok = train_tokenizer([corpus_file], 1000, out, progress=False)
    return tok, out


ROUND_TRIP = [
    "Hello, world! It's 2024.",
    "我们今天用Python训练了一个小模型，速度很快。",
    "混合 text 和 中文123 with emoji 😀👍🏽 and 日本語のテキスト, 한국어.",
    "def main():\n    print(f'{x!r}')  # 注释\n\n\treturn [1, 2, 3]\n",
    "  leading and trailing spaces  \r\n",
    "\u0000\u0007 control bytes, a BOM \ufeff, and a lone combining mark \u0301",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(trained, text):
    tok, _ = trained
    ids = tok.encode(text, special=False)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_learned_merges_and_size(trained):
    tok, _ = trained
    assert tok.kind == "bpe"
    assert 256 + len(DEFAULT_SPECIAL_TOKENS) < tok.vocab_size <= 1000
    # frequent words of the corpus became single tokens
    for word in ("模型", " model"):
        assert len(tok.encode(word)) == 1, word


def test_scripts_never_merge(trained):
    """No token mixes Han with Latin letters or digits; every digit is its own token."""
    tok, _ = trained
    for i in range(tok.vocab_size):
        if tok.is_special(i):
            continue
        text = tok.token_bytes(i).decode("utf-8", errors="replace")
        if HAN.search(text):
            assert not LATIN.search(text) and not DIGIT.search(text), (i, text)
        if DIGIT.search(text):
            assert len(text.strip()) == 1, (i, text)
    # on glued text too, no token's bytes hold both a CJK lead byte (U+3000-U+9FFF encode as
    # E3..E9 xx xx) and an ASCII letter or digit, even for characters never seen in training
    for text in ("模型model训练data3中文", "用Python训练model3次", "第2个ok好"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        for i in ids:
            raw = tok.token_bytes(i)
            cjk = any(0xE3 <= b <= 0xE9 for b in raw)
            alnum = any(chr(b).isalnum() for b in raw if b < 0x80)
            assert not (cjk and alnum), (text, raw)
    assert [tok.decode([i]) for i in tok.encode("模型model")] == ["模型", "model"]


def test_special_tokens(trained):
    tok, out = trained
    expected = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|pad|>": 3}
    for text, i in expected.items():
        assert tok.token_to_id(text) == i
        assert tok.encode(text) == [i]
        assert tok.is_special(i)
    assert tok.bos_id == 0 and not tok.add_bos
    assert set(tok.eos_ids) == {0, 2}
    ids = tok.encode("<|im_start|>user\n你好<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1] and 2 not in ids[1:-1]
    # as plain text, a special token's text is never its id
    plain = tok.encode("<|im_start|>", special=False)
    assert len(plain) > 1 and not set(plain) & set(expected.values())
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["bos_token"] == "<|endoftext|>" and config["add_bos_token"] is False
    assert config["chat_template"] == CHATML_TEMPLATE
    (source,) = config["pocketlm"]["sources"]
    assert source["file"] == "train.txt" and source["bytes"] > 0


def test_chat_template_renders(trained):
    from pocketlm.chat import render

    tok, out = trained
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    text = render(config["chat_template"], [{"role": "user", "content": "你好"}])
    assert text == "<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids.count(1) == 2 and ids.count(2) == 1


def test_reload_identical(trained):
    tok, out = trained
    again = load_trained_tokenizer(out)
    assert again.vocab_size == tok.vocab_size
    assert (again.bos_id, again.eos_ids, again.add_bos) == (tok.bos_id, tok.eos_ids, tok.add_bos)
    assert again.special_tokens == tok.special_tokens
    for text in ROUND_TRIP:
        assert again.encode(text) == tok.encode(text)
    # the pocketlm serialisation round-trips too
    assert Tokenizer.from_json(tok.to_json()).encode(ROUND_TRIP[2]) == tok.encode(ROUND_TRIP[2])


def test_custom_special_tokens(corpus_file, tmp_path):
    tok = train_tokenizer([corpus_file], 400, tmp_path, special_tokens=["<eos>", "<sep>"],
                          progress=False)
    assert tok.token_to_id("<eos>") == 0 and tok.token_to_id("<sep>") == 1
    assert tok.bos_id == 0 and tok.eos_ids == [0]
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "chat_template" not in config  # no <|im_start|>/<|im_end|> to write ChatML with


def test_texts_and_sampling(tmp_path):
    text = _corpus(500, seed=3)
    a = train_tokenizer([text], 500, tmp_path / "a", progress=False)
    b = train_tokenizer(iter(text.splitlines(keepends=True)), 500, tmp_path / "b", progress=False)
    assert a.encode(ROUND_TRIP[1]) == b.encode(ROUND_TRIP[1])
    s1 = train_tokenizer([text], 500, tmp_path / "s1", sample_lines=50, seed=1, progress=False)
    s2 = train_tokenizer([text], 500, tmp_path / "s2", sample_lines=50, seed=2, progress=False)
    c1 = json.loads((tmp_path / "s1" / "tokenizer_config.json").read_text())["pocketlm"]
    assert c1["training_lines"] == 50
    assert s1.hf.to_str() != s2.hf.to_str()  # different samples, different merges


def test_deterministic(corpus_file, tmp_path):
    """Same input, same settings: byte-identical tokenizer.json, also across processes."""
    train_tokenizer([corpus_file], 700, tmp_path / "a", progress=False)
    train_tokenizer([corpus_file], 700, tmp_path / "b", progress=False)
    code = (
        "import sys; from pathlib import Path; "
        "from pocketlm.train.tokenizer_train import train_tokenizer; "
        "train_tokenizer([Path(sys.argv[1])], 700, Path(sys.argv[2]), progress=False)"
    )
    subprocess.run([sys.executable, "-c", code, str(corpus_file), str(tmp_path / "c")],
                   check=True)
    a, b, c = ((tmp_path / d / "tokenizer.json").read_bytes() for d in "abc")
    assert a == b == c


# ---------------------------------------------------------------------------------- bad input


def test_no_files(tmp_path):
    with pytest.raises(TokenizerTrainingError, match="no training data"):
        train_tokenizer([], 1000, tmp_path)


def test_missing_file(tmp_path):
    with pytest.raises(TokenizerTrainingError, match="no such file"):
        train_tokenizer([tmp_path / "nope.txt"], 1000, tmp_path / "out")


def test_empty_file(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(TokenizerTrainingError, match=r"empty\.txt: the file is empty"):
        train_tokenizer([tmp_path / "empty.txt"], 1000, tmp_path / "out")


def test_a_line_with_a_million_spaces_is_named_before_the_library_panics(tmp_path):
    # the pre-tokenizer's pattern gave up on ~10 M spaces: a Rust panic and a traceback
    (tmp_path / "ws.txt").write_text("hello there\nx" + " " * 1_000_000 + "y\nbye\n",
                                     encoding="utf-8")
    with pytest.raises(TokenizerTrainingError, match="training line 2: .*run of 1,000,000 or "
                       "more whitespace"):
        train_tokenizer([tmp_path / "ws.txt"], 300, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_an_error_of_the_callers_own_texts_is_not_called_a_tokenization_error(tmp_path):
    class SourceDown(Exception):
        pass

    def texts():
        yield from ["hello there"] * 50
        raise SourceDown("the dataset server went away")

    with pytest.raises(SourceDown, match="went away"):
        train_tokenizer(texts(), 400, tmp_path / "out", progress=False)


@pytest.mark.parametrize("token", ["the", "end_of_text", "EOS 2"])
def test_a_special_token_of_plain_words_is_refused(tmp_path, token):
    # it was taken: every "the" of the corpus (and of prompts), "then" too, became token 0
    with pytest.raises(TokenizerTrainingError, match="plain text.*<\\|"):
        train_tokenizer([tmp_path / "unused.txt"], 400, tmp_path / "out",
                        special_tokens=[token], progress=False)


def test_blank_corpus(tmp_path):
    (tmp_path / "blank.txt").write_text("\n   \n\t\n", encoding="utf-8")
    with pytest.raises(TokenizerTrainingError, match=r"corpus is empty.*blank\.txt"):
        train_tokenizer([tmp_path / "blank.txt"], 1000, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_binary_file(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 4)
    with pytest.raises(TokenizerTrainingError, match=r"model\.bin: binary file.*not UTF-8 text"):
        train_tokenizer([tmp_path / "model.bin"], 1000, tmp_path / "out")


def test_non_utf8_file_names_line_and_offset(tmp_path):
    good = "中文 text line\n" * 20000  # the bad line lies beyond the first read chunk
    path = tmp_path / "gbk.txt"
    data = good.encode("utf-8") + "模型训练\n".encode("gbk")
    path.write_bytes(data)
    with pytest.raises(UnicodeDecodeError) as decoding:
        data.decode("utf-8")
    offset = decoding.value.start
    with pytest.raises(TokenizerTrainingError) as info:
        train_tokenizer([path], 1000, tmp_path / "out", progress=False)
    message = str(info.value)
    assert "gbk.txt" in message and "not UTF-8 text" in message
    assert f"offset {offset}" in message and "line 20001" in message
    assert "\n" not in message
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_a_file_that_is_not_text_from_its_start_is_refused_before_training(tmp_path, capsys):
    """No NUL byte, but not UTF-8 from its first bytes: refused by the file check, before the
    trainer starts (its progress bar printed blank lines on stdout beside the error)."""
    from pocketlm.cli import main

    path = tmp_path / "latin1.txt"
    path.write_bytes("café crème\n".encode("latin-1") * 100)
    with pytest.raises(TokenizerTrainingError, match=r"latin1\.txt: not UTF-8 text \(byte 0xe9 at "
                                                     r"offset 3\)"):
        _check_file(path)
    assert main(["tokenizer", "train", "--data", str(path), "--vocab-size", "300",
                 "--out", str(tmp_path / "tok")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "not UTF-8 text" in err
    assert not (tmp_path / "tok").exists()
    cut = tmp_path / "cut.txt"  # a character cut by the first chunk's end is not an error
    cut.write_bytes(b"a" * (_READ_CHUNK - 1) + "好\n".encode())
    assert _check_file(cut) == _READ_CHUNK + 3


def test_truncated_utf8_at_end(tmp_path):
    path = tmp_path / "cut.txt"
    path.write_bytes("好".encode()[:2])
    with pytest.raises(TokenizerTrainingError, match="not UTF-8 text"):
        train_tokenizer([path], 1000, tmp_path / "out", progress=False)


@pytest.mark.parametrize("size", [0, 100, 260, 1_000_001, 2**40])
def test_bad_vocab_size(corpus_file, tmp_path, size):
    with pytest.raises(TokenizerTrainingError, match=f"vocab_size {size} is"):
        train_tokenizer([corpus_file], size, tmp_path)


def test_vocab_size_bounds_are_exact(corpus_file, tmp_path):
    smallest = 256 + len(DEFAULT_SPECIAL_TOKENS) + 1
    with pytest.raises(TokenizerTrainingError, match=f"at least {smallest}"):
        train_tokenizer([corpus_file], smallest - 1, tmp_path / "a")
    tok = train_tokenizer([corpus_file], smallest, tmp_path / "b", progress=False)
    assert tok.vocab_size == smallest


@pytest.mark.parametrize("specials", [[], ["<a>", "<a>"], ["<a>", ""]])
def test_bad_special_tokens(corpus_file, tmp_path, specials):
    with pytest.raises(TokenizerTrainingError, match="special"):
        train_tokenizer([corpus_file], 1000, tmp_path, special_tokens=specials)


def test_errors_are_pocket_errors():
    assert issubclass(TokenizerTrainingError, PocketError)


def test_load_missing(tmp_path):
    with pytest.raises(PocketError, match="no tokenizer.json"):
        load_trained_tokenizer(tmp_path)
    with pytest.raises(PocketError, match="no such tokenizer folder"):
        load_trained_tokenizer(tmp_path / "absent")


def test_load_bad_config(trained, tmp_path):
    _, out = trained
    (tmp_path / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(PocketError, match="tokenizer_config.json: not valid JSON"):
        load_trained_tokenizer(tmp_path)


def test_an_interrupted_save_leaves_no_tokenizer_without_its_config(corpus_file, tmp_path,
                                                                     monkeypatch):
    # tokenizer.json marks a folder as holding a tokenizer (pocket train resumes with it):
    # written first, a Ctrl-C before its config left one that loads with another end of text
    # and no chat template
    import pocketlm.train.tokenizer_train as tt

    real = tt.os.replace
    calls = []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(tt.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        train_tokenizer([corpus_file], 300, tmp_path, progress=False)
    assert not (tmp_path / "tokenizer.json").exists()
    assert not list(tmp_path.glob("*.partial"))  # nor a partial file


# ----------------------------------------------------------------------------- comparing


def test_chars_per_token(trained):
    tok, _ = trained
    texts = ["模型训练", "the model runs"]
    n = sum(len(tok.encode(t)) for t in texts)
    assert chars_per_token(tok, texts) == pytest.approx((4 + 14) / n)
    with pytest.raises(PocketError, match="empty"):
        chars_per_token(tok, [""])


def test_embedding_bytes():
    assert embedding_bytes(32000, 960, 16) == 32000 * 960 * 2
    assert embedding_bytes(32000, 960, 4.5) == 32000 * 960 * 9 // 16


def test_compare_tokenizers(trained, corpus_file, tmp_path):
    tok, _ = trained
    small = train_tokenizer([corpus_file], 300, tmp_path, progress=False)
    held_en = ["The model runs on a small phone with fast decode."]
    held_zh = ["我们今天在手机应用里训练小模型，速度很好。"]
    rows = compare_tokenizers({"big": tok, "small": small}, held_en, held_zh, d_model=64,
                              progress=False)
    big, little = rows
    assert (big.name, little.name) == ("big", "small")
    assert big.chars_per_token_zh > little.chars_per_token_zh
    assert big.chars_per_token_en > little.chars_per_token_en
    assert big.embed_mb_f16 == pytest.approx(tok.vocab_size * 64 * 2 / 1e6)
    assert big.embed_mb_int4 == pytest.approx(tok.vocab_size * 64 * 4.5 / 8 / 1e6)
    assert set(big.as_dict()) >= {"name", "vocab_size", "chars_per_token_en",
                                  "chars_per_token_zh", "embed_mb_f16", "embed_mb_int4"}
    with pytest.raises(PocketError, match="held-out"):
        compare_tokenizers({"big": tok}, [], held_zh)


def test_tokenizer_train_cli_checks_its_output_before_training(tmp_path, capsys):
    from pocketlm.cli import main

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"hello world {i} 小猫 北京" for i in range(50)),
                      encoding="utf-8")
    args = ["tokenizer", "train", "--data", str(corpus), "--vocab-size", "300", "-q", "--out"]
    # a file named --out was found only after the training, as a raw "File exists"
    assert main([*args, str(corpus)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a file of that name exists" in err
    out = tmp_path / "tok"
    assert main([*args, str(out)]) == 0
    first = (out / "tokenizer.json").read_bytes()
    # a second run replaced the tokenizer that shards and runs were made with, silently
    assert main([*args, str(out)]) == 1
    assert "holds a tokenizer already; pass --force" in capsys.readouterr().err
    assert main([*args, str(out), "--force"]) == 0
    assert (out / "tokenizer.json").read_bytes() == first  # same data, same seed
    capsys.readouterr()
    # the text to train on, named tokenizer.json in --out: --force replaced it with the result
    own = tmp_path / "own"
    own.mkdir()
    (own / "tokenizer.json").write_text(corpus.read_text(encoding="utf-8"), encoding="utf-8")
    code = main(["tokenizer", "train", "--data", str(own / "tokenizer.json"), "--vocab-size",
                 "300", "-q", "--out", str(own), "--force"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "is the input" in err, err
    assert (own / "tokenizer.json").read_text(encoding="utf-8") == corpus.read_text(
        encoding="utf-8")
    # the flags are named, not the function's arguments (min_frequency, sample_lines)
    for flag, value in (("--min-frequency", "-3"), ("--sample-lines", "0")):
        assert main([*args, str(tmp_path / "t2"), flag, value]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{flag} must be" in err, err


def test_sigterm_while_replacing_a_tokenizer_leaves_no_mismatched_pair(tmp_path):
    """SIGTERM as ``pocket tokenizer train --force`` puts its files in place: exit status 143,
    no ``.partial`` file left, and never the earlier tokenizer.json beside the new config (its
    special tokens and template would be read with the earlier vocabulary); the folder then
    holds no tokenizer, and the same command without --force writes one."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"hello world {i} 小猫 北京" for i in range(50)),
                      encoding="utf-8")
    out = tmp_path / "tok"
    args = ["tokenizer", "train", "--data", str(corpus), "--vocab-size", "300", "-q", "--out",
            str(out)]
    assert subprocess.run([sys.executable, "-m", "pocketlm.cli", *args],
                          capture_output=True).returncode == 0
    first = (out / "tokenizer.json").read_bytes()
    script = f"""
import os, signal, sys
from pocketlm import cli

replace = os.replace

def replace_then_stop(src, dst):
    if os.path.basename(dst) == "tokenizer.json":
        os.kill(os.getpid(), signal.SIGTERM)
    return replace(src, dst)

os.replace = replace_then_stop
sys.exit(cli.main({[*args, "--force", "--special-tokens", "<|end|>", "<|user|>"]!r}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr
    assert not list(out.glob("*.partial"))
    assert not (out / "tokenizer.json").exists()
    proc = subprocess.run([sys.executable, "-m", "pocketlm.cli", *args], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "tokenizer.json").read_bytes() == first  # same data, same seed
