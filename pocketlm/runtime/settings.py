"""The engine settings: every ``POCKET_*`` variable that configures the kernels or the engine,
read from the environment in one place.

:meth:`EngineSettings.from_env` parses and validates them once; the runtime, the native engine
and the kernel wrappers take the resulting object and pass its choices down as arguments. A
setting left unset is None (or its fixed default), and the code that uses it fills in the
default that depends on the machine:

========================  =================  ===================================================
variable                  field              unset
========================  =================  ===================================================
``POCKET_KERNELS``        ``kernels``        ``native`` when the extension is built, else
                                             ``numpy``
``POCKET_CPU_LEVEL``      ``cpu_level``      the best kernel level the CPU supports
``POCKET_ACT``            ``act``            the engine: ``q8`` at the avx2, avx512 and neon
                                             levels, ``f32`` at the scalar level; a single
                                             :func:`~pocketlm.runtime.kernels.linear` call:
                                             ``f32``
``POCKET_KV``             ``kv``             ``f16`` with q8 activations, ``f32`` with f32
``POCKET_THREADS``        ``threads``        the engine: 2, or the usable CPUs if fewer; a single
                                             kernel call: the usable CPUs, at most 8
``POCKET_Q8_DIGITS``      ``q8_digits``      2
``POCKET_AMX``            ``amx``            AMX-BF16 prefill where available (q8, avx512 level)
``POCKET_AMX_WEIGHTS``    ``amx_weights``    ``mixed``
``POCKET_AVXVNNI``        ``avxvnni``        1: AVX-VNNI where the CPU has it (avx2 level)
``POCKET_HUGEPAGES``      ``hugepages``      0: the engine's repacked weights in the OS's default
                                             pages (1: transparent huge pages where the OS
                                             offers them, Linux)
``POCKET_HEAD_SCREEN``    ``head_screen``    64: an INT8 output head, in greedy decoding, reads
                                             its high nibbles for every row, then the head for
                                             the 64 tiles of 16 rows with the largest estimates
                                             (1 to 256 tiles; 0: the whole head every step;
                                             docs/engine.md)
``POCKET_COMPACT_TILES``  ``compact_tiles``  1: the engine's tiles keep coded scales
                                             (``int4_c8``) as codes and implicit minimums (a
                                             zero point) not at all (not with the AMX
                                             prefill): 0.5 bits a weight fewer read per token,
                                             the same results (0: float16 scales and minimums
                                             in every tile)
========================  =================  ===================================================

Checks that depend on the machine (a kernel level this CPU lacks, ``POCKET_AMX=1`` without
AMX, ``POCKET_KERNELS=native`` without the extension) are made where the setting is used, in
:mod:`pocketlm.runtime.kernels`. The meaning of each setting is in
:mod:`pocketlm.runtime.kernels.native`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from ..errors import KernelError, UnsupportedError

BACKENDS = ("native", "numpy")
ACTIVATIONS = ("f32", "q8")
LEVELS = ("scalar", "avx2", "avx512", "neon")  # indices: the LEVEL_* values of _native
KV_FORMATS = ("f32", "f16", "q8")
AMX_WEIGHT_TERMS = ("two-term", "mixed", "one-term")
DEFAULT_AMX_WEIGHTS = "mixed"
DEFAULT_Q8_DIGITS = 2
MAX_THREADS = 1024  # the most threads an engine or a kernel call takes

# field -> environment variable, in the order they are parsed (and reported)
VARIABLES = {
    "kernels": "POCKET_KERNELS",
    "cpu_level": "POCKET_CPU_LEVEL",
    "act": "POCKET_ACT",
    "kv": "POCKET_KV",
    "threads": "POCKET_THREADS",
    "q8_digits": "POCKET_Q8_DIGITS",
    "amx": "POCKET_AMX",
    "amx_weights": "POCKET_AMX_WEIGHTS",
    "avxvnni": "POCKET_AVXVNNI",
    "hugepages": "POCKET_HUGEPAGES",
    "head_screen": "POCKET_HEAD_SCREEN",
    "compact_tiles": "POCKET_COMPACT_TILES",
}


@dataclass(frozen=True)
class EngineSettings:
    """What the kernels and the engine are asked to run with (None: the machine's default,
    see the module docstring). ``from_environment``: the fields whose value was set in the
    environment (the others are defaults)."""

    kernels: str | None = None
    cpu_level: str | None = None
    act: str | None = None
    kv: str | None = None
    threads: int | None = None
    q8_digits: int = DEFAULT_Q8_DIGITS
    amx: bool | None = None
    amx_weights: str = DEFAULT_AMX_WEIGHTS
    avxvnni: int = 1
    hugepages: int = 0
    head_screen: int = 64
    compact_tiles: int = 1
    from_environment: frozenset[str] = field(default=frozenset(), compare=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EngineSettings:
        """Parse and validate every ``POCKET_*`` engine variable of ``environ`` (default
        ``os.environ``, read now). Raises UnsupportedError (POCKET_KERNELS, POCKET_ACT) or
        KernelError (the others) with a one-line message for an invalid value."""
        env = os.environ if environ is None else environ
        values: dict = {}
        for name, var in VARIABLES.items():
            raw = env.get(var, "").strip()
            if raw:
                values[name] = _PARSERS[name](raw)
        return cls(**values, from_environment=frozenset(values))

    def source(self, name: str) -> str:
        """``"env"`` when the field ``name`` was set in the environment, else ``"default"``."""
        if name not in VARIABLES:
            raise KeyError(name)
        return "env" if name in self.from_environment else "default"

    def items(self) -> list[tuple[str, str, object, str]]:
        """``(field, variable, value, source)`` of every setting, in the order of VARIABLES."""
        return [(f.name, VARIABLES[f.name], getattr(self, f.name), self.source(f.name))
                for f in fields(self) if f.name in VARIABLES]


def _kernels(raw: str) -> str:
    name = raw.lower()
    if name not in BACKENDS:
        raise UnsupportedError(f"POCKET_KERNELS={name!r} is not a kernel backend; choose one of "
                               f"{', '.join(BACKENDS)}")
    return name


def _cpu_level(raw: str) -> str:
    level = raw.lower()
    if level not in LEVELS:
        raise KernelError(f"POCKET_CPU_LEVEL={level!r}: unknown kernel level; choose one of "
                          f"{', '.join(LEVELS)}")
    return level


def _act(raw: str) -> str:
    act = raw.lower()
    if act not in ACTIVATIONS:
        raise UnsupportedError(f"POCKET_ACT={act!r}; choose one of {', '.join(ACTIVATIONS)}")
    return act


def _kv(raw: str) -> str:
    kv = raw.lower()
    if kv not in KV_FORMATS:
        raise KernelError(f"POCKET_KV={kv!r}; choose one of {', '.join(KV_FORMATS)}")
    return kv


def _threads(raw: str) -> int:
    digits = raw.strip()
    if not (digits.isascii() and digits.isdigit()):  # int() took "1_0", "+4" and "٣"
        raise KernelError(f"POCKET_THREADS={raw!r} is not an integer")
    n = int(digits)
    if not 1 <= n <= MAX_THREADS:
        raise KernelError(f"POCKET_THREADS={n} is out of range 1..{MAX_THREADS}")
    return n


def _q8_digits(raw: str) -> int:
    if raw not in ("1", "2"):
        raise KernelError(f"POCKET_Q8_DIGITS={raw!r}; choose 1 or 2")
    return int(raw)


def _amx(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise KernelError(f"POCKET_AMX={raw!r}; choose 0 or 1")
    return raw == "1"


def _amx_weights(raw: str) -> str:
    terms = raw.lower()
    if terms not in AMX_WEIGHT_TERMS:
        raise KernelError(f"POCKET_AMX_WEIGHTS={terms!r}; choose one of "
                          f"{', '.join(AMX_WEIGHT_TERMS)}")
    return terms


def _zero_one(variable: str):
    def parse(raw: str) -> int:
        if raw not in ("0", "1"):
            raise KernelError(f"{variable}={raw!r}; choose 0 or 1")
        return int(raw)
    return parse


_avxvnni = _zero_one("POCKET_AVXVNNI")
_hugepages = _zero_one("POCKET_HUGEPAGES")


def _head_screen(raw: str) -> int:
    if not (raw.isascii() and raw.isdigit()) or int(raw) > 256:  # not "²" (a digit to isdigit)
        raise KernelError(f"POCKET_HEAD_SCREEN={raw!r}; choose 0 (off) or a number of "
                          "tiles from 1 to 256")
    return int(raw)


_PARSERS = {"kernels": _kernels, "cpu_level": _cpu_level, "act": _act, "kv": _kv,
            "threads": _threads, "q8_digits": _q8_digits, "amx": _amx,
            "amx_weights": _amx_weights, "avxvnni": _avxvnni, "hugepages": _hugepages,
            "head_screen": _head_screen, "compact_tiles": _zero_one("POCKET_COMPACT_TILES")}
