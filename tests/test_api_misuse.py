"""Misuse of the Python API, the sampler and the text inputs: every bad value is a typed
:class:`PocketError` that names it, never a NaN, a builtin exception or a silent coercion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiny_gguf

import pocketlm
from pocketlm.errors import PocketError, SamplingError, TextError, TokenIdError
from pocketlm.evaluate.tasks import load_task
from pocketlm.sampling import Sampler, SamplingParams

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with tiny_gguf.loaded_tiny_model(tmp_path_factory, "misuse", seed=3) as env:
        yield env


@pytest.fixture
def m(env):
    return env["model"]


# -- the sampler -----------------------------------------------------------------------------
LOGITS = np.random.default_rng(0).normal(size=500).astype(np.float32) * 8


@pytest.mark.parametrize("temperature", [5e-324, 1e-308, 1.7e-307, 1e-30, 1e-3, 0.7, 1e300])
@pytest.mark.parametrize("penalty", [1.0, 1e-300, 1e300])
@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (5, 0.9, 0.05), (1, 1e-9, 1.0)])
def test_no_accepted_parameter_makes_the_sampler_fail(temperature, penalty, top_k, top_p,
                                                      min_p):
    """Dividing the logits by a tiny temperature overflowed to inf and inf - inf made the
    probabilities NaN; a tiny or huge repetition penalty did the same to the seen tokens."""
    params = SamplingParams(temperature=temperature, repetition_penalty=penalty, top_k=top_k,
                            top_p=top_p, min_p=min_p, seed=1)
    sampler = Sampler(params)
    for _ in range(3):
        token = sampler(LOGITS, history=[1, 2, 3, int(np.argmax(LOGITS))])
        assert 0 <= token < LOGITS.size


@pytest.mark.parametrize("key", [2**63, 2**70, -1, True, 1.0])
def test_a_logit_bias_key_that_is_no_token_id_is_refused(key):
    # past int64: the sampler's id array overflowed (a raw OverflowError)
    with pytest.raises(SamplingError, match="logit_bias keys must be token ids"):
        Sampler(SamplingParams(logit_bias={key: 1.0}, temperature=1.0))


def test_a_vanishing_temperature_samples_the_greedy_token():
    # every other token is exp(-gap / 1e-308) = 0 times as likely
    assert Sampler(SamplingParams(temperature=1e-308, seed=0))(LOGITS) == int(np.argmax(LOGITS))


def test_non_finite_logits_are_sampled_sensibly():
    x = np.array([0.0, np.nan, 1.0, -np.inf], np.float32)
    s = Sampler(SamplingParams(temperature=1.0, seed=0))
    assert all(s(x) in (0, 2) for _ in range(20))  # NaN and -inf are never drawn
    x = np.array([0.0, np.inf, 1.0, np.inf], np.float32)
    assert {s(x) for _ in range(40)} == {1, 3}  # +inf is the most likely: only those
    with pytest.raises(SamplingError, match="NaN or -inf"):
        s(np.array([np.nan, -np.inf], np.float32))


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_never_picks_a_nan_logit(penalty):
    # np.argmax takes the first NaN: damaged weights decoded token 0 over and over, silently
    greedy = Sampler(SamplingParams(temperature=0, repetition_penalty=penalty))
    x = np.array([np.nan, 0.5, 2.0, np.nan], np.float32)
    assert greedy(x, history=[1]) == 2
    assert greedy(x, allowed=np.array([True, True, False, True])) == 1
    with pytest.raises(SamplingError, match="checksums"):
        greedy(np.full(4, np.nan, np.float32), history=[1])


def test_damaged_scales_loaded_without_checksums_are_named(env, tmp_path):
    from pocketlm.api import deploy_file
    from pocketlm.errors import KernelError
    from pocketlm.formats.pocketfile import PocketFile

    src = deploy_file(env["gguf"])
    infos = PocketFile(src).infos
    # the engine refuses scales that are not finite when it repacks a weight (every product's
    # weights: where AMX ran the prefill, a layer's went unnoticed: three tokens of garbage);
    # the embedding's, read in place, are refused by the reader (the tied head's said "no
    # usable logits" at the first token)
    from pocketlm.errors import FormatError
    for name, words, error in (("layers.0.attn.w_q.weight.scales", "damaged", KernelError),
                               ("embed.weight.scales", "'embed.weight' holds values that are "
                                "not finite", FormatError)):
        data = bytearray(src.read_bytes())
        info = infos[name]
        data[info.start:info.end] = np.full((info.end - info.start) // 2, np.nan,
                                            np.float16).tobytes()
        bad = tmp_path / f"{name}.pocket"
        bad.write_bytes(bytes(data))
        with pytest.raises(PocketError, match=f"{name}. is corrupt .CRC-32"):
            pocketlm.load(bad)  # the default: the CRC-32 of each tensor names it
        with pytest.raises(error, match=words):  # was "status -1", or token 0 as the answer
            pocketlm.load(bad, verify=False).generate("hello", max_tokens=3)


def test_generate_with_a_vanishing_temperature_is_greedy(m):
    greedy = m.generate("hello", max_tokens=6, temperature=0)
    assert m.generate("hello", max_tokens=6, temperature=1e-308, seed=3) == greedy


def test_numpy_integers_are_taken_as_lengths_seeds_and_top_k(m):
    # a count from an array (np.int64) was refused as max_tokens while seed and top_k took it
    plain = m.generate("hello", max_tokens=4, temperature=0.8, seed=3, top_k=20)
    assert m.generate("hello", max_tokens=np.int64(4), temperature=0.8, seed=np.int64(3),
                      top_k=np.int32(20)) == plain


def test_a_used_generation_state_is_refused(m):
    # a state that already recorded a generation made the next one yield nothing: it read as
    # finished, its tokens counted toward max_tokens
    from pocketlm.generate import GenerationState

    state = GenerationState()
    first = list(m.stream_ids([1, 2, 3], max_tokens=3, state=state))
    assert first and state.generated == first
    with pytest.raises(PocketError, match="state must be a new GenerationState"):
        m.stream_ids([1, 2, 3], max_tokens=3, state=state)
    assert list(m.stream_ids([1, 2, 3], max_tokens=3, state=GenerationState())) == first


def test_a_numpy_integer_is_taken_as_n_ctx(env):
    # it was refused as "not a positive number of tokens" while max_tokens took it
    m = pocketlm.load(env["gguf"], n_ctx=np.int64(16))
    assert m.n_ctx == 16 and type(m.n_ctx) is int


# -- the API misuse table --------------------------------------------------------------------
MISUSE = [
    ("logits([1.9])", lambda m: m.logits([1.9]), TokenIdError, "integers"),
    ("logits(['5'])", lambda m: m.logits(["5"]), TokenIdError, "integers"),
    ("logits(complex)", lambda m: m.logits(np.array([1 + 2j])), TokenIdError, "integers"),
    ("logits(True)", lambda m: m.logits([True]), TokenIdError, "integers"),
    ("logits(5)", lambda m: m.logits(5), TokenIdError, "list of integers"),
    ("logits('5')", lambda m: m.logits("5"), TokenIdError, "list of integers"),
    ("logits(2-D)", lambda m: m.logits(np.zeros((2, 2), np.int64)), TokenIdError,
     "one-dimensional"),
    ("logits(-1)", lambda m: m.logits([-1]), TokenIdError, "out of range"),
    ("logits([])", lambda m: m.logits([]), TokenIdError, "at least one"),
    ("detokenize(huge)", lambda m: m.detokenize([10**9]), TokenIdError, "out of range"),
    ("detokenize(['a'])", lambda m: m.detokenize(["a"]), TokenIdError, "integers"),
    ("detokenize(None)", lambda m: m.detokenize(None), TokenIdError, "list of integers"),
    # a set or a dict has no order (a dict's keys were taken): the text was any permutation
    ("detokenize(set)", lambda m: m.detokenize({5, 9}), TokenIdError, "got set"),
    ("detokenize(dict)", lambda m: m.detokenize({5: 1}), TokenIdError, "got dict"),
    ("logits(frozenset)", lambda m: m.logits(frozenset({5})), TokenIdError, "got frozenset"),
    ("generate('')", lambda m: m.generate("", max_tokens=2, add_bos=False), TokenIdError,
     "the prompt is empty"),
    ("stream('')", lambda m: m.stream("", max_tokens=2, add_bos=False), TokenIdError,
     "the prompt is empty"),
    ("tokenize(None)", lambda m: m.tokenize(None), TextError, "str"),
    ("tokenize(bytes)", lambda m: m.tokenize(b"hi"), TextError, "str"),
    ("tokenize(surrogate)", lambda m: m.tokenize("a\ud800"), TextError, "U+D800"),
    ("generate(surrogate)", lambda m: m.generate("a\ud800", max_tokens=2), TextError,
     "U+D800"),
    ("generate(escaped byte)", lambda m: m.generate("hi \udcff", max_tokens=2), TextError,
     "U+DCFF"),
    ("generate(stop=5)", lambda m: m.generate("hi", max_tokens=2, stop=5), SamplingError,
     "stop"),
    ("generate(stop=[5])", lambda m: m.generate("hi", max_tokens=2, stop=[5]), TextError,
     "stop"),
    ("generate(max_tokens=-1)", lambda m: m.generate("hi", max_tokens=-1), SamplingError,
     "max_tokens"),
    ("generate(max_tokens=2.5)", lambda m: m.generate("hi", max_tokens=2.5), SamplingError,
     "max_tokens"),
    ("generate(temperature='hot')", lambda m: m.generate("hi", temperature="hot"),
     SamplingError, "temperature"),
    ("generate(temperature=nan)", lambda m: m.generate("hi", temperature=float("nan")),
     SamplingError, "temperature"),
    ("generate(top_k=1.5)", lambda m: m.generate("hi", top_k=1.5, temperature=1),
     SamplingError, "top_k"),
    ("generate(seed=-1)", lambda m: m.generate("hi", seed=-1, temperature=1), SamplingError,
     "seed"),
    ("chat(surrogate)", lambda m: m.chat([{"role": "user", "content": "a\ud800b"}]), TextError,
     "U+D800"),
    ("chat(not a list)", lambda m: m.chat("hello"), PocketError, "messages"),
    ("stream_ids(floats)", lambda m: list(m.stream_ids([1.5])), TokenIdError, "integers"),
    # these were a raw AttributeError / TypeError / ValueError, or ran: a float id truncated,
    # max_batch=1.5 taken as a batch size
    ("stream_ids(state='x')", lambda m: list(m.stream_ids([1], state="x")), PocketError,
     "state must be a GenerationState"),
    ("tokenizer.decode([1.5])", lambda m: m.tokenizer.decode([1.5]), TokenIdError, "integers"),
    ("tokenizer.decode(['a'])", lambda m: m.tokenizer.decode(["a"]), TokenIdError,
     "integers"),
    ("chat_batch(None)", lambda m: list(m.chat_batch(None, max_tokens=1)), PocketError,
     "conversations"),
    ("chat_batch(max_batch=0)", lambda m: list(m.chat_batch(
        [[{"role": "user", "content": "x"}]], max_tokens=1, max_batch=0)), SamplingError,
     "max_batch"),
    ("chat_batch(max_batch=1.5)", lambda m: list(m.chat_batch(
        [[{"role": "user", "content": "x"}]], max_tokens=1, max_batch=1.5)), SamplingError,
     "max_batch"),
    # a number as a string passed the check (float("0.5")) and failed deep in the sampler
    # with a raw TypeError; True was taken for 1.0
    ("generate(temperature='0.5')", lambda m: m.generate("hi", max_tokens=2,
                                                         temperature="0.5"),
     SamplingError, "temperature"),
    ("generate(temperature=True)", lambda m: m.generate("hi", max_tokens=2, temperature=True),
     SamplingError, "temperature"),
    ("chat(top_p=True)", lambda m: m.chat([{"role": "user", "content": "x"}], max_tokens=2,
                                          top_p=True), SamplingError, "top_p"),
    # no messages: the reply to nothing but the assistant header ran
    ("chat([])", lambda m: m.chat([], max_tokens=2), PocketError, "messages is empty"),
    ("chat_batch([[]])", lambda m: list(m.chat_batch([[]], max_tokens=2)), PocketError,
     "messages is empty"),
    # switches read by their truthiness: stream="no" streamed, add_bos="no" added a BOS
    ("chat(stream='no')", lambda m: m.chat([{"role": "user", "content": "x"}], max_tokens=2,
                                           stream="no"), PocketError, "stream must be True"),
    ("tokenize(add_bos='no')", lambda m: m.tokenize("x", add_bos="no"), PocketError,
     "add_bos must be True or False (or None)"),
    ("generate(add_bos=1)", lambda m: m.generate("x", max_tokens=2, add_bos=1), PocketError,
     "add_bos must be True"),
    ("tokenize(special=None)", lambda m: m.tokenize("x", special=None), PocketError,
     "special must be True"),
    ("chat_ids(add_generation_prompt='no')", lambda m: m.chat_ids(
        [{"role": "user", "content": "x"}], add_generation_prompt="no"), PocketError,
     "add_generation_prompt must be True or False"),
    # Python's own "got multiple values for keyword argument 'bos_token'"
    ("chat_ids(bos_token='X')", lambda m: m.chat_ids(
        [{"role": "user", "content": "x"}], bos_token="X"), PocketError,
     "template variable 'bos_token' is the model's own"),
    # an integer beyond float's range was a raw OverflowError; one too long to write out made
    # the message itself fail with a raw ValueError
    ("generate(temperature=10**400)", lambda m: m.generate("hi", max_tokens=2,
                                                           temperature=10**400),
     SamplingError, "temperature must be a finite number, got an integer of 401 digits"),
    ("chat(top_p=-10**400)", lambda m: m.chat([{"role": "user", "content": "x"}], max_tokens=2,
                                              top_p=-10**400), SamplingError, "top_p"),
    ("generate(top_k=-10**5000)", lambda m: m.generate("hi", max_tokens=2, top_k=-10**5000),
     SamplingError, "top_k must be a non-negative integer (0 = off), got a negative integer"),
    ("generate(seed=-10**5000)", lambda m: m.generate("hi", max_tokens=2, seed=-10**5000),
     SamplingError, "seed"),
    ("generate(max_tokens=-10**5000)", lambda m: m.generate("hi", max_tokens=-10**5000),
     SamplingError, "max_tokens"),
]


@pytest.mark.parametrize("call,error,words", [(c, e, w) for _, c, e, w in MISUSE],
                         ids=[n for n, *_ in MISUSE])
def test_model_misuse_is_a_typed_error(m, call, error, words):
    with pytest.raises(error) as info:
        call(m)
    assert words in str(info.value)


LOAD_MISUSE = [
    ("keep_precision='yes'", dict(keep_precision="yes"), "keep_precision"),
    ("keep_precision=2", dict(keep_precision=2), "keep_precision"),
    ("group_size=33", dict(group_size=33), "group_size"),
    ("group_size=True", dict(group_size=True), "group_size"),
    ("embed_bits=5", dict(embed_bits=5), "embed_bits"),
    ("n_ctx=0", dict(n_ctx=0), "n_ctx"),
    ("n_ctx=1.5", dict(n_ctx=1.5), "n_ctx"),
    ("verify='no'", dict(verify="no"), "verify"),
    ("quiet='no'", dict(quiet="no"), "quiet must be True"),
    ("precision='int3'", dict(precision="int3"), "precision"),
]


@pytest.mark.parametrize("kwargs,words", [(k, w) for _, k, w in LOAD_MISUSE],
                         ids=[n for n, *_ in LOAD_MISUSE])
def test_load_misuse_is_a_typed_error(env, kwargs, words):
    with pytest.raises(PocketError, match=words):
        pocketlm.load(env["gguf"], **kwargs)


@pytest.mark.parametrize("model", [123, ["a"], "a\ud800"])
def test_a_model_that_is_not_a_name_or_path_is_a_typed_error(env, model):
    with pytest.raises(PocketError):
        pocketlm.load(model)


# -- text from the command line --------------------------------------------------------------
def pocket(env, args: list, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, "POCKET_HOME": str(env["root"] / "home"), "LC_ALL": "C.UTF-8"}
    return subprocess.run([sys.executable, "-m", "pocketlm.cli", *args], input=stdin,
                          capture_output=True, env=environ, cwd=REPO, timeout=300)


def assert_one_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert len(err) == 1 and err[0].startswith("pocket: error: "), proc.stderr
    for w in words:
        assert w in err[0], (w, err)


def test_non_utf8_stdin_is_one_line(env):
    proc = pocket(env, ["run", "-m", str(env["gguf"]), "-n", "4"], stdin=b"hi \xff\xfe")
    assert_one_line(proc, "stdin:1: not UTF-8", "0xff", "offset 3")


def test_non_utf8_argument_is_one_line(env):
    proc = pocket(env, ["run", "-m", str(env["gguf"]), "-n", "4", os.fsdecode(b"hi \xff")])
    assert_one_line(proc, "the prompt is not UTF-8")


def test_chat_names_a_non_utf8_line_and_goes_on(env):
    proc = pocket(env, ["chat", "-m", str(env["gguf"]), "-n", "2"],
                  stdin=b"hi \xff\nhello\n/quit\n")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.decode("utf-8", "replace")
    assert "not UTF-8" in err and "Traceback" not in err


@pytest.mark.parametrize("args,words", [
    (["run", "-n", "2"], "no prompt given"),
    (["run", "-n", "2", "-"], "stdin is closed"),
    (["chat", "-n", "2"], "stdin is closed"),
    (["eval", "--ppl", "-"], "stdin is closed"),
])
def test_a_closed_stdin_is_one_line(env, args, words):
    # sys.stdin is None then: each of these was a traceback (isatty, read, input())
    environ = {**os.environ, "POCKET_HOME": str(env["root"] / "home"), "LC_ALL": "C.UTF-8"}
    proc = subprocess.run([sys.executable, "-m", "pocketlm.cli", args[0], "-m",
                           str(env["gguf"]), *args[1:]], capture_output=True, env=environ,
                          cwd=REPO, timeout=300, stdin=None, preexec_fn=lambda: os.close(0))
    assert_one_line(proc, words)


# -- evaluation task files -------------------------------------------------------------------
def task_header(**extra) -> dict:
    return {"type": "generation", "template": "Q: {question}\nA:", "extract": "last_number",
            **extra}


@pytest.mark.parametrize("case", ["huge int", "deep nesting", "surrogate", "huge int jsonl",
                                  "deep jsonl"])
def test_hostile_task_files_are_one_clear_error(tmp_path, case):
    path = tmp_path / "task.json"
    if case == "huge int":
        path.write_text('{"type": "generation", "template": "x", "shots": 1' + "0" * 5000 + "}")
    elif case == "deep nesting":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif case == "surrogate":
        path.write_text(json.dumps(task_header(examples=[{"question": "a\ud800",
                                                          "answer": "1"}])))
    else:
        path = tmp_path / "task.jsonl"
        bad = ('{"question": "x", "answer": 1' + "0" * 5000 + "}" if case == "huge int jsonl"
               else "[" * 100_000 + "]" * 100_000)
        path.write_text(json.dumps({"task": task_header()}) + "\n" + bad + "\n")
    with pytest.raises(PocketError) as info:
        load_task(path, strict=True)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("messages, error", [
    ([{"role": "user"}], "messages[0].content must be a string, got none"),
    ([{"content": "hi"}], "messages[0].role must be a string"),
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": None}],
     "messages[1].content must be a string, got NoneType"),
    (["hi"], "messages[0] must be a {'role': str, 'content': str} dict, got str"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0] must be a text part"),
    ([{"role": "user", "content": "a\ud800"}],
     "messages[0].content is not valid Unicode: a lone surrogate U+D800 at character 1"),
])
def test_a_bad_message_is_named_with_its_field(m, messages, error):
    """Every malformed message got one error ('messages must be a list of ...'), and a lone
    surrogate was placed in the rendered template's text, not the message's."""
    with pytest.raises(PocketError) as info:
        m.chat_ids(messages)
    assert str(info.value).startswith(error), str(info.value)


def test_openai_text_parts_are_the_text_they_hold(m):
    """The server takes OpenAI's content parts; the Python API refused them."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "},
                                          {"type": "text", "text": "there"}]}]
    assert m.chat_ids(parts) == m.chat_ids([{"role": "user", "content": "Hi there"}])
    assert m.chat(parts, max_tokens=4) == m.chat([{"role": "user", "content": "Hi there"}],
                                                 max_tokens=4)


