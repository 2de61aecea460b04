"""Print each runtime and ``serve`` dependency of pyproject.toml pinned to its declared minimum
(one per line), for scripts/check-min-versions."""

import re
import sys
from pathlib import Path

import tomllib

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml")
                        .read_text(encoding="utf-8"))["project"]
for spec in project["dependencies"] + project["optional-dependencies"]["serve"]:
    m = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)", spec.strip())
    if m is None:
        sys.exit(f"pyproject.toml: {spec!r} has no plain minimum (NAME>=VERSION) to pin")
    print(f"{m[1]}=={m[2]}")
