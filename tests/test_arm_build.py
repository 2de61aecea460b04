"""The engine's portable C code built for ARM64 (aarch64) and run under qemu-user.

``tests/native_harness.c`` drives the engine (pocketlm/runtime/csrc, no Python) on a model dump
written here: a prefill with every logit, decode steps, a second cache, and one batched step
over both caches, with the portable kernels (``POCKET_LEVEL_SCALAR``) and a pool of 2 threads.
It is compiled with the engine's sources (setup.py's, less the CPython module pocket_module*.c)
twice: ``gcc`` for this host and ``aarch64-linux-gnu-gcc`` for ARM64, run under
``qemu-aarch64 -L /usr/aarch64-linux-gnu``. Tiny random models of every family (INT4 layers,
INT8 embedding / head, as test_native_forward quantizes them; W_down in INT5, W_gate / W_up
in INT4 with coded steps and W_k / W_v in INT5 / INT4 with implicit minimums, which the engine
keeps compact in its tiles), each run with int8 activations
on and off (act_q8 = 31 / 0) and float16 KV caches on and off.

Flags: setup.py's, from ``build_flags.py`` (``-O3 -std=c11 -fno-strict-aliasing -Wall
-Wno-unknown-pragmas -pthread -ffp-contract=off``), on both compilers: this is the real build.
GCC already defaults to no contraction under ``-std=c11`` (an ISO mode); spelled out, it keeps
AArch64's fused multiply-adds out of the float code whatever the compiler's default. The
harness alone also gets ``-Werror``.

Each build is linked twice: against the C library as is (the real build) and "pinned", with
``-Wl,--wrap=tanhf -Wl,--wrap=expf`` routing the engine's only float libm calls to versions in
the harness computed through the double functions (identical on both platforms). glibc's
tanhf differs by up to 3 ulp between its x86-64 and AArch64 builds (glibc 2.36), and that is
the whole of the cross-architecture difference: with it pinned, every logit is bit-identical.

Checks, per family and mode (bounds relative to the largest |logit| of the reference):

* pinned: ARM64 logits == host logits, bit for bit (observed: identical, all 20 cases);
* real builds: ARM64 within 1e-5 of the host with float activations (observed: up to 6.2e-7,
  where glibc's tanhf shows through silu / GELU) and within 1e-4 with int8 activations
  (observed: 0 on most models, 4.5e-5 on qwen3: an activation that glibc's 1-ulp difference
  moves across a rounding boundary of its int8 digits changes that digit; the pinned builds
  show the engine's own arithmetic identical);
* real builds, both targets, within test_native_forward's bounds (its MODES) of the numpy
  reference runtime: f32 2e-5 (observed <= 1.4e-6), f32 activations + f16 KV 3e-3 (observed
  <= 5e-4), q8 2e-2 (observed <= 5.4e-4; also used for q8 with a float32 KV cache, whose
  error is a part of it: observed <= 1.9e-4);
* the host build == the CPython wrapper's engine (NativeEngine, level "scalar", 2 threads), bit
  for bit: the harness fills the model exactly as pocket_module_model.c does.

The neon level (pm_ops_neon, pocket_model_neon.c: SDOT products on the tiled weights) runs in
the same ARM64 build under ``qemu-aarch64 -cpu max`` (a CPU with the dot-product extension;
the harness's LEVEL argument, and its output line names the level and operations it ran):

* ARM64 neon == ARM64 scalar, bit for bit, in every mode above plus one int8 digit everywhere
  and a mix of one and two digits (observed: identical, all 30 cases). The SDOT totals are the
  portable kernel's exact int32 sums and the float epilogue repeats its operations in order
  (no fused multiply-add); float activations run the scalar kernels at this level;
* the level is refused under ``-cpu cortex-a53`` (ARMv8.0, no HWCAP_ASIMDDP), where scalar
  still runs, and is not compiled into the x86-64 build.

If the cross compiler or qemu is missing, these tests fail (they do not skip): run
``scripts/ensure-cross`` (as root it installs them) or
``sudo apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user``.
"""

from __future__ import annotations

import platform
import runpy
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch_ref
from test_native_forward import IDS, MODES
from tiny_models import coded_int4, implicit_minimums

