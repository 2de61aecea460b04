"""The capability report: `pocket eval --suite pocket` per model and pack, recorded and drawn.

    python benchmarks/capability.py run -m qwen2.5-0.5b                 # default pack
    python benchmarks/capability.py run -m qwen2.5-0.5b --precision float
    python benchmarks/capability.py run -m smollm2-135m --limit 20       # a quick, smaller run
    python benchmarks/capability.py write            # docs/capability.md + docs/capability.svg
    python benchmarks/capability.py write --check    # exit 1 if they are out of date
    python benchmarks/capability.py compare A.jsonl B.jsonl    # two runs of the same items

`run` loads the model once, runs the suite (each scored example goes to a predictions file
under $POCKET_HOME/eval/runs, so an interrupted run resumes where it stopped), then, for a
deploy file, measures its decode speed and peak memory with `pocket bench` in a fresh process
(128-token prompt, 64 generated, median of 3), and appends one JSON line to
benchmarks/capability.jsonl: the command, model, pack, suite version, per-task and per-ability
accuracy with 95 % intervals, seconds, machine, threads and date.

`write` regenerates every block of docs/capability.md that opens with
`<!-- generated: capability KIND benchmarks/capability.jsonl -->` (KIND: abilities, tasks,
published) and ends with `<!-- end of generated block -->`, and draws docs/capability.svg: the
report's quadrant chart, ability against decode tok/s and against peak memory. The latest run
of each (model, pack, limit) is the one shown.

`compare` reads two predictions files (`pocket eval --suite ... --predictions FILE`, e.g. the
same model through pocketlm and through `--engine llama.cpp`) and, on the items both scored,
prints per task how often the two chose the same answer, both accuracies and, for multiple
choice, how far apart their log-likelihoods are; `--out FILE` appends it as one JSON line
(benchmarks/capability_oracle.jsonl holds the runs the docs quote).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "capability.jsonl"
ORACLE = ROOT / "benchmarks" / "capability_oracle.jsonl"
PUBLISHED = ROOT / "benchmarks" / "published_scores.json"
DOC = ROOT / "docs" / "capability.md"
SVG = ROOT / "docs" / "capability.svg"
MODELS = ["pocket-zh-en", "smollm2-135m", "gemma3-270m", "gemma3-270m-zh-en", "qwen2.5-0.5b",
          "qwen2.5-1.5b"]


# -- run ----------------------------------------------------------------------------------------


def _pack_label(model: str, precision: str) -> tuple[str, str | None]:
    """``(label, deploy file path or None)`` of what a run measures."""
    if precision == "float":
        return "float32 (dequantized source)", None
    from pocketlm.api import deploy_file
    from pocketlm.formats.pocketfile import PocketFile

    path = deploy_file(model, quiet=True) if not str(model).endswith(".pocket") else model
    quant = PocketFile(path, verify=False).json("quant")
    cal = quant.get("calibration")
    if isinstance(cal, dict) and cal.get("bits_per_weight") is not None:
        label = f"bit budget {cal['bits_per_weight']} ({cal.get('method', '?')})"
        if cal.get("channel_scaling"):
            label += " + awq"
        return label, str(path)
    label = f"int4 g{quant['group_size']}, embed int{quant['embed_bits']}"
    if "+" in quant["scheme"]:
        label += ", keep-precision"
    return label, str(path)


def _speed(model: str, threads: int) -> dict | None:
    """Decode speed and peak memory of ``model``'s deploy file, measured in a fresh process."""
    cmd = [sys.executable, "-m", "pocketlm.cli", "bench", "-m", model, "--json", "--threads",
           str(threads), "--n-prompt", "128", "--n-gen", "64", "--runs", "3"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        print(f"capability.py: bench failed: {r.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    row = json.loads(r.stdout.strip().splitlines()[-1])
    return {k: row[k] for k in ("prefill_tps", "decode_tps", "peak_rss_delta_mb", "file_mb")}


def run(args) -> None:
    import pocketlm
    from pocketlm.bench import machine_info
    from pocketlm.evaluate.suite import Predictions, format_table, run_header, run_suite
    from pocketlm.evaluate.tasks import PocketEngine
    from pocketlm.registry import pocket_home

    only = [t for t in args.tasks.split(",") if t] if args.tasks else None
    pack, path = _pack_label(args.model, args.precision)
    model = pocketlm.load(args.model, precision=args.precision, quiet=False)
    engine = PocketEngine(model)
    preds_path = Path(args.predictions) if args.predictions else (
        pocket_home() / "eval" / "runs" / f"{Path(args.model).name}-{args.precision}-"
        f"{args.suite}.jsonl")
    preds = Predictions(preds_path, run_header(args.model, args.precision, args.suite,
                                               engine.name))
    print(f"predictions: {preds_path}", file=sys.stderr)
    try:
        result = run_suite(engine, args.suite, limit=args.limit, only=only, predictions=preds)
    finally:
        preds.close()
    print(format_table(result))
    del engine, model
    speed = _speed(path, args.threads) if path and not args.no_speed else None
    keep = ("task", "ability", "recipe", "headline", "chat", "n", "correct", "accuracy", "ci95",
            "shots", "seconds", "tokens_per_s", "generated_tokens", "acc_norm",
            "accuracy_loose", "instruction_accuracy", "instructions_by_check", "resumed")
    record = {
        "command": "python benchmarks/capability.py " + " ".join(map(shlex.quote, sys.argv[1:])),
        "model": args.model, "precision": args.precision, "pack": pack,
        "suite": result["suite"], "suite_version": result["suite_version"],
        "limit": args.limit, "tasks": [{k: r[k] for k in keep if k in r}
                                       for r in result["tasks"]],
        "abilities": result["abilities"], "seconds": sum(r["seconds"] for r in result["tasks"]),
        "speed": speed, "threads": args.threads, "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    with open(args.out, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"appended to {args.out}", file=sys.stderr)


# -- write --------------------------------------------------------------------------------------


def load_rows(path: Path = RESULTS) -> list[dict]:
    """The latest record of each (model, precision, pack, limit, tasks), in model order."""
    if not path.exists():
        return []
    latest: dict[tuple, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            key = (r["model"], r["precision"], r["pack"], r["limit"],
                   tuple(t["task"] for t in r["tasks"]))
            latest[key] = r
    order = {m: i for i, m in enumerate(MODELS)}
    return sorted(latest.values(), key=lambda r: (order.get(r["model"], 99), r["model"],
                                                  r["precision"] != "float", r["pack"]))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _cell(x: dict | None) -> str:
    if x is None:
        return "–"
    lo, hi = x["ci95"]
    return f"{_pct(x['accuracy'])} [{_pct(lo)}, {_pct(hi)}] ({x['n']})"


def _label(r: dict) -> str:
    limit = "" if r["limit"] is None else f", limit {r['limit']}"
    return f"{r['model']} · {r['pack']}{limit}"


def abilities_text(rows: list[dict]) -> str:
    from pocketlm.evaluate.suite import ABILITIES

    head = "| model · weights | " + " | ".join(ABILITIES) + " | minutes | decode tok/s | peak MiB |"
    out = [head, "|" + "---|" * (len(ABILITIES) + 4)]
    for r in rows:
        by = {a["ability"]: a for a in r["abilities"]}
        speed = r.get("speed") or {}
        dec = f"{speed['decode_tps']:.0f}" if speed else "–"
        mem = f"{speed['peak_rss_delta_mb']:.0f}" if speed else "–"
        out.append(f"| {_label(r)} | " + " | ".join(_cell(by.get(a)) for a in ABILITIES)
                   + f" | {r['seconds'] / 60:.0f} | {dec} | {mem} |")
    out.append("")
    out.append("Each cell: accuracy % [95 % Wilson interval] (items). " + machine_line(rows))
    return "\n".join(out)


def tasks_text(rows: list[dict]) -> str:
    keys: list[str] = []
    for r in rows:
        for t in r["tasks"]:
            if t["task"] not in keys:
                keys.append(t["task"])
    out = ["| model · weights | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 1)]
    for r in rows:
        by = {t["task"]: t for t in r["tasks"]}
        out.append(f"| {_label(r)} | " + " | ".join(_cell(by.get(k)) for k in keys) + " |")
    extra = []
    for r in rows:
        for t in r["tasks"]:
            if "instruction_accuracy" in t:
                extra.append(f"{_label(r)}: {t['task']} loose {_pct(t['accuracy_loose'])} %, "
                             f"instruction-level {_pct(t['instruction_accuracy'])} %")
    if extra:
        out += ["", "Instruction following, besides prompt-level strict accuracy: "
                + "; ".join(extra) + "."]
    return "\n".join(out)


def published_text(rows: list[dict]) -> str:
    """The publishers' scores next to ours on the closest task (the float run where there is
    one, else the default pack; full-size runs only), by the entry's ``metric`` (``acc`` or
    ``acc_norm``), with its 95 % interval."""
    from pocketlm.evaluate.tasks import wilson_interval

    if not PUBLISHED.exists():
        return "(no published scores recorded)"
    published = json.loads(PUBLISHED.read_text(encoding="utf-8"))
    out = ["| model | variant | benchmark | published | setup | source | ours | how ours differs |",
           "|---|---|---|---|---|---|---|---|"]
    for p in published:
        mine = [r for r in rows if r["model"] == p["model"] and r["limit"] is None]
        mine.sort(key=lambda r: r["precision"] != "float")
        task = next((t for r in mine for t in r["tasks"] if t["task"] == p["ours"]), None)
        got = "–"
        if task is not None:
            metric = p.get("metric", "acc")
            acc = task["acc_norm"] if metric == "acc_norm" else task["accuracy"]
            lo, hi = wilson_interval(round(acc * task["n"]), task["n"])
            what = p["ours"] + (", acc_norm" if metric == "acc_norm" else "")
            got = f"{_pct(acc)} [{_pct(lo)}, {_pct(hi)}] ({what})"
        out.append(f"| {p['model']} | {p['variant']} | {p['benchmark']} | {p['score']} | "
                   f"{p['setup']} | [{p['source_title']}]({p['source']}) | {got} | "
                   f"{p['differs']} |")
    return "\n".join(out)


def machine_line(rows: list[dict]) -> str:
    machines = sorted({f"{r['machine']['cpu']} ({r['machine']['cores']} cores, "
                       f"{r['machine']['kernel_level']}), {r['threads']} threads"
                       for r in rows})
    dates = sorted({r["date"] for r in rows})
    return (f"Measured on {'; '.join(machines)}; "
            f"{dates[0] if dates else ''}{' to ' + dates[-1] if len(dates) > 1 else ''}.")


def mean_ability(r: dict) -> float:
    """The unweighted mean of a run's ability accuracies (the chart's vertical axis)."""
    return sum(a["accuracy"] for a in r["abilities"]) / max(len(r["abilities"]), 1)


def svg_text(rows: list[dict]) -> str:
    """Two panels: mean ability against decode tok/s, and against peak memory; the budgets
    (decode 200 tok/s, memory 300 MB) drawn as dashed lines, the app-native quadrant shaded."""
    from pocketlm.bench import BUDGETS, MEMORY_BUDGET_MIB

    points = [r for r in rows if r.get("speed")]
    w, h, pad = 860, 360, 55
    pw = (w - 3 * pad) / 2
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           'font-family="sans-serif" font-size="12">', '<rect width="100%" height="100%" '
           'fill="white"/>', f'<text x="{pad}" y="20" font-size="14">pocket suite: mean ability '
           'against speed and memory (deploy files)</text>']
    colors = ["#2f6fdf", "#e07b39", "#5aa469", "#a05195", "#d1495b", "#666666"]
    top, bottom = 45, h - 62
    ymax = max([mean_ability(r) for r in points] + [0.5]) * 1.15
    for p, (field, title, budget, better_high) in enumerate((
            ("decode_tps", "decode tok/s", 200.0, True),
            ("peak_rss_delta_mb", "peak memory MiB", MEMORY_BUDGET_MIB, False))):
        x0 = pad + p * (pw + pad)
        xmax = max([r["speed"][field] for r in points] + [budget]) * 1.15
        def sx(v, x0=x0, xmax=xmax):
            return x0 + pw * v / xmax

        def sy(v):
            return bottom - (bottom - top) * v / ymax
        qx0, qx1 = (sx(budget), x0 + pw) if better_high else (x0, sx(budget))
        out.append(f'<rect x="{qx0:.1f}" y="{top}" width="{qx1 - qx0:.1f}" '
                   f'height="{bottom - top}" fill="#eef6ee"/>')
        out.append(f'<line x1="{x0}" y1="{bottom}" x2="{x0 + pw:.1f}" y2="{bottom}" '
                   'stroke="black"/>')
        out.append(f'<line x1="{x0}" y1="{top}" x2="{x0}" y2="{bottom}" stroke="black"/>')
        out.append(f'<line x1="{sx(budget):.1f}" y1="{top}" x2="{sx(budget):.1f}" '
                   f'y2="{bottom}" stroke="#888" stroke-dasharray="4 3"/>')
        out.append(f'<text x="{sx(budget) + 3:.1f}" y="{top + 12}" fill="#555">budget '
                   + (f"{BUDGETS['peak_rss_delta_mb']:g} MB" if field == "peak_rss_delta_mb"
                      else f"{budget:.0f}")
                   + '</text>')
        out.append(f'<text x="{x0 + pw / 2 - 40:.1f}" y="{bottom + 32}">{escape(title)}</text>')
        for k in range(5):
            v = xmax * k / 4
            out.append(f'<text x="{sx(v) - 8:.1f}" y="{bottom + 15}" fill="#555">{v:.0f}</text>')
            a = ymax * k / 4
            out.append(f'<text x="{x0 - 35}" y="{sy(a) + 4:.1f}" fill="#555">'
                       f'{100 * a:.0f}%</text>')
        for i, r in enumerate(points):
            cx, cy = sx(r["speed"][field]), sy(mean_ability(r))
            out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="5" '
                       f'fill="{colors[i % len(colors)]}"/>')
            name = r["model"] + ("" if r["limit"] is None else f" ({r['limit']}/task)")
            out.append(f'<text x="{cx + 7:.1f}" y="{cy + 4:.1f}">{escape(name)}</text>')
    out.append(f'<text x="{pad}" y="{h - 6}" fill="#555">vertical: mean of the six ability '
               'accuracies; shaded: inside the budget</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


BLOCK = re.compile(r"^(<!-- generated: capability (abilities|tasks|published) "
                   r"benchmarks/capability\.jsonl -->\n)(.*?)^(<!-- end of generated block -->)$",
                   re.M | re.S)


def write(check: bool) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from vs_llamacpp import update_files

    rows = load_rows()
    suite = [r for r in rows if r["suite"] == "pocket"]  # the ability tables and the picture
    texts = {"abilities": abilities_text(suite), "tasks": tasks_text(suite),
             "published": published_text(rows)}
    doc = BLOCK.sub(lambda m: m[1] + "\n" + texts[m[2]] + "\n\n" + m[4],
                    DOC.read_text(encoding="utf-8"))
    update_files({DOC: doc, SVG: svg_text(suite)}, check)


# -- compare ------------------------------------------------------------------------------------


def read_predictions(path: Path) -> tuple[dict, dict[tuple[str, str], dict]]:
    """``(run header, {(task, example key): result})`` of a predictions file (a torn last line
    is skipped, as a resumed run skips it)."""
    header: dict = {}
    out: dict[tuple[str, str], dict] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "run" in r:
            header = r["run"]
        elif "result" in r:
            out[(r["task"], r["key"])] = r["result"]
    if not header:
        raise SystemExit(f"capability.py: {path}: not a predictions file (no run header)")
    return header, out


def compare_predictions(a: dict[tuple[str, str], dict], b: dict[tuple[str, str], dict]
                        ) -> list[dict]:
    """Per task, on the items both files scored: same answer, accuracies and, where both hold
    log-likelihoods, their largest and median absolute difference."""
    tasks: dict[str, list[tuple[dict, dict]]] = {}
    for key in sorted(a.keys() & b.keys()):
        tasks.setdefault(key[0], []).append((a[key], b[key]))
    rows = []
    for task, pairs in tasks.items():
        same = sum(x.get("prediction", x.get("output")) == y.get("prediction", y.get("output"))
                   for x, y in pairs)
        row = {"task": task, "items": len(pairs), "same_answer": same,
               "accuracy_a": sum(bool(x["correct"]) for x, _ in pairs) / len(pairs),
               "accuracy_b": sum(bool(y["correct"]) for _, y in pairs) / len(pairs)}
        diffs = sorted(max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"], strict=True))
                       for x, y in pairs if "logprobs" in x and "logprobs" in y)
        if diffs:
            row["logprob_diff_max"] = diffs[-1]
            row["logprob_diff_median"] = diffs[len(diffs) // 2]
        rows.append(row)
    return rows


def compare(args) -> None:
    from pocketlm.bench import machine_info

    head_a, a = read_predictions(Path(args.a))
    head_b, b = read_predictions(Path(args.b))
    rows = compare_predictions(a, b)
    if not rows:
        raise SystemExit(f"capability.py: {args.a} and {args.b} share no scored item")
    for r in rows:
        line = (f"{r['task']:<15} {r['items']:>4} items  same answer {r['same_answer']:>4}  "
                f"accuracy {_pct(r['accuracy_a'])} / {_pct(r['accuracy_b'])}")
        if "logprob_diff_max" in r:
            line += (f"  |d log p| median {r['logprob_diff_median']:.3f} "
                     f"max {r['logprob_diff_max']:.3f}")
        print(line)
    if args.out:
        record = {"command": "python benchmarks/capability.py "
                             + " ".join(map(shlex.quote, sys.argv[1:])),
                  "a": head_a, "b": head_b, "tasks": rows, "machine": machine_info(),
                  "date": time.strftime("%Y-%m-%d", time.gmtime())}
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        print(f"appended to {args.out}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the suite on one model and record it")
    r.add_argument("-m", "--model", required=True)
    r.add_argument("--precision", choices=("int4", "float"), default="int4")
    r.add_argument("--suite", default="pocket")
    r.add_argument("--limit", type=int, help="items per task instead of the suite's (0: all)")
    r.add_argument("--tasks", help="only these tasks (comma-separated)")
    r.add_argument("--threads", type=int, default=2, help="threads for the speed measurement")
    r.add_argument("--predictions", help="predictions file (default under $POCKET_HOME)")
    r.add_argument("--no-speed", action="store_true", help="skip the speed measurement")
    r.add_argument("--out", default=str(RESULTS), help="results file to append to")
    w = sub.add_parser("write", help="regenerate docs/capability.md and docs/capability.svg")
    w.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    c = sub.add_parser("compare", help="two predictions files on the items both scored")
    c.add_argument("a", help="predictions file (e.g. pocketlm's)")
    c.add_argument("b", help="predictions file (e.g. --engine llama.cpp's)")
    c.add_argument("--out", help=f"append the comparison here as a JSON line (e.g. {ORACLE.name})")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args)
    elif args.cmd == "compare":
        compare(args)
    else:
        write(args.check)


if __name__ == "__main__":
    main()
