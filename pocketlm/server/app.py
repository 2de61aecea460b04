"""`pocket serve`: an OpenAI-compatible HTTP API and a chat page over one loaded model.

    GET  /                      the chat page (plain HTML + JS, streaming)
    GET  /health                {"status": "ok", ...} with the scheduler's counters
    GET  /v1/models             the served model
    POST /v1/completions        text completion (stream=true: server-sent events)
    POST /v1/chat/completions   chat with the model's own template (idem)

Built on Starlette (ASGI) and run by uvicorn. Requests are batched by
:class:`~pocketlm.server.scheduler.Scheduler`; this module checks the wire (auth, body size,
JSON, fields, context) and turns scheduler events into OpenAI responses. Every error is
OpenAI's error object with a fitting status; a client that disconnects has its request
cancelled and its KV cache freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from importlib import resources

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..api import PocketModel
from ..errors import PocketError
from ..sampling import Sampler
from . import protocol as P
from .scheduler import MB, QueueFullError, Request, Scheduler, ShuttingDownError, TooLargeError


def current_rss() -> int:
    """Resident memory of this process in bytes (Linux), 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def step_headroom(model: PocketModel, max_batch: int) -> int:
    """Memory a decode step needs beside the KV caches: the batch's float32 logits, the
    sampler's float64 copy of a row, and a fixed allowance for the HTTP side's buffers and the
    engine's lazily grown tables (RoPE up to the longest position, per-thread scratch). 56 MB:
    eight concurrent smollm2-135m completions used 52-56 MB beside their caches on an Intel
    Xeon VM (48 MB, measured on an AMD one, was 3 MB short there)."""
    vocab = model.config.vocab_size
    return max_batch * vocab * 4 + vocab * 8 * 4 + 56 * MB


class ServerConfig:
    def __init__(self, *, model_name: str, api_key: str | None = None, max_batch: int = 16,
                 max_queue: int = 64, max_memory_mb: float | None = None,
                 max_body_kb: int = 1024, prefix_cache_mb: float = 64.0):
        if not 1 <= max_batch <= 256:
            raise PocketError(f"--max-batch must be in 1..256, got {max_batch}")
        if max_queue < 0:
            raise PocketError(f"--max-queue must be >= 0, got {max_queue}")
        if max_body_kb < 1:
            raise PocketError(f"--max-body-kb must be >= 1, got {max_body_kb}")
        if max_memory_mb is not None and max_memory_mb <= 0:
            raise PocketError(f"--max-memory-mb must be positive, got {max_memory_mb}")
        if prefix_cache_mb < 0:
            raise PocketError(f"--prefix-cache-mb must be >= 0, got {prefix_cache_mb}")
        self.model_name = model_name
        self.api_key = api_key or None
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_memory_mb = max_memory_mb
        self.max_body = max_body_kb * 1024
        self.prefix_cache_mb = prefix_cache_mb


def kv_budget_for(model: PocketModel, cfg: ServerConfig) -> tuple[int | None, int]:
    """(bytes the KV caches may use, bytes the process uses without them) under
    ``cfg.max_memory_mb``; raises if the budget does not even hold the model."""
    base = current_rss() + step_headroom(model, cfg.max_batch)
    if cfg.max_memory_mb is None:
        return None, base
    budget = int(cfg.max_memory_mb * MB) - base
    if budget < 16 * MB:
        raise PocketError(
            f"--max-memory-mb {cfg.max_memory_mb:g} is too small: the loaded model and the "
            f"server already use {base / MB:.0f} MB (weights, tokenizer, step buffers); give "
            f"at least {base / MB + 16:.0f} MB (16 MB for KV caches)")
    return budget, base