from pocketlm.head_patch import PATCH, PATCH_IDS
from pocketlm.quant import quantize_int4, quantize_int5, quantize_int8
from pocketlm.runtime import Runtime
from pocketlm.runtime.kernels import native

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "pocketlm" / "runtime" / "csrc"
HARNESS = Path(__file__).with_name("native_harness.c")
# setup.py compiles every csrc/*.c; pocket_module*.c are the CPython wrapper (need Python.h)
ENGINE_SOURCES = sorted(p for p in CSRC.glob("*.c") if not p.name.startswith("pocket_module"))
CFLAGS = runpy.run_path(str(ROOT / "build_flags.py"))["CFLAGS"]  # setup.py's, the one source
HARNESS_CFLAGS = ["-Werror"]
LIBS = ["-pthread", "-lm"]
PIN_LIBM = ["-Wl,--wrap=tanhf", "-Wl,--wrap=expf"]  # see native_harness.c

ARM_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")
INSTALL = ("run scripts/ensure-cross (as root it installs them), or: sudo apt-get install "
           "gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user")
EM_AARCH64 = 183  # ELF e_machine
HOST_ARCH = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64",
             "arm64": "aarch64"}.get(platform.machine().lower(), "other")

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3", "pocket"]
SPLIT = 8  # IDS[:8] in one prefill, the other 5 ids one decode step each
IDS_B = [7, 300, 2, 64, 9]  # a second sequence, in a second cache
BATCH = [42, 250]  # one forward_batch step: the next token of each sequence
N_ROWS = len(IDS) + len(IDS_B) + len(BATCH)
RUNS = [(0, 0), (0, 1), (31, 0), (31, 1), (31, 2)]  # (act_q8, kv_fmt: 0 f32, 1 f16, 2 int8)
BOUND_MODE = {(0, 0): "f32", (0, 1): "f32-kv16", (31, 0): "q8", (31, 1): "q8", (31, 2): "q8-kv8"}
ARM_VS_HOST = {0: 1e-5, 31: 1e-4}  # real libm, by act_q8; pinned: bit-identical
NEON_CPU = "max"  # qemu's CPU model for the neon runs: reports asimddp (SDOT) in HWCAP
NO_DOTPROD_CPU = "cortex-a53"  # ARMv8.0-A: NEON without the dot-product extension
OPS = {"scalar": "portable", "neon": "neon"}  # level -> the engine's operations (pm_ops_*)

KIND = {"f32": 1, "int4": 4, "int5": 5, "int8": 8, "int4_c8": 14, "int4_zp": 24, "int5_zp": 25,
        "i32": 32}


# -- the model dump (format: the top of tests/native_harness.c) --------------------------------

def _weights(cfg, seed):
    """As test_native_forward._weights(quantized=True): INT4 layers, INT8 embedding / head;
    W_down in INT5 (the other weight layout of a keep-precision pack), W_gate and W_up in INT4
    with coded steps (a bit budget's layout), W_k in INT5 and W_v in INT4 with implicit
    minimums (a GGUF's Q5_0 / Q4_0)."""
    sd = torch_ref.random_state_dict(cfg, seed=seed)
    out = dict(sd)
    for name, w in sd.items():
        if w.ndim == 2:
            out[name] = (quantize_int8(w) if name in ("embed.weight", "lm_head.weight")
                         else quantize_int5(w, 32) if name.endswith("w_down.weight")
                         else coded_int4(quantize_int4(w, 32))
                         if name.endswith(("w_gate.weight", "w_up.weight"))
                         else implicit_minimums(quantize_int5(w, 32), 16) if name.endswith("w_k.weight")
                         else implicit_minimums(quantize_int4(w, 32), 8) if name.endswith("w_v.weight")
                         else quantize_int4(w, 32))
    return out


