"""``pocket doctor``: what pocketlm runs on here, and with which settings.

The pocketlm, Python and numpy versions, the platform, whether the native extension is built
(or why not), the CPU's model name and features, the kernel levels it supports and the one
chosen, AMX availability, where models are kept (``POCKET_HOME``) and which one runs when none
is named (``POCKET_MODEL``), and every effective engine setting (``POCKET_*``) with its source:
``env`` (set in the environment) or ``default``; ``-`` (JSON null) for a setting that does not
apply (the native ones under ``POCKET_KERNELS=numpy``, the AMX weight terms without AMX, the
int8 digits without q8 activations, AVX-VNNI off the avx2 level). ``pocket --version -v``
prints the same; ``pocket doctor --json`` gives it as one JSON object. An invalid ``POCKET_*`` value is an error
(one line, exit code 1), as it is for every command that runs a model.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Mapping

import numpy as np

from . import __version__, registry
from .runtime import kernels
from .runtime.kernels import native
from .runtime.settings import EngineSettings


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` where there is one), else what the platform
    says, else ``unknown``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("model name", "hardware", "processor name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def report(environ: Mapping[str, str] | None = None) -> dict:
    """Everything ``pocket doctor`` prints, as a JSON-able dict. Raises KernelError or
    UnsupportedError for an invalid ``POCKET_*`` value of ``environ`` (default
    ``os.environ``), or one this machine cannot run."""
    settings = EngineSettings.from_env(environ)
    environ = os.environ if environ is None else environ
    backend = kernels.backend_name(settings)
    built = native.available()
    cpu: dict = {"model": cpu_model(), "features": [], "levels": [], "compiled": [],
                 "best": None, "selected": None, "engine_products": None}
    uses_native = backend == "native"  # else every product is numpy's: no native setting
    engine = {"level": None, "act": None, "amx": None, "kv": None, "huge_pages": None,
              "head_screen": None}
    if built:
        info = native.cpu_features(settings)
        if info.get("error") and uses_native:
            native.check_settings(settings)  # raises the error the CPU gives this setting
        # under POCKET_KERNELS=numpy no native level is chosen: every product is numpy's
        cpu.update(features=sorted(k for k, v in info["features"].items() if v),
                   levels=list(info["levels"]), compiled=list(info["compiled"]),
                   best=info["best"], selected=info["selected"] if uses_native else None)
        if uses_native and native.engine_available():
            engine = native.engine_setting(settings)
            cpu["engine_products"] = engine["level"]
    effective = {
        "kernels": backend,
        "cpu_level": cpu["selected"] if uses_native else None,
        "act": engine["act"],
        "kv": engine["kv"],
        "threads": native.engine_threads(settings) if uses_native else None,
        # the int8 digits of an activation exist only under the q8 activations
        "q8_digits": settings.q8_digits if engine["act"] == "q8" else None,
        "amx": engine["amx"],
        "amx_weights": settings.amx_weights if engine["amx"] else None,
        # AVX-VNNI is a choice only for the avx2 level's int8 products on a CPU that has it
        "avxvnni": settings.avxvnni if (
            engine["act"] == "q8" and str(engine["level"]).startswith("avx2")
            and "avxvnni" in cpu["features"]) else None,
        # the advice only takes where the OS hands out transparent huge pages on request
        "hugepages": None if engine["huge_pages"] is None else int(engine["huge_pages"]),
        "head_screen": engine["head_screen"],
        # compact tiles on every level, but not under the AMX prefill (float16 steps)
        "compact_tiles": None if engine["level"] is None else int(
            bool(settings.compact_tiles) and not engine["amx"]),
    }
    rows = {}
    for name, variable, _, source in settings.items():
        rows[name] = {"variable": variable, "value": effective[name], "source": source}
    # a single kernel call (outside the engine) takes its own default threads
    rows["kernel_threads"] = {"variable": "POCKET_THREADS",
                              "value": native.default_threads(settings) if uses_native else None,
                              "source": settings.source("threads")}
    # where models are kept and which one runs when none is named (errors as for any command)
    paths = {
        "home": {"variable": "POCKET_HOME", "value": str(registry.pocket_home(environ)),
                 "source": "env" if environ.get("POCKET_HOME") else "default"},
        "model": {"variable": "POCKET_MODEL", "value": registry.default_model(environ),
                  "source": "env" if environ.get("POCKET_MODEL") else "default"},
    }
    return {
        "pocketlm": __version__,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "python_executable": sys.executable,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "native": {"built": built, "engine": native.engine_available(),
                   "reason": native.unavailable_reason() or None},
        "cpu": cpu,
        "amx": {"available": native.amx_available()},
        "paths": paths,
        "settings": rows,
    }


def _value(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def format_text(info: dict, *, header: bool = True) -> str:
    """The report as aligned lines (``header``: start with the ``pocketlm VERSION`` line)."""
    nat, cpu = info["native"], info["cpu"]
    if nat["built"]:
        native_line = "built" + ("" if nat["engine"] else " (kernels only, no engine)")
    else:
        native_line = f"not built: {nat['reason']}"
    levels = " ".join(cpu["levels"]) or "-"
    if cpu["levels"] and cpu["selected"] is None:
        levels += f" (best {cpu['best']}; none chosen: the numpy kernels run)"
    elif cpu["levels"]:
        levels += f" (best {cpu['best']}, chosen {cpu['selected']}"
        if cpu["engine_products"] and cpu["engine_products"] != cpu["selected"]:
            levels += f", engine int8 products {cpu['engine_products']}"
        levels += ")"
    rows = [
        ("python", f"{info['python']} ({info['python_implementation']}, "
                   f"{info['python_executable']})"),
        ("numpy", info["numpy"]),
        ("platform", f"{info['platform']} ({info['machine']})"),
        ("native", native_line),
        ("cpu", cpu["model"]),
        ("features", " ".join(cpu["features"]) or "-"),
        ("levels", levels),
        ("amx", "available" if info["amx"]["available"] else "not available"),
    ]
    rows += [(key, f"{row['value']} ({row['variable']} {'set' if row['source'] == 'env' else 'unset'})")
             for key, row in info["paths"].items()]
    lines = [f"pocketlm {info['pocketlm']}"] if header else []
    lines += [f"{k:<9} {v}" for k, v in rows]
    lines.append("settings:")
    for name, row in info["settings"].items():
        label = "POCKET_THREADS (kernel call)" if name == "kernel_threads" else row["variable"]
        lines.append(f"  {label:<28} {_value(row['value']):<14} {row['source']}")
    return "\n".join(lines)


def cmd_doctor(args) -> int:
    info = report()
    print(json.dumps(info) if args.json else format_text(info))
    return 0


def add_command(sub) -> None:
    p = sub.add_parser("doctor", help="print what pocketlm runs on here and its settings",
                       description="Print the pocketlm, Python and numpy versions, the "
                       "platform, whether the native extension is built, the CPU, its kernel "
                       "levels and AMX, the model folder (POCKET_HOME) and default model (POCKET_MODEL), "
                       "and every engine setting (POCKET_*) with its source "
                       "(env or default). An invalid POCKET_* value is an error.")
    p.add_argument("--json", action="store_true", help="the report as one JSON object")
    p.set_defaults(func=cmd_doctor)
