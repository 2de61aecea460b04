"""Saved-logits check: every engine path computes the same bits before and after a refactor.

``snapshot OUT.npz`` runs, for each engine setting in its own process (the settings are read
from the environment the way a user sets them), tiny random models of every family with float,
INT4, INT5 and INT8 weights through prefill with all logits, token-by-token decode, a prefill
split into prefill + decode and a batched decode step, and (``--model``, default smollm2-135m
when its deploy file is cached) the real model's greedy tokens and last logits. It saves every
array. ``compare A.npz B.npz`` then reports, per array, whether the bits are equal; exit 1
names the first difference.

    python benchmarks/logit_identity.py snapshot /tmp/before.npz
    ... change the code, rebuild ...
    python benchmarks/logit_identity.py snapshot /tmp/after.npz
    python benchmarks/logit_identity.py compare /tmp/before.npz /tmp/after.npz

Prints one JSON line per run (command, machine, settings, arrays, result).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")
IDS = [5, 17, 3, 250, 11, 9, 42, 7, 101, 64, 2, 300, 18, 77, 8, 190]
PROMPT = "The capital of France is"


def _settings() -> list[dict]:
    """The engine settings, as the environment a user would set."""
    sys.path.insert(0, str(ROOT))
    from pocketlm.runtime.kernels import native

    out = [{"POCKET_KERNELS": "numpy"}]
    if not native.engine_available():
        return out
    for level in native.cpu_features()["levels"]:
        for act, kv, digits in (("f32", "f32", "2"), ("f32", "f16", "2"), ("q8", "f16", "2"),
                                ("q8", "f16", "1"), ("q8", "q8", "2"), ("q8", "f32", "2")):
            out.append({"POCKET_KERNELS": "native", "POCKET_CPU_LEVEL": level,
                        "POCKET_ACT": act, "POCKET_KV": kv, "POCKET_Q8_DIGITS": digits})
    # the defaults: nothing set
    out.append({})
    return out


def _tiny_weights(cfg, kind):
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import random_state_dict

    from pocketlm.quant import quantize_int4, quantize_int5, quantize_int8

    sd = random_state_dict(cfg, seed=3)
    if kind == "float":
        return sd
    layer = {"int4": quantize_int4, "int5": quantize_int5, "int8": quantize_int8}[kind]
    out = dict(sd)
    for name, w in sd.items():
        if w.ndim == 2:
            embed = name in ("embed.weight", "lm_head.weight")
            out[name] = quantize_int8(w) if embed else (
                layer(w, 32))
    return out


def _child(out_path: str, model: str | None) -> None:
    """Runs in a child process with the settings in its environment."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import tiny_config

    from pocketlm.runtime import Runtime

    arrays = {}
    for arch in FAMILIES:
        for kind in ("float", "int4", "int5", "int8"):
            cfg = tiny_config(arch)
            rt = Runtime(cfg, _tiny_weights(cfg, kind))
            key = f"{arch}.{kind}.{rt.engine}"
            cache = rt.new_cache(len(IDS) + 4)
            arrays[key + ".prefill"] = rt.forward(IDS, cache, all_logits=True)
            cache = rt.new_cache(len(IDS) + 4)
            rows = [rt.forward(IDS[:5], cache, all_logits=True)]
            rows += [rt.forward([t], cache, all_logits=True) for t in IDS[5:]]
            arrays[key + ".split"] = np.concatenate(rows)
            caches = [rt.new_cache(len(IDS) + 4) for _ in range(3)]
            for i, c in enumerate(caches):
                rt.forward(IDS[:3 + 2 * i], c)
            arrays[key + ".batch"] = rt.forward_batch([IDS[0], IDS[1], IDS[2]], caches)
    if model:
        from pocketlm.api import load_pocket

        m = load_pocket(model, n_ctx=256)
        ids = m.tokenize(PROMPT)
        rt = m.runtime
        cache = rt.new_cache(len(ids) + 40)
        logits = rt.forward(ids, cache)
        toks = []
        for _ in range(32):
            t = int(np.argmax(logits))
            toks.append(t)
            logits = rt.forward([t], cache)
        arrays["model.greedy"] = np.array(toks, np.int64)
        arrays["model.last_logits"] = logits
    np.savez(out_path, **arrays)


def _default_model() -> str | None:
    packed = Path(os.environ.get("POCKET_HOME", Path.home() / ".cache" / "pocketlm")) / "packed"
    found = sorted(packed.glob("smollm2-135m-*.pocket"))
    return str(found[-1]) if found else None


def snapshot(out: str, model: str | None) -> int:
    result = {}
    settings = _settings()
    with tempfile.TemporaryDirectory() as tmp:
        for i, env in enumerate(settings):
            name = ",".join(f"{k[7:].lower()}={v}" for k, v in env.items()) or "defaults"
            part = os.path.join(tmp, f"{i}.npz")
            child_env = {k: v for k, v in os.environ.items() if not k.startswith("POCKET_")
                         or k == "POCKET_HOME"}
            child_env.update(env)
            subprocess.run([sys.executable, __file__, "_child", part, model or ""],
                           env=child_env, check=True)
            with np.load(part) as z:
                for k in z.files:
                    result[f"{name}|{k}"] = z[k]
    np.savez(out, **result)
    print(json.dumps({"bench": "logit_identity", "command": "snapshot", "out": out,
                      "machine": platform.machine(), "settings": len(settings),
                      "arrays": len(result), "model": model}))
    return 0


def compare(a: str, b: str) -> int:
    with np.load(a) as za, np.load(b) as zb:
        ka, kb = set(za.files), set(zb.files)
        differ = [k for k in sorted(ka & kb)
                  if za[k].shape != zb[k].shape or za[k].tobytes() != zb[k].tobytes()]
        missing = sorted(ka ^ kb)
    print(json.dumps({"bench": "logit_identity", "command": "compare", "a": a, "b": b,
                      "arrays": len(ka & kb), "different": len(differ),
                      "only_in_one": len(missing), "first_different": differ[:5],
                      "first_only_in_one": missing[:5]}))
    return 1 if differ or missing else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot", help="save the logits of every engine path")
    s.add_argument("out")
    s.add_argument("--model", default=None,
                   help="a .pocket file whose greedy tokens to save too (default: the cached "
                        "smollm2-135m deploy file, if any; 'none' to skip)")
    c = sub.add_parser("compare", help="compare two snapshots bit for bit")
    c.add_argument("a")
    c.add_argument("b")
    ch = sub.add_parser("_child")
    ch.add_argument("out")
    ch.add_argument("model")
    args = p.parse_args()
    if args.cmd == "_child":
        _child(args.out, args.model or None)
        return 0
    if args.cmd == "snapshot":
        model = None if args.model == "none" else (args.model or _default_model())
        return snapshot(args.out, model)
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
