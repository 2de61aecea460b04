"""`pocket serve`: the command line of the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from ..errors import PocketError

SHUTDOWN_GRACE_S = 5.0  # on SIGINT / SIGTERM, how long the requests in flight may go on

SERVE_EPILOG = """examples:
  pocket serve                                   # default model on http://127.0.0.1:8000
  pocket serve -m qwen2.5-0.5b --max-memory-mb 900 --api-key-file ~/.config/pocket/key
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}'

Any OpenAI client works: base_url="http://127.0.0.1:8000/v1" (api_key: the server's key, or any
string when none is set). Give the key as $POCKET_API_KEY or --api-key-file FILE: an --api-key
on the command line is visible to every user of the machine (ps).

Settings a request leaves out (temperature, top_p, max_tokens, ...) are the model's own
generation settings, else greedy decoding with 16 tokens for a completion and the rest of the
context for a chat. Without an API key, web pages from other origins are refused (403) unless
--allow-origin names them.

memory: --max-memory-mb bounds the whole process (weights, tokenizer, step buffers and every
KV cache). A request reserves the KV cache of its prompt + max_tokens before it starts;
requests that do not fit wait (oldest first) in a line of --max-queue, and beyond that get
429 with Retry-After. Nothing accepted is dropped.
"""


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP API and chat page "
                       "(continuous batching, memory budget)",
                       description="Serve one model over OpenAI's HTTP API (/v1/completions, "
                       "/v1/chat/completions, /v1/models, streaming as server-sent events) with "
                       "a chat page at /. Concurrent requests are decoded together, one batched "
                       "step at a time.", epilog=SERVE_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", help="registry name, .pocket, .gguf, HF folder or training "
                   "run (default: $POCKET_MODEL or smollm2-135m)")
    p.add_argument("--model-name", help="the id clients use in 'model' (default: the registry "
                   "name or the file's stem)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: "
                   "this machine only; 0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 and the "
                   "tokenizer routes (visible in ps: prefer $POCKET_API_KEY or --api-key-file; "
                   "default: $POCKET_API_KEY, else no auth)")
    p.add_argument("--api-key-file", metavar="FILE", help="read the API key from FILE (its "
                   "first line)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages from ORIGIN (scheme://host[:port]; '*': any) call a "
                   "server without an API key, with CORS; repeatable (default: only the "
                   "server's own page)")
    p.add_argument("--ctx", type=int, default=None, help="context per request, prompt + "
                   "answer (default 4096, or the model's if smaller)")
    p.add_argument("--max-batch", type=int, default=16, help="requests decoded together at "
                   "most (default 16)")
    p.add_argument("--speculative", choices=("lookup",), default=None,
                   help="decode every request speculatively by prompt lookup unless it says "
                   "otherwise ('speculative': false); requests may also ask for it themselves "
                   "('speculative': 'lookup'). The same answers, several tokens per pass where "
                   "the answer copies the prompt")
    p.add_argument("--draft-max", type=int, default=None, metavar="N",
                   help="with --speculative: draft at most N tokens per step (1-16, default 8); "
                   "also the most a request's own 'max_draft' gets")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a "
                   "slot or memory; more get 429 (default 64)")
    p.add_argument("--max-memory-mb", type=float, default=None, help="memory budget of the "
                   "whole process in MB (default: none beyond --max-batch x context)")
    p.add_argument("--prefix-cache-mb", type=float, default=64.0, help="memory for cached prompt "
                   "prefixes, e.g. a shared system prompt (default 64; 0: off; with "
                   "--max-memory-mb, at most half its KV caches' share)")
    p.add_argument("--max-body-kb", type=int, default=1024, help="largest request body "
                   "(default 1024 KB)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request body that takes longer to arrive gets 408; a connection "
                   "whose request line and headers, once begun, take longer is closed "
                   "(default 30)")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning)")
    p.set_defaults(func=cmd_serve)


def _uvicorn_server():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, whose SIGINT/SIGTERM end in a graceful stop and exit code 0 (uvicorn
        re-raises the signal once shut down, which would end the process as killed).

        The requests in flight get ``grace`` seconds to finish; then ``stop_requests`` (the
        scheduler's close) ends the rest, each with the error the API gives a request that a
        shutdown cuts (a 503 ``shutting_down``, or an error event and the stream's end), before
        uvicorn's own timeout, ``grace`` later, cancels the handlers: cancelled, a client got
        a plain-text 500 or a stream cut without its end. A second SIGINT ends them at once."""

        def __init__(self, config, *, stop_requests=None, grace: float = SHUTDOWN_GRACE_S):
            super().__init__(config)
            self._stop_requests = stop_requests
            self._grace = grace
            self._stop_timer: threading.Timer | None = None

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            if self._stop_requests is None:
                return
            if self.force_exit or self._stop_timer is None:
                if self._stop_timer is not None:
                    self._stop_timer.cancel()
                self._stop_timer = threading.Timer(0 if self.force_exit else self._grace,
                                                   self._stop_requests)
                self._stop_timer.daemon = True
                self._stop_timer.start()

        async def shutdown(self, sockets=None):
            await super().shutdown(sockets)
            if self.force_exit and self._stop_requests is not None:
                # the second signal: uvicorn waits for nothing, and the handlers it leaves
                # running are cancelled when the loop ends, each logged as a traceback. The
                # requests are being ended now (the stop above): let their handlers send
                # their errors, for a moment
                loop = asyncio.get_running_loop()
                deadline = loop.time() + SHUTDOWN_GRACE_S / 2
                while self.server_state.tasks and loop.time() < deadline:
                    await asyncio.sleep(0.02)

        def cancel_stop(self) -> None:
            """Drop a pending stop (the server ended before its grace ran out)."""
            if self._stop_timer is not None:
                self._stop_timer.cancel()

        def capture_signals(self):
            stack = contextlib.ExitStack()
            stack.enter_context(super().capture_signals())
            stack.callback(lambda: getattr(self, "_captured_signals", []).clear())  # first
            return stack

    return Server


