"""The engine settings (every POCKET_* variable read once, in one place), the Engine interface
of the runtime's two engines, and ``pocket doctor``."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import tiny_models

from pocketlm import cli
from pocketlm.errors import (
    ContextLengthError,
    FormatError,
    KernelError,
    PocketError,
    TokenIdError,
    UnsupportedError,
)
from pocketlm.quant import quantize_int4, quantize_int5, quantize_int8
from pocketlm.runtime import (
    Engine,
    KVCache,
    NativeModelEngine,
    NumpyEngine,
    Runtime,
    settings,
)
from pocketlm.runtime.kernels import native
from pocketlm.runtime.settings import VARIABLES, EngineSettings

IDS = [5, 17, 3, 250, 11, 9, 42]
ENGINE_BUILT = native.engine_available()


def _quantized(cfg, seed=3):
    """INT4 / INT5 layers, an INT8 embedding: every quantized weight kind."""
    sd = tiny_models.random_state_dict(cfg, seed=seed)
    out = dict(sd)
    for i, (name, w) in enumerate(sorted(sd.items())):
        if w.ndim == 2:
            out[name] = (quantize_int8(w) if name in ("embed.weight", "lm_head.weight")
                         else quantize_int5(w, 32) if i % 2 else quantize_int4(w, 32))
    return out


# -- parsing ---------------------------------------------------------------------------------
def test_defaults_when_nothing_is_set():
    s = EngineSettings.from_env({})
    assert s == EngineSettings()
    assert (s.kernels, s.cpu_level, s.act, s.kv, s.threads) == (None,) * 5
    assert (s.q8_digits, s.amx, s.amx_weights, s.avxvnni, s.hugepages, s.head_screen) == (
        2, None, "mixed", 1, 0, 64)
    assert all(source == "default" for *_, source in s.items())
    assert [var for _, var, _, _ in s.items()] == list(VARIABLES.values())


@pytest.mark.parametrize("var, raw, field, value", [
    ("POCKET_KERNELS", " Numpy ", "kernels", "numpy"),
    ("POCKET_KERNELS", "native", "kernels", "native"),
    ("POCKET_CPU_LEVEL", "SCALAR", "cpu_level", "scalar"),
    ("POCKET_CPU_LEVEL", "neon", "cpu_level", "neon"),  # a known level; the CPU check is later
    ("POCKET_ACT", "Q8", "act", "q8"),
    ("POCKET_ACT", "f32", "act", "f32"),
    ("POCKET_KV", "f16", "kv", "f16"),
    ("POCKET_KV", "q8", "kv", "q8"),
    ("POCKET_THREADS", " 3 ", "threads", 3),
    ("POCKET_THREADS", "1024", "threads", 1024),
    ("POCKET_Q8_DIGITS", "1", "q8_digits", 1),
    ("POCKET_AMX", "0", "amx", False),
    ("POCKET_AMX", "1", "amx", True),
    ("POCKET_AMX_WEIGHTS", "One-Term", "amx_weights", "one-term"),
    ("POCKET_AVXVNNI", "0", "avxvnni", 0),
    ("POCKET_AVXVNNI", "1", "avxvnni", 1),
    ("POCKET_HUGEPAGES", "0", "hugepages", 0),
    ("POCKET_HUGEPAGES", "1", "hugepages", 1),
    ("POCKET_HEAD_SCREEN", "0", "head_screen", 0),
    ("POCKET_HEAD_SCREEN", "8", "head_screen", 8),
])
def test_each_variable_is_parsed(var, raw, field, value):
    s = EngineSettings.from_env({var: raw})
    assert getattr(s, field) == value
    assert s.source(field) == "env"
    assert all(src == "default" for name, _, _, src in s.items() if name != field)


def test_an_empty_or_blank_variable_is_unset():
    s = EngineSettings.from_env({var: " " for var in VARIABLES.values()})
    assert s == EngineSettings() and not s.from_environment


@pytest.mark.parametrize("var, raw, error, message", [
    ("POCKET_KERNELS", "cuda", UnsupportedError,
     "POCKET_KERNELS='cuda' is not a kernel backend; choose one of native, numpy"),
    ("POCKET_CPU_LEVEL", "avx9", KernelError,
     "POCKET_CPU_LEVEL='avx9': unknown kernel level; choose one of scalar, avx2, avx512, neon"),
    ("POCKET_ACT", "int4", UnsupportedError, "POCKET_ACT='int4'; choose one of f32, q8"),
    ("POCKET_KV", "f64", KernelError, "POCKET_KV='f64'; choose one of f32, f16, q8"),
    ("POCKET_THREADS", "two", KernelError, "POCKET_THREADS='two' is not an integer"),
    # int() took these: "1_0" as 10, "+4", and an Arabic-Indic three as 3
    ("POCKET_THREADS", "1_0", KernelError, "POCKET_THREADS='1_0' is not an integer"),
    ("POCKET_THREADS", "+4", KernelError, "POCKET_THREADS='+4' is not an integer"),
    ("POCKET_THREADS", "\u0663", KernelError, "POCKET_THREADS='\u0663' is not an integer"),
    ("POCKET_THREADS", "0", KernelError, "POCKET_THREADS=0 is out of range 1..1024"),
    ("POCKET_THREADS", "1025", KernelError, "POCKET_THREADS=1025 is out of range 1..1024"),
    ("POCKET_Q8_DIGITS", "3", KernelError, "POCKET_Q8_DIGITS='3'; choose 1 or 2"),
    ("POCKET_AMX", "yes", KernelError, "POCKET_AMX='yes'; choose 0 or 1"),
    ("POCKET_AMX_WEIGHTS", "half", KernelError,
     "POCKET_AMX_WEIGHTS='half'; choose one of two-term, mixed, one-term"),
    ("POCKET_AVXVNNI", "on", KernelError, "POCKET_AVXVNNI='on'; choose 0 or 1"),
    ("POCKET_HUGEPAGES", "yes", KernelError, "POCKET_HUGEPAGES='yes'; choose 0 or 1"),
    # a digit to str.isdigit() that int() refuses: was a raw ValueError
    ("POCKET_HEAD_SCREEN", "\u00b2", KernelError,
     "POCKET_HEAD_SCREEN='\u00b2'; choose 0 (off) or a number of tiles from 1 to 256"),
    ("POCKET_HEAD_SCREEN", "-1", KernelError,
     "POCKET_HEAD_SCREEN='-1'; choose 0 (off) or a number of tiles from 1 to 256"),
])
def test_bad_values_are_rejected_with_the_message(var, raw, error, message):
    with pytest.raises(error) as info:
        EngineSettings.from_env({var: raw})
    assert str(info.value) == message and "\n" not in message


def test_from_env_reads_os_environ_when_called(clean_env):
    clean_env.setenv("POCKET_KV", "q8")
    assert EngineSettings.from_env().kv == "q8"
    clean_env.setenv("POCKET_KV", "f16")  # read at the call, never cached
    assert EngineSettings.from_env().kv == "f16"


def test_settings_are_frozen():
    with pytest.raises(AttributeError):
        EngineSettings().kv = "q8"


# -- read once per runtime, passed down --------------------------------------------------------
def _count_from_env(monkeypatch) -> list:
    calls = []
    original = EngineSettings.from_env.__func__

    def counting(cls, environ=None):
        calls.append(1)
        return original(cls, environ)

    monkeypatch.setattr(EngineSettings, "from_env", classmethod(counting))
    return calls


@pytest.mark.parametrize("engine", [None, "numpy"] + (["native"] if ENGINE_BUILT else []))
def test_from_env_runs_once_per_runtime_not_per_forward(monkeypatch, engine):
    cfg = tiny_models.tiny_config("llama")
    w = _quantized(cfg)
    calls = _count_from_env(monkeypatch)
    rt = Runtime(cfg, w, engine=engine)
    assert len(calls) == 1
    caches = [rt.new_cache(16) for _ in range(3)]
    rt.forward(IDS, caches[0], all_logits=True)
    rt.forward([4], caches[0])
    rt.forward_batch([1, 2], caches[1:])
    rt.copy_prefix(caches[1], caches[0], 3)
    rt.cache_nbytes(16)
    assert len(calls) == 1


def test_settings_given_to_the_runtime_are_used_not_the_environment(clean_env):
    cfg = tiny_models.tiny_config("llama")
    w = _quantized(cfg)
    clean_env.setenv("POCKET_KV", "f64")  # would be an error if it were read
    rt = Runtime(cfg, w, engine="numpy", settings=EngineSettings())
    assert rt.settings == EngineSettings() and rt.engine == "numpy"
    with pytest.raises(KernelError, match="POCKET_KV='f64'"):
        Runtime(cfg, w, engine="numpy")
    if ENGINE_BUILT:
        rt = Runtime(cfg, w, settings=EngineSettings(kernels="native", act="f32", kv="q8",
                                                     threads=1, q8_digits=1))
        assert rt.engine == "native"
        assert (rt.native.act, rt.native.kv_format, rt.native.threads) == ("f32", "q8", 1)
        assert rt.native.digits == 1
        rt = Runtime(cfg, w, settings=EngineSettings(kernels="numpy"))
        assert rt.engine == "numpy" and rt.native is None


@pytest.mark.skipif(not ENGINE_BUILT, reason="the native engine is not built")
def test_avxvnni_setting_reaches_the_engine(clean_env):
    cfg = tiny_models.tiny_config("llama")
    w = _quantized(cfg)
    assert native.NativeEngine(cfg, w).avxvnni == 1
    clean_env.setenv("POCKET_AVXVNNI", "0")
    assert native.NativeEngine(cfg, w).avxvnni == 0
    assert Runtime(cfg, w, engine="native").native.avxvnni == 0
    assert native.NativeEngine(cfg, w, avxvnni=True).avxvnni == 1
    assert native.NativeEngine(cfg, w, settings=EngineSettings()).avxvnni == 1
    clean_env.setenv("POCKET_AVXVNNI", "2")
    with pytest.raises(KernelError, match="POCKET_AVXVNNI='2'; choose 0 or 1"):
        Runtime(cfg, w)


@pytest.mark.skipif(not ENGINE_BUILT, reason="the native engine is not built")
def test_hugepages_setting_reaches_the_engine_and_changes_no_bit(clean_env):
    cfg = tiny_models.tiny_config("llama")
    w = _quantized(cfg)
    ids = np.array([3, 1, 4, 1, 5, 9, 2, 6], dtype=np.int32)
    off = native.NativeEngine(cfg, w)
    assert off.huge_pages == 0
    clean_env.setenv("POCKET_HUGEPAGES", "1")
    on = native.NativeEngine(cfg, w)
    assert on.huge_pages == 1
    assert Runtime(cfg, w, engine="native").native.huge_pages == 1
    assert native.NativeEngine(cfg, w, huge_pages=False).huge_pages == 0
    rows = [e.verify(e.new_kv(16), ids, 0) for e in (on, off)]
    assert rows[0].shape == (len(ids), cfg.vocab_size)
    assert np.array_equal(rows[0], rows[1])
    clean_env.setenv("POCKET_HUGEPAGES", "2")
    with pytest.raises(KernelError, match="POCKET_HUGEPAGES='2'; choose 0 or 1"):
        Runtime(cfg, w)


@pytest.mark.skipif(not ENGINE_BUILT, reason="the native engine is not built")
def test_native_functions_take_their_choices_from_the_settings(clean_env):
    clean_env.setenv("POCKET_THREADS", "zero")  # never read when settings are given
    s = EngineSettings(cpu_level="scalar", kv="q8", threads=3, amx=False)
    assert native.default_threads(s) == native.engine_threads(s) == 3
    assert native.kv_format("f32", s) == "q8"
    assert native.kv_format("q8", EngineSettings()) == "f16"
    assert native.kv_format("f32", EngineSettings()) == "f32"
    huge = native.transparent_huge_pages() in ("always", "madvise")
    assert native.engine_setting(s) == {"level": "scalar", "act": "f32", "amx": False,
                                        "amx_weights": None, "kv": "q8", "huge_pages": False,
                                        "head_screen": 0}  # float activations: no screening
    # every level's plane products screen int8 head activations, the scalar level's too
    assert native.engine_setting(EngineSettings(cpu_level="scalar", act="q8"))["head_screen"] == 64
    assert native.engine_setting(EngineSettings(hugepages=0))["huge_pages"] is False
    assert native.engine_setting(EngineSettings(hugepages=1))["huge_pages"] is huge
    assert native.engine_setting(EngineSettings(act="q8"))["head_screen"] == 64
    assert native.engine_setting(EngineSettings(act="f32"))["head_screen"] == 0
    assert native.cpu_features(s)["selected"] == "scalar"
    assert native.engine_threads(EngineSettings()) <= 2
    assert 1 <= native.default_threads(EngineSettings()) <= 8
    with pytest.raises(KernelError, match="POCKET_THREADS='zero'"):
        native.engine_threads()  # no settings: the environment's


# -- the numpy engine is numpy only ---------------------------------------------------------------
@pytest.mark.parametrize("how", ["engine=numpy", "POCKET_KERNELS=numpy"])
def test_the_numpy_engine_never_calls_the_extension(monkeypatch, how):
    cfg = tiny_models.tiny_config("qwen3")
    w = _quantized(cfg)
    expected = None
    if ENGINE_BUILT:  # the same runtime before the extension is disabled
        rt = Runtime(cfg, w, engine="numpy")
        expected = rt.forward(IDS, rt.new_cache(16), all_logits=True)
    from pocketlm import _native as ext

    if ext is None:
        pytest.skip("the native extension is not built")

    def refuse(*args, **kwargs):
        raise AssertionError("the numpy engine called pocketlm._native")

    for name in dir(ext):
        if not name.startswith("_") and callable(getattr(ext, name)):
            monkeypatch.setattr(ext, name, refuse)
    if how == "engine=numpy":
        rt = Runtime(cfg, w, engine="numpy")
    else:
        monkeypatch.setenv("POCKET_KERNELS", "numpy")
        rt = Runtime(cfg, w)
    assert rt.engine == "numpy" and rt.native is None
    cache = rt.new_cache(16)
    logits = rt.forward(IDS, cache, all_logits=True)
    rt.forward([3], cache)
    others = [rt.new_cache(16), rt.new_cache(16)]
    rt.copy_prefix(others[0], cache, 4)
    rt.forward_batch([1, 2], others)
    assert np.isfinite(logits).all()
    if expected is not None:
        np.testing.assert_array_equal(logits, expected)


def test_the_numpy_engine_is_the_numpy_reference_exactly():
    """Every weight kind goes through numpy_ref.linear_ref: one layer's products by hand."""
    from pocketlm.runtime.kernels import numpy_ref as R

    cfg = tiny_models.tiny_config("llama", n_layers=1)
    w = _quantized(cfg)
    rt = Runtime(cfg, w, engine="numpy")
    logits = rt.forward([7], rt.new_cache(4))
    x = R.embedding_ref(w["embed.weight"], np.array([7]))
    h = R.rmsnorm_ref(x, w["layers.0.attn_norm.weight"], cfg.norm_eps)
    v = R.linear_ref(h, w["layers.0.attn.w_v.weight"])  # one position: attention returns v
    a = np.repeat(v.reshape(1, cfg.n_kv_heads, cfg.head_dim), cfg.n_heads // cfg.n_kv_heads, 1)
    x = x + R.linear_ref(np.ascontiguousarray(a.reshape(1, cfg.q_dim)),
                         w["layers.0.attn.w_o.weight"])
    h = R.rmsnorm_ref(x, w["layers.0.mlp_norm.weight"], cfg.norm_eps)
    g = R.linear_ref(h, w["layers.0.mlp.w_gate.weight"])
    u = R.linear_ref(h, w["layers.0.mlp.w_up.weight"])
    x = x + R.linear_ref(np.ascontiguousarray(R.silu_ref(g) * u), w["layers.0.mlp.w_down.weight"])
    head = w.get("lm_head.weight", w["embed.weight"])
    expected = R.linear_ref(R.rmsnorm_ref(x, w["norm.weight"], cfg.norm_eps), head)[0]
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


# -- the Engine interface -------------------------------------------------------------------------
def _engines(cfg, w):
    yield NumpyEngine(cfg, w)
    if ENGINE_BUILT:
        yield NativeModelEngine(cfg, native.NativeEngine(cfg, w, act="f32", kv="f32", threads=1))


def test_both_engines_implement_the_interface():
    cfg = tiny_models.tiny_config("gemma3")
    w = tiny_models.random_state_dict(cfg, seed=4)
    results = {}
    for eng in _engines(cfg, w):
        assert isinstance(eng, Engine) and eng.name in ("numpy", "native")
        cache = eng.new_cache(16)
        assert eng.owns(cache) and cache.length == 0 and cache.capacity == 16
        assert eng.cache_nbytes(16) == cache.nbytes
        ids = np.array(IDS, np.int64)
        all_rows = eng.forward(ids, cache, True)
        assert all_rows.shape == (len(IDS), cfg.vocab_size) and cache.length == len(IDS)
        last = eng.forward(ids[:1], cache, False)
        assert last.shape == (cfg.vocab_size,) and cache.length == len(IDS) + 1
        others = [eng.new_cache(16), eng.new_cache(16)]
        eng.copy_prefix(others[0], cache, 3)
        assert others[0].length == 3
        batch = eng.forward_batch(np.array([1, 2], np.int64), others)
        assert batch.shape == (2, cfg.vocab_size)
        assert [c.length for c in others] == [4, 1]
        results[eng.name] = all_rows
    if "native" in results:
        ref = results["numpy"]
        np.testing.assert_allclose(results["native"], ref, rtol=0,
                                   atol=1e-4 * np.abs(ref).max())
    with pytest.raises(TypeError):
        Engine()


def test_a_cache_of_another_engine_is_refused(clean_env):
    cfg = tiny_models.tiny_config("llama")
    w = tiny_models.random_state_dict(cfg, seed=5)
    a, b = Runtime(cfg, w, engine="numpy"), Runtime(cfg, w, engine="numpy")
    assert isinstance(a._engine, Engine)
    if not ENGINE_BUILT:
        return
    b.native = native.NativeEngine(cfg, w, act="f32", threads=1)
    assert b.engine == "native" and isinstance(b._engine, NativeModelEngine)
    for rt, other in ((a, b), (b, a)):
        theirs = other.new_cache(8)
        with pytest.raises(ValueError, match="this KV cache belongs to another runtime"):
            rt.forward([1], theirs)
        with pytest.raises(ValueError, match="this KV cache belongs to another runtime"):
            rt.forward_batch([1], [theirs])
        with pytest.raises(ValueError, match="copy_prefix\\(\\) needs two caches of the same"):
            rt.copy_prefix(rt.new_cache(8), theirs, 0)
    b.native = None  # back to the reference
    assert b.engine == "numpy" and b.native is None
    b.forward([1], b.new_cache(8))


def _runtimes(cfg, w):
    yield Runtime(cfg, w, engine="numpy")
    if ENGINE_BUILT:
        rt = Runtime(cfg, w, engine="numpy")
        rt.native = native.NativeEngine(cfg, w, act="f32", threads=1)
        yield rt


def _full(rt):
    cache = rt.new_cache(2)
    rt.forward([1, 2], cache)
    return cache


# every call a runtime refuses: (name, call, error, words); none may run, none may raise a
# builtin exception (these were raw ValueError / TypeError / OverflowError / AttributeError,
# or ran: a float id truncated, a string parsed, a 2-D array flattened, a float capacity kept)
RUNTIME_MISUSE = [
    ("forward([1.7])", lambda rt: rt.forward([1.7], rt.new_cache(4)), TokenIdError, "integers"),
    ("forward(NaN array)", lambda rt: rt.forward(np.array([np.nan]), rt.new_cache(4)),
     TokenIdError, "integers"),
    ("forward('12')", lambda rt: rt.forward("12", rt.new_cache(4)), TokenIdError, "str"),
    ("forward(None)", lambda rt: rt.forward(None, rt.new_cache(4)), TokenIdError, "NoneType"),
    ("forward([True])", lambda rt: rt.forward([True], rt.new_cache(4)), TokenIdError,
     "integers"),
    ("forward(2-D)", lambda rt: rt.forward(np.ones((2, 2), np.int64), rt.new_cache(8)),
     TokenIdError, "one-dimensional"),
    ("forward(['a'])", lambda rt: rt.forward(np.array([1, "a"], object), rt.new_cache(4)),
     TokenIdError, "integers"),
    ("forward([2**63])", lambda rt: rt.forward([2**63], rt.new_cache(4)), TokenIdError,
     "out of range"),
    ("forward([2**70])", lambda rt: rt.forward([2**70], rt.new_cache(4)), TokenIdError,
     "out of range"),
    ("forward(uint64 max)", lambda rt: rt.forward(np.array([2**64 - 1], np.uint64),
                                                  rt.new_cache(4)), TokenIdError, "out of range"),
    ("forward([-1])", lambda rt: rt.forward([-1], rt.new_cache(4)), TokenIdError,
     "out of range"),
    ("forward([])", lambda rt: rt.forward([], rt.new_cache(4)), TokenIdError, "at least one"),
    ("forward(cache=None)", lambda rt: rt.forward([1], None), KernelError, "NoneType"),
    ("forward(screen='no')", lambda rt: rt.forward([1], rt.new_cache(4), screen="no"),
     KernelError, "screen"),
    ("forward(all_logits=[1])", lambda rt: rt.forward([1], rt.new_cache(4), all_logits=[1]),
     KernelError, "all_logits"),
    ("forward(full cache)", lambda rt: rt.forward([1], _full(rt)), ContextLengthError,
     "do not fit"),
    ("verify([])", lambda rt: rt.verify([], rt.new_cache(4)), TokenIdError, "1 to 128"),
    ("verify([1.5])", lambda rt: rt.verify([1.5], rt.new_cache(4)), TokenIdError, "integers"),
    ("forward_batch(caches=None)", lambda rt: rt.forward_batch([1], None), KernelError,
     "list of caches"),
    ("forward_batch([None])", lambda rt: rt.forward_batch([1], [None]), KernelError,
     "NoneType"),
    ("forward_batch(2 ids, 1 cache)", lambda rt: rt.forward_batch([1, 2], [rt.new_cache(4)]),
     KernelError, "one per token"),
    ("forward_batch(screen=5)", lambda rt: rt.forward_batch([1], [rt.new_cache(4)], screen=5),
     KernelError, "screen"),
    ("forward_batch(screen=['x'])",
     lambda rt: rt.forward_batch([1], [rt.new_cache(4)], screen=["x"]), KernelError, "screen"),
    ("verify_batch(None)", lambda rt: rt.verify_batch(None), KernelError, "pairs"),
    ("verify_batch([1, 2])", lambda rt: rt.verify_batch([1, 2]), KernelError, "pairs"),
    ("verify_batch(screen=3)", lambda rt: rt.verify_batch([([1], rt.new_cache(4))], screen=3),
     KernelError, "screen"),
    ("copy_prefix(n=1.5)", lambda rt: rt.copy_prefix(rt.new_cache(4), _full(rt), 1.5),
     ContextLengthError, "whole number"),
    ("copy_prefix(None, ..)", lambda rt: rt.copy_prefix(None, _full(rt), 1), KernelError,
     "NoneType"),
    ("new_cache(1.5)", lambda rt: rt.new_cache(1.5), ContextLengthError, "1.5"),
    ("new_cache(True)", lambda rt: rt.new_cache(True), ContextLengthError, "True"),
    ("new_cache('4')", lambda rt: rt.new_cache("4"), ContextLengthError, "'4'"),
    ("cache_nbytes(-16)", lambda rt: rt.cache_nbytes(-16), ContextLengthError, "-16"),
    ("truncate(1.5)", lambda rt: _full(rt).truncate(1.5), ContextLengthError, "1.5"),
    ("truncate(-1)", lambda rt: _full(rt).truncate(-1), ContextLengthError, "-1"),
    ("truncate(None)", lambda rt: _full(rt).truncate(None), ContextLengthError, "None"),
]


@pytest.mark.parametrize("call, error, words", [(c, e, w) for _, c, e, w in RUNTIME_MISUSE],
                         ids=[n for n, *_ in RUNTIME_MISUSE])
def test_runtime_misuse_is_a_typed_error(clean_env, call, error, words):
    cfg = tiny_models.tiny_config("llama")
    for rt in _runtimes(cfg, tiny_models.random_state_dict(cfg, seed=5)):
        with pytest.raises(error) as info:
            call(rt)
        assert words in str(info.value), rt.engine
    assert issubclass(error, PocketError)


def test_a_cache_of_a_model_of_other_shapes_is_refused(clean_env):
    """The reference took any numpy cache: another model's ran on (IndexError, or attention
    over that model's keys)."""
    small = tiny_models.tiny_config("llama")
    big = tiny_models.tiny_config("llama", n_layers=small.n_layers + 1)
    a = Runtime(small, tiny_models.random_state_dict(small, seed=5), engine="numpy")
    b = Runtime(big, tiny_models.random_state_dict(big, seed=5), engine="numpy")
    for rt, other in ((a, b), (b, a)):
        with pytest.raises(KernelError, match="belongs to another runtime"):
            rt.forward([1], other.new_cache(4))
    a.forward([1], KVCache(small, 4))  # one made directly for its shapes runs
    with pytest.raises(KernelError, match="belongs to another runtime"):
        a.forward([1], KVCache(big, 4))


def test_a_runtime_of_bad_parts_is_a_typed_error():
    cfg = tiny_models.tiny_config("llama")
    w = tiny_models.random_state_dict(cfg, seed=5)
    with pytest.raises(FormatError, match="'norm.weight' must be a numpy array"):
        Runtime(cfg, {**w, "norm.weight": [1.0] * cfg.d_model})  # was an AttributeError
    with pytest.raises(KernelError, match="engine must be"):
        Runtime(cfg, w, engine="gpu")


def test_truncate_keeps_whole_positions():
    cfg = tiny_models.tiny_config("llama")
    rt = Runtime(cfg, tiny_models.random_state_dict(cfg, seed=5), engine="numpy")
    cache = rt.new_cache(8)
    rt.forward([1, 2, 3], cache)
    cache.truncate(np.int64(2))
    assert cache.length == 2 and type(cache.length) is int
    cache.truncate(5)  # beyond the positions filled: forgets nothing
    assert cache.length == 2


@pytest.mark.skipif(not ENGINE_BUILT, reason="the native engine is not built")
def test_one_cache_run_from_two_threads_is_refused_not_corrupted(clean_env):
    """Two threads running one cache read the same length and wrote the same position: tokens
    were silently lost (half of them here). Now a call that finds the cache in use is
    refused, and every call that runs gets a position of its own."""
    cfg = tiny_models.tiny_config("llama", max_context=256)
    rt = Runtime(cfg, tiny_models.random_state_dict(cfg, seed=5), engine="native")
    cache = rt.new_cache(256)
    ran, refused = [0], [0]
    start = threading.Barrier(2)

    def work():
        start.wait()
        for _ in range(100):
            try:
                rt.forward([1], cache)
                ran[0] += 1
            except KernelError as e:
                assert "in use by another call" in str(e)
                refused[0] += 1

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ran[0] + refused[0] == 200 and cache.length == ran[0]
    rt.forward([1], cache)  # free again once the calls are done


@pytest.mark.parametrize("engine", ["numpy", pytest.param("native", marks=pytest.mark.skipif(
    not ENGINE_BUILT, reason="the native engine is not built"))])
def test_an_interrupt_anywhere_in_a_call_leaves_the_cache_free(clean_env, engine):
    """Ctrl-C arrives between any two bytecodes: one arriving after the cache's lock was taken
    and before the call recorded it left the cache locked, and every later call on it was
    refused as "in use by another call". Interrupted at each line of taking the caches in
    turn, the next call runs. (An interrupt while the call gives the caches back, a second
    one, is not covered: no Python clean-up is, ``with lock:`` included.)"""
    import sys

    from pocketlm.runtime import engine as engine_mod
    from pocketlm.runtime import model as model_mod

    cfg = tiny_models.tiny_config("llama", max_context=64)
    rt = Runtime(cfg, tiny_models.random_state_dict(cfg, seed=5), engine=engine)
    cache, other = rt.new_cache(64), rt.new_cache(64)
    using = model_mod.Runtime._using.__wrapped__.__code__
    entering = {using, engine_mod.CacheGuard.enter.__code__}
    interrupted = 0
    for k in range(1, 200):
        lines, taken = [0], [False]  # taken: _using has yielded (the caches are the call's)

        def tracer(frame, event, arg, k=k, lines=lines, taken=taken):
            if frame.f_code not in entering or taken[0]:
                return None

            def local(frame, event, arg, k=k, lines=lines, taken=taken):
                if frame.f_code is using and event == "return":
                    taken[0] = True
                elif event == "line" and not taken[0]:
                    lines[0] += 1
                    if lines[0] == k:
                        raise KeyboardInterrupt
                return local
            return local

        sys.settrace(tracer)
        try:
            rt.copy_prefix(other, cache, 0)  # two caches: interrupted between them too
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            sys.settrace(None)
        if lines[0] < k:  # ran whole: every line has been interrupted once
            break
        rt.forward([1], cache)  # free: not "in use by another call"
        rt.forward([1], other)
    assert interrupted >= 5


# -- pocket doctor ----------------------------------------------------------------------------------
def _cli(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_doctor_text(clean_env, capsys):
    clean_env.setenv("POCKET_KV", "q8")
    code, out, err = _cli(capsys, "doctor")
    assert code == 0 and not err
    import pocketlm

    assert out.startswith(f"pocketlm {pocketlm.__version__}\n")
    for word in ("python", "numpy", "platform", "native", "cpu", "features", "levels", "amx",
                 "settings:"):
        assert f"\n{word}" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines()
             if line.startswith("  POCKET_")}
    assert set(lines) == set(VARIABLES.values())
    assert lines["POCKET_KV"][1:] == ["q8", "env"]
    assert lines["POCKET_Q8_DIGITS"][-1] == "default"
    if ENGINE_BUILT:
        assert lines["POCKET_KERNELS"][1:] == ["native", "default"]
        assert "native    built" in out


def test_doctor_json(clean_env, capsys):
    clean_env.setenv("POCKET_THREADS", "3")
    clean_env.setenv("POCKET_KERNELS", "numpy")
    code, out, _ = _cli(capsys, "doctor", "--json")
    assert code == 0 and len(out.strip().splitlines()) == 1
    info = json.loads(out)
    for key in ("pocketlm", "python", "numpy", "platform", "native", "cpu", "amx", "settings"):
        assert key in info
    assert set(info["native"]) == {"built", "engine", "reason"}
    assert {"model", "features", "levels", "selected"} <= set(info["cpu"])
    rows = info["settings"]
    assert {r["variable"] for r in rows.values()} == set(VARIABLES.values())
    assert rows["kernels"] == {"variable": "POCKET_KERNELS", "value": "numpy", "source": "env"}
    assert rows["threads"]["source"] == "env"
    assert rows["kv"]["source"] == "default"
    if ENGINE_BUILT:
        clean_env.delenv("POCKET_KERNELS")
        info = json.loads(_cli(capsys, "doctor", "--json")[1])
        assert info["settings"]["threads"]["value"] == 3
        assert info["settings"]["kernel_threads"]["value"] == 3
        assert info["cpu"]["selected"] == info["settings"]["cpu_level"]["value"]
        assert info["native"] == {"built": True, "engine": True, "reason": None}


@pytest.mark.parametrize("argv", [["doctor"], ["doctor", "--json"], ["--version", "-v"]])
@pytest.mark.parametrize("var, raw, message", [
    ("POCKET_KV", "f64", "POCKET_KV='f64'; choose one of f32, f16, q8"),
    ("POCKET_KERNELS", "gpu", "POCKET_KERNELS='gpu' is not a kernel backend"),
])
def test_doctor_bad_setting_is_one_line_and_exit_1(clean_env, capsys, argv, var, raw, message):
    clean_env.setenv(var, raw)
    code, out, err = _cli(capsys, *argv)
    assert code == 1 and not out
    assert err.strip().splitlines() == [f"pocket: error: {err.strip()[15:]}"]
    assert message in err


def test_version_verbose(clean_env, capsys):
    import pocketlm

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"pocketlm {pocketlm.__version__}\n"
    clean_env.setenv("POCKET_KV", "f64")  # plain --version reads no setting
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    capsys.readouterr()
    clean_env.delenv("POCKET_KV")
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version", "-v"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"pocketlm {pocketlm.__version__}\n") and "POCKET_AVXVNNI" in out
    assert "settings:" in out


def test_settings_module_lists_every_variable():
    """The docstring's table names every variable the settings read."""
    for var in VARIABLES.values():
        assert f"``{var}``" in settings.__doc__


def test_doctor_marks_what_does_not_apply(clean_env, capsys):
    """Under the numpy kernels no native level is named as chosen, and the q8 digits and
    AVX-VNNI are shown only where they take effect."""
    clean_env.setenv("POCKET_KERNELS", "numpy")
    info = json.loads(_cli(capsys, "doctor", "--json")[1])
    assert info["cpu"]["selected"] is None
    assert info["settings"]["q8_digits"]["value"] is None
    assert info["settings"]["avxvnni"]["value"] is None
    out = _cli(capsys, "doctor")[1]
    levels = next(line for line in out.splitlines() if line.startswith("levels"))
    if info["cpu"]["levels"]:
        assert "chosen" not in levels.replace("none chosen", "") and "numpy kernels" in levels
    if not ENGINE_BUILT:
        return
    clean_env.delenv("POCKET_KERNELS")
    clean_env.setenv("POCKET_ACT", "f32")
    info = json.loads(_cli(capsys, "doctor", "--json")[1])
    assert info["settings"]["q8_digits"]["value"] is None
    clean_env.delenv("POCKET_ACT")
    info = json.loads(_cli(capsys, "doctor", "--json")[1])
    assert info["settings"]["q8_digits"]["value"] == 2
    avx2 = str(info["cpu"]["engine_products"]).startswith("avx2")
    vnni = "avxvnni" in info["cpu"]["features"]
    assert (info["settings"]["avxvnni"]["value"] == 1) == (avx2 and vnni)
    if "avx512" in info["cpu"]["levels"]:
        clean_env.setenv("POCKET_CPU_LEVEL", "avx512")
        assert json.loads(_cli(capsys, "doctor", "--json")[1])["settings"]["avxvnni"][
            "value"] is None


def test_doctor_paths(clean_env, capsys, tmp_path):
    """The model folder and the default model, with whether the environment set them; a blank
    POCKET_MODEL is an error here as for every command."""
    clean_env.delenv("POCKET_HOME", raising=False)
    clean_env.delenv("POCKET_MODEL", raising=False)
    info = json.loads(_cli(capsys, "doctor", "--json")[1])
    assert info["paths"]["model"] == {"variable": "POCKET_MODEL", "value": "smollm2-135m",
                                      "source": "default"}
    assert info["paths"]["home"]["source"] == "default"
    clean_env.setenv("POCKET_HOME", str(tmp_path))
    clean_env.setenv("POCKET_MODEL", "qwen2.5-0.5b")
    out = _cli(capsys, "doctor")[1]
    assert f"\nhome      {tmp_path} (POCKET_HOME set)\n" in out
    assert "\nmodel     qwen2.5-0.5b (POCKET_MODEL set)\n" in out
    clean_env.setenv("POCKET_MODEL", "  ")
    code, out, err = _cli(capsys, "doctor")
    assert code == 1 and not out and "POCKET_MODEL='  ' is blank" in err
