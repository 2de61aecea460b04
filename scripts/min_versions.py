"""Print each runtime and ``serve`` dependency of pyproject.toml pinned to its declared minimum
(one per line), for scripts/check-min-versions."""

import re
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    sys.exit("scripts/check-min-versions reads pyproject.toml with tomllib: Python 3.11 or newer")

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml")
                        .read_text(encoding="utf-8"))["project"]
# the oldest release with wheels for a newer Python, where the declared minimum has none
NEWER_PYTHON = {"numpy": [((3, 13), "2.1"), ((3, 12), "1.26")]}

for spec in project["dependencies"] + project["optional-dependencies"]["serve"]:
    m = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)", spec.strip())
    if m is None:
        sys.exit(f"pyproject.toml: {spec!r} has no plain minimum (NAME>=VERSION) to pin")
    name, least = m[1], m[2]
    least = next((v for py, v in NEWER_PYTHON.get(name, []) if sys.version_info >= py), least)
    print(f"{name}=={least}")
