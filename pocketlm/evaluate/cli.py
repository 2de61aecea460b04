"""``pocket eval``: perplexity of a text file, or accuracy on a task file or bundled recipe.

Registered by :func:`add_commands` on the main parser.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import PocketError

EVAL_EPILOG = """examples:
  pocket eval -m smollm2-135m --ppl notes.txt
  pocket eval -m model.pocket --task sentiment-zh --limit 200 --json
  pocket eval -m smollm2-135m --task gsm8k --shots 5 --limit 50
  pocket eval -m smollm2-135m --task my_task.yaml --engine llama.cpp
  pocket eval --list-tasks

TASK is a task file (YAML/JSON with a header and examples, or JSONL whose first line is
{"task": {...}}) or a recipe name: """


def add_commands(sub: argparse._SubParsersAction) -> None:
    from .recipes import RECIPES

    p = sub.add_parser("eval", help="perplexity and task accuracy of a model",
                       description="Perplexity of a text (sliding window) or accuracy on a "
                       "task: multiple choice and classification by the log-likelihood of each "
                       "candidate, generation by greedy decoding and exact match.",
                       epilog=EVAL_EPILOG + ", ".join(RECIPES),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", help="registry name, .pocket, .gguf or HF folder")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--ppl", metavar="FILE", help="UTF-8 text file to score ('-': stdin)")
    what.add_argument("--task", metavar="TASK", help="task file or recipe name")
    what.add_argument("--list-tasks", action="store_true", help="list the bundled recipes")
    p.add_argument("--limit", type=int, help="score at most N examples")
    p.add_argument("--shots", type=int, help="few-shot examples (default: the task's)")
    p.add_argument("--seed", type=int, help="seed for drawing few-shot examples")
    p.add_argument("--chat", action="store_true",
                   help="render each prompt as a user message with the model's chat template")
    p.add_argument("--strict", action="store_true",
                   help="refuse malformed JSONL lines instead of skipping them")
    p.add_argument("--window", type=int, help="--ppl: tokens per window (default min(context, "
                   "1024))")
    p.add_argument("--stride", type=int, help="--ppl: tokens between windows (default half "
                   "the window)")
    p.add_argument("--engine", default="pocketlm", choices=("pocketlm", "llama.cpp"),
                   help="pocketlm's runtime (default) or llama-cpp-python on the GGUF")
    p.add_argument("--n-ctx", type=int, help="context to load the model with")
    p.add_argument("--predictions", metavar="FILE.jsonl",
                   help="also write each scored example and its prediction here")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.set_defaults(func=cmd_eval)


def _open_engine(args):
    from .tasks import LlamaCppEngine, PocketEngine

    if not args.model:
        raise PocketError("pocket eval needs a model: -m NAME_OR_PATH")
    if args.engine == "llama.cpp":
        from ..registry import resolve

        return LlamaCppEngine(resolve(args.model, quiet=args.json), n_ctx=args.n_ctx)
    from ..api import load

    return PocketEngine(load(args.model, n_ctx=args.n_ctx, quiet=args.json))


def _read_text(spec: str) -> tuple[str, str]:
    if spec == "-":
        return sys.stdin.read(), "<stdin>"
    from ..textfile import read_text_file

    path = Path(spec)
    text = read_text_file(path)
    return text, str(path)


def cmd_eval(args) -> int:
    from .recipes import RECIPES, resolve_task
    from .tasks import evaluate_task, perplexity

    if args.list_tasks:
        for name, r in RECIPES.items():
            if args.json:
                print(json.dumps({"name": name, "package": r.source.package,
                                  "version": r.source.version, "license": r.source.license,
                                  "description": r.description}, ensure_ascii=False))
            else:
                print(f"{name:<14} {r.description}  [{r.source.package} {r.source.version}, "
                      f"{r.source.license.split(' ')[0]}]")
        return 0
    if not args.ppl and not args.task:
        raise PocketError("pocket eval needs --ppl FILE or --task TASK (see --list-tasks)")
    for flag in ("limit", "shots", "n_ctx", "window", "stride"):
        value = getattr(args, flag)
        if value is not None and value < (0 if flag == "shots" else 1):
            raise PocketError(f"--{flag.replace('_', '-')} must be "
                              f"{'non-negative' if flag == 'shots' else 'positive'}")
    if args.ppl:
        text, source = _read_text(args.ppl)
        engine = _open_engine(args)
        result = perplexity(engine, text, window=args.window, stride=args.stride,
                            progress=not args.json)
        result = {"model": args.model, "engine": engine.name, "file": source, **result}
        if args.json:
            print(json.dumps(result))
        else:
            print(f"{source}: perplexity {result['ppl']:.3f} per token "
                  f"({result['tokens']} tokens), {result['ppl_char']:.3f} per character, "
                  f"{result['bits_per_char']:.3f} bits/char ({result['chars']} chars; window "
                  f"{result['window']}, stride {result['stride']})")
        return 0

    def warn(message: str) -> None:
        print(f"pocket: warning: {message}", file=sys.stderr)

    task = resolve_task(args.task, strict=args.strict, warn=warn)
    if args.chat:
        task.chat = True
    engine = _open_engine(args)
    sink = open(args.predictions, "w", encoding="utf-8") if args.predictions else None  # noqa: SIM115

    def record(example: dict, result: dict) -> None:
        if sink is not None:
            sink.write(json.dumps({"example": example, **result}, ensure_ascii=False) + "\n")

    try:
        result = evaluate_task(engine, task, limit=args.limit, shots=args.shots, seed=args.seed,
                               progress=not args.json, on_example=record)
    finally:
        if sink is not None:
            sink.close()
    result = {**result, "model": args.model, "engine": engine.name, "chat": task.chat}
    if task.skipped:
        result["skipped_lines"] = task.skipped
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        line = (f"{task.name}: accuracy {result['accuracy']:.4f} ({result['correct']}/"
                f"{result['n']}")
        if "acc_norm" in result:
            line += f"; acc_norm {result['acc_norm']:.4f}"
        line += f"; {result['shots']}-shot; {result['examples_per_s']:.2f} examples/s)"
        print(line)
        if "predicted" in result:
            print("predicted: " + ", ".join(f"{k} {v}" for k, v in result["predicted"].items()))
    return 0
