"""`pocket serve`: an OpenAI-compatible HTTP API and a chat page over one loaded model.

    GET  /                      the chat page (plain HTML + JS, streaming)
    GET  /health                {"status": "ok", ...} with the scheduler's counters
    GET  /v1/models             the served model
    GET  /v1/models/{model}     the served model by name (404 for another)
    POST /v1/completions        text completion (stream=true: server-sent events)
    POST /v1/chat/completions   chat with the model's own template (idem)
    GET  /tokenizer_info        the tokenizer's special tokens and limits (as vLLM's)
    POST /tokenize, /detokenize text <-> token ids (as vLLM's)

Built on Starlette (ASGI) and run by uvicorn. Requests are batched by
:class:`~pocketlm.server.scheduler.Scheduler`; this module checks the wire (origin, auth,
content type, body size and arrival time, JSON, fields, context) and turns scheduler events
into OpenAI responses. Every error is OpenAI's error object with a fitting status; a client
that disconnects, streaming or not, has its request cancelled and its KV cache freed.

A server without an API key answers only its own page and clients that send no ``Origin``
(or an origin of ``allow_origins``): browsers send cross-origin "simple" POSTs without asking
first, so without this check any web page could make a local server generate.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import hmac
import ipaddress
import json
import time
from collections.abc import Iterable
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..api import PocketModel
from ..errors import ContextLengthError, GrammarError, PocketError, SamplingError, TextError
from ..sampling import Sampler
from ..tools import (
    GENERIC_TRIGGER,
    NATIVE_TRIGGER,
    call_constraint,
    check_tools,
    is_native,
    parse_calls,
    render_messages,
)
from . import protocol as P
from .scheduler import (
    MB,
    GenerationError,
    QueueFullError,
    Request,
    Scheduler,
    ShuttingDownError,
    TooLargeError,
)

# how much of a body over --max-body-kb is read and dropped so that its 413 arrives
DRAIN_BYTES = 64 * MB
LARGE_BODY = 256 * 1024  # bytes: after such a body is handled, free heap goes back (trim_heap)


def _malloc_trim():
    try:
        import ctypes
        import ctypes.util

        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


_TRIM = _malloc_trim()


def trim_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). Parsing, rendering and tokenizing a large body takes tens of MB, freed into the
    worker thread's own arena, which the process otherwise keeps: a spell of 1 MB bodies left
    the server at 690 MB resident instead of 275."""
    if _TRIM is not None:
        _TRIM(0)


async def off_loop(work, body_size: int):
    """``work()`` in a worker thread: parsing, rendering and tokenizing a body takes a while,
    and the streams being served must not wait for it. After a body over ``LARGE_BODY`` the
    heap's free pages go back (:func:`trim_heap`)."""
    def run():
        try:
            return work()
        finally:
            if body_size > LARGE_BODY:
                trim_heap()

    return await asyncio.to_thread(run)


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


MIN_BODY_TIMEOUT_S = 0.1
MAX_MEMORY_MB = 1 << 30  # beyond any machine: a larger budget printed a 300-digit figure


def check_api_key(key: str, where: str | None = None) -> str:
    """``key`` if a client can send it as written: a header carries it, so a key with
    characters beyond printable ASCII, or spaces around it, could never match."""
    if not all(" " <= c <= "~" for c in key) or key.strip() != key:
        raise PocketError(f"{where + ': ' if where else ''}the API key must be printable "
                          "ASCII without spaces around it (an HTTP header carries it)")
    return key


# -- origins --------------------------------------------------------------------------------
def _parse_origin(text: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an origin ``scheme://host[:port]``; None if it is not one."""
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError:
        return None
    host = parts.hostname
    if (parts.scheme not in ("http", "https") or not host or parts.username
            or parts.path not in ("", "/") or parts.query or parts.fragment or port == 0
            or "*" in host or any(c.isspace() for c in host)):
        return None
    return parts.scheme, host, (443 if parts.scheme == "https" else 80) if port is None else port


def normalize_origin(text: str) -> str:
    """``text`` as browsers write an origin (lower case, a default port left out), the form
    origins are compared in; ``*`` stays ``*``. Raises :class:`PocketError` for what is not
    an origin."""
    if text.strip() == "*":
        return "*"
    parsed = _parse_origin(text)
    if parsed is None:
        raise PocketError(f"--allow-origin {text!r} is not an origin: give scheme://host[:port] "
                          "as a browser sends it, e.g. http://localhost:3000 (or '*' for any)")
    scheme, host, port = parsed
    default = port == (443 if scheme == "https" else 80)
    return f"{scheme}://{f'[{host}]' if ':' in host else host}{'' if default else f':{port}'}"


def _is_loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _unmapped(host: str) -> str:
    """An IPv4-mapped IPv6 address (``::ffff:127.0.0.1``: a server bound to ``::`` and reached
    over IPv4) as the IPv4 address a browser names; any other host as it is."""
    try:
        mapped = ipaddress.ip_address(host).ipv4_mapped
    except (ValueError, AttributeError):
        return host
    return str(mapped) if mapped else host


def _unrebindable(host: str) -> bool:
    """A host name no DNS answer can point elsewhere: an IP address, or ``localhost`` (which
    browsers keep on the loopback interface)."""
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_own_origin(origin: str, scope: dict[str, Any]) -> bool:
    """Whether ``origin`` is this server's own: same scheme and port as the connection, and the
    host the connection came in on (by address; ``localhost`` and any loopback address count as
    one); or exactly the Host the request was sent to where that host is an IP address or
    ``localhost``: the chat page reached through an SSH tunnel or a container's port mapping
    (``localhost:9000`` forwarded to port 8000) names the forwarded address. A Host that is a
    DNS name is not trusted: a page that rebinds its name to this machine sends that name as
    both Host and Origin."""
    parsed = _parse_origin(origin)
    server = scope.get("server")
    if parsed is None or not server:
        return False
    scheme, host, port = parsed
    if scheme != scope.get("scheme", "http"):
        return False
    own = _unmapped(str(server[0]).lower())
    if port == server[1] and (host == own or (_is_loopback(host) and _is_loopback(own))):
        return True
    sent_to = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"host"),
                   None)
    addressed = _parse_origin(f"{scheme}://{sent_to}") if sent_to else None
    return addressed == parsed and _unrebindable(host)