def _tensor_order(cfg, has_head):
    names = ["embed.weight"] + (["lm_head.weight"] if has_head else []) + ["norm.weight"]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        names += [p + s for s in ("attn_norm.weight", "mlp_norm.weight", "attn.w_q.weight",
                                  "attn.w_k.weight", "attn.w_v.weight", "attn.w_o.weight",
                                  "mlp.w_gate.weight", "mlp.w_up.weight", "mlp.w_down.weight")]
        if cfg.qkv_bias:
            names += [p + "attn.w_q.bias", p + "attn.w_k.bias", p + "attn.w_v.bias"]
        if cfg.qk_norm:
            names += [p + "attn.q_norm.weight", p + "attn.k_norm.weight"]
        if cfg.sandwich_norms:
            names += [p + "post_attn_norm.weight", p + "post_mlp_norm.weight"]
    return names


def _le_bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()


def _tensor_record(name: str, t) -> bytes:
    """One tensor in the engine's form (what native.engine_weights hands the wrapper)."""
    if isinstance(t, tuple):  # ("int4" | "int5", q, scales, mins, gs[, computed, codes])
        kind, q, *rest = t    # | ("int8", q, scales, gs)
        if kind == "int8":
            gs, arrays = rest[1], [q, rest[0]]
        else:
            gs, arrays = rest[2], [q, rest[0], rest[1]]
        assert q.dtype == (np.int8 if kind == "int8" else np.uint8)
        assert all(a.dtype == np.float16 for a in arrays[1:])
        codes = rest[4] if len(rest) == 5 else None
        if codes is not None:  # scale codes, minimum codes, steps, groups per step
            sc, mc, steps, per = codes
            assert [c.dtype for c in (sc, mc, steps)] == [np.uint8, np.int8, np.float16]
            kind, arrays = "int4_c8", arrays + [sc, mc, np.asarray([per], np.int32), steps]
        zero_point = rest[3] if len(rest) >= 4 and type(rest[3]) is int else None
        if zero_point is not None:  # implicit minimums: their zero point after the arrays
            kind, arrays = kind + "_zp", arrays + [np.asarray([zero_point], np.int32)]
        rows = q.shape[0]
        cols = {"int4": q.shape[1] * 2, "int4_c8": q.shape[1] * 2, "int4_zp": q.shape[1] * 2,
                "int5": q.shape[1] // 20 * 32, "int5_zp": q.shape[1] // 20 * 32,
                "int8": q.shape[1]}[kind]
    elif t.dtype == np.int32:  # the head patch's ids
        kind, gs, arrays = "i32", 0, [t]
        rows, cols = t.shape[0], 0
    else:  # float32 matrix or vector
        assert t.dtype == np.float32
        kind, gs, arrays = "f32", 0, [t]
        rows, cols = (t.shape[0], 0) if t.ndim == 1 else t.shape
    encoded = name.encode()
    head = struct.pack("<i", len(encoded)) + encoded
    head += struct.pack("<4i", KIND[kind], rows, cols, gs)
    return head + b"".join(_le_bytes(a) for a in arrays)


def _steps_per_group(t):
    """A coded weight's engine tuple with one pair of steps per group instead of per row
    (codes 1 under steps equal to the float16 scale and minimum: the same values), so that
    the kernels' step runs shorter than a row (GGUF Q4_K's, per 256 columns) are exercised."""
    kind, q, scales, mins, gs, computed, codes = t
    rows, ng = scales.shape
    steps = np.stack([scales, mins], axis=2).reshape(rows, 2 * ng)
    return (kind, q, scales, mins, gs, computed,
            (np.ones((rows, ng), np.uint8), np.ones((rows, ng), np.int8), steps, 1))


def write_dump(cfg, weights, path: Path) -> None:
    tensors, reason = native.engine_weights(cfg, weights)
    assert tensors is not None, reason
    for name in [n for n in tensors if n.endswith("w_up.weight")]:
        tensors[name] = _steps_per_group(tensors[name])
    has_head = "lm_head.weight" in tensors
    parts = [
        b"PLMDUMP1",
        struct.pack("<7i", cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads,
                    cfg.n_kv_heads, cfg.head_dim, cfg.d_ff),
        struct.pack("<8i", int(cfg.qkv_bias), int(cfg.qk_norm), int(cfg.sandwich_norms),
                    {"silu": 0, "gelu_tanh": 1}[cfg.activation], cfg.sliding_window or 0,
                    int(cfg.tie_embeddings), int(has_head), cfg.max_context),
        struct.pack("<5d", cfg.norm_eps, cfg.embed_scale,
                    -1.0 if cfg.attn_scale is None else cfg.attn_scale, cfg.rope_theta,
                    cfg.rope_theta_local or 0.0),
        struct.pack(f"<{cfg.n_layers}i", *(int(t == "sliding") for t in cfg.layer_types)),
    ]
    order = _tensor_order(cfg, has_head)
    patch = [n for n in (PATCH, PATCH_IDS) if n in tensors]
    assert sorted(order + patch) == sorted(tensors), "the dump must hold every tensor once"
    parts += [_tensor_record(name, tensors[name]) for name in order]
    if patch:
        parts += [b"PTCH"] + [_tensor_record(name, tensors[name]) for name in patch]
    parts.append(b"END!")
    path.write_bytes(b"".join(parts))