def create_app(model: PocketModel, cfg: ServerConfig) -> Starlette:
    kv_budget, base = kv_budget_for(model, cfg)
    scheduler = Scheduler(model, max_batch=cfg.max_batch, max_queue=cfg.max_queue,
                          kv_budget=kv_budget,
                          prefix_cache_mb=min(cfg.prefix_cache_mb,
                                              (kv_budget or 1 << 62) / MB / 2))
    page = resources.files("pocketlm.server").joinpath("static/index.html").read_text("utf-8")
    started = int(time.time())

    # -- wire checks ---------------------------------------------------------------------
    def check_auth(request: HTTPRequest) -> None:
        if cfg.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 cfg.api_key.encode()):
            raise P.APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                             code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})

    async def read_json(request: HTTPRequest):
        length = request.headers.get("content-length")
        too_big = P.APIError(413, f"the request body exceeds {cfg.max_body // 1024} KB",
                             code="request_too_large")
        if length is not None:
            if not length.isdigit():
                raise P.APIError(400, "invalid Content-Length header", code="invalid_request")
            if int(length) > cfg.max_body:
                raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cfg.max_body:
                raise too_big
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            return json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise P.APIError(400, "the request body is not UTF-8 text",
                             code="invalid_json") from None
        except json.JSONDecodeError as e:
            raise P.APIError(400, f"the request body is not valid JSON: {e.msg} at line "
                             f"{e.lineno} column {e.colno}", code="invalid_json") from None
        except RecursionError:
            raise P.APIError(400, "the request body nests too deeply",
                             code="invalid_json") from None

    def check_model(name: str) -> None:
        if name != cfg.model_name:
            raise P.APIError(404, f"The model '{name}' does not exist; this server serves "
                             f"'{cfg.model_name}'", param="model", code="model_not_found")

    def prompt_ids(g: P.GenerationRequest) -> list[int]:
        try:
            ids = (model.chat_ids(g.messages) if g.messages is not None
                   else model.tokenize(g.prompt))
        except PocketError as e:
            raise P.APIError(400, str(e), param="messages" if g.messages else "prompt") from None
        if not ids:
            raise P.APIError(400, "the prompt is empty", param="prompt")
        return ids

    def build(g: P.GenerationRequest, ids: list[int], loop) -> Request:
        n_ctx = model.n_ctx
        if len(ids) >= n_ctx:
            raise P.APIError(400, f"This model's maximum context length is {n_ctx} tokens; "
                             f"the prompt has {len(ids)} tokens", param="messages"
                             if g.messages is not None else "prompt",
                             code="context_length_exceeded")
        max_tokens = n_ctx - len(ids) if g.max_tokens is None else g.max_tokens
        if len(ids) + max_tokens > n_ctx:
            raise P.APIError(400, f"This model's maximum context length is {n_ctx} tokens; "
                             f"the prompt has {len(ids)} and max_tokens asks for {max_tokens} "
                             f"more ({len(ids) + max_tokens})", param="max_tokens",
                             code="context_length_exceeded")
        try:
            params = model._params(g.temperature, g.top_k, g.top_p, g.min_p,
                                   g.repetition_penalty, g.seed)
        except PocketError as e:
            raise P.APIError(400, str(e)) from None
        return Request(prompt_ids=ids, max_tokens=max_tokens, sampler=Sampler(params),
                       stop=g.stop, loop=loop, ignore_eos=g.ignore_eos)

    def submit(req: Request) -> None:
        try:
            scheduler.submit(req)
        except QueueFullError as e:
            raise P.APIError(429, str(e), code="rate_limit_exceeded",
                             headers={"Retry-After": str(e.retry_after)}) from None
        except TooLargeError as e:
            raise P.APIError(400, str(e), param="max_tokens",
                             code="context_length_exceeded") from None
        except ShuttingDownError as e:
            raise P.APIError(503, str(e), code="shutting_down",
                             headers={"Retry-After": "5"}) from None

    # -- endpoints -----------------------------------------------------------------------
    async def index(request: HTTPRequest) -> Response:
        return HTMLResponse(page)

    async def health(request: HTTPRequest) -> Response:
        return JSONResponse({"status": "ok", "model": cfg.model_name,
                             "engine": model.runtime.engine, "n_ctx": model.n_ctx,
                             "memory_mb": round(current_rss() / MB, 1),
                             "max_memory_mb": cfg.max_memory_mb, **scheduler.snapshot()})

    async def models(request: HTTPRequest) -> Response:
        check_auth(request)
        return JSONResponse({"object": "list", "data": [
            {"id": cfg.model_name, "object": "model", "created": started,
             "owned_by": "pocketlm", "context_length": model.n_ctx}]})

    async def generate(request: HTTPRequest, chat: bool) -> Response:
        check_auth(request)
        g = P.parse_request(await read_json(request), chat=chat)
        check_model(g.model)
        ids = prompt_ids(g)
        req = build(g, ids, asyncio.get_running_loop())
        submit(req)
        rid = P.new_id(chat)
        if g.stream:
            return StreamingResponse(stream(req, rid, g, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        return await collect(request, req, rid, chat)

    async def collect(request: HTTPRequest, req: Request, rid: str, chat: bool) -> Response:
        pieces = []
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(req.events.get(), timeout=0.5)
                except asyncio.TimeoutError:  # (not the builtin before Python 3.11)
                    if await request.is_disconnected():
                        scheduler.cancel(req)
                        return Response(status_code=499)
                    continue
                if ev[0] == "text":
                    pieces.append(ev[1])
                elif ev[0] == "done":
                    use = P.usage(len(req.prompt_ids), req.completion_tokens)
                    return JSONResponse(P.completion_body(rid, cfg.model_name, "".join(pieces),
                                                          ev[1], use, chat=chat))
                else:
                    raise P.APIError(500, ev[1], code="internal_error")
        except asyncio.CancelledError:
            scheduler.cancel(req)
            raise

    async def stream(req: Request, rid: str, g: P.GenerationRequest, chat: bool):
        def sse(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        done = False
        try:
            if chat:
                yield sse(P.chunk_body(rid, cfg.model_name, chat=True, role=True))
            while True:
                ev = await req.events.get()
                if ev[0] == "text":
                    yield sse(P.chunk_body(rid, cfg.model_name, chat=chat, text=ev[1]))
                elif ev[0] == "done":
                    done = True
                    yield sse(P.chunk_body(rid, cfg.model_name, chat=chat, finish=ev[1]))
                    if g.include_usage:
                        use = P.usage(len(req.prompt_ids), req.completion_tokens)
                        yield sse(P.chunk_body(rid, cfg.model_name, chat=chat, use=use))
                    yield "data: [DONE]\n\n"
                    return
                else:
                    done = True
                    yield sse(P.APIError(500, ev[1], code="internal_error").body())
                    return
        finally:
            if not done:  # the client went away (or the response was torn down)
                scheduler.cancel(req)

    async def completions(request: HTTPRequest) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: HTTPRequest) -> Response:
        return await generate(request, chat=True)

    # -- errors --------------------------------------------------------------------------
    async def api_error(request: HTTPRequest, exc: P.APIError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request: HTTPRequest, exc: HTTPException) -> Response:
        msg = {404: f"no route {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        return JSONResponse(P.APIError(exc.status_code, msg).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    async def server_error(request: HTTPRequest, exc: Exception) -> Response:
        return JSONResponse(P.APIError(500, f"internal error: {exc}").body(), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.close()

    app = Starlette(
        routes=[Route("/", index), Route("/health", health), Route("/v1/models", models),
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/chat/completions", chat_completions, methods=["POST"])],
        exception_handlers={P.APIError: api_error, HTTPException: http_error,
                            Exception: server_error},
        lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.base_memory = base
    app.state.kv_budget = kv_budget
    return app