@pytest.mark.parametrize("engine", ["native", "numpy"])
@pytest.mark.parametrize("length", [2.7, -1, "3", 10**9, True, None])
def test_a_cache_length_set_by_hand_is_checked(env, monkeypatch, engine, length):
    """KVCache.length is a plain attribute: set to a float it was taken (the native engine
    wrote at position 7.7 -> 7), negative or a string it was a bare ValueError, IndexError or
    TypeError. Every call checks it, and the cache works again once truncated."""
    from pocketlm.errors import KernelError

    monkeypatch.setenv("POCKET_KERNELS", engine)
    model = pocketlm.load(env["gguf"])
    rt = model.runtime
    ref = rt.new_cache(16)
    rt.forward([1, 2, 3], ref)
    want = rt.forward([4], ref)
    cache = rt.new_cache(16)
    rt.forward([1, 2, 3], cache)
    cache.length = length
    for call in (lambda: rt.forward([4], cache), lambda: rt.verify([4, 5], cache)):
        with pytest.raises(KernelError, match="length must be an integer from 0 to its capacity"):
            call()
    cache.length = 3
    np.testing.assert_array_equal(rt.forward([4], cache), want)


@pytest.mark.parametrize("options", [dict(group_size=64), dict(embed_bits=4),
                                     dict(keep_precision=False)])
def test_packing_options_for_a_deploy_file_are_refused_not_ignored(env, options):
    """A deploy file runs as it was packed: the packing options were silently ignored."""
    from pocketlm.api import deploy_file

    pocket = deploy_file(env["gguf"])
    with pytest.raises(PocketError, match="is a deploy file, packed already"):
        pocketlm.load(pocket, **options)
    assert pocketlm.load(pocket, group_size=32, embed_bits=8).generate("hi", max_tokens=2)
