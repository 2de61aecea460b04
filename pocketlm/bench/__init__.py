"""``pocket bench``: the MNN-Pocket report's methodology, side by side with other engines.

* The prompt is a fixed text tokenized by the model's tokenizer and truncated to ``n_prompt``
  tokens (hash reported); every engine gets the same ids.
* Decode: ``n_gen`` greedy tokens after the prompt, end-of-sequence ignored.
* Each engine runs in a fresh process (so its peak memory is its own): load, 1 warm-up, then
  ``runs`` measured runs. Engines alternate run by run, so that a noisy machine hits them alike.
  Reported: median, min and max of prefill and decode tokens/s.
* Peak memory: peak resident set (VmHWM) minus the resident set just before the model is loaded,
  in MiB (2^20 bytes, as /proc counts it; the ``*_mb`` fields hold MiB), judged against the
  budget in MB (10^6 bytes). File sizes are MB.
* Engines: pocketlm on its deploy file; llama.cpp (llama-cpp-python) on the GGUF; mnn (MNN's LLM
  engine, ``MNN.llm``) on an export by scripts/export-mnn, whose deploy size is the folder's.
* Energy for the report's typical call (``n_prompt`` in, ``n_gen`` out): RAPL where the machine
  exposes it, otherwise CPU-seconds x a stated watts-per-core figure, labelled as an estimate;
  compared with 1/10000 of a reference phone battery (13.9 Wh -> 5.0 J).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import KernelError, ModelNotFoundError, PocketError, UnsupportedError, refuse_empty
from ..runtime.kernels.native import MAX_THREADS
from .prompt import benchmark_ids, ids_hash

PHONE_BATTERY_WH = 13.9
# the report's budgets; energy: 1/10000 of the phone's battery (5.004 J), one threshold for
# the verdict and the plot
MIB = 1 << 20
BUDGETS = {"decode_tps": 200.0, "peak_rss_delta_mb": 300.0,  # the memory budget in MB
           "energy_j": round(PHONE_BATTERY_WH * 3600 / 10000, 3)}
# the memory budget on the scale the peaks are measured in (MiB), for drawing it beside them
MEMORY_BUDGET_MIB = BUDGETS["peak_rss_delta_mb"] * 1e6 / MIB
WATTS_PER_CORE = 3.0  # assumed power of one busy core when RAPL is not available
RAPL = Path("/sys/class/powercap/intel-rapl:0/energy_uj")
VS_ENGINES = ("llama.cpp", "mnn")
MNN_VERSION = "3.6.1"  # the version scripts/export-mnn exports for


@dataclass
class EngineResult:
    model: str
    engine: str
    threads: int
    n_prompt: int
    n_gen: int
    runs: int
    prefill_tps: float
    prefill_tps_min: float
    prefill_tps_max: float
    decode_tps: float
    decode_tps_min: float
    decode_tps_max: float
    peak_rss_delta_mb: float
    file_mb: float
    load_s: float
    energy_j_est: float
    energy_method: str
    prompt_hash: str
    machine: dict[str, Any] = field(default_factory=dict)
    command: str = ""
    memory_stages: list = field(default_factory=list)  # [stage, rss MiB, peak MiB] from baseline
    speculative: dict | None = None  # drafting of a pocketlm+SPEC row: acceptance, tokens/pass

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from ..runtime.kernels import native

    setting = {"level": None, "act": None, "amx": False, "amx_weights": None, "kv": None,
               "huge_pages": None, "head_screen": None}
    if native.available():
        try:  # what pocketlm's engine runs on with this environment's settings
            setting = native.engine_setting()
        except KernelError:
            pass
    return {"cpu": cpu, "arch": platform.machine(), "cores": os.cpu_count(),
            "kernel_level": setting["level"], "activations": setting["act"],
            "amx_prefill": setting["amx"], "amx_weights": setting["amx_weights"],
            "kv_cache": setting["kv"], "huge_pages": setting["huge_pages"],
            "head_screen": setting["head_screen"], "python": platform.python_version(),
            "os": platform.system()}


def _check_lengths(n_prompt: int, n_gen: int, max_context: int, model: str | None = None
                   ) -> None:
    """Refuse a call the model's context cannot hold: the prompt, ``n_gen`` decoded tokens
    and the last one read out (the worker's KV cache holds n_prompt + n_gen + 1)."""
    if n_prompt + n_gen >= max_context:
        raise PocketError(f"{model + ': ' if model else ''}n_prompt + n_gen = "
                          f"{n_prompt + n_gen} must be below the model's context of "
                          f"{max_context}")


class _Worker:
    def __init__(self, engine: str, path: Path, threads: int, n_ctx: int):
        env = dict(os.environ, POCKET_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
        self.engine = engine
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pocketlm.bench.worker", engine, str(path), str(threads),
             str(n_ctx)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise PocketError(f"the {self.engine} benchmark process ended unexpectedly "
                              f"(exit code {self.proc.wait()})")
        msg = json.loads(line)
        if "error" in msg:
            raise PocketError(f"{self.engine}: {msg['error']}")
        return msg

    def ask(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def _read_rapl() -> int | None:
    try:
        return int(RAPL.read_text())
    except (OSError, ValueError):
        return None


def mnn_export(model: str, mnn: str | None) -> Path:
    """The MNN export folder for ``--vs mnn``: ``mnn`` (the folder or its config.json), by default
    ``$POCKET_HOME/mnn/<model>``, where scripts/export-mnn writes a registry model's."""
    from ..registry import REGISTRY, pocket_home

    if not mnn and model not in REGISTRY:
        raise PocketError("--vs mnn: give the model's MNN export with --mnn DIR "
                          "(scripts/export-mnn NAME makes one for a registry model)")
    path = Path(mnn).expanduser() if mnn else pocket_home() / "mnn" / model
    folder = path.parent if path.is_file() else path
    if not (folder / "config.json").is_file():
        fix = (f"run scripts/export-mnn {model}" if model in REGISTRY
               else "give the folder that scripts/export-mnn wrote with --mnn DIR")
        raise PocketError(f"--vs mnn: no MNN export at {folder} (no config.json): {fix}")
    if importlib.util.find_spec("MNN") is None:
        raise PocketError(f"--vs mnn needs MNN in this Python ({sys.executable}): "
                          f"pip install MNN=={MNN_VERSION}")
    return folder


def _file_mb(path: Path) -> float:
    """Deploy size: the file, or every file of a folder (an MNN export)."""
    files = [f for f in path.iterdir() if f.is_file()] if path.is_dir() else [path]
    return sum(f.stat().st_size for f in files) / 1e6


def bench(model: str | None = None, *, threads: int = 2, n_prompt: int = 512, n_gen: int = 128,
          runs: int = 5, vs: list[str] | None = None, gguf: str | None = None,
          mnn: str | None = None, watts_per_core: float = WATTS_PER_CORE,
          progress=None, compare: list[str] | None = None,
          speculative: str | None = None, draft_max: int | None = None) -> list[EngineResult]:
    """Benchmark pocketlm (and ``vs`` engines: llama.cpp on the GGUF, MNN on the export ``mnn``)
    on one model; one result per engine. ``compare``: other models pocketlm runs in the same
    run, alternating with the first (a trimmed variant against its source, say); each is
    prompted with the benchmark text as its own tokenizer reads it. ``speculative``: also run
    the model decoding speculatively ('lookup' or a draft model), drafting at most
    ``draft_max`` tokens a step; its tokens are compared with plain decoding's, run by run."""
    from ..api import deploy_file, file_config_and_tokenizer
    from ..formats import sniff
    from ..formats.pocketfile import PocketFile
    from ..registry import DEFAULT_MODEL, resolve

    for name, value in (("threads", threads), ("n_prompt", n_prompt), ("n_gen", n_gen),
                        ("runs", runs)):
        if not isinstance(value, int) or value < 1:
            raise PocketError(f"--{name.replace('_', '-')} must be a positive integer, got "
                              f"{value!r}")
    if threads > MAX_THREADS:
        raise PocketError(f"--threads must be at most {MAX_THREADS}, got {threads}")
    if (isinstance(watts_per_core, bool) or not isinstance(watts_per_core, (int, float))
            or not 0 < watts_per_core < float("inf")):
        raise PocketError(f"--watts-per-core must be a positive number of watts, got "
                          f"{watts_per_core!r}")
    if speculative is not None:  # an empty one (an unset shell variable) is no request to skip
        if not isinstance(speculative, str) or not speculative.strip():
            raise PocketError("--speculative needs 'lookup' or a draft model, got "
                              f"{speculative!r}")
        speculative = speculative.strip()
    if draft_max is not None:
        from ..speculative import MAX_DRAFT

        if not speculative:
            raise PocketError("--draft-max applies with --speculative (lookup or a draft model)")
        if isinstance(draft_max, bool) or not isinstance(draft_max, int) \
                or not 1 <= draft_max <= MAX_DRAFT:
            raise PocketError(f"--draft-max must be from 1 to {MAX_DRAFT}, got {draft_max!r}")
    vs = list(dict.fromkeys(vs or []))  # in order, once each
    unknown = [e for e in vs if e not in VS_ENGINES]
    if unknown:
        raise UnsupportedError(f"--vs {unknown[0]!r}: supported engines to compare with: "
                               f"{', '.join(VS_ENGINES)}")
    refuse_empty("--gguf", gguf)
    refuse_empty("--mnn", mnn)
    for c in compare or ():
        refuse_empty("--compare", c, "a model")
    if mnn and "mnn" not in vs:
        raise PocketError("--mnn names the MNN export for --vs mnn: add --vs mnn")
    if gguf and "llama.cpp" not in vs:
        raise PocketError("--gguf names the GGUF for --vs llama.cpp: add --vs llama.cpp")
    name = model or DEFAULT_MODEL
    files = {"mnn": mnn_export(name, mnn)} if "mnn" in vs else {}
    src = resolve(name)
    deploy = deploy_file(src, quiet=False)  # a GGUF / HF source packed once, then cached
    config, tokenizer = file_config_and_tokenizer(PocketFile(deploy))  # checksums verified
    _check_lengths(n_prompt, n_gen, config.max_context)  # before the prompt is built
    ids = benchmark_ids(tokenizer, n_prompt)
    if speculative and speculative != "lookup":
        # a draft that does not exist or speaks another vocabulary is refused here, in one
        # line, not in the worker (a traceback, then "ended unexpectedly")
        from ..speculative import check_same_vocabulary

        try:
            draft = deploy_file(resolve(speculative), quiet=False)
        except ModelNotFoundError as e:
            raise ModelNotFoundError(f"--speculative: {e} (prompt lookup is --speculative "
                                     "lookup)") from None
        check_same_vocabulary(file_config_and_tokenizer(PocketFile(draft))[1], tokenizer,
                              speculative)
    del tokenizer
    files["pocketlm"] = deploy
    prompts = {"pocketlm": ids}
    models = {"pocketlm": name}
    spec_label = None
    if speculative:  # the same model decoding speculatively, in its own process
        spec_label = f"pocketlm+{'lookup' if speculative == 'lookup' else 'draft'}"
        files[spec_label] = deploy
        models[spec_label] = name
        spec_msg = {"method": "lookup"} if speculative == "lookup" else {"draft": speculative}
        if draft_max is not None:
            spec_msg["max_draft"] = draft_max
    for other in dict.fromkeys(compare or []):
        label = f"pocketlm:{other}"
        files[label] = deploy_file(resolve(other), quiet=False)
        if Path(files[label]).resolve() == Path(deploy).resolve():  # rows none could tell apart
            raise PocketError(f"--compare {other} is the model -m benchmarks already; name "
                              "another model")
        cfg, tok = file_config_and_tokenizer(PocketFile(files[label]))
        _check_lengths(n_prompt, n_gen, cfg.max_context, other)
        prompts[label] = benchmark_ids(tok, n_prompt)
        models[label] = other
    if "llama.cpp" in vs:
        gguf_path = Path(gguf) if gguf else Path(src)
        if sniff(gguf_path) != "gguf":
            raise PocketError("--vs llama.cpp needs the model as GGUF: give a registry name or a "
                              ".gguf file with -m, or the GGUF with --gguf")
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise PocketError("--vs llama.cpp needs llama-cpp-python: pip install "
                              "llama-cpp-python") from None
        if gguf:  # the same model: a ratio between two models is no comparison (and another
            # vocabulary failed in llama.cpp with a traceback)
            from ..formats import open_source

            other = open_source(gguf_path).config
            if other.vocab_size != config.vocab_size:
                raise PocketError(f"--gguf {gguf}: a vocabulary of {other.vocab_size:,} "
                                  f"pieces, not {name}'s {config.vocab_size:,}: give the GGUF "
                                  "of the same model")
            _check_lengths(n_prompt, n_gen, other.max_context, f"--gguf {gguf}")
        files["llama.cpp"] = gguf_path
    n_ctx = n_prompt + n_gen + 8 + (16 if speculative else 0)  # room for the last drafts
    order = ["pocketlm", *(k for k in files if k.startswith("pocketlm:")),
             *([spec_label] if spec_label else []), *vs]

    def run_msg(engine: str) -> dict:
        msg = {"cmd": "run", "ids": prompts.get(engine, ids), "n_gen": n_gen}
        if engine == spec_label:
            msg["speculative"] = spec_msg
        return msg

    workers: dict[str, _Worker] = {}
    samples: dict[str, list[dict]] = {e: [] for e in order}
    rapl: dict[str, list[float]] = {e: [] for e in order}
    try:
        for engine in order:
            workers[engine] = _Worker(engine.split(":")[0].split("+")[0], files[engine],
                                      threads, n_ctx)
            workers[engine].ask(**run_msg(engine))  # warm-up
        for r in range(runs):
            for engine in (order if r % 2 == 0 else order[::-1]):  # alternate
                e0 = _read_rapl()
                sample = workers[engine].ask(**run_msg(engine))
                e1 = _read_rapl()
                if e0 is not None and e1 is not None and e1 >= e0:
                    rapl[engine].append((e1 - e0) / 1e6)
                samples[engine].append(sample)
                if progress:
                    progress(engine, r, sample)
        stats = {e: workers[e].ask(cmd="stats") for e in order}
    finally:
        for w in workers.values():
            w.close()

    command = " ".join(["pocket", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else \
        " ".join(sys.argv)
    results = []
    for engine in order:
        s = samples[engine]
        prefill = [n_prompt / x["prefill_s"] for x in s]
        decode = [n_gen / x["decode_s"] for x in s]
        if rapl[engine]:
            energy, method = statistics.median(rapl[engine]), "rapl (the CPU package, measured: every process on it)"
        else:
            energy = statistics.median(x["cpu_s"] for x in s) * watts_per_core
            method = f"estimate: CPU-seconds x {watts_per_core:g} W per busy core"
        st = stats[engine]
        results.append(EngineResult(
            model=models.get(engine, name), engine=engine.split(":")[0], threads=threads,
            n_prompt=n_prompt, n_gen=n_gen,
            runs=runs, prefill_tps=statistics.median(prefill), prefill_tps_min=min(prefill),
            prefill_tps_max=max(prefill), decode_tps=statistics.median(decode),
            decode_tps_min=min(decode), decode_tps_max=max(decode),
            peak_rss_delta_mb=st["peak_rss_mb"] - st["baseline_rss_mb"],
            file_mb=_file_mb(files[engine]), load_s=st["load_s"],
            energy_j_est=energy, energy_method=method,
            prompt_hash=ids_hash(prompts.get(engine, ids)),
            machine=machine_info(), command=command,
            memory_stages=[[name, rss - st["baseline_rss_mb"], hwm - st["baseline_rss_mb"]]
                           for name, rss, hwm in st.get("stages", [])],
            speculative=_speculative_summary(s, samples["pocketlm"], draft_max)
            if engine == spec_label else None,
        ))
    return results


def _speculative_summary(spec: list[dict], plain: list[dict], draft_max: int | None) -> dict:
    """The last speculative run's drafting, and whether every run's tokens equal the plain run
    of the same round (``same_tokens``; ``runs_differing`` counts those that do not)."""
    out = dict(spec[-1].get("speculative") or {})
    differing = sum(a.get("ids") != b.get("ids") for a, b in zip(spec, plain))
    out.update(same_tokens=differing == 0, runs_differing=differing)
    if draft_max is not None:
        out["max_draft"] = draft_max
    return out


BUDGET_CALL = (512, 128)  # the call the energy budget is for: prompt and decoded tokens


def budget_line(r: EngineResult) -> str:
    """The verdict on each budget, judged on the values as printed (a verdict that differs
    between two lines showing the same numbers would be no verdict)."""
    battery_j = BUDGETS["energy_j"]
    decode, memory = BUDGETS["decode_tps"], BUDGETS["peak_rss_delta_mb"]
    # the peak is measured in MiB (as /proc reports it); the budget is in MB (10^6 bytes)
    tps, peak = round(r.decode_tps, 1), round(r.peak_rss_delta_mb * MIB / 1e6, 1)
    checks = [  # (name, met, "measured; budget")
        ("decode", tps > decode, f"{tps:.1f} tok/s; budget > {decode:g}"),
        ("memory", peak < memory, f"{r.peak_rss_delta_mb:.1f} MiB = {peak:.1f} MB; budget "
                                  f"< {memory:g} MB"),
    ]
    line = "  ".join(f"{name}: {'PASS' if ok else 'MISS'} ({text})" for name, ok, text in checks)
    energy = round(r.energy_j_est, 3)
    if (r.n_prompt, r.n_gen) != BUDGET_CALL:  # a shorter call uses less: no verdict
        return line + (f"  energy: not judged ({energy:.3f} J for {r.n_prompt} + "
                       f"{r.n_gen} tokens; the budget <= {battery_j:.3f} J is for a "
                       f"{BUDGET_CALL[0]} + {BUDGET_CALL[1]}-token call)")
    met = energy <= battery_j
    return line + (f"  energy: {'PASS' if met else 'MISS'} ({energy:.3f} J; "
                   f"budget <= {battery_j:.3f})")


def memory_breakdown(results: list[EngineResult]) -> str:
    """Where memory goes: resident set (and peak) above the baseline after each load step."""
    lines = ["memory above the pre-load baseline (MiB): step, resident, peak"]
    for r in results:
        prev = 0.0
        for name, rss, hwm in r.memory_stages:
            lines.append(f"  {r.engine:<10} {name:<36} {rss:8.1f} ({rss - prev:+.1f}) "
                         f"peak {hwm:8.1f}")
            prev = rss
    return "\n".join(lines)


def row_label(r: EngineResult, first: EngineResult) -> str:
    """A result's name in the table and the picture: its engine, and its model where it is
    not the first row's (``--compare``)."""
    return r.engine if r.model == first.model else f"{r.engine} {r.model}"


def format_table(results: list[EngineResult]) -> str:
    r0 = results[0]
    lines = [
        f"model {r0.model}  threads {r0.threads}  prompt {r0.n_prompt} tokens "
        f"(hash {r0.prompt_hash})  decode {r0.n_gen} tokens  runs {r0.runs} (+1 warm-up)",
        f"machine: {r0.machine.get('cpu')} ({r0.machine.get('cores')} CPUs); pocketlm kernels "
        f"{r0.machine.get('kernel_level')}"
        + (f", {r0.machine['activations']} activations" if r0.machine.get("activations")
           else "")
        + ((", AMX-BF16 prefill"
            + (f" ({r0.machine['amx_weights']} weights)" if r0.machine.get("amx_weights")
               else ""))
           if r0.machine.get("amx_prefill") else "")
        + (f", {r0.machine['kv_cache']} KV cache" if r0.machine.get("kv_cache") else ""),
        "",
        f"{'engine':<10} {'prefill tok/s':>22} {'decode tok/s':>22} {'peak Δ MiB':>10} "
        f"{'file MB':>8} {'load s':>7} {'energy J':>9}",
    ]
    def label(r: EngineResult) -> str:
        return row_label(r, r0)

    for r in results:
        lines.append(
            f"{label(r):<10} {r.prefill_tps:>8.1f} [{r.prefill_tps_min:.0f}-{r.prefill_tps_max:.0f}]"
            f"{'':>3} {r.decode_tps:>8.1f} [{r.decode_tps_min:.0f}-{r.decode_tps_max:.0f}]"
            f"{'':>3} {r.peak_rss_delta_mb:>10.0f} {r.file_mb:>8.1f} {r.load_s:>7.2f} "
            f"{r.energy_j_est:>9.2f}")
    if len(results) > 1:
        base = results[0]
        for other in results[1:]:
            lines.append(
                f"{label(other)} / pocketlm: prefill x{other.prefill_tps / base.prefill_tps:.2f}, "
                f"decode x{other.decode_tps / base.decode_tps:.2f}, peak memory "
                f"x{other.peak_rss_delta_mb / max(base.peak_rss_delta_mb, 1e-9):.2f}"
                if other.engine.startswith("pocketlm") else
                f"pocketlm / {other.engine}: prefill x{base.prefill_tps / other.prefill_tps:.2f}, "
                f"decode x{base.decode_tps / other.decode_tps:.2f}, peak memory "
                f"x{base.peak_rss_delta_mb / max(other.peak_rss_delta_mb, 1e-9):.2f}")
    for r in results:
        if r.speculative:
            sp = r.speculative
            same = ("the same greedy tokens as plain decoding in every run"
                    if sp.get("same_tokens") else
                    f"tokens DIFFER from plain decoding in {sp.get('runs_differing')} of "
                    f"{r.runs} runs")
            lines.append(f"{r.engine}: {sp['accepted']}/{sp['drafted']} drafts accepted "
                         f"({sp['acceptance']:.0%}), {sp['tokens_per_step']:.2f} tokens per pass "
                         f"({same})")
    lines.append("")
    lines.append(f"budgets (pocketlm): {budget_line(results[0])}")
    for r in results[1:]:
        if r.engine == "pocketlm":
            lines.append(f"budgets ({r.model}): {budget_line(r)}")
    lines.append(f"energy: {results[0].energy_method}; budget = 1/10000 of a "
                 f"{PHONE_BATTERY_WH} Wh phone battery")
    return "\n".join(lines)


__all__ = ["bench", "EngineResult", "format_table", "budget_line", "BUDGETS", "VS_ENGINES"]
