"""Fill the data and training sections of docs/pocket-zh-en.md from a recipe run folder.

    python benchmarks/pocket_zh_en_card.py [RUN]     # default $POCKET_HOME/recipes/pocket-zh-en

Reads RUN/data_report.json (what was kept and dropped, and why), RUN/recipe_report.json (each
stage's time, the deploy file's size and sha256) and the SFT and QAT runs' metrics.jsonl
(steps, tokens, losses); copies their loss curves to docs/pocket-zh-en-{sft,qat}-loss.svg; and
rewrites the blocks between the card's ``<!-- data:start -->`` / ``<!-- training:start -->``
markers and their ends. Stages not run yet are said to be so.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARD = ROOT / "docs" / "pocket-zh-en.md"


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _replace(text: str, name: str, body: str) -> str:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    a, b = text.index(start) + len(start), text.index(end)
    return text[:a] + "\n" + body.rstrip() + "\n" + text[b:]


def data_block(run: Path) -> str:
    report = json.loads((run / "data_report.json").read_text(encoding="utf-8")) \
        if (run / "data_report.json").is_file() else None
    if report is None:
        return "The data stage has not run yet in the recorded run."
    lines = ["| kept (source / task) | chats |", "|---|---:|"]
    for key, n in report["kept"].items():
        lines.append(f"| {key} | {n:,} |")
    lines.append(f"| **all** | **{report['chats']:,}** |")
    lines += ["", "| teacher answers dropped, by reason | answers |", "|---|---:|"]
    for why, n in report["dropped"].items():
        lines.append(f"| {why} | {n:,} |")
    lines += ["", f"The teacher generated {report['teacher_tokens']:,} tokens; the chats hold "
              f"{report['characters']:,} characters; `sft.jsonl` sha256 "
              f"`{report['sha256']}`."]
    return "\n".join(lines)


def training_block(run: Path) -> str:
    rep = json.loads((run / "recipe_report.json").read_text(encoding="utf-8")) \
        if (run / "recipe_report.json").is_file() else {"stages": {}}
    cfg = json.loads((run / "recipe.json").read_text(encoding="utf-8")) \
        if (run / "recipe.json").is_file() else {}
    lines = ["| stage | what | steps | tokens (with padding) | final loss (held-out) | hours |",
             "|---|---|---:|---:|---|---:|"]
    for stage in ("prompts", "teacher", "data", "sft", "qat", "export"):
        st = rep["stages"].get(stage)
        hours = f"{st['seconds'] / 3600:.2f}" if st else "not run"
        if stage in ("sft", "qat") and "last" not in (st or {}):
            hours = "under way" if (run / stage / "metrics.jsonl").is_file() else "not run"
        what = steps = tokens = loss = ""
        if stage in ("sft", "qat"):
            metrics = _rows(run / stage / "metrics.jsonl")
            train = [m for m in metrics if "loss" in m]
            held = [m for m in metrics if "val_loss" in m]
            if train:
                steps = f"{train[-1]['step']:,}"
                tokens = f"{train[-1].get('tokens', 0):,}"
                loss = f"{train[-1]['loss']:.3f}" + (f" ({held[-1]['val_loss']:.3f})" if held
                                                      else "")
            what = ("full fine-tuning, lr {sft_lr}, batch {sft_batch} x {sft_seq_len}"
                    if stage == "sft" else "LoRA rank {qat_rank} against the INT4 grid, lr "
                    "{qat_lr}").format(**cfg) if cfg else ""
            svg = run / stage / "loss.svg"
            if svg.is_file():
                shutil.copyfile(svg, ROOT / "docs" / f"pocket-zh-en-{stage}-loss.svg")
        lines.append(f"| {stage} | {what} | {steps} | {tokens} | {loss} | {hours} |")
    total = sum(s["seconds"] for s in rep["stages"].values()) / 3600
    done = "export" in rep["stages"]
    lines += ["", f"{'Total' if done else 'Total so far'}: {total:.1f} hours on the reference "
              "machine (2-vCPU AMD EPYC Zen 4 VM, 2 threads, no GPU; the runs were paused now "
              "and then for benchmarks, which the hours include)."]
    notes = [(stage, st["note"]) for stage, st in rep["stages"].items() if st.get("note")]
    if notes:
        lines += [""] + [f"- {stage}: {note}." for stage, note in notes]
    for stage in ("sft", "qat"):
        if (ROOT / "docs" / f"pocket-zh-en-{stage}-loss.svg").is_file():
            lines += ["", f"![{stage} loss](pocket-zh-en-{stage}-loss.svg)"]
    if "deploy_file" in rep:
        d = rep["deploy_file"]
        lines += ["", f"The deploy file: {d['size']:,} bytes, sha256 `{d['sha256']}` (the "
                  "registry entry records it)."]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", help="the recipe's run folder (default: "
                    "$POCKET_HOME/recipes/pocket-zh-en)")
    args = ap.parse_args()
    if args.run is not None:
        run = Path(args.run)
    else:
        from pocketlm.recipes import run_folder

        run = run_folder("pocket-zh-en")
    # a folder with no report would blank the card's recorded sections: refused
    if not any((run / name).is_file() for name in ("data_report.json", "recipe_report.json")):
        print(f"error: {run} holds no data_report.json or recipe_report.json (a run folder of "
              "`pocket pull pocket-zh-en`); the card is left as it is", file=sys.stderr)
        return 1
    text = CARD.read_text(encoding="utf-8")
    text = _replace(text, "data", data_block(run))
    text = _replace(text, "training", training_block(run))
    CARD.write_text(text, encoding="utf-8")
    print(f"{CARD}: data and training sections from {run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