def read_logits(path: Path, rows: int, vocab: int) -> np.ndarray:
    data = path.read_bytes()
    assert data[:8] == b"PLMLOGIT", f"{path}: not a logits file"
    assert struct.unpack_from("<2i", data, 8) == (rows, vocab)
    assert len(data) == 16 + 4 * rows * vocab
    return np.frombuffer(data, "<f4", offset=16).reshape(rows, vocab).astype(np.float32)


# -- builds -------------------------------------------------------------------------------------

def _require_tools(target: str) -> None:
    if target == "host":
        if shutil.which("gcc") is None:
            pytest.fail("the ARM64 build test needs gcc: sudo apt-get install gcc",
                        pytrace=False)
        return
    missing = [t for t in (ARM_CC, QEMU) if shutil.which(t) is None]
    if not (SYSROOT / "lib" / "ld-linux-aarch64.so.1").exists():
        missing.append(f"the ARM64 C library in {SYSROOT}")
    if missing:
        pytest.fail(f"the ARM64 build test needs {', '.join(missing)}: {INSTALL}",
                    pytrace=False)


def _sh(cmd: list, what: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd,
                       timeout=300)
    if p.returncode != 0:
        pytest.fail(f"{what} failed (exit {p.returncode}): {' '.join(map(str, cmd))}\n"
                    f"{p.stdout}{p.stderr}", pytrace=False)
    return p


class Builds:
    """The harness + engine per target ("host", "arm64"), compiled once, linked twice:
    "libc" (the C library's math) and "pinned" (tanhf / expf from the harness)."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.progs: dict[str, dict[str, Path]] = {}

    def get(self, target: str, variant: str) -> Path:
        _require_tools(target)
        if target not in self.progs:
            cc = "gcc" if target == "host" else ARM_CC
            out = self.tmp / target
            out.mkdir()
            _sh([cc, *CFLAGS, *HARNESS_CFLAGS, f"-I{CSRC}", "-c", HARNESS],
                f"{target}: compiling the harness", cwd=out)
            _sh([cc, *CFLAGS, f"-I{CSRC}", "-c", *ENGINE_SOURCES],
                f"{target}: compiling the engine", cwd=out)
            objs = sorted(out.glob("*.o"))
            assert len(objs) == len(ENGINE_SOURCES) + 1
            progs = {"libc": out / "native_harness", "pinned": out / "native_harness_pinned"}
            _sh([cc, *objs, "-o", progs["libc"], *LIBS], f"{target}: linking")
            _sh([cc, *objs, *PIN_LIBM, "-o", progs["pinned"], *LIBS], f"{target}: linking")
            if target == "arm64":
                for prog in progs.values():
                    machine = struct.unpack_from("<H", prog.read_bytes(), 18)[0]
                    assert machine == EM_AARCH64, f"{prog}: ELF e_machine {machine}"
            self.progs[target] = progs
        return self.progs[target][variant]

    @staticmethod
    def command(prog: Path, target: str, cpu: str | None = None) -> list:
        """How to start `prog`: directly on the host, under qemu for ARM64 (`cpu`: qemu's
        -cpu model, None: its default)."""
        if target == "host":
            return [prog]
        return [QEMU, *(["-cpu", cpu] if cpu else []), "-L", SYSROOT, prog]

    def run(self, target: str, variant: str, dump: Path, act_q8: int, kv_fmt: int,
            vocab: int, level: str = "scalar", screen: int = 0) -> np.ndarray:
        """The harness's logits at a kernel level: "scalar" (the portable operations, the
        default, run as before) or "neon" (ARM64 only, under qemu's "max" CPU, which has the
        dot-product extension; the harness must report that it ran pm_ops_neon). ``screen``:
        the head screening's tiles (A's decode steps and the batch's first row screened)."""
        prog = self.get(target, variant)
        out = dump.with_name(f"{target}-{variant}-{level}-{act_q8}-{kv_fmt}-{screen}.logits")
        cmd = self.command(prog, target, NEON_CPU if level == "neon" else None)
        cmd += [dump, out, act_q8, kv_fmt, SPLIT, ",".join(map(str, IDS)),
                ",".join(map(str, IDS_B)), ",".join(map(str, BATCH))]
        if level != "scalar" or screen:
            cmd.append(level)
        if screen:
            cmd.append(screen)
        p = _sh(cmd, f"the {target} harness ({variant}, {level})")
        arch = HOST_ARCH if target == "host" else "aarch64"
        ops = OPS[level]
        assert p.stdout.startswith(f"ok arch={arch} level={level} ops={ops} "), p.stdout
        return read_logits(out, N_ROWS, vocab)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    return Builds(tmp_path_factory.mktemp("arm_build"))


