"""A model's own generation settings: read from the source (GGUF ``general.sampling.*``, a
Hugging Face ``generation_config.json``), carried by pack into the deploy file, and honoured
the same way by the API, the CLI and the server: an explicit argument wins, then the model's
setting, then the built-in one."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import tiny_gguf
from tiny_hf import write_tiny_hf

import pocketlm
from pocketlm import cli
from pocketlm.api import load_pocket
from pocketlm.config import GenerationDefaults
from pocketlm.errors import FormatError
from pocketlm.formats.gguf import read_gguf
from pocketlm.formats.hf import read_hf
from pocketlm.formats.pocketfile import PocketFile
from pocketlm.pack import pack
from pocketlm.server.app import ServerConfig, create_app

SAMPLING = {"general.sampling.temp": 0.7, "general.sampling.top_k": 5,
            "general.sampling.top_p": 0.9, "general.sampling.min_p": 0.05,
            "general.sampling.penalty_repeat": 1.1}
FROM_SAMPLING = GenerationDefaults(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05,
                                   repetition_penalty=1.1)
HF_GENERATION = {"do_sample": True, "temperature": 0.8, "top_k": 5, "top_p": 0.9,
                 "repetition_penalty": 1.3, "max_new_tokens": 6, "bos_token_id": 0}
# what the settings above mean when given explicitly
EXPLICIT = dict(temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.3)
BUILTIN = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
PROMPT = "hello world, the cat"
VOCAB = 259  # the tiny byte-level tokenizer's: every id the model samples is a token


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two tiny HF folders with the same weights, one with a generation_config.json, and
    their deploy files."""
    root = tmp_path_factory.mktemp("gen")
    write_tiny_hf(root / "plain", "llama", seed=1, vocab_size=VOCAB)
    write_tiny_hf(root / "tuned", "llama", seed=1, vocab_size=VOCAB)
    (root / "tuned" / "generation_config.json").write_text(json.dumps(HF_GENERATION))
    for name in ("plain", "tuned"):
        pack(root / name, root / f"{name}.pocket")
    return root


@pytest.fixture(scope="module")
def plain(files):
    return load_pocket(files / "plain.pocket")


@pytest.fixture(scope="module")
def tuned(files):
    return load_pocket(files / "tuned.pocket")


# -- the one rule ------------------------------------------------------------------------------
def test_resolve_takes_the_argument_then_the_model_then_the_builtin():
    d = GenerationDefaults(temperature=0.5, max_tokens=9)
    assert d.resolve(128) == {**BUILTIN, "temperature": 0.5, "max_tokens": 9}
    assert d.resolve(128, temperature=0.0, max_tokens=3)["temperature"] == 0.0
    assert d.resolve(128, max_tokens=3)["max_tokens"] == 3
    assert GenerationDefaults().resolve(128) == {**BUILTIN, "max_tokens": 128}
    assert GenerationDefaults().resolve()["max_tokens"] is None
    with pytest.raises(TypeError, match="temp"):
        d.resolve(temp=1.0)


def test_the_deploy_file_keeps_only_a_length_the_model_names():
    assert "max_tokens" not in GenerationDefaults().to_dict()
    assert GenerationDefaults(max_tokens=64).to_dict()["max_tokens"] == 64
    # files packed before the importers read the source's settings all hold this: no length
    legacy = {**BUILTIN, "max_tokens": 256}
    assert GenerationDefaults.from_dict(legacy).max_tokens is None
    assert GenerationDefaults.from_dict({**legacy, "temperature": 0.7}).max_tokens == 256
    assert GenerationDefaults.from_dict({"max_tokens": 256}).max_tokens == 256


