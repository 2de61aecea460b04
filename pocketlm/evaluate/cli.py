"""``pocket eval``: perplexity of a text file, or accuracy on a task file or bundled recipe.

Registered by :func:`add_commands` on the main parser.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from ..errors import PocketError, refuse_empty

EVAL_EPILOG = """examples:
  pocket eval -m qwen2.5-0.5b --suite pocket
  pocket eval -m smollm2-135m --suite pocket --limit 20 --predictions run.jsonl
  pocket eval -m qwen2.5-0.5b --suite pocket --precision float --tasks cloze-zh,humaneval
  pocket eval -m smollm2-135m --ppl notes.txt
  pocket eval -m model.pocket --task sentiment-zh --limit 200 --json
  pocket eval -m smollm2-135m --task gsm8k --shots 5 --limit 50
  pocket eval -m smollm2-135m --task my_task.yaml --engine llama.cpp
  pocket eval --list-tasks

TASK is a task file (YAML/JSON with a header and examples, or JSONL whose first line is
{"task": {...}}) or a recipe name: """

SUITE_EPILOG = """

--suite pocket runs the capability suite (docs/capability.md): one table, one row per ability,
with a 95% confidence interval; --suite published runs the tasks in the formulations of the
models' own reports (MMLU cloze, HumanEval in the chat template), to set scores against
theirs. --predictions FILE writes each scored example; the same command with the same FILE
resumes an interrupted run. Suites: """


def add_commands(sub: argparse._SubParsersAction) -> None:
    from .recipes import RECIPES
    from .suite import SUITES

    p = sub.add_parser("eval", help="perplexity and task accuracy of a model",
                       description="Perplexity of a text (sliding window) or accuracy on a "
                       "task: multiple choice and classification by the log-likelihood of each "
                       "candidate, generation by greedy decoding and exact match.",
                       epilog=EVAL_EPILOG + ", ".join(RECIPES) + SUITE_EPILOG
                       + ", ".join(SUITES),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", help="registry name, .pocket, .gguf or HF folder")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--ppl", metavar="FILE", help="UTF-8 text file to score ('-': stdin)")
    what.add_argument("--task", metavar="TASK", help="task file or recipe name")
    what.add_argument("--suite", metavar="NAME", help="run a capability suite (pocket, published)")
    what.add_argument("--list-tasks", action="store_true", help="list the bundled recipes")
    p.add_argument("--tasks", metavar="A,B", help="--suite: only these of its tasks")
    p.add_argument("--limit", type=int, help="score at most N examples (0: all; --suite: "
                   "instead of each task's fixed subset)")
    p.add_argument("--precision", choices=("int4", "float"), default="int4",
                   help="int4: the default deploy pack (default); float: the source's "
                   "dequantized float32 weights, the reference (--engine pocketlm)")
    p.add_argument("--shots", type=int, help="few-shot examples (default: the task's)")
    p.add_argument("--seed", type=int, help="seed for drawing few-shot examples from the "
                   "task's fewshot pool")
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
                   help="also write each scored example and its prediction here (--suite: "
                   "resumes from what FILE holds)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.set_defaults(func=cmd_eval)


def _open_engine(args):
    from .tasks import LlamaCppEngine, PocketEngine

    if not args.model:
        raise PocketError("pocket eval needs a model: -m NAME_OR_PATH")
    # a --ppl window longer than the default context loads a context that holds it (capped at
    # the model's own, which perplexity() then names), as --n-ctx would
    n_ctx = args.n_ctx
    if n_ctx is None and getattr(args, "ppl", None) and args.window is not None:
        n_ctx = args.window
    if args.engine == "llama.cpp":
        from ..formats import sniff
        from ..registry import resolve

        path = resolve(args.model, quiet=args.json)
        if sniff(path) != "gguf":
            raise PocketError(f"--engine llama.cpp runs GGUF files; {args.model} is not one "
                              "(a trimmed model or deploy file runs with --engine pocketlm)")
        return LlamaCppEngine(path, n_ctx=n_ctx)
    from ..api import context_note, load

    model = load(args.model, n_ctx=n_ctx, quiet=args.json, precision=args.precision)
    note = context_note(model, args.n_ctx, "--n-ctx")  # as pocket run says it of --ctx
    if note:
        print(note, file=sys.stderr)
    return PocketEngine(model)


def _read_text(spec: str) -> tuple[str, str]:
    from ..textfile import read_stdin_text, read_text_file

    if spec == "-":
        return read_stdin_text("text to score"), "<stdin>"

    path = Path(spec)
    text = read_text_file(path)
    return text, str(path)


def cmd_eval(args) -> int:
    from ..cli import _exit_on_sigterm

    with _exit_on_sigterm():  # SIGTERM: a --task run's temporary predictions file is removed
        return _eval(args)


def _eval(args) -> int:
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
    from ..api import check_context_flag

    check_context_flag(args.n_ctx, "--n-ctx")
    refuse_empty("--ppl", args.ppl, "a text file")
    refuse_empty("--task", args.task, "a name")
    refuse_empty("--suite", args.suite, "a name")
    if not args.ppl and not args.task and not args.suite:
        raise PocketError("pocket eval needs --ppl FILE, --task TASK (see --list-tasks) or "
                          "--suite pocket")
    for flag in ("limit", "shots", "n_ctx", "window", "stride"):
        value = getattr(args, flag)
        floor = 0 if flag in ("shots", "limit") else 1
        if value is not None and value < floor:
            raise PocketError(f"--{flag.replace('_', '-')} must be "
                              f"{'non-negative' if floor == 0 else 'positive'}")
    if args.tasks is not None and not args.suite:
        raise PocketError("--tasks names tasks of a suite; use it with --suite")
    if args.ppl:  # flags of task scoring: refused rather than silently ignored
        for flag in ("limit", "shots", "seed", "chat", "strict", "predictions"):
            value = getattr(args, flag)
            if value is not None and value is not False:
                raise PocketError(f"--{flag} does not apply to --ppl (it scores tasks)")
    elif args.window is not None or args.stride is not None:
        raise PocketError("--window and --stride apply to --ppl")
    if args.engine == "llama.cpp" and args.precision != "int4":
        # llama.cpp runs the GGUF as it is: the flag was ignored, and a suite's result and
        # predictions file still recorded "precision": "float"
        raise PocketError("--precision applies to --engine pocketlm; llama.cpp runs the GGUF's "
                          "own weights")
    if args.predictions is not None:
        refuse_empty("--predictions", args.predictions)
        from ..export import check_output

        # a folder, a FIFO (opening it would block) or an unwritable place: refused before the
        # model loads; an existing file is replaced (--suite resumes from it)
        check_output(args.predictions, force=True)
        if args.suite:  # only an earlier --suite run's file is resumed, never another cut
            from ..export import check_replaceable

            check_replaceable(args.predictions, "--predictions",
                              "a predictions file of pocket eval --suite",
                              lambda head: head.lstrip().startswith(b'{"run"'))
    if args.suite:
        return _cmd_suite(args)
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
    if args.seed is not None and (not task.fewshot or task.fewshot_group is not None):
        # the seed draws shots from a few-shot pool only: without one it changed nothing
        where = ("the other examples of each one's group" if task.fewshot_group is not None
                 else "its first examples")
        raise PocketError(f"--seed draws few-shot examples from a task's 'fewshot' pool; task "
                          f"{task.name} takes its shots from {where}, which no seed changes")
    if args.predictions:  # only an earlier --task run's file is replaced, never another
        from ..export import check_replaceable

        check_replaceable(args.predictions, "--predictions",
                          "a predictions file of pocket eval --task",
                          lambda head: head.lstrip().startswith(b'{"example"'))
    engine = _open_engine(args)
    with contextlib.ExitStack() as stack:
        sink = None
        if args.predictions:  # written beside it and renamed at the end: a run that fails
            from ..export import atomic_file  # leaves no half file, and the earlier one whole

            tmp = stack.enter_context(atomic_file(args.predictions))
            sink = stack.enter_context(open(tmp, "w", encoding="utf-8"))

        def record(index: int, example: dict, result: dict) -> None:
            if sink is not None:
                sink.write(json.dumps({"example": example, **result}, ensure_ascii=False)
                           + "\n")

        result = evaluate_task(engine, task, limit=args.limit or None, shots=args.shots,
                               seed=args.seed,
                               progress=not args.json, on_example=record)
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
        if "instructions_by_check" in result:
            print(f"loose {result['accuracy_loose']:.4f}; instruction-level "
                  f"{result['instruction_accuracy']:.4f}; by kind (passed/given): "
                  + ", ".join(f"{k} {v['passed']}/{v['given']}"
                              for k, v in result["instructions_by_check"].items()))
    return 0


def _cmd_suite(args) -> int:
    from .suite import Predictions, format_table, run_header, run_suite, suite_tasks

    for flag in ("ppl", "shots", "seed", "chat", "strict", "window", "stride"):
        value = getattr(args, flag)  # --shots 0 and --seed 0 are given too, not falsy
        if value is not None and value is not False:
            raise PocketError(f"--{flag} does not apply to --suite (its tasks fix their own)")
    only = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks is not None \
        else None
    if only == []:  # `--tasks ""` (an unset variable): not the whole suite, hours of it
        raise PocketError(f"--tasks names no task; give some of suite {args.suite}'s, "
                          f"comma-separated: {', '.join(t.key for t in suite_tasks(args.suite))}")
    suite_tasks(args.suite, only)  # an unknown suite or task fails before the model loads
    engine = _open_engine(args)
    run = run_header(args.model, args.precision, args.suite, engine.name, args.n_ctx)
    preds = Predictions(args.predictions, run) if args.predictions else None

    def finished(r: dict) -> None:
        if not args.json:
            lo, hi = r["ci95"]
            print(f"{r['task']}: {100 * r['accuracy']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] "
                  f"of {r['n']} ({r['seconds']:.0f} s)", file=sys.stderr)

    try:
        result = run_suite(engine, args.suite, limit=args.limit, only=only, predictions=preds,
                           progress=not args.json, on_task=finished)
    except KeyboardInterrupt:
        if preds is not None:
            print(f"\npocket: interrupted; the predictions so far are in {preds.path}: run "
                  "the same command again to resume", file=sys.stderr)
        raise
    finally:
        if preds is not None:
            preds.close()
    result = {"model": args.model, "precision": args.precision, "engine": engine.name,
              **result}
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        print(f"{args.model} ({args.precision}, {engine.name}): suite {args.suite} "
              f"v{result['suite_version']}, {result['seconds'] / 60:.1f} min")
        print(format_table(result))
    return 0
