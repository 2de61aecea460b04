"""The ``pocket`` command line.

Each verb maps to a Python function of the same name with the same keyword arguments.
Errors print one line (``pocket: error: ...``) and exit with code 1; ``--debug`` shows the
traceback. ``pocket --version`` prints the version; ``pocket --version -v`` adds what
``pocket doctor`` reports (the machine, the native extension and every engine setting).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

from . import __version__
from .errors import ContextLengthError, ModelNotFoundError, PocketError
from .textfile import checked_text

EPILOG = """examples:
  pocket run "Write a haiku about the sea"        # default model, pulled on first use
  pocket chat -m qwen2.5-0.5b                      # interactive chat
  pocket pull gemma3-270m                          # fetch a registry model
  pocket pack model.gguf -o model.pocket           # INT4 deploy file
  pocket inspect model.pocket                      # what is inside
  pocket bench --vs llama.cpp mnn                  # speed, memory, energy vs llama.cpp, MNN
  pocket serve -m qwen2.5-0.5b                     # OpenAI-compatible API + chat page
  pocket train --preset tiny --data corpus.txt --out runs/tiny   # train from scratch
  pocket export runs/tiny -o tiny.pocket           # a training run as a deploy file

environment:
  POCKET_HOME     cache for pulled and packed models (default ~/.cache/pocketlm)
  POCKET_MODEL    default model for run/chat (default smollm2-135m)
  POCKET_KERNELS  kernel backend: native (default when built) or numpy
  POCKET_THREADS  engine threads (default: 2, or the usable CPUs if fewer)
  (`pocket doctor` lists every engine setting, POCKET_ACT, POCKET_KV, ..., and its source)