class ErrorResponse(JSONResponse):
    """An error object, written in ASCII so that no message can fail to encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(exc: P.APIError) -> Response:
    return ErrorResponse(exc.body(), status_code=exc.status, headers=exc.headers)


class JSONCORSMiddleware(CORSMiddleware):
    """Starlette's CORS, with a preflight it refuses answered by the API's error object (403
    ``origin_not_allowed`` for an origin not allowed, 400 ``cors_not_allowed`` for a method or
    header) instead of plain text."""

    def preflight_response(self, request_headers) -> Response:
        refused = super().preflight_response(request_headers)
        if refused.status_code < 400:
            return refused
        origin = request_headers["origin"]
        what = bytes(refused.body).decode("utf-8", "replace").removeprefix("Disallowed CORS ")
        refusal = f"the CORS preflight is refused (disallowed {what})"
        if not self.is_allowed_origin(origin=origin):
            exc = P.APIError(403, f"{refusal}: the web origin '{P.shown(origin)}' is not one "
                             "this server allows (--allow-origin)", code="origin_not_allowed")
        else:
            headers = ("any headers" if self.allow_all_headers
                       else f"the headers {', '.join(self.allow_headers)}")
            exc = P.APIError(400, f"{refusal}: this server allows cross-origin "
                             f"{', '.join(self.allow_methods)} with {headers}",
                             code="cors_not_allowed")
        exc.headers = {k: v for k, v in refused.headers.items()
                       if k.lower() not in ("content-type", "content-length")}
        return error_response(exc)


class TextCursor:
    """Where the next token's text starts in a completion's text, in characters, as its tokens'
    bytes arrive (a character cut between two tokens counts where it is completed)."""

    def __init__(self, pos: int = 0):
        self.pos = pos
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def advance(self, raw: bytes) -> int:
        """The offset of a token with bytes ``raw``; the cursor moves past it."""
        start = self.pos
        self.pos += len(self._decoder.decode(raw))
        return start


def request_speculative(default: dict | None, asked: dict | bool | None) -> dict | None:
    """A request's drafting options: what it asked (None: the server's ``default``, False:
    none). With ``pocket serve --speculative lookup``, ``--draft-max`` is both the default
    draft length and the most a request's own ``max_draft`` gets."""
    spec = default if asked is None else asked or None
    if spec is not None and default is not None:
        cap = default["max_draft"]
        spec = {**spec, "max_draft": min(spec.get("max_draft", cap), cap)}
    return spec


def generation_failure(error: Exception) -> P.APIError:
    """The API error a request that failed in the scheduler gets."""
    if isinstance(error, ShuttingDownError):
        return P.APIError(503, str(error), code="shutting_down", headers={"Retry-After": "5"})
    cause = error.cause if isinstance(error, GenerationError) else error
    if isinstance(cause, (SamplingError, ContextLengthError, TextError, GrammarError)):
        return P.APIError(400, f"this request cannot be generated: {cause}",
                          code="generation_failed")
    return P.APIError(500, f"internal error while generating this request: {error}",
                      code="internal_error")