def _json_400_protocol(head_timeout: float = 30.0):
    """uvicorn's HTTP/1.1 protocol, answering a request it cannot parse (a ``Content-Length:
    abc``, a broken request line or header) with OpenAI's JSON error object like every other
    400 of the server, not uvicorn's plain text: such a request never reaches the app. A
    connection whose request line and headers have not all arrived within ``head_timeout``
    seconds of the server waiting for them is closed (uvicorn times only idle connections
    after a response: one that sent nothing, or a header a second, was held for ever, and
    enough of them used up the process's file descriptors)."""
    import json

    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from .protocol import APIError

    body = json.dumps(APIError(
        400, "malformed HTTP request: its request line or headers (e.g. Content-Length) "
        "cannot be parsed", code="bad_http_request").body()).encode()

    class Protocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            headers = [(b"content-type", b"application/json"),
                       (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

        _timer = None
        _fresh = True  # no request head has arrived on this connection yet

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._watch(got_bytes=False)

        def _waiting_on_client(self, got_bytes: bool) -> bool:
            """Whether the connection waits on the client outside any request the app is
            answering: a head begun (or none yet on a new connection; an idle one after a
            response is uvicorn's keep-alive's), or a body the app answered without reading
            (a 401 or 415) that the client goes on sending."""
            their = self.conn.their_state
            if their is h11.IDLE:
                return got_bytes or self._fresh or self._timer is not None
            return their is h11.SEND_BODY and self.conn.our_state is h11.DONE

        def _watch(self, got_bytes: bool) -> None:
            if self.conn.their_state is not h11.IDLE:
                self._fresh = False
            if not self._waiting_on_client(got_bytes):
                self._stop_watch()
            elif self._timer is None and not self.transport.is_closing():
                # kept, not restarted, as more pieces arrive
                self._timer = self.loop.call_later(head_timeout, self._timed_out)

        def _stop_watch(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _timed_out(self) -> None:
            self._timer = None
            if self._waiting_on_client(got_bytes=True):
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch(got_bytes=True)

        def handle_events(self) -> None:
            super().handle_events()
            self._watch(got_bytes=False)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch(got_bytes=False)

        def connection_lost(self, exc) -> None:
            self._stop_watch()
            super().connection_lost(exc)

    return Protocol


def uvicorn_config(app, **kw):
    """The uvicorn config ``pocket serve`` runs ``app`` under (tests use it too)."""
    import uvicorn

    head_timeout = getattr(app.state, "body_timeout", 30.0)  # the same bound as a body's
    return uvicorn.Config(app, http=_json_400_protocol(head_timeout), **kw)


def served_name(model_arg: str) -> str:
    """The id clients send: a registry name as given, a file or folder by its stem."""
    path = Path(model_arg)
    return path.stem if path.exists() or path.suffix in (".pocket", ".gguf") else model_arg


def _require_stack() -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise PocketError(f"pocket serve needs {e.name}: install the serve extra (pip install "
                          "'.[serve]' in pocketlm's folder, or pip install starlette uvicorn)"
                          ) from None


def api_key_from(args, environ: Mapping[str, str]) -> str | None:
    """The API key: ``--api-key``, else the first line of ``--api-key-file``, else
    ``$POCKET_API_KEY``; None for none."""
    from .app import check_api_key

    if args.api_key is not None and args.api_key_file is not None:
        raise PocketError("give the API key once: --api-key or --api-key-file, not both")
    if args.api_key is not None:
        if not args.api_key.strip():
            raise PocketError("--api-key is empty; give a key or leave the option out")
        return check_api_key(args.api_key.strip(), "--api-key")
    if args.api_key_file is not None:
        return check_api_key(_read_key_file(args.api_key_file),
                             f"--api-key-file {args.api_key_file}")
    key = environ.get("POCKET_API_KEY", "")
    if key and not key.strip():
        raise PocketError("$POCKET_API_KEY is blank; set a key, or unset it for no key")
    return check_api_key(key.strip(), "$POCKET_API_KEY") if key else None


def _read_key_file(path: str) -> str:
    if not path:
        raise PocketError("--api-key-file is empty: give the path of the file that holds the key")
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a leading BOM is no part of a key
    except OSError as e:
        raise PocketError(f"--api-key-file {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise PocketError(f"--api-key-file {path}: not UTF-8 text; the file should hold the "
                          "key on its first line") from None
    lines = text.strip().splitlines()
    if not lines:
        raise PocketError(f"--api-key-file {path} is empty; write the key on its first line")
    return lines[0].strip()


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` for uvicorn to listen on; a port already taken (or an
    address this machine does not have) is a one-line error before anything loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PocketError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    # IPv4 first: "localhost" should listen where browsers and clients try first
    family, kind, proto, _, address = min(infos, key=lambda i: i[0] != socket.AF_INET)
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PocketError(f"port {port} on {host} is in use ({e.strerror}); pass --port "
                              "with a free port (--port 0: any free one)") from None
        raise PocketError(f"cannot listen on {host} port {port} ({e.strerror}); pass another "
                          "--host or --port") from None
    return sock


def cmd_serve(args) -> int:
    _require_stack()

    import pocketlm

    from ..api import check_context_flag, context_note
    from ..registry import model_or_default
    from .app import ServerConfig, create_app

    check_context_flag(args.ctx)
    if args.ctx is not None and args.ctx < 2:  # a server that could answer nothing
        raise PocketError(f"--ctx {args.ctx} holds no prompt and answer: give at least 2 tokens")
    if not 0 <= args.port <= 65535:
        raise PocketError(f"--port must be in 0..65535, got {args.port}")
    model_arg = model_or_default(args.model)
    if args.model_name is not None and not args.model_name.strip():
        raise PocketError("--model-name is empty: give the id clients send in 'model'")
    cfg = ServerConfig(model_name=args.model_name or served_name(model_arg),
                       api_key=api_key_from(args, os.environ), max_batch=args.max_batch,
                       max_queue=args.max_queue, max_memory_mb=args.max_memory_mb,
                       max_body_kb=args.max_body_kb, prefix_cache_mb=args.prefix_cache_mb,
                       allow_origins=args.allow_origin, body_timeout_s=args.body_timeout,
                       speculative=args.speculative, draft_max=args.draft_max)
    sock = bind_socket(args.host, args.port)
    try:
        t0 = time.time()
        model = pocketlm.load(model_arg, n_ctx=args.ctx, quiet=False)
        note = context_note(model, args.ctx)
        if note:
            print(note, file=sys.stderr)
        app = create_app(model, cfg)
    except BaseException:
        sock.close()
        raise
    # no lifespan: the scheduler is closed below, after uvicorn returns (a second Ctrl-C
    # cancelled the app's lifespan task mid-shutdown, and uvicorn logged its traceback)
    config = uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=2 * SHUTDOWN_GRACE_S, lifespan="off")
    server = _uvicorn_server()(config, stop_requests=app.state.scheduler.close)

    budget = app.state.kv_budget
    mem = (f"memory budget {cfg.max_memory_mb:g} MB ({app.state.base_memory / 2**20:.0f} MB "
           f"model + buffers, {budget / 2**20:.0f} MB for KV caches)" if budget is not None
           else f"no memory budget (model + buffers {app.state.base_memory / 2**20:.0f} MB)")

    async def announce():
        while not server.started:
            await asyncio.sleep(0.05)
        for sock in server.servers[0].sockets if server.servers else []:
            host, port = sock.getsockname()[:2]
            host = f"[{host}]" if ":" in host else host  # an IPv6 address, as a URL writes it
            print(f"pocketlm: serving '{cfg.model_name}' ({model.runtime.engine} engine, "
                  f"context {model.n_ctx}, up to {cfg.max_batch} "
                  f"request{'s' if cfg.max_batch != 1 else ''} at once; {mem}) "
                  f"loaded in {time.time() - t0:.1f} s", file=sys.stderr)
            print(f"pocketlm: http://{host}:{port}/  (OpenAI API at http://{host}:{port}/v1"
                  f"{', API key required' if cfg.api_key else ''})", file=sys.stderr, flush=True)
            break

    async def main():
        task = asyncio.create_task(announce())
        try:
            await server.serve(sockets=[sock])
        finally:
            server.cancel_stop()
            task.cancel()
            app.state.scheduler.close()

    asyncio.run(main())
    if server.started:
        print("pocketlm: server stopped", file=sys.stderr)
    return 0 if server.started else 1