"""


def model_or_default(model: str | None) -> str:
    from .registry import model_or_default

    return model_or_default(model)


# -- verbs -----------------------------------------------------------------------------------
def _exit_on_sigterm():
    """A context in which SIGTERM (and SIGHUP) raise SystemExit(128 + signal number), so that
    the writers' cleanup runs (no temp file is left behind) and the exit status still tells
    which signal ended the process. A signal that the parent set to be ignored stays ignored."""
    import signal

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    stack = contextlib.ExitStack()
    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is None or signal.getsignal(sig) is not signal.SIG_DFL:
            continue
        try:
            previous = signal.signal(sig, terminate)
        except ValueError:  # not the main thread: signals stay as they are
            continue
        stack.callback(signal.signal, sig, previous)
    return stack


def cmd_pull(args) -> int:
    from .registry import canonical_name, pull, verify

    args.name = canonical_name(args.name)
    if args.verify:
        path = verify(args.name, quiet=args.quiet)
        from .registry import RECIPES

        if args.name in RECIPES:  # made here: its hash against the recorded run's, if any
            from .recipes import built_record

            rec, ref = built_record(path), RECIPES[args.name].sha256
            how = ("matches the recorded run's" if rec.get("sha256") == ref else
                   "differs from the recorded run's" if ref else
                   "(no recorded run to compare with yet)")
            print(f"{args.name}: ok, a readable deploy file; sha256 {rec.get('sha256')} {how} "
                  f"({path})")
            return 0
        print(f"{args.name}: ok, sha256 matches the registry ({path})")
        return 0
    with _exit_on_sigterm():
        path = pull(args.name, force=args.force, quiet=args.quiet)
    print(path)
    return 0


def cmd_list(args) -> int:
    from .registry import list_models

    rows = list_models()
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    width = max(len("name"), *(len(r["name"]) for r in rows))
    print(f"{'name':<{width}} {'size':>7}  {'pulled':<10}  description")
    for r in rows:
        size = f"{r['size'] / 1e6:5.0f}MB" if r["size"] else f"{'recipe':>7}"
        state = "built" if r.get("recipe") and r["state"] == "yes" else r["state"]
        print(f"{r['name']:<{width}} {size}  {state:<10}  {r['description']}")
    doubtful = [r["name"] for r in rows if r["state"] in ("changed", "unverified")]
    if doubtful:
        print(f"(changed / unverified: the file is not known to match the registry; check it "
              f"with `pocket pull {doubtful[0]} --verify`)")
    recipes = [r["name"] for r in rows if r.get("recipe") and r["state"] == "no"]
    if recipes:
        print(f"(recipe: made by pocketlm, not downloaded; `pocket pull {recipes[0]}` builds "
              "it in hours, resumable: see docs/pocket-zh-en.md)")
    return 0


def cmd_pack(args) -> int:
    from .pack import pack
    from .registry import default_pack_bits, resolve

    calibration = calibration_kwargs(args)  # a bad flag is refused before any work
    vocab = vocab_spec(args)
    with _exit_on_sigterm():
        src = resolve(args.src)
        from .export import check_output

        # the files the pack reads: --force must not replace them
        read = [c for c in (calibration["calib"], args.vocab_corpus) if c not in (None, "default")]
        out = check_output(args.output, force=args.force, inputs=(src, *read))
        if (calibration["bits_per_weight"] is None and calibration["calib"] is None
                and (args.group_size, args.embed_bits, args.keep_precision) == (32, 8, None)):
            # a registry model's default pack is its registry bit budget (see pocket list)
            calibration["bits_per_weight"] = default_pack_bits(src)
        report = pack(src, out, group_size=args.group_size, embed_bits=args.embed_bits,
                      keep_precision=args.keep_precision, progress=True, vocab=vocab,
                      reproducible=args.reproducible, **calibration)
    print(report.summary())
    if args.bits_per_weight is not None or args.list_tensors:
        print(report.choices())
    return 0


def cmd_inspect(args) -> int:
    from .formats import sniff
    from .formats.pocketfile import FORMAT_NAME, PocketFile

    if not args.file.strip():  # an unset shell variable: not the current folder
        raise PocketError("the file to inspect is empty: give a .pocket file or a registry name")
    path = Path(args.file)
    if not path.exists():
        from .api import deploy_file

        # a registry name: the deploy file `pocket run -m NAME` runs (packed on first use)
        with _exit_on_sigterm():  # a pull or pack on first use: no temp file left
            path = deploy_file(args.file, quiet=False)
    if sniff(path) != "pocket":
        raise PocketError(f"{path}: not a .pocket deploy file (inspect reads deploy files; "
                          "pack a GGUF or Hugging Face model with `pocket pack` first)")
    pf = PocketFile(path, verify=args.verify)
    meta = pf.metadata
    config = pf.config()  # validated: a malformed config is a one-line error, not a KeyError
    pf.check_model(config)
    quant = pf.json_object("quant", {})
    prov = pf.json_object("provenance", {})
    generation = pf.json_object("generation", {})
    layouts = pf.quant_layouts()
    if args.json:
        out = {k: v for k, v in meta.items() if k not in ("checksums", "header_checksum")}
        out.update(config=config.to_dict(), generation=generation, provenance=prov,
                   quant={**quant, "tensors": len(layouts)}, file_bytes=pf.nbytes,
                   header_verified=pf.header_verified)
        for key in ("vocab", "adapter"):  # objects, as the other records are (not JSON text)
            if key in meta:
                out[key] = pf.json_object(key, None)
        if args.tensors:  # it was dropped silently
            out["tensor_list"] = [{"name": n, "dtype": i.dtype, "shape": list(i.shape)}
                                  for n, i in pf.infos.items() if not n.startswith("_pad.")]
        # a crafted header's NaN or Infinity is no JSON value: null
        print(json.dumps(_finite(out), ensure_ascii=False, allow_nan=False))
        return 0

    def say(line: str) -> None:
        # the header's strings shown as text: an escape sequence or a newline a crafted file
        # carries is written out, not sent to the terminal
        print("".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in line))

    c = config
    say(f"file:        {path} ({pf.nbytes / 1e6:.1f} MB, format {FORMAT_NAME} "
        f"v{pf.format_version})")
    say(f"model:       {c.arch}, {c.n_layers} layers, d_model {c.d_model}, "
        f"{c.n_heads} heads / {c.n_kv_heads} KV heads of {c.head_dim}, "
        f"d_ff {c.d_ff}, vocab {c.vocab_size}, context {c.max_context}")
    encodings = pf.encodings()
    kept = ", ".join(f"{n} as {e}" for e, n in sorted(
        Counter(encodings.values()).items())) if encodings else ""
    # what the file holds, not the pack's option (a source's 5-bit embedding keeps its 5)
    held = ", ".join(f"{what} {layouts[name][0].upper() if name in layouts else 'float'}"
                     for what, name in (("embeddings", "embed.weight"), ("head", "lm_head.weight"))
                     if name in pf.infos)
    say(f"quant:       {quant.get('scheme', 'none')}, {held}, {len(layouts)} quantized tensors"
        + (f" ({kept}: the source's own blocks)" if kept else ""))
    cal = quant.get("calibration")
    if isinstance(cal, dict):
        cset = cal.get("set") if isinstance(cal.get("set"), dict) else {}
        head = cal.get("head") if isinstance(cal.get("head"), dict) else {}
        agree = head.get("top1_vs_float")
        line = (f"{cal.get('method', '?')} on {cset.get('sequences', '?')} x "
                f"{cset.get('seq_len', '?')} tokens ({cset.get('source', '?')}, sha256 "
                f"{str(cset.get('sha256', ''))[:12]})")
        if cal.get("bits_per_weight") is not None:
            line += f", bit budget {cal['bits_per_weight']}"
        cs = cal.get("channel_scaling")
        if isinstance(cs, dict):
            line += (f"; channel scaling on {cs.get('scaled', '?')} of {cs.get('sites', '?')} "
                     f"sites (mean alpha {cs.get('mean_alpha', '?')})")
        patch = head.get("patch") if isinstance(head.get("patch"), dict) else None
        if isinstance(agree, dict):  # fractions (a hand-made 10**400 has no float to show)
            shown = str(head.get("layout", "?")) + (
                f" + patch of {patch.get('rows', '?')} rows" if patch else "")
            line += f"; head {shown} top-1 " + ", ".join(
                f"{k} {v:.1%}" for k, v in agree.items()
                if isinstance(v, (int, float)) and abs(v) <= 1)
        say(f"calibration: {line}")
    vocab = pf.json_object("vocab", None) if "vocab" in meta else None
    if isinstance(vocab, dict):
        from .pack import vocab_summary

        try:
            say(f"vocabulary:  {vocab_summary(vocab).split(': ', 1)[1]}")
        except (KeyError, TypeError, ValueError, ArithmeticError):  # overflow: 10**400 pieces
            say("vocabulary:  trimmed (record unreadable)")
    adapter = pf.json_object("adapter", None) if "adapter" in meta else None
    if isinstance(adapter, dict):
        nbytes = sum(i.end - i.start for n, i in pf.infos.items()
                     if n.endswith((".lora_a", ".lora_b")))
        say(f"adapters:    LoRA rank {adapter.get('rank', '?')} (alpha "
            f"{adapter.get('alpha', '?')}) beside {adapter.get('weights', '?')} weights, "
            f"float16, {nbytes / 1e6:.1f} MB, added at run time")
    known = {k: prov.get(k, "unknown") for k in ("source_file", "source_format",
                                                   "source_sha256", "packed_at",
                                                   "pocketlm_version")}
    if prov.get("untrimmed_sha256"):  # a trimmed model: its source_sha256 is a derived id
        known["source_sha256"] = prov["untrimmed_sha256"]
    say(f"source:      {known['source_file']} ({known['source_format']}, sha256 "
        f"{str(known['source_sha256'])[:16]}...)")
    say(f"packed:      {known['packed_at']} by pocketlm {known['pocketlm_version']}")
    say(f"template:    {'yes' if pf.text('chat_template') else 'none'}")
    say(f"generation:  {json.dumps(generation, sort_keys=True)}")
    say(f"header:      {pf.header_status}")
    say(f"checksums:   {'verified' if args.verify else 'not verified (--no-verify)'}")
    if args.tensors:
        for name, info in pf.infos.items():
            if not name.startswith("_pad."):
                say(f"  {name:<40} {info.dtype:<4} {list(info.shape)}")
    return 0


def _finite(value):
    """``value`` with every float that is not finite replaced by None (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _load(args):
    import pocketlm
    from pocketlm.api import context_note

    model = model_or_default(args.model)
    t0 = time.time()
    with _exit_on_sigterm():  # a pull or pack on first use: no download or temp file left
        m = pocketlm.load(model, n_ctx=args.ctx, quiet=False)
    note = context_note(m, args.ctx)
    if note:
        print(note, file=sys.stderr)
    if args.verbose:
        print(f"[loaded {model} in {time.time() - t0:.2f} s]", file=sys.stderr)
    return m


def _settings(args, m) -> dict:
    """The generation arguments of ``m.chat``/``m.stream``: each flag given, else the model's
    generation default, else the built-in one (``args.n_default`` tokens)."""
    s = m.settings(args.n_default, max_tokens=args.n, temperature=args.temp, top_p=args.top_p,
                   top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repeat_penalty)
    return {**s, "seed": args.seed}


def _check_generation_flags(args) -> None:
    """The sampling flags given, checked before a model is loaded (or pulled and packed):
    the same rules, and words, as when they reach the model."""
    from .api import check_context_flag
    from .errors import SamplingError
    from .sampling import SamplingParams

    check_context_flag(args.ctx)
    if args.n is not None and args.n < 0:
        raise SamplingError(f"--max-tokens must be a non-negative integer, got {args.n}")
    given = {"temperature": args.temp, "top_k": args.top_k, "top_p": args.top_p,
             "min_p": args.min_p, "repetition_penalty": args.repeat_penalty, "seed": args.seed}
    flags = {"temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p",
             "min_p": "--min-p", "repetition_penalty": "--repeat-penalty", "seed": "--seed"}
    SamplingParams(**{k: v for k, v in given.items() if v is not None}).validate(names=flags)


def cmd_run(args) -> int:
    _check_generation_flags(args)
    prompt = " ".join(args.prompt) if args.prompt else None
    if prompt == "-" or (prompt is None and sys.stdin is not None and not sys.stdin.isatty()):
        from .textfile import read_stdin_text

        prompt = read_stdin_text("prompt")
    elif prompt is not None:
        prompt = checked_text(prompt, "the prompt")
    if not prompt:
        raise PocketError("no prompt given: pocket run \"your prompt\" (or pipe text on stdin)")
    m = _load(args)
    speculative = _speculative(args)
    if speculative is not None:
        _check_drafter(m, speculative)  # a bad drafter fails here, before the prompt runs
    constrain = _constrain(args)
    if constrain:
        m.constraint(**constrain)  # a bad schema, regex or grammar fails here
    m.last_speculative = None
    t0 = time.perf_counter()
    use_chat = not args.raw and bool(m.chat_template)
    if args.chat and not m.chat_template:
        raise PocketError("--chat: this model has no chat template")
    if use_chat:
        if args.echo:
            sys.stdout.write(prompt + "\n")
        pieces = m.chat([{"role": "user", "content": prompt}], stream=True, stop=args.stop,
                        speculative=speculative, **constrain, **_settings(args, m))
    else:
        sys.stdout.write(prompt if args.echo else "")
        pieces = m.stream(prompt, stop=args.stop, speculative=speculative, **constrain,
                          **_settings(args, m))
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    state = m.last_state
    if args.verbose and state is not None:
        print(f"[{state.prompt_tokens} prompt tokens, {_speed_line(state, t0)}, finish: "
              f"{state.finish_reason}{_speculative_line(m)}]", file=sys.stderr)
    return 0


CHAT_COMMANDS = ("/reset clears the conversation (the --system message stays), /quit, /exit "
                 "or /bye (or Ctrl-D) leaves; a line that begins with // is sent with one /")


class _LineTooLong(Exception):
    pass


def _chat_lines(limit: int):
    """The chat's input lines, without their line ends. On a terminal ``input()`` reads them
    (with line editing where Python has readline, and the prompt on the terminal); piped in,
    they are read with no prompt, each at most ``limit`` characters (a longer one is
    :class:`_LineTooLong` once its rest has been skipped, instead of growing without bound;
    input with no line end in 64 times that, such as /dev/zero, is no text of lines: a
    :class:`PocketError`), and undecodable bytes reach the
    caller as lone surrogates in their own line (a strict decoder dropped the whole buffered
    chunk, lines before and after the bad one)."""
    stdin = sys.stdin
    if stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing, and lines beyond the terminal's 4095)
        tty_out = sys.stdout.isatty()
        while True:
            if tty_out:
                yield input(">>> ")
            else:  # the answers go to a file: the prompt goes where the user looks
                sys.stderr.write(">>> ")
                sys.stderr.flush()
                yield input()
    if hasattr(stdin, "reconfigure"):
        stdin.reconfigure(errors="surrogateescape")
    while True:
        line = stdin.readline(limit + 2)  # the line, its "\r\n", and one more: too long
        if not line:
            return
        if len(line.rstrip("\r\n")) > limit:
            skipped = len(line)
            while line and not line.endswith("\n"):
                line = stdin.readline(1 << 16)
                skipped += len(line)
                if skipped > 64 * limit:
                    raise PocketError(f"stdin holds no line end in {skipped:,} characters: "
                                      "pocket chat reads one message a line")
            yield _LineTooLong()
            continue
        yield line.removesuffix("\n").removesuffix("\r")


def cmd_chat(args) -> int:
    _check_generation_flags(args)  # a bad flag is one error and exit 1, not one per turn
    if sys.stdin is None:  # started with it closed (`<&-`): input() has nothing to read
        raise PocketError("stdin is closed: pocket chat reads its lines there (use pocket run "
                          "\"PROMPT\" for one answer)")
    if sys.stderr is None:  # started with it closed (`2>&-`): input() refuses to run
        import os

        sys.stderr = open(os.devnull, "w")  # noqa: SIM115  (for the process's life)
    m = _load(args)
    if not m.chat_template:
        raise PocketError("this model has no chat template, so pocket chat cannot frame a "
                          "conversation; use pocket run \"PROMPT\" to continue text")
    speculative = _speculative(args)
    if speculative is not None:
        _check_drafter(m, speculative)  # a bad drafter fails here, before the first line
    constrain = _constrain(args)
    if constrain:
        m.constraint(**constrain)  # a bad schema, regex or grammar fails here
    history: list[dict] = []
    if args.system is not None:  # an empty one too: it replaces a template's default
        history.append({"role": "system", "content": checked_text(args.system, "--system")})
    base = list(history)
    tty = sys.stdin.isatty()
    print(f"pocket chat: {model_or_default(args.model)}  (/reset clears the conversation, "
          "/quit or Ctrl-D leaves)", file=sys.stderr)
    limit = max(1 << 16, 64 * m.n_ctx)
    lines = _chat_lines(limit)
    while True:
        try:
            line = next(lines)
        except StopIteration:
            return 0
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            if not tty:
                raise
            # on a terminal it leaves nothing: a Ctrl-C meant for an answer that had just
            # ended would throw the conversation away
            print("\n(Ctrl-C stops an answer; /quit or Ctrl-D leaves)", file=sys.stderr)
            lines = _chat_lines(limit)
            continue
        except UnicodeDecodeError as exc:  # a terminal in a strict locale: this line only
            print(f"pocket: error: that line is not UTF-8 text (byte 0x{exc.object[exc.start]:02x}"
                  f"); use UTF-8", file=sys.stderr)
            lines = _chat_lines(limit)
            continue
        if isinstance(line, _LineTooLong):
            print(f"pocket: error: that line is longer than {limit:,} characters, more than "
                  f"the context of {m.n_ctx:,} tokens could hold; it was not sent",
                  file=sys.stderr)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit", "/bye"):
            return 0
        if text == "/reset":
            history = list(base)
            print("[conversation cleared]", file=sys.stderr)
            continue
        if text.startswith("//"):
            line = line.replace("//", "/", 1)
        elif text.startswith("/"):
            word = text.split()[0]
            if word in ("/quit", "/exit", "/bye", "/reset"):
                print(f"[not sent: {word} takes nothing after it]", file=sys.stderr)
            elif text not in ("/help", "/?"):
                print(f"[not sent: {word[:40]} is no command]", file=sys.stderr)
            print(f"[{CHAT_COMMANDS}]", file=sys.stderr)
            continue
        try:
            line = checked_text(line, "that line")
        except PocketError as exc:
            print(f"pocket: error: {exc}", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        reply = []
        t0 = time.perf_counter()
        m.last_speculative = None
        stopped = False
        try:
            for piece in m.chat(history, stream=True, speculative=speculative, **constrain,
                                **_settings(args, m)):
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            stopped = True
        except PocketError as exc:
            history.pop()
            hint = ""
            if (isinstance(exc, ContextLengthError) and len(history) > len(base)
                    and len(m.tokenize(line)) < m.n_ctx // 2):
                hint = " (the conversation fills the context: /reset starts a new one)"
            print(f"\npocket: error: {exc}{hint}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        state = m.last_state
        if args.verbose and state is not None:
            finish = "stopped (Ctrl-C)" if stopped else state.finish_reason
            print(f"[{state.prompt_tokens} prompt tokens, {_speed_line(state, t0)}, finish: "
                  f"{finish}{_speculative_line(m)}]", file=sys.stderr)
        history.append({"role": "assistant", "content": "".join(reply)})


def cmd_bench(args) -> int:
    from .bench import bench, format_table, memory_breakdown

    def progress(engine, run, sample):
        if args.verbose:
            print(f"[{engine} run {run + 1}: prefill {args.n_prompt / sample['prefill_s']:.1f} "
                  f"tok/s, decode {args.n_gen / sample['decode_s']:.1f} tok/s]", file=sys.stderr)

    plot = None
    if args.plot is not None:  # an empty or unwritable path fails now, not after the benchmark
        from .export import check_replaceable

        plot = check_replaceable(args.plot, "--plot", "an SVG picture", lambda head: (
            head.lstrip().startswith((b"<svg", b"<?xml"))))
    threads = args.threads
    if threads is None:  # POCKET_THREADS (checked with the other engine settings), else 2
        from .runtime.settings import EngineSettings

        threads = EngineSettings.from_env().threads or 2
    with _exit_on_sigterm():  # the workers are closed and a first-use pack cleans up
        results = bench(model_or_default(args.model), threads=threads,
                        n_prompt=args.n_prompt, n_gen=args.n_gen, runs=args.runs, vs=args.vs,
                        gguf=args.gguf, mnn=args.mnn, watts_per_core=args.watts_per_core,
                        progress=progress, compare=args.compare,
                        speculative=args.speculative, draft_max=args.draft_max)
    if args.json:
        for r in results:
            print(r.to_json())
    else:
        print(format_table(results))
        if args.verbose:
            print()
            print(memory_breakdown(results))
    if plot is not None:
        from .bench.plot import to_svg
        from .export import atomic_file

        with atomic_file(plot) as tmp:
            tmp.write_text(to_svg(results), encoding="utf-8")
        print(f"[picture written to {args.plot}]", file=sys.stderr)
    return 0


# -- parser ----------------------------------------------------------------------------------
def _add_model_args(p: argparse.ArgumentParser, *, n_default: int) -> None:
    # generation flags left out take the model's own default (its deploy file's), else these
    p.set_defaults(n_default=n_default)
    p.add_argument("-m", "--model", help="registry name, .pocket, .gguf, HF folder or training run "
                   "(default: $POCKET_MODEL or smollm2-135m)")
    p.add_argument("-n", "--max-tokens", dest="n", type=int, default=None,
                   help=f"tokens to generate at most (default: the model's, else {n_default})")
    p.add_argument("--temp", "--temperature", type=float, default=None, help="temperature; 0 = greedy "
                   "(default: the model's, else 0)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens, 0 = "
                   "off (default: the model's, else 0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass, 0 to 1 "
                   "(default: the model's, else 1)")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens below min-p x the top "
                   "probability after temperature (default: the model's, else 0)")
    p.add_argument("--repeat-penalty", type=float, default=None, help="repetition penalty over "
                   "the prompt and the answer, 1 = off (default: the model's, else 1)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--ctx", type=int, default=None, help="context size (default 4096, or the "
                   "model's if smaller)")
    p.add_argument("-v", "--verbose", action="store_true", help="print load time and speed")
    p.add_argument("--speculative", metavar="lookup|MODEL", default=None,
                   help="speculative decoding: 'lookup' drafts from n-grams of the prompt and "
                   "the text so far (fast on tasks that copy their input: extract, rewrite, "
                   "summarize); a model name or file drafts with that smaller model of the same "
                   "vocabulary. The same tokens as without it; -v prints the acceptance")
    p.add_argument("--draft-max", type=int, default=None, metavar="N",
                   help="with --speculative: draft at most N tokens per step (1-16, default 8; "
                   "fewer as acceptance falls)")


def _add_constraint_args(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE|JSON", default=None,
                       help="constrain the output to this JSON Schema (a file, or the schema "
                       "itself): it always parses and validates (docs/structured.md)")
    group.add_argument("--regex", metavar="REGEX", default=None,
                       help="constrain the output to match this regular expression (Rust regex "
                       "syntax, whole output)")
    group.add_argument("--grammar", metavar="FILE", default=None,
                       help="constrain the output to this grammar: a Lark file (start rule "
                       "'start'), or GBNF (rules with ::=, start rule 'root')")


def _constrain(args) -> dict:
    """The ``json_schema`` / ``regex`` / ``grammar`` argument from the flags ({} for none)."""
    schema = getattr(args, "json_schema", None)
    if schema is not None:
        schema = checked_text(schema, "--json-schema")
        text = schema.strip()
        if not text.startswith(("{", "[")) and text not in ("true", "false"):
            text = _read_flag_file(schema, "--json-schema")
        try:
            return {"json_schema": json.loads(text)}
        except ValueError as e:
            raise PocketError(f"--json-schema: not valid JSON ({e})") from None
        except RecursionError:
            raise PocketError("--json-schema: nested too deeply to read") from None
    if getattr(args, "regex", None) is not None:
        return {"regex": checked_text(args.regex, "--regex")}
    if getattr(args, "grammar", None) is not None:
        return {"grammar": _read_flag_file(checked_text(args.grammar, "--grammar"), "--grammar")}
    return {}


def _read_flag_file(path: str, flag: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise PocketError(f"{flag}: {path!r} is not a file" + (
            "" if flag == "--grammar" else " (nor JSON text starting with '{')"))
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise PocketError(f"{flag}: {path} is not UTF-8 text") from None
    except OSError as e:
        raise PocketError(f"{flag}: cannot read {path}: {e.strerror}") from None


def _speculative(args):
    """The ``speculative`` argument of ``m.chat``/``m.stream`` from --speculative/--draft-max."""
    spec = getattr(args, "speculative", None)
    if spec is None:
        if getattr(args, "draft_max", None) is not None:
            raise PocketError("--draft-max applies with --speculative (lookup or a draft model)")
        return None
    spec = checked_text(spec, "--speculative").strip()
    if not spec:
        raise PocketError("--speculative needs 'lookup' or a draft model")
    from .speculative import DEFAULT_MAX_DRAFT, MAX_DRAFT

    n = DEFAULT_MAX_DRAFT if args.draft_max is None else args.draft_max
    if not 1 <= n <= MAX_DRAFT:
        raise PocketError(f"--draft-max must be from 1 to {MAX_DRAFT}, got {n}")
    if spec == "lookup":
        return {"method": "lookup", "max_draft": n}
    return {"draft": spec, "max_draft": n}


def _check_drafter(m, speculative: dict) -> None:
    """Build the drafter once, so a bad one fails before any text; a draft model that does not
    exist is named as the flag that gave it."""
    if "draft" in speculative:
        from .registry import resolve

        try:
            resolve(speculative["draft"])
        except ModelNotFoundError as e:
            raise ModelNotFoundError(f"--speculative: {e} (prompt lookup is --speculative "
                                     "lookup)") from None
    m._drafter(speculative)


def _speed_line(state, t0: float) -> str:
    """``-v``'s timing of one answer begun at ``t0`` (perf_counter): the time to the first
    token (template, tokenizing and prefill) and the decode speed after it, as `pocket bench`
    counts them (tokens after the first over the time after it)."""
    n, end = len(state.generated), time.perf_counter()
    first = state.first_token_at
    if not n or first is None:
        return f"0 generated in {end - t0:.2f} s"
    line = f"{n} generated in {end - t0:.2f} s: first token after {first - t0:.2f} s"
    if n > 1 and end > first:
        line += f", then {(n - 1) / (end - first):.1f} tok/s"
    return line


def _speculative_line(m) -> str:
    st = m.last_speculative
    if st is None:
        return ""
    return (f", speculative: {st.accepted}/{st.drafted} drafts accepted "
            f"({st.acceptance:.0%}), {st.tokens_per_step:.2f} tokens per pass")


def add_precision_options(parser: argparse.ArgumentParser) -> None:
    """``--all-int4`` / ``--keep-precision`` on an argparse parser, into ``keep_precision``
    (None when neither is given: the default policy of :mod:`pocketlm.pack`)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--all-int4", dest="keep_precision", action="store_const", const=False,
                       help="requantize every linear weight to INT4, also those a GGUF holds "
                       "above 4 bits (by default Q5_0/Q5_1 stay exact in INT5 and Q5_K/Q6_K/"
                       "Q8_0 go to INT8): the smallest file, below the source's quality")
    group.add_argument("--keep-precision", dest="keep_precision", action="store_const",
                       const=True, help="also keep float weights (F16, BF16, F32) above 4 "
                       "bits, in INT8: a larger file")


def add_calibration_options(parser: argparse.ArgumentParser) -> None:
    """``--calib``, ``--bits-per-weight``, ``--quant-method`` and ``--awq`` (docs/quantization.md),
    shared by pack, export and finetune --export."""
    parser.add_argument("--calib", metavar="FILE", help="calibrate the quantization on FILE "
                        "(UTF-8 text from the app; 'default': the built-in zh + en + code set): "
                        "activation statistics from the runtime, then GPTQ rounding of every "
                        "requantized tensor")
    parser.add_argument("--bits-per-weight", metavar="B", help="choose each tensor's layout "
                        "(INT4 / INT5 / INT8, group 32-128, INT4 with 8-bit coded scales, or "
                        "the source's own grid) by "
                        "measured sensitivity to average B bits per weight over the quantized "
                        "tensors, scales included (4.25-8; 'source': no larger than the source "
                        "GGUF); calibrates on the default set unless --calib is given")
    parser.add_argument("--head-patch", metavar="ROWS", default=None,
                        help="with --bits-per-weight, when the output head is rounded to INT4: "
                        "'off' (default) keeps no patch; 'auto' keeps its most used rows also "
                        "in INT8, as many as bring the top-1 agreement with the float head to "
                        "99.5 %% on held-back calibration text and fit the budget (their "
                        "bytes come from the other tensors); a number asks for that many rows "
                        "(refused if the budget cannot hold them)")
    parser.add_argument("--quant-method", choices=("rtn", "act", "gptq"), default=None,
                        help="how calibrated tensors are rounded (default gptq)")
    parser.add_argument("--awq", action="store_true",
                        help="activation-aware channel scaling before rounding: each input "
                        "channel's scale is searched on the calibration statistics and folded "
                        "into the norm or matrix before it (docs/quantization.md); calibrates "
                        "on the default set unless --calib is given")


def add_vocab_options(parser: argparse.ArgumentParser) -> None:
    """``--vocab``, ``--vocab-corpus``, ``--vocab-rule``, ``--vocab-size`` and
    ``--vocab-backfill`` (docs/vocabulary.md)."""
    parser.add_argument("--vocab", metavar="LANGS", help="trim the vocabulary to these "
                        "languages (comma-separated: en, zh): text in them tokenizes exactly as "
                        "before, the embedding and head shrink; other text still encodes, in "
                        "smaller pieces or bytes")
    parser.add_argument("--vocab-corpus", metavar="FILE", help="also keep every piece the "
                        "model's tokenizer produces on FILE (UTF-8 text from the app)")
    parser.add_argument("--vocab-rule", choices=("corpus", "script"), default=None,
                        help="corpus (default): the pieces produced on the languages' "
                        "built-in corpora (smaller); script: every piece written only in the "
                        "languages' scripts, digits and punctuation (exact on any such text)")
    parser.add_argument("--vocab-size", metavar="N", type=int, default=None,
                        help="keep at most N pieces, the most frequent on the corpus first "
                        "(the pieces tokenization needs are always kept)")
    parser.add_argument("--vocab-backfill", metavar="Q", type=float, default=None,
                        help="corpus rule: also keep the languages' pieces the corpus missed "
                        "that the source ranks ahead of the share Q of the pieces it produced "
                        "(default 0.95; 0: only the produced pieces, the smallest set)")


def vocab_spec(args):
    """The :class:`pocketlm.vocab.VocabSpec` of :func:`add_vocab_options`' flags (None: no
    trimming), checked before any work."""
    if args.vocab is None and args.vocab_corpus is None:
        for flag, value in (("--vocab-rule", args.vocab_rule), ("--vocab-size", args.vocab_size),
                            ("--vocab-backfill", args.vocab_backfill)):
            if value is not None:
                raise PocketError(f"{flag} needs --vocab LANGS (or --vocab-corpus FILE)")
        return None
    from .vocab import DEFAULT_BACKFILL, VocabSpec, parse_languages

    if args.vocab_backfill is not None and (args.vocab_rule == "script" or args.vocab is None):
        raise PocketError("--vocab-backfill applies to the corpus rule with --vocab LANGS (the "
                          "languages whose pieces it fills in)")
    return VocabSpec(languages=parse_languages(args.vocab) if args.vocab is not None else (),
                     rule=args.vocab_rule or "corpus", corpus=args.vocab_corpus,
                     size=args.vocab_size,
                     backfill=(DEFAULT_BACKFILL if args.vocab_backfill is None
                               else args.vocab_backfill))


def calibration_kwargs(args) -> dict:
    """The pack() arguments of :func:`add_calibration_options`' flags, checked first (a bad
    budget, or a calibration file that is missing, empty, binary or not UTF-8, is refused
    before any work: before training, for finetune --export)."""
    from .calibdata import check_text_file
    from .calibrate import check_bits_per_weight

    if args.bits_per_weight is not None:
        check_bits_per_weight(args.bits_per_weight)
    if args.calib is not None and args.calib != "default":
        check_text_file(args.calib)
    head_patch = args.head_patch
    if head_patch is not None:
        from .calibrate import check_head_patch_option

        head_patch = check_head_patch_option(head_patch)
        if head_patch != 0 and args.bits_per_weight is None:
            raise PocketError("--head-patch needs --bits-per-weight: a patch is part of a "
                              "bit budget's INT4 head")
    return {"calib": args.calib, "bits_per_weight": args.bits_per_weight,
            "quant_method": args.quant_method, "awq": args.awq, "head_patch": head_patch}


class _Parser(argparse.ArgumentParser):
    """Usage errors are user errors too: one line, exit code 1."""

    def error(self, message: str):
        self.exit(1, f"pocket: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from .bench import VS_ENGINES

    parser = _Parser(
        prog="pocket", description="Run, pack, inspect, benchmark and train app-native small language models.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("-v", "--verbose", dest="version_verbose", action="store_true",
                        help="with --version: also what `pocket doctor` reports")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = sub.choices  # each command's parser, by name

    p = sub.add_parser("run", help="generate text from a prompt (streams to stdout)",
                       description="Generate text from a prompt, streaming to stdout. A model "
                       "with a chat template gets the prompt as a user message (what instruct "
                       "models expect); --raw continues the text as given.")
    p.add_argument("prompt", nargs="*", help="the prompt ('-' or piped stdin reads it; words "
                   "given unquoted are joined by spaces)")
    _add_model_args(p, n_default=128)
    _add_constraint_args(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--chat", action="store_true",
                      help="require the chat template (the default when the model has one)")
    mode.add_argument("--raw", action="store_true",
                      help="continue the prompt as plain text, without the chat template")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--echo", action="store_true", help="print the prompt before the output")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="interactive chat with the model's chat template",
                       description="Chat with a model through its chat template, line by line "
                       "(typed, or piped in: one message per line). Each answer streams as it "
                       "is generated; Ctrl-C stops it and keeps what was said.",
                       epilog=f"in the chat: {CHAT_COMMANDS}. The whole conversation is sent "
                       "each turn; when it no longer fits --ctx, the line is refused (nothing "
                       "is cut) and /reset starts a new one.")
    _add_model_args(p, n_default=512)
    _add_constraint_args(p)
    p.add_argument("--system", help="system message")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="prefill/decode speed, peak memory, size and energy, "
                       "optionally side by side with llama.cpp and MNN",
                       description="Benchmark a model with the MNN-Pocket methodology: a fixed "
                       "prompt of --n-prompt tokens, --n-gen greedy tokens with EOS ignored, 1 "
                       "warm-up and --runs measured runs (median, min, max), each engine in its "
                       "own process for its peak-memory delta, engines alternating run by run.")
    p.add_argument("-m", "--model", help="registry name, .pocket, .gguf, HF folder or "
                   "training run")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default $POCKET_THREADS, else 2)")
    p.add_argument("--n-prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--n-gen", type=int, default=128, help="generated tokens (default 128)")
    p.add_argument("--runs", type=int, default=5, help="measured runs (default 5)")
    p.add_argument("--vs", action="extend", nargs="+", choices=VS_ENGINES, metavar="ENGINE",
                   help="also run these engines on the same model, alternating: llama.cpp (the "
                   "GGUF), mnn (an MNN export, see --mnn)")
    p.add_argument("--compare", action="append", metavar="MODEL",
                   help="also run pocketlm on MODEL in the same run, alternating (a trimmed "
                   "variant against its source, another pack of the same model); repeatable")
    p.add_argument("--speculative", metavar="lookup|MODEL", default=None,
                   help="also run the model decoding speculatively (prompt lookup, or a draft "
                   "model of the same vocabulary), alternating with plain decoding; the "
                   "benchmark text is prose repeated to --n-prompt, so lookup drafts often hit: "
                   "see benchmarks/speculative.py for task prompts")
    p.add_argument("--draft-max", type=int, default=None, metavar="N",
                   help="with --speculative: draft at most N tokens per step (1-16, default 8)")
    p.add_argument("--gguf", help="the GGUF for --vs llama.cpp when -m is a .pocket file")
    p.add_argument("--mnn", metavar="DIR", help="the MNN export for --vs mnn (default: "
                   "$POCKET_HOME/mnn/NAME, written by scripts/export-mnn NAME)")
    p.add_argument("--watts-per-core", type=float, default=3.0,
                   help="power of one busy core for the energy estimate without RAPL (default 3)")
    p.add_argument("--json", action="store_true", help="one JSON line per engine")
    p.add_argument("--plot", metavar="FILE.svg", help="also draw the results as an SVG picture")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print every run and where memory goes")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("pull", help="fetch a registry model into $POCKET_HOME",
                       description="Fetch a registry model into $POCKET_HOME/models and check "
                       "its sha256. A model already there is used as it is while it is "
                       "unchanged since it was verified, and hashed again otherwise. A trimmed "
                       "model (NAME-zh-en) is built from its pulled source in minutes; a "
                       "recipe model (pocket-zh-en) is built by its recipe: it prints the "
                       "stages left and an estimate first, takes hours, and resumes where it "
                       "stopped when run again (docs/pocket-zh-en.md).")
    p.add_argument("name", help="registry name (see `pocket list`)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--force", action="store_true", help="fetch again even if present (a "
                      "recipe model: export it again from its run folder, or, when that folder "
                      "holds a run of an older version of the recipe, move that run aside and "
                      "build again, reusing its teacher answers where they still serve)")
    mode.add_argument("--verify", action="store_true", help="hash the pulled file again and "
                      "compare it with the registry's sha256 (exit 1 on a mismatch)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars (the path "
                   "is still printed)")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("list", help="list registry models",
                       description="List registry models. size: the file `pocket pull` "
                       "leaves (the GGUF it downloads; for a trimmed or recipe model, the "
                       "deploy file it builds). pulled: yes (verified against the registry's "
                       "sha256 and unchanged since; built for a recipe model), changed "
                       "(modified since it was verified), unverified (present, never "
                       "verified), no.")
    p.add_argument("--json", action="store_true", help="one JSON object per line (\"state\": "
                   "the pulled column; \"pulled\": true only for yes)")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("pack", help="quantize a GGUF/HF model into one .pocket file (INT4; a "
                       "GGUF's 5-8-bit tensors kept)")
    p.add_argument("src", help="GGUF file, Hugging Face folder or registry name")
    p.add_argument("-o", "--output", required=True, help="the .pocket file to write")
    p.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128),
                   help="INT4 group size (default 32)")
    p.add_argument("--embed-bits", type=int, default=8, choices=(4, 8),
                   help="bits of the token embedding and output head (default 8; a source "
                   "that holds them in Q4_0/Q4_1/Q4_K keeps its 4 bits, and one in Q5_0/Q5_1 "
                   "its 5 unless --all-int4, losslessly)")
    add_precision_options(p)
    add_calibration_options(p)
    add_vocab_options(p)
    p.add_argument("--list-tensors", action="store_true",
                   help="print every tensor's layout and errors (always with --bits-per-weight)")
    p.add_argument("--reproducible", action="store_true",
                   help="leave the packing time and how long calibration took out of the file, "
                   "so that the same source and options give the same bytes (the tensors are "
                   "the same either way)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.set_defaults(func=cmd_pack)

    p = sub.add_parser("inspect", help="print a .pocket file's header")
    p.add_argument("file", help="a .pocket file, or a registry name (its deploy file, as "
                   "`pocket run -m NAME` uses it)")
    p.add_argument("--json", action="store_true", help="the header as one JSON object")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the checksum verification")
    p.set_defaults(func=cmd_inspect)

    from .train.cli import add_commands  # train, export, tokenizer, data, distill-data

    add_commands(sub)
    from .evaluate.cli import add_commands as add_eval_commands

    add_eval_commands(sub)
    from .server.cli import add_commands as add_serve_commands

    add_serve_commands(sub)
    from .doctor import add_command as add_doctor_command

    add_doctor_command(sub)
    return parser


def cmd_version(args) -> int:
    """``--version`` (``-v``: with the doctor's report); exits like argparse's version action."""
    text = f"pocketlm {__version__}"
    if args.version_verbose:
        from .doctor import format_text, report

        text = format_text(report())
    print(text)
    raise SystemExit(0)


@contextlib.contextmanager
def _sigint_blocked():
    """SIGINT held back (then delivered) meanwhile: threads started meanwhile (numpy's BLAS
    pool starts one at import) inherit the block, so a terminal's Ctrl-C always reaches the
    main thread. Taken by a thread that only notes it for Python, it left ``pocket chat``
    sitting in its read of the next line until Enter."""
    import signal

    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def main(argv: list[str] | None = None) -> int:
    try:  # building the parser imports the subcommands' modules (numpy, the engine): ~0.5 s
        with _sigint_blocked():
            parser = build_parser()
    except KeyboardInterrupt:
        print("\npocket: interrupted", file=sys.stderr)
        return 130
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the command's own parser, so the hint is its --help
        where = parser.commands.get(args.command, parser)
        where.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.version:
        args.func = cmd_version
    elif not args.command:
        parser.print_help()
        return 1
    if sys.stdout is None:  # started with its standard output closed (`>&-`): print() drops all
        if sys.stderr is not None:
            print("pocket: error: standard output is closed; redirect it to a file or "
                  "/dev/null instead (`> /dev/null`)", file=sys.stderr)
        return 1
    try:
        return args.func(args)
    except PocketError as exc:
        if args.debug:
            raise
        print(f"pocket: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\npocket: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as exc:  # unreadable files, full disks: user-fixable, one line
        if args.debug:
            raise
        import errno

        what = exc.strerror or str(exc)
        if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            what = f"the disk is full ({what}); free some space and try again"
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"pocket: error: {where}{what}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
