"""What the runtime's libraries serve, on whatever versions are installed (scripts/check-min-
versions runs it on the declared minimums): the default model read from its GGUF and packed,
generation and chat, a JSON schema, and the HTTP API. Exits non-zero on the first failure."""

import asyncio
import json
import tempfile
from importlib.metadata import version

import httpx

import pocketlm
from pocketlm.runtime.kernels import native
from pocketlm.server.app import ServerConfig, create_app

PACKAGES = ("numpy", "gguf", "tokenizers", "sentencepiece", "jinja2", "tqdm", "llguidance",
            "starlette", "uvicorn")
print("versions:", ", ".join(f"{p} {version(p)}" for p in PACKAGES), flush=True)
assert native.available(), native.unavailable_reason()

# a SentencePiece vocabulary (Gemma's kind, read through the sentencepiece library): encoded,
# decoded and serialised as a deploy file stores it
from pocketlm.formats.gguf_vocab import tokenizer_from_gguf_fields  # noqa: E402
from pocketlm.tokenizer import Tokenizer  # noqa: E402

pieces = {"\u2581hello": -1.0, "\u2581world": -1.5, "\u2581": -2.0, "h": -3.0, "e": -3.0,
          "l": -3.0, "o": -3.0, "w": -3.0, "r": -3.0, "d": -3.0}
spm = tokenizer_from_gguf_fields({
    "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
    "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
                              *pieces],
    "tokenizer.ggml.token_type": [2, 3, 3, *([6] * 256), *([1] * len(pieces))],
    "tokenizer.ggml.scores": [0.0] * 259 + list(pieces.values()),
    "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True,
    "tokenizer.ggml.add_space_prefix": True})
assert spm.kind == "spm", spm.kind
ids = spm.encode("hello world 你好")
assert ids[0] == 1 and 0 not in ids, ids  # BOS first; 你好 as bytes, not <unk>
assert spm.decode(ids[1:]) == "hello world 你好", spm.decode(ids[1:])
assert Tokenizer.from_json(spm.to_json()).encode("hello world 你好") == ids

with tempfile.TemporaryDirectory() as tmp:
    # packed here from the shared GGUF (the tokenizer and the tensors read by these versions)
    deploy = f"{tmp}/smollm2.pocket"
    from pocketlm.pack import pack
    from pocketlm.registry import resolve

    pack(resolve("smollm2-135m"), deploy)
    m = pocketlm.load(deploy)
    text = m.generate("The capital of France is", max_tokens=8)
    assert text.strip(), text
    reply = m.chat([{"role": "user", "content": "用一句话介绍北京。"}], max_tokens=16)
    assert reply.strip(), reply
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    answer = json.loads(m.generate("Name a city as JSON.", max_tokens=40, json_schema=schema))
    assert isinstance(answer["city"], str), answer

    app = create_app(m, ServerConfig(model_name="smollm2-135m"))

    async def serve() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000",
                                     timeout=120) as c:
            page = await c.get("/")
            assert page.status_code == 200 and "pocketlm chat" in page.text, page.status_code
            r = await c.post("/v1/chat/completions", json={
                "model": "smollm2-135m", "max_tokens": 8,
                "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"], r.text
            r = await c.post("/v1/completions", json={
                "model": "smollm2-135m", "prompt": "Hello", "max_tokens": 4, "stream": True})
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text

    try:
        asyncio.run(serve())
    finally:
        app.state.scheduler.close()
print("min-versions smoke: ok", flush=True)