# -- the comparisons ----------------------------------------------------------------------------

def _reference(rt) -> np.ndarray:
    """What the harness computes, through a Runtime: A (prefill + decode), B, the batch step."""
    a, b = rt.new_cache(len(IDS) + 1), rt.new_cache(len(IDS_B) + 1)
    rows = [rt.forward(IDS[:SPLIT], a, all_logits=True)]
    rows += [rt.forward([t], a, all_logits=True) for t in IDS[SPLIT:]]
    rows.append(rt.forward(IDS_B, b, all_logits=True))
    rows.append(rt.forward_batch(BATCH, [a, b]))
    out = np.concatenate(rows, axis=0)
    assert out.shape == (N_ROWS, rt.config.vocab_size)
    return out


def _wrapper_runtime(cfg, w, act_q8, kv_fmt):
    """The CPython wrapper's engine at the scalar level, 2 threads, in the harness's mode."""
    if not native.engine_available():
        pytest.fail(native.unavailable_reason() or "the native engine is not built: run "
                    "`pip install -e .`", pytrace=False)
    rt = Runtime(cfg, w, engine="numpy")
    rt.native = native.NativeEngine(cfg, w, act="q8" if act_q8 else "f32",
                                    kv=("f32", "f16", "q8")[kv_fmt], digits=2, level="scalar",
                                    threads=2, smooth_keys=False)  # the harness has none
    assert rt.native.q8_mask() == act_q8
    return rt


def _rel_err(ours, ref) -> float:
    """The largest difference, relative to the largest reference logit."""
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def _where(a, b) -> str:
    d = np.abs(a - b)
    row, col = np.unravel_index(d.argmax(), d.shape)
    return (f"max |diff| {d.max():.3g} ({_rel_err(a, b):.3g} of max |logit|) at row {row}, "
            f"token {col}; {int((d > 0).sum())} of {d.size} logits differ")


def test_cross_toolchain_builds_and_runs_an_arm64_program(tmp_path):
    _require_tools("arm64")
    src = tmp_path / "hello.c"
    src.write_text('#include <stdio.h>\nint main(void) { printf("%d\\n", (int)sizeof(void *) * 8'
                   ' + __aarch64__); return 0; }\n')
    exe = tmp_path / "hello"
    _sh([ARM_CC, "-O2", "-o", exe, src], "cross-compiling a test program")
    out = _sh([QEMU, "-L", SYSROOT, exe], "running it under qemu").stdout.strip()
    assert out == "65"  # 64-bit pointers + __aarch64__ defined: it really is an ARM64 binary