# -- importers ---------------------------------------------------------------------------------
def test_gguf_sampling_keys_become_the_defaults(tmp_path):
    tiny_gguf.write_tiny_gguf(tmp_path / "s.gguf", "llama", seed=3, metadata=SAMPLING)
    tiny_gguf.write_tiny_gguf(tmp_path / "p.gguf", "llama", seed=3)
    # float32 in the file, read back as the decimal that was written
    assert read_gguf(tmp_path / "s.gguf").generation == FROM_SAMPLING
    assert read_gguf(tmp_path / "p.gguf").generation == GenerationDefaults()
    pack(tmp_path / "s.gguf", tmp_path / "s.pocket")
    assert PocketFile(tmp_path / "s.pocket").json_object("generation") == FROM_SAMPLING.to_dict()
    assert load_pocket(tmp_path / "s.pocket").generation_defaults == FROM_SAMPLING


@pytest.mark.parametrize("key,value", [("general.sampling.temp", -1.0),
                                       ("general.sampling.top_p", 1.5),
                                       ("general.sampling.top_k", -3),
                                       ("general.sampling.penalty_repeat", "x")])
def test_a_bad_gguf_sampling_key_is_named(tmp_path, key, value):
    tiny_gguf.write_tiny_gguf(tmp_path / "b.gguf", "llama", metadata={key: value})
    with pytest.raises(FormatError, match=key.replace(".", r"\.")):
        read_gguf(tmp_path / "b.gguf")


@pytest.mark.parametrize("config,expected", [
    ({}, GenerationDefaults()),
    (HF_GENERATION, GenerationDefaults(**EXPLICIT, max_tokens=6)),
    # transformers decodes greedily unless do_sample is true
    ({"temperature": 0.6, "top_p": 0.9}, GenerationDefaults(temperature=0.0, top_p=0.9)),
    ({"do_sample": False, "temperature": 0.6, "top_k": 20},
     GenerationDefaults(temperature=0.0, top_k=20)),
    # ... and then samples with its own temperature and top_k where the file says none
    ({"do_sample": True, "top_p": 0.95}, GenerationDefaults(temperature=1.0, top_k=50,
                                                           top_p=0.95)),
    ({"do_sample": True, "temperature": 0.7, "top_k": None, "max_length": 20},
     GenerationDefaults(temperature=0.7, top_k=50)),
])
def test_hf_generation_config_becomes_the_defaults(tmp_path, config, expected):
    write_tiny_hf(tmp_path / "m", "llama")
    if config:
        (tmp_path / "m" / "generation_config.json").write_text(json.dumps(config))
    assert read_hf(tmp_path / "m").generation == expected


@pytest.mark.parametrize("config,word", [
    ({"do_sample": True, "temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"), ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"do_sample": "yes"}, "do_sample"), ([1], "JSON object"),
])
def test_a_bad_generation_config_is_named(tmp_path, config, word):
    write_tiny_hf(tmp_path / "m", "llama")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match=f"generation_config.json.*{word}"):
        read_hf(tmp_path / "m")


def test_pack_carries_the_hf_defaults(files, tuned, plain):
    assert PocketFile(files / "tuned.pocket").json_object("generation") == {
        **EXPLICIT, "min_p": 0.0, "max_tokens": 6}
    assert tuned.generation_defaults == GenerationDefaults(**EXPLICIT, max_tokens=6)
    assert plain.generation_defaults == GenerationDefaults()


# -- API ---------------------------------------------------------------------------------------
def test_the_api_uses_the_models_defaults_unless_told_otherwise(tuned, plain):
    sampled = plain.generate(PROMPT, max_tokens=6, seed=3, **EXPLICIT)
    greedy = plain.generate(PROMPT, max_tokens=6)
    assert sampled != greedy  # else this test could not tell them apart
    assert tuned.generate(PROMPT, seed=3) == sampled
    assert tuned.generate(PROMPT, max_tokens=6, **BUILTIN) == greedy
    assert "".join(tuned.stream(PROMPT, seed=3)) == sampled
    messages = [{"role": "user", "content": "hi"}]
    assert tuned.chat(messages, seed=3) == plain.chat(messages, max_tokens=6, seed=3, **EXPLICIT)
    # without defaults, nothing changed: greedy, 128 tokens (256 for chat)
    assert plain.generate(PROMPT) == plain.generate(PROMPT, max_tokens=128, temperature=0.0)


