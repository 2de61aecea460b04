"""The docs are true to the tree: generated tables match the recorded benchmarks, links resolve."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _headings(md: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (outside code blocks)."""
    out, inside = set(), False
    for line in md.read_text(encoding="utf-8").split("\n"):
        if line.startswith("```"):
            inside = not inside
        if inside or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_generated_tables_are_current():
    # README.md and docs/benchmarks.md hold tables written from benchmarks/*.jsonl
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_llamacpp.py"), "--write",
                        "--check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_relative_links_resolve():
    broken = []
    for md in DOCS:
        text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            f = (md.parent / path).resolve() if path else md
            if not f.exists():
                broken.append(f"{md.name}: {target} (no such file)")
            elif anchor and f.suffix == ".md" and anchor not in _headings(f):
                broken.append(f"{md.name}: {target} (no such heading)")
    assert not broken, broken


def test_capability_report_is_current():
    # docs/capability.md and docs/capability.svg are written from benchmarks/capability.jsonl
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "capability.py"), "write",
                        "--check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_quantization_tables_are_current():
    # docs/quantization.md's results table is written from benchmarks/quant_quality.jsonl
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quant_quality.py"), "write",
                        "--check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_vocabulary_tables_are_current():
    # docs/vocabulary.md's and README.md's trimming table is written from benchmarks/vocab_trim.jsonl
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vocab_trim.py"), "write",
                        "--check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_export_table_is_current():
    # docs/export.md's table is written from benchmarks/export.jsonl
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "export.py"), "write",
                        "--check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