@pytest.mark.parametrize("arch", FAMILIES)
def test_arm64_build_matches_host_and_reference(arch, builds, tmp_path):
    cfg = torch_ref.tiny_config(arch)
    w = _weights(cfg, 21)
    dump = tmp_path / "model.bin"
    write_dump(cfg, w, dump)
    expected = _reference(Runtime(cfg, w, engine="numpy"))
    V = cfg.vocab_size
    for act_q8, kv_fmt in RUNS:
        mode = f"{arch}, act_q8={act_q8}, kv_fmt={kv_fmt}"
        host, arm = (builds.run(t, "libc", dump, act_q8, kv_fmt, V) for t in ("host", "arm64"))
        pin_host, pin_arm = (builds.run(t, "pinned", dump, act_q8, kv_fmt, V)
                             for t in ("host", "arm64"))
        assert np.array_equal(pin_arm, pin_host), (
            f"{mode}: ARM64 vs host, libm pinned: {_where(pin_arm, pin_host)}")
        assert _rel_err(arm, host) <= ARM_VS_HOST[act_q8], (
            f"{mode}: ARM64 vs host: {_where(arm, host)}")
        bound = MODES[BOUND_MODE[act_q8, kv_fmt]][3]
        for target, got in (("host", host), ("arm64", arm)):
            err = _rel_err(got, expected)
            assert err <= bound, f"{mode}: {target} vs the numpy reference: {err:.3g} > {bound}"
        wrapped = _reference(_wrapper_runtime(cfg, w, act_q8, kv_fmt))
        assert np.array_equal(host, wrapped), (
            f"{mode}: harness vs NativeEngine(level='scalar'): {_where(host, wrapped)}")


# -- the neon level (ARM64 with the dot-product extension) -------------------------------------

# (act_q8, kv_fmt): RUNS, plus one int8 digit everywhere (31 | 31 << 5) and a mix of one digit
# (QKV, gate / up) and two (wo, down, head)
NEON_RUNS = RUNS + [(1023, 1), (31 | (1 | 4) << 5, 0)]


@pytest.mark.parametrize("arch", FAMILIES)
def test_arm64_neon_matches_arm64_scalar(arch, builds, tmp_path):
    """The neon level of the ARM64 build (pm_ops_neon: SDOT products on the tiled weights, under
    qemu -cpu max) against its scalar level (the portable operations), both with the C library's
    math: bit for bit in every mode. With int8 activations the SDOT sums are the portable
    kernel's exact int32 totals (INT8 weights XORed to q, which equals the portable
    128 * sum(u x1) + sum(u x2) - corr), and the float epilogue repeats the portable operations
    in their order, lane = row, without fused multiply-adds; with float activations the neon
    level runs the scalar kernels (no tiled float products), so those logits are identical as
    well."""
    cfg = torch_ref.tiny_config(arch)
    w = _weights(cfg, 21)
    dump = tmp_path / "model.bin"
    write_dump(cfg, w, dump)
    V = cfg.vocab_size
    for act_q8, kv_fmt in NEON_RUNS:
        mode = f"{arch}, act_q8={act_q8}, kv_fmt={kv_fmt}"
        scalar = builds.run("arm64", "libc", dump, act_q8, kv_fmt, V)
        neon = builds.run("arm64", "libc", dump, act_q8, kv_fmt, V, level="neon")
        assert np.array_equal(neon, scalar), (
            f"{mode}: ARM64 neon vs ARM64 scalar: {_where(neon, scalar)}")


@pytest.mark.parametrize("arch", FAMILIES)
def test_arm64_neon_screened_head_matches_arm64_scalar(arch, builds, tmp_path):
    """Head screening on ARM64 (pm_ops.matmul_planes: the neon level's SDOT kernels on the
    nibble planes, the scalar level's portable loop): with one tile refined per screened row,
    so that the estimates of every other tile show in the logits, neon == scalar bit for bit,
    with two int8 digits and with one. The prefills (every logit) and the unscreened batch row
    equal the unscreened run's (the planes recombined are the INT8 head's codes); A's screened
    decode steps and the batch's first row do not (screening happened)."""
    cfg = torch_ref.tiny_config(arch)
    w = _weights(cfg, 21)
    dump = tmp_path / "model.bin"
    write_dump(cfg, w, dump)
    V = cfg.vocab_size
    decode = np.zeros(N_ROWS, bool)
    decode[SPLIT:len(IDS)] = True
    decode[-2] = True  # the batch's first row
    for act_q8 in (31, 1023):
        mode = f"{arch}, act_q8={act_q8}, screened"
        scalar = builds.run("arm64", "libc", dump, act_q8, 1, V, screen=1)
        neon = builds.run("arm64", "libc", dump, act_q8, 1, V, level="neon", screen=1)
        assert np.array_equal(neon, scalar), (
            f"{mode}: ARM64 neon vs ARM64 scalar: {_where(neon, scalar)}")
        whole = builds.run("arm64", "libc", dump, act_q8, 1, V, level="neon")
        assert np.array_equal(neon[~decode], whole[~decode]), f"{mode}: unscreened rows differ"
        for r in np.flatnonzero(decode):  # one tile of 16 exact, the rest estimates
            exact = (neon[r] == whole[r]).reshape(-1, 16).all(axis=1)
            assert exact.sum() == 1, f"{mode}: row {r}: {exact.sum()} exact tiles"