class ServerConfig:
    def __init__(self, *, model_name: str, api_key: str | None = None, max_batch: int = 16,
                 max_queue: int = 64, max_memory_mb: float | None = None,
                 max_body_kb: int = 1024, prefix_cache_mb: float = 64.0,
                 allow_origins: Iterable[str] = (), body_timeout_s: float = 30.0,
                 speculative: str | None = None, draft_max: int | None = None):
        if not 1 <= max_batch <= 256:
            raise PocketError(f"--max-batch must be in 1..256, got {max_batch}")
        if max_queue < 0:
            raise PocketError(f"--max-queue must be >= 0, got {max_queue}")
        if max_body_kb < 1:
            raise PocketError(f"--max-body-kb must be >= 1, got {max_body_kb}")
        if max_memory_mb is not None and not 0 < max_memory_mb <= MAX_MEMORY_MB:  # NaN too
            raise PocketError(f"--max-memory-mb must be a positive number of MB up to "
                              f"{MAX_MEMORY_MB:,} (1 PiB), got {max_memory_mb}")
        if not prefix_cache_mb >= 0:  # NaN too
            raise PocketError(f"--prefix-cache-mb must be >= 0, got {prefix_cache_mb}")
        if not MIN_BODY_TIMEOUT_S <= body_timeout_s < float("inf"):
            # below a tenth of a second, a body that had wholly arrived got 408 before it was
            # read
            raise PocketError(f"--body-timeout must be a number of seconds from "
                              f"{MIN_BODY_TIMEOUT_S:g}, got {body_timeout_s}")
        try:
            model_name.encode("utf-8")
        except UnicodeEncodeError:
            raise PocketError(f"--model-name {model_name!r} is not valid Unicode text; name the "
                              "model with --model-name NAME") from None
        if speculative not in (None, "lookup"):
            raise PocketError(f"--speculative {speculative}: the server drafts by prompt lookup "
                              "only (--speculative lookup)")
        from ..speculative import DEFAULT_MAX_DRAFT, MAX_DRAFT

        if draft_max is not None and speculative is None:  # it would be ignored
            raise PocketError("--draft-max applies with --speculative lookup")
        draft_max = DEFAULT_MAX_DRAFT if draft_max is None else draft_max
        if not 1 <= draft_max <= MAX_DRAFT:
            raise PocketError(f"--draft-max must be from 1 to {MAX_DRAFT}, got {draft_max}")
        # requests that do not say: prompt-lookup drafting with these options, or none
        self.speculative = {"method": "lookup", "max_draft": draft_max} if speculative else None
        self.model_name = model_name
        if api_key:
            check_api_key(api_key)
        self.api_key = api_key or None
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_memory_mb = max_memory_mb
        self.max_body = max_body_kb * 1024
        self.prefix_cache_mb = prefix_cache_mb
        self.allow_origins = frozenset(normalize_origin(o) for o in allow_origins)
        self.body_timeout = body_timeout_s

    def origin_allowed(self, origin: str) -> bool:
        """Whether ``origin`` is one the user allowed with ``--allow-origin``."""
        if "*" in self.allow_origins:
            return True
        return (_parse_origin(origin) is not None
                and normalize_origin(origin) in self.allow_origins)


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
    def check_origin(request: HTTPRequest) -> None:
        origin = request.headers.get("origin")
        if (cfg.api_key is not None or origin is None or cfg.origin_allowed(origin)
                or is_own_origin(origin, request.scope)):
            return
        raise P.APIError(403, f"requests from the web origin '{P.shown(origin)}' are refused: "
                         "this server has no API key, so only its own page may call it from a "
                         "browser; start it with --allow-origin ORIGIN to allow that site (or "
                         "this page, reached through a proxy under a name), or with an API key",
                         code="origin_not_allowed")

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

    def check_json_type(request: HTTPRequest) -> None:
        got = request.headers.get("content-type", "")
        if got.partition(";")[0].strip().lower() != "application/json":
            raise P.APIError(415, "the request body must be JSON sent with 'Content-Type: "
                             "application/json'; got " + (f"'{P.shown(got)}'" if got else
                                                           "no Content-Type"),
                             code="unsupported_media_type")

    async def read_body(request: HTTPRequest) -> bytes:
        """The body, within ``max_body`` bytes and ``body_timeout`` seconds (a client that
        sends it slowly, or never finishes it, is cut off with 408)."""
        # read as a task, looked at every quarter second: a shutdown (the scheduler stopped
        # at the end of the grace) ends a body still arriving with the 503 the requests in
        # flight get, instead of uvicorn cancelling the handler later (a plain-text 500)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.body_timeout
        task = asyncio.ensure_future(read_limited(request))
        try:
            while not task.done():
                left = deadline - loop.time()
                if left <= 0:
                    raise P.APIError(408, f"the request body did not arrive within "
                                     f"{cfg.body_timeout:g} s", code="request_timeout",
                                     headers={"Connection": "close"})
                if scheduler.stopping:
                    raise P.APIError(503, "the server is shutting down", code="shutting_down",
                                     headers={"Connection": "close"})
                await asyncio.wait({task}, timeout=min(0.25, left))
            return task.result()
        except ClientDisconnect:
            raise P.APIError(400, "the client disconnected before the whole body arrived",
                             code="incomplete_body") from None
        finally:
            if not task.done():
                task.cancel()

    async def read_limited(request: HTTPRequest) -> bytes:
        length = request.headers.get("content-length")
        too_big = P.APIError(413, f"the request body exceeds {cfg.max_body // 1024} KB",
                             code="request_too_large", headers={"Connection": "close"})
        # a body over the limit is read to its end and dropped (up to DRAIN_BYTES more) before
        # the 413 goes out: closing a connection with input unread makes the kernel reset it,
        # and the reset can reach the client before the 413 does. A client that waits for
        # '100 Continue' has sent nothing yet, so it gets the 413 at once.
        drain = 0 if "100-continue" in request.headers.get("expect", "").lower() else DRAIN_BYTES
        if length is not None:
            if not (length.isascii() and length.isdigit()):
                raise P.APIError(400, "invalid Content-Length header", code="invalid_request",
                                 headers={"Connection": "close"})
            if len(length) > 20 or int(length) > cfg.max_body + drain:
                raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cfg.max_body + drain:
                raise too_big
            if size <= cfg.max_body:
                chunks.append(chunk)
        if size > cfg.max_body:
            raise too_big
        return b"".join(chunks)

    def check_model(name: str) -> None:
        if name != cfg.model_name:
            raise P.APIError(404, f"The model '{P.shown(name)}' does not exist; this server "
                             f"serves '{cfg.model_name}'", param="model",
                             code="model_not_found")

    def check_named_model(body: dict) -> None:
        """The ``model`` a tokenizer request may name: absent or null, else the served one."""
        name = body.get("model")
        if name is None:
            return
        if not isinstance(name, str):
            raise P.APIError(400, "'model' must be a string", param="model",
                             code="invalid_type")
        check_model(name)

    native_tools = is_native(model.chat_template)

    def calls_mode(g: P.GenerationRequest) -> bool:
        """True when the answer may be tool calls."""
        return bool(g.tools) and g.tool_choice != "none"

    def chat_prompt(g: P.GenerationRequest) -> list[int]:
        offered = g.tools if calls_mode(g) else []
        messages, extra = g.messages, {}
        if offered or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            messages, extra = render_messages(messages, offered, native=native_tools)
        return model.chat_ids(messages, **extra)

    def make_constraint(g: P.GenerationRequest):
        """The request's constraint (tool calls or response_format), compiled (cached per
        schema), or None; a 400 naming the field for one that cannot be used."""
        try:
            if calls_mode(g):
                check_tools(g.tools)
                return call_constraint(g.tools, g.tool_choice, native=native_tools,
                                       tokenizer=model.tokenizer,
                                       n_vocab=model.config.vocab_size,
                                       parallel=g.parallel_tool_calls)
            if g.json_schema is not None:
                return model.constraint(json_schema=g.json_schema)
        except GrammarError as e:
            param = e.param if calls_mode(g) else "response_format"
            if param == "grammar":
                param = "tools"
            raise P.APIError(400, str(e), param=param, code="invalid_schema") from None
        return None

    def added_bos(prompt, ids: list[int]) -> int:
        """1 where the tokenizer put a BOS before a text prompt (it is echoed without it)."""
        tok = model.tokenizer
        return int(isinstance(prompt, str) and tok.add_bos and tok.bos_id is not None
                   and bool(ids) and ids[0] == tok.bos_id)

    def prompt_ids(g: P.GenerationRequest, prompt=None) -> list[int]:
        """The token ids of the chat, or of one completions ``prompt`` (text or ids)."""
        try:
            if g.messages is not None:
                ids = chat_prompt(g)
            elif isinstance(prompt, list):
                ids = model._check_ids(prompt)
            else:
                ids = model.tokenize(prompt)
        except PocketError as e:
            raise P.APIError(400, str(e), param=e.param or (
                "messages" if g.messages is not None else "prompt")) from None
        if not ids:
            raise P.APIError(400, "the prompt is empty", param="prompt")
        return ids

    def build(g: P.GenerationRequest, ids: list[int], loop, choice: int = 0) -> Request:
        n_ctx = model.n_ctx
        if len(ids) >= n_ctx:
            raise P.APIError(400, f"This model's maximum context length is {n_ctx} tokens; "
                             f"the prompt has {len(ids)} token{'' if len(ids) == 1 else 's'}",
                             param="messages"
                             if g.messages is not None else "prompt",
                             code="context_length_exceeded")
        # the request's length, else the model's (within the room the prompt leaves), else
        # the endpoint's; none of them: the rest of the context
        max_tokens = model.settings(g.builtin_max_tokens, max_tokens=g.max_tokens)["max_tokens"]
        if max_tokens is None:
            max_tokens = n_ctx - len(ids)
        elif g.max_tokens is None and model.generation_defaults.max_tokens is not None:
            max_tokens = min(max_tokens, n_ctx - len(ids))
        if len(ids) + max_tokens > n_ctx:
            raise P.APIError(400, f"This model's maximum context length is {n_ctx} tokens; "
                             f"the prompt has {len(ids)} and max_tokens asks for {max_tokens} "
                             f"more ({len(ids) + max_tokens})", param="max_tokens",
                             code="context_length_exceeded")
        if g.logit_bias:
            bad = [t for t in g.logit_bias if t >= model.config.vocab_size]
            if bad:
                raise P.APIError(400, f"'logit_bias' names token {bad[0]}, beyond the "
                                 f"vocabulary (0..{model.config.vocab_size - 1})"
                                 f"{model._trimmed_note()}",
                                 param="logit_bias", code="invalid_value")
        try:
            # with a seed, choice i draws with seed + i: several choices differ, reproducibly
            seed = None if g.seed is None else g.seed + choice
            params = model.sampling_params(g.temperature, g.top_k, g.top_p, g.min_p,
                                           g.repetition_penalty, seed)
            params.presence_penalty = g.presence_penalty or 0.0
            params.frequency_penalty = g.frequency_penalty or 0.0
            params.logit_bias = g.logit_bias or None
            sampler = Sampler(params)
        except PocketError as e:
            raise P.APIError(400, str(e)) from None
        spec = request_speculative(cfg.speculative, g.speculative)
        return Request(prompt_ids=ids, max_tokens=max_tokens, sampler=sampler,
                       stop=g.stop, loop=loop, ignore_eos=g.ignore_eos, speculative=spec,
                       continuation=g.messages is None,
                       logprobs=g.logprobs,
                       score_prompt=g.echo and g.logprobs is not None)

    def submit(reqs: list[Request]) -> None:
        try:
            scheduler.submit(*reqs)
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
        # no other site may frame the page (a framed page's clicks would send as this user)
        return HTMLResponse(page, headers={"Content-Security-Policy": "frame-ancestors 'none'",
                                           "X-Frame-Options": "DENY",
                                           "Referrer-Policy": "no-referrer"})

    async def health(request: HTTPRequest) -> Response:
        return JSONResponse({"status": "ok", "model": cfg.model_name,
                             "engine": model.runtime.engine, "n_ctx": model.n_ctx,
                             "memory_mb": round(current_rss() / MB, 1),
                             "max_memory_mb": cfg.max_memory_mb, **scheduler.snapshot()})

    def model_object() -> dict:
        return {"id": cfg.model_name, "object": "model", "created": started,
                "owned_by": "pocketlm", "context_length": model.n_ctx}

    async def models(request: HTTPRequest) -> Response:
        check_origin(request)
        check_auth(request)
        return JSONResponse({"object": "list", "data": [model_object()]})

    async def retrieve_model(request: HTTPRequest) -> Response:
        """OpenAI's GET /v1/models/{model}: the served model, 404 for any other name."""
        check_origin(request)
        check_auth(request)
        check_model(request.path_params["model"])
        return JSONResponse(model_object())

    # -- the tokenizer, as vLLM's server exposes it (evaluation harnesses tokenize with it) ----
    async def tokenizer_info(request: HTTPRequest) -> Response:
        check_origin(request)
        check_auth(request)
        tok = model.tokenizer
        name = tok.id_to_token
        return JSONResponse({
            "model": cfg.model_name, "vocab_size": model.config.vocab_size,
            "bos_token": name(tok.bos_id) if tok.bos_id is not None else None,
            "eos_token": name(tok.eos_ids[0]) if tok.eos_ids else None,
            "pad_token": None, "add_bos_token": tok.add_bos, "max_model_len": model.n_ctx,
            "chat_template": model.chat_template})

    async def tokenize(request: HTTPRequest) -> Response:
        """``{"prompt": text, "add_special_tokens": bool}`` or ``{"messages": [...]}`` ->
        ``{"tokens", "count", "max_model_len"}``."""
        check_origin(request)
        check_auth(request)
        check_json_type(request)
        raw = await read_body(request)
        body = P.decode_json(raw)
        if not isinstance(body, dict):
            raise P.APIError(400, "the request body must be a JSON object", code="invalid_type")
        unknown = set(body) - {"model", "prompt", "messages", "add_special_tokens"}
        if unknown:
            raise P.APIError(400, f"unrecognized field '{P.shown(sorted(unknown)[0])}'",
                             param=P.shown(sorted(unknown)[0]), code="unknown_parameter")
        check_named_model(body)
        add = body.get("add_special_tokens", True)
        if not isinstance(add, bool):
            raise P.APIError(400, "'add_special_tokens' must be a boolean",
                             param="add_special_tokens", code="invalid_type")
        if "messages" not in body and not isinstance(body.get("prompt"), str):
            raise P.APIError(400, "'prompt' (a string) or 'messages' is required",
                             param="prompt", code="invalid_type")

        def count() -> list[int]:
            if "messages" in body:
                g = P.parse_request({"model": cfg.model_name, "messages": body["messages"]},
                                    chat=True)
                return chat_prompt(g)
            return model.tokenize(body["prompt"], add_bos=None if add else False)

        try:
            ids = await off_loop(count, len(raw))
        except PocketError as e:
            raise P.APIError(400, str(e), param="prompt") from None
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": model.n_ctx})

    async def detokenize(request: HTTPRequest) -> Response:
        """``{"tokens": [ids]}`` -> ``{"prompt": text}``."""
        check_origin(request)
        check_auth(request)
        check_json_type(request)
        body = P.decode_json(await read_body(request))
        if not isinstance(body, dict):
            raise P.APIError(400, "the request body must be a JSON object", code="invalid_type")
        unknown = set(body) - {"model", "tokens"}
        if unknown:
            raise P.APIError(400, f"unrecognized field '{P.shown(sorted(unknown)[0])}'",
                             param=P.shown(sorted(unknown)[0]), code="unknown_parameter")
        check_named_model(body)
        ids = body.get("tokens")
        if not isinstance(ids, list):
            raise P.APIError(400, "'tokens' (an array of token ids) is required",
                             param="tokens", code="invalid_type")
        try:
            text = await asyncio.to_thread(model.detokenize, ids)
        except PocketError as e:
            raise P.APIError(400, str(e), param="tokens") from None
        return JSONResponse({"prompt": text})

    async def generate(request: HTTPRequest, chat: bool) -> Response:
        check_origin(request)
        check_auth(request)
        check_json_type(request)
        body = await read_body(request)

        def prepare() -> tuple[P.GenerationRequest, list[list[int]]]:
            g = P.parse_request(P.decode_json(body), chat=chat)
            check_model(g.model)
            return g, [prompt_ids(g, prompt) for prompt in ([None] if chat else g.prompts)]

        g, prompts = await off_loop(prepare, len(body))
        # more choices than the batch and the waiting line hold together never fit: a 429
        # would have the client retry what no retry can serve
        choices = len(prompts) * g.n
        if choices > cfg.max_batch + cfg.max_queue:
            raise P.APIError(400, f"this request asks for {choices} choices ({len(prompts)} "
                             f"prompt(s) x n {g.n}) but the server takes at most "
                             f"{cfg.max_batch + cfg.max_queue} at once (--max-batch "
                             f"{cfg.max_batch} + --max-queue {cfg.max_queue}); ask for fewer",
                             param="n" if g.n > 1 else "prompt", code="invalid_value")
        loop = asyncio.get_running_loop()
        # one request per (prompt, choice): they decode together like any others
        reqs: list[Request] = []
        for source, ids in zip([None] if chat else g.prompts, prompts, strict=True):
            for choice in range(g.n):
                reqs.append(build(g, ids, loop, choice))
                reqs[-1].echo_from = added_bos(source, ids)
        if g.json_schema is not None or calls_mode(g):
            # compiling a new schema (and, once, the vocabulary's index) must not stall the
            # event loop: other requests keep streaming meanwhile
            for req in reqs:
                req.constraint = await asyncio.to_thread(make_constraint, g)
        submit(reqs)  # every choice or none
        rid = P.new_id(chat)
        if g.stream:
            return StreamingResponse(stream(reqs, rid, g, chat),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        return await collect(request, reqs, rid, g, chat)

    async def cancel_on_disconnect(request: HTTPRequest, reqs: list[Request],
                                   gone: asyncio.Event) -> None:
        """Wait for the client to hang up (the body is read: what comes next is ASGI's
        ``http.disconnect``), then cancel ``reqs``."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for req in reqs:
            scheduler.cancel(req)
            req.events.put_nowait(("gone",))
        gone.set()

    def usage(reqs: list[Request]) -> dict:
        """Each distinct prompt counted once, every choice's tokens."""
        prompts = {id(r.prompt_ids): len(r.prompt_ids) for r in reqs}
        return P.usage(sum(prompts.values()), sum(r.completion_tokens for r in reqs))

    def logprobs_body(entries: list, chat: bool, *, prompt: list[int] | None = None,
                      prompt_entries: list | None = None, generated: list[int] | None = None,
                      cursor: TextCursor | None = None, echo_from: int = 0,
                      stop: tuple | None = None) -> dict:
        """OpenAI's logprobs object: chat's ``content`` list, or completions' parallel arrays
        (with the prompt's tokens first under echo: the first has no log-probability).

        A completions token that is part of a character is named by its bytes, as OpenAI
        names them (``bytes:\\xe6\\x97``), and ``text_offset`` counts the characters of
        the text before each token (a character's first token is where it starts): ``cursor``
        carries the count, and a cut character, from one streamed chunk to the next. A token
        the text does not show (a BOS the client did not send, the first ``echo_from``; a
        generated control token; ``stop``, the stop id that ended it, with its entry, listed
        last) takes no characters."""
        tok = model.tokenizer

        def piece(i: int) -> tuple[str, list[int]]:
            b = tok.token_bytes(i)
            return b.decode("utf-8", errors="replace"), list(b)

        def named(i: int) -> str:
            b = tok.token_bytes(i)
            try:
                return b.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{c:02x}" for c in b)

        def lp(x: float) -> float:
            return x if x >= -9999.0 else -9999.0  # JSON has no -inf or NaN (OpenAI's floor)

        if chat:
            content = []
            for token, (logp, top) in zip(generated, entries, strict=False):
                text, raw = piece(token)
                content.append({"token": text, "logprob": lp(logp), "bytes": raw,
                                "top_logprobs": [{"token": piece(t)[0], "logprob": lp(x),
                                                  "bytes": piece(t)[1]} for t, x in top]})
            return {"content": content, "refusal": None}
        tokens, token_lps, tops, offsets = [], [], [], []
        pairs = []  # (token, entry, the bytes it adds to the text)
        if prompt is not None:
            # the echo is decode(prompt[echo_from:]), which drops the space a SentencePiece
            # vocabulary puts before the first word
            strip = tok._strip_leading_space
            for i, (t, e) in enumerate(zip(prompt, [None, *prompt_entries], strict=False)):
                raw = tok.token_bytes(t) if i >= echo_from else b""
                if strip and raw:
                    raw, strip = raw.removeprefix(b" "), False
                pairs.append((t, e, raw))
        pairs += [(t, e, b"" if tok.is_special(t) else tok.token_bytes(t))
                  for t, e in zip(generated, entries, strict=False)]
        if stop is not None:
            pairs.append((stop[0], stop[1], b""))
        cursor = cursor or TextCursor()
        for token, entry, raw in pairs:
            tokens.append(named(token))
            offsets.append(cursor.advance(raw))
            if entry is None:
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(lp(entry[0]))
                tops.append({named(t): lp(x) for t, x in entry[1]})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def answer(req: Request, g: P.GenerationRequest, chat: bool, text: str, finish: str
               ) -> tuple[str, str, list[dict] | None]:
        """(text, finish reason, tool calls) of a finished request."""
        calls = None
        if chat and calls_mode(g) and finish == "stop":
            calls = parse_calls(text, native=native_tools)
            finish = "tool_calls" if calls else finish
        if not chat and g.echo:
            text = model.detokenize(req.prompt_ids[req.echo_from:]) + text
        return text, finish, calls

    async def collect(request: HTTPRequest, reqs: list[Request], rid: str,
                      g: P.GenerationRequest, chat: bool) -> Response:
        gone = asyncio.Event()
        watcher = asyncio.create_task(cancel_on_disconnect(request, reqs, gone))
        choices = []
        try:
            for index, req in enumerate(reqs):
                pieces = []
                while True:
                    ev = await req.events.get()
                    if ev[0] == "text":
                        pieces.append(ev[1])
                    elif ev[0] == "done":
                        text, finish, calls = answer(req, g, chat, "".join(pieces), ev[1])
                        lps = None
                        if g.logprobs is not None:
                            state = req.seq.state
                            lps = logprobs_body(
                                state.logprobs or [], chat, generated=state.generated,
                                prompt=req.prompt_ids if (g.echo and not chat) else None,
                                prompt_entries=req.prompt_logprobs, echo_from=req.echo_from,
                                stop=None if chat else state.stop_logprob)
                        choices.append(P.choice_body(index, text, finish, chat=chat,
                                                     tool_calls=calls, logprobs=lps))
                        break
                    elif ev[0] == "gone":
                        return Response(status_code=499)  # nobody reads it
                    else:
                        for r in reqs:
                            scheduler.cancel(r)
                        raise generation_failure(ev[1])
            return JSONResponse(P.completion_body(rid, cfg.model_name, choices, usage(reqs),
                                                  chat=chat))
        except asyncio.CancelledError:
            for r in reqs:
                scheduler.cancel(r)
            raise
        finally:
            watcher.cancel()

    async def stream(reqs: list[Request], rid: str, g: P.GenerationRequest, chat: bool):
        def sse(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        # every choice's events, in the order they come
        merged: asyncio.Queue = asyncio.Queue()

        async def forward(index: int, req: Request) -> None:
            while True:
                ev = await req.events.get()
                await merged.put((index, ev))
                if ev[0] != "text":
                    return

        tasks = [asyncio.create_task(forward(i, r)) for i, r in enumerate(reqs)]
        finished = 0
        # an answer that may be tool calls is held back until it is clearly not one (its
        # start can no longer be a call's); calls are sent whole, once they are complete
        trigger = (NATIVE_TRIGGER if native_tools else GENERIC_TRIGGER) if (
            chat and calls_mode(g)) else None
        triggers = [trigger] * len(reqs)
        held: list[list[str]] = [[] for _ in reqs]
        held_lps: list[list] = [[] for _ in reqs]
        sent_tokens = [0] * len(reqs)
        cursors = [TextCursor() for _ in reqs]

        def chunk_lps(index: int, entries: list) -> dict | None:
            if g.logprobs is None:
                return None
            req = reqs[index]
            generated = req.seq.state.generated[sent_tokens[index]:
                                                sent_tokens[index] + len(entries)]
            sent_tokens[index] += len(entries)
            return logprobs_body(entries, chat, generated=generated, cursor=cursors[index])

        def echo(index: int) -> str:
            """The chunk that echoes a completion's prompt (and its log-probabilities)."""
            req = reqs[index]
            text = model.detokenize(req.prompt_ids[req.echo_from:])
            cursors[index] = TextCursor(len(text))
            lps = None if g.logprobs is None else logprobs_body(
                [], False, prompt=req.prompt_ids, prompt_entries=req.prompt_logprobs,
                generated=[], echo_from=req.echo_from)
            return sse(P.chunk_body(rid, cfg.model_name, chat=False, text=text, index=index,
                                    logprobs=lps))

        try:
            if chat:
                for i in range(len(reqs)):
                    yield sse(P.chunk_body(rid, cfg.model_name, chat=True, role=True, index=i))
            elif g.echo and g.logprobs is None:
                for i in range(len(reqs)):
                    yield echo(i)
            # with logprobs a choice's echo waits for its first event: its prompt is scored
            echo_due = [g.echo and not chat and g.logprobs is not None] * len(reqs)
            while finished < len(reqs):
                i, ev = await merged.get()
                if echo_due[i]:
                    echo_due[i] = False
                    yield echo(i)
                if ev[0] == "text":
                    entries = ev[2] if len(ev) > 2 else []
                    if triggers[i] is not None:
                        held[i].append(ev[1])
                        held_lps[i] += entries
                        start = "".join(held[i]).lstrip()
                        if start.startswith(triggers[i]) or triggers[i].startswith(start):
                            continue
                        triggers[i] = None  # a plain answer: what was held goes out now
                        text, held[i] = "".join(held[i]), []
                        entries, held_lps[i] = held_lps[i] + [], []
                    else:
                        text = ev[1]
                    yield sse(P.chunk_body(rid, cfg.model_name, chat=chat, text=text, index=i,
                                           logprobs=chunk_lps(i, entries)))
                elif ev[0] == "done":
                    finished += 1
                    finish = ev[1]
                    if held[i]:
                        text = "".join(held[i])
                        calls = parse_calls(text, native=native_tools) if finish == "stop" \
                            else None
                        if calls:
                            finish = "tool_calls"
                            yield sse(P.chunk_body(rid, cfg.model_name, chat=True, index=i,
                                                   tool_calls=calls,
                                                   logprobs=chunk_lps(i, held_lps[i])))
                        else:
                            yield sse(P.chunk_body(rid, cfg.model_name, chat=chat, text=text,
                                                   index=i,
                                                   logprobs=chunk_lps(i, held_lps[i])))
                        held[i] = []
                    stop = reqs[i].seq.state.stop_logprob if reqs[i].seq else None
                    if stop is not None and not chat and g.logprobs is not None:
                        yield sse(P.chunk_body(rid, cfg.model_name, chat=False, text="",
                                               index=i, logprobs=logprobs_body(
                                                   [], False, generated=[], stop=stop,
                                                   cursor=cursors[i])))
                    yield sse(P.chunk_body(rid, cfg.model_name, chat=chat, finish=finish,
                                           index=i))
                else:
                    finished = len(reqs)
                    err = generation_failure(ev[1]).body()
                    yield f"data: {json.dumps(err, ensure_ascii=True)}\n\n"
                    return
            if g.include_usage:
                yield sse(P.chunk_body(rid, cfg.model_name, chat=chat, use=usage(reqs)))
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for r in reqs:  # the client went away, or an error: nothing more is read
                if r.seq is None or not r.seq.finished:
                    scheduler.cancel(r)

    async def completions(request: HTTPRequest) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: HTTPRequest) -> Response:
        return await generate(request, chat=True)

    # -- errors --------------------------------------------------------------------------
    async def api_error(request: HTTPRequest, exc: P.APIError) -> Response:
        return error_response(exc)

    async def http_error(request: HTTPRequest, exc: HTTPException) -> Response:
        path = P.shown(request.url.path)
        msg = {404: f"no route {request.method} {path}",
               405: f"method {request.method} is not allowed on {path}"}.get(
            exc.status_code, str(exc.detail))
        return error_response(P.APIError(exc.status_code, msg,
                                         headers=getattr(exc, "headers", None)))

    async def server_error(request: HTTPRequest, exc: Exception) -> Response:
        return error_response(P.APIError(500, f"internal error: {exc}"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.close()

    # installed with no origin allowed too, so that a foreign page's preflight gets the 403
    # of any foreign origin, not a 405 for OPTIONS
    cors = Middleware(JSONCORSMiddleware, allow_origins=sorted(cfg.allow_origins),
                      # any request headers: OpenAI's own JavaScript client adds X-Stainless-*
                      allow_methods=["GET", "POST"], allow_headers=["*"])
    app = Starlette(
        middleware=[cors],
        routes=[Route("/", index), Route("/health", health), Route("/v1/models", models),
                Route("/v1/models/{model:path}", retrieve_model),
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                Route("/tokenizer_info", tokenizer_info),
                Route("/tokenize", tokenize, methods=["POST"]),
                Route("/detokenize", detokenize, methods=["POST"])],
        exception_handlers={P.APIError: api_error, HTTPException: http_error,
                            Exception: server_error},
        lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.base_memory = base
    app.state.kv_budget = kv_budget
    app.state.body_timeout = cfg.body_timeout
    return app