def test_the_api_honours_the_models_length(tuned):
    ids = tuned.tokenize(PROMPT)
    out = list(tuned.stream_ids(ids, seed=3))
    state = tuned.last_state
    assert len(out) == 6 or state.finish_reason == "stop"
    assert out == list(tuned.stream_ids(ids, max_tokens=6, seed=3))
    assert len(list(tuned.stream_ids(ids, max_tokens=2, seed=3))) <= 2
    assert tuned.last_state.finish_reason in ("length", "stop")


# -- CLI ---------------------------------------------------------------------------------------
def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_cli_uses_the_models_defaults_unless_told_otherwise(files, capsys):
    tuned, plain = files / "tuned.pocket", files / "plain.pocket"
    flags = ["-n", 6, "--temp", 0.8, "--top-k", 5, "--top-p", 0.9, "--repeat-penalty", 1.3]
    _, want, _ = run_cli(capsys, "run", "--raw", "-m", plain, "--seed", 3, *flags, PROMPT)
    code, got, err = run_cli(capsys, "run", "--raw", "-m", tuned, "--seed", 3, "-v", PROMPT)
    assert code == 0 and got == want
    assert "6 generated" in err or "finish: stop" in err
    builtin = ["--temp", 0, "--top-k", 0, "--top-p", 1, "--repeat-penalty", 1]
    _, want, _ = run_cli(capsys, "run", "--raw", "-m", plain, "-n", 3, PROMPT)
    _, got, _ = run_cli(capsys, "run", "--raw", "-m", tuned, "-n", 3, *builtin, PROMPT)
    assert got == want


def test_the_cli_help_tells_the_true_defaults(capsys):
    for command, n in (("run", 128), ("chat", 512)):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"(default: the model's, else {n})" in text
        assert "greedy (default: the model's, else 0)" in text


# -- server ------------------------------------------------------------------------------------
def post(model, path: str, body: dict) -> dict:
    async def go():
        app = create_app(model, ServerConfig(model_name="tiny"))
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000",
                                         timeout=60) as c:
                r = await c.post(path, json={"model": "tiny", **body})
                assert r.status_code == 200, r.text
                return r.json()
        finally:
            app.state.scheduler.close()

    return asyncio.run(go())


def test_the_server_uses_the_models_defaults_unless_told_otherwise(tuned, plain):
    ask = {"prompt": PROMPT, "seed": 3, "ignore_eos": True}
    want = post(plain, "/v1/completions", {**ask, "max_tokens": 6, **EXPLICIT})
    got = post(tuned, "/v1/completions", ask)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"]["completion_tokens"] == 6
    # an explicit setting wins; without any, the endpoint's own (16 for completions)
    told = post(tuned, "/v1/completions", {**ask, "max_tokens": 3, **BUILTIN})
    greedy = post(plain, "/v1/completions", {**ask, "max_tokens": 3})
    assert told["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert post(plain, "/v1/completions", ask)["usage"]["completion_tokens"] == 16
    chat = {"messages": [{"role": "user", "content": "hi"}], "seed": 3, "ignore_eos": True}
    got = post(tuned, "/v1/chat/completions", chat)
    assert got["usage"]["completion_tokens"] == 6
    assert got["choices"][0]["message"]["content"] == post(
        plain, "/v1/chat/completions", {**chat, "max_tokens": 6, **EXPLICIT}
    )["choices"][0]["message"]["content"]


def test_the_models_length_is_kept_within_the_context(tuned, monkeypatch):
    monkeypatch.setattr(tuned, "generation_defaults", GenerationDefaults(max_tokens=10 ** 6))
    got = post(tuned, "/v1/completions", {"prompt": PROMPT, "ignore_eos": True,
                                          "temperature": 0})
    n = len(tuned.tokenize(PROMPT))
    assert got["usage"]["completion_tokens"] == tuned.n_ctx - n


def test_loading_by_name_packs_with_the_defaults(files, tmp_path, monkeypatch):
    monkeypatch.setenv("POCKET_HOME", str(tmp_path / "home"))
    assert pocketlm.load(files / "tuned").generation_defaults.max_tokens == 6