def test_neon_level_needs_arm64_with_dotprod(builds, tmp_path):
    """The neon level is chosen from the CPU's HWCAP_ASIMDDP: refused on an ARMv8.0 CPU
    (qemu -cpu cortex-a53) where the scalar level still runs, and absent from an x86-64 build."""
    cfg = torch_ref.tiny_config("llama")
    dump = tmp_path / "model.bin"
    write_dump(cfg, _weights(cfg, 21), dump)
    args = [dump, tmp_path / "out.logits", 31, 0, SPLIT, ",".join(map(str, IDS)),
            ",".join(map(str, IDS_B)), ",".join(map(str, BATCH))]

    def harness(target, cpu, *level):
        cmd = builds.command(builds.get(target, "libc"), target, cpu) + args + list(level)
        return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300)

    p = harness("arm64", NO_DOTPROD_CPU, "neon")
    assert p.returncode == 1 and "'neon' is not supported by this CPU" in p.stderr, (
        p.returncode, p.stdout, p.stderr)
    p = harness("arm64", NO_DOTPROD_CPU)
    assert p.returncode == 0 and p.stdout.startswith("ok arch=aarch64 level=scalar ops=portable ")
    if HOST_ARCH == "x86_64":
        p = harness("host", None, "neon")
        assert p.returncode == 1 and "'neon' is not compiled in" in p.stderr, (
            p.returncode, p.stdout, p.stderr)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied, untied head
def test_arm64_head_patch_matches_host_scalar_and_neon(arch, builds, tmp_path):
    """An INT4 head with a head patch (pocketlm/head_patch.py): the ARM64 build equals the
    host's with the math library pinned, its neon level its scalar level bit for bit, and both
    the numpy reference within the mode's bound (the patch's rows take the head's products)."""
    cfg = torch_ref.tiny_config(arch)
    w = _weights(cfg, 21)
    name = "lm_head.weight" if "lm_head.weight" in w else "embed.weight"
    head = w[name].dequantize()
    w[name] = quantize_int4(head, 32)
    ids = np.array([0, 5, 17, 42, 101, 250, 300, cfg.vocab_size - 1], np.int32)
    w[PATCH] = quantize_int8(head[ids], 32)
    w[PATCH_IDS] = ids
    dump = tmp_path / "model.bin"
    write_dump(cfg, w, dump)
    expected = _reference(Runtime(cfg, w, engine="numpy"))
    V = cfg.vocab_size
    for act_q8, kv_fmt in ((0, 0), (31, 1)):
        mode = f"{arch}, act_q8={act_q8}, kv_fmt={kv_fmt}, patched"
        pin_host, pin_arm = (builds.run(t, "pinned", dump, act_q8, kv_fmt, V)
                             for t in ("host", "arm64"))
        assert np.array_equal(pin_arm, pin_host), f"{mode}: {_where(pin_arm, pin_host)}"
        bound = MODES[BOUND_MODE[act_q8, kv_fmt]][3]
        assert _rel_err(pin_host, expected) <= bound, mode
        scalar = builds.run("arm64", "libc", dump, act_q8, kv_fmt, V)
        neon = builds.run("arm64", "libc", dump, act_q8, kv_fmt, V, level="neon")
        assert np.array_equal(neon, scalar), f"{mode}: {_where(neon, scalar)}"
