"""Training checkpoints as model sources: export to a deploy file through the standard packing path.

``checkpoint_source(run)`` is a :class:`pocketlm.formats.SourceModel` like a GGUF file or a Hugging
Face folder (float32 tensors under the runtime's names, the run's tokenizer and chat template), so
``pocket export RUN -o model.pocket`` is ``pocket pack``'s quantization and its report, and
``pocketlm.api.from_source`` runs the checkpoint's float weights for checking an export.
"""

from __future__ import annotations

from pathlib import Path

from ..config import ModelConfig
from ..errors import FormatError
from ..formats import SourceModel, SourceTensor, run_checkpoint
from ..tokenizer import Tokenizer
from .trainer import BEST, checkpoint_weights, load_checkpoint

__all__ = ["checkpoint_source", "export"]


def checkpoint_source(run: str | Path, *, best: bool | None = None,
                      keep_lora: bool = False) -> SourceModel:
    """The run's weights as a model source. ``best``: the early-stopping best weights
    (``best.pt``); None takes them when the run has them, else the latest checkpoint. LoRA
    adapters are merged into the weights, or with ``keep_lora`` kept beside the base weights
    (:mod:`pocketlm.runtime.adapters`: the source's ``adapters``, the scale folded into B)."""
    run_path = Path(run)
    if best is None:
        path = run_checkpoint(run_path) if run_path.is_dir() else run_path
    elif best:
        path = run_path / BEST
        if not path.is_file():
            raise FormatError(f"{run}: no {BEST} (the run did not use early stopping)")
    else:
        path = run_path
    ck = load_checkpoint(path)
    cfg = ModelConfig.from_dict(ck["model_config"])
    adapters = adapter = None
    if keep_lora:
        lora = ck.get("lora")
        if not lora:
            raise FormatError(f"{run}: --keep-lora needs a LoRA run (this one trained every "
                              "weight)")
        if lora.get("qat_group"):
            raise FormatError(f"{run} was trained against the INT4 grid (--qat): export it "
                              "merged, without --keep-lora")
        state = ck["model"]
        scale = float(lora["alpha"]) / int(lora["rank"])
        adapters = {k[: -len(".lora_a")]: (
            state[k].detach().float().cpu().numpy(),
            (state[k[: -len(".lora_a")] + ".lora_b"].detach().float() * scale).cpu().numpy())
            for k in state if k.endswith(".lora_a")}
        adapter = {"kind": "lora", "rank": int(lora["rank"]), "alpha": float(lora["alpha"]),
                   "weights": len(adapters)}
        weights = {k: v for k, v in state.items() if not k.endswith((".lora_a", ".lora_b"))}
    else:
        weights = checkpoint_weights(ck)
    tensors: dict[str, SourceTensor] = {}
    for name, t in weights.items():
        arr = t.detach().float().cpu().numpy()
        tensors[name] = SourceTensor(name=name, shape=tuple(arr.shape), dtype="F32",
                                     to_float=lambda a=arr: a)
    src = SourceModel(
        config=cfg, tokenizer=Tokenizer.from_json(ck["tokenizer"]),
        chat_template=ck.get("chat_template"), tensors=tensors,
        provenance={"source": "pocketlm training checkpoint", "path": str(Path(run)),
                    "step": int(ck["step"]), "preset": ck["train_config"].get("preset"),
                    "base": ck["train_config"].get("base"), "lora": ck.get("lora"),
                    "mode": ck["train_config"].get("mode"), "saved": ck.get("saved")},
        adapters=adapters, adapter=adapter,
    )
    vocab = ck.get("vocab")  # a trimmed base's record: the export records it as pack --vocab
    if vocab:
        import numpy as np

        src.vocab = vocab["record"]
        src.vocab_source_ids = np.asarray(vocab["source_ids"], dtype=np.int32)
    src.check_tensors(str(run))
    return src


def export(run: str | Path, out: str | Path, *, group_size: int = 32, embed_bits: int = 8,
           best: bool | None = None, progress: bool = True, keep_lora: bool = False,
           **calibration):
    """Quantize the run (its best weights under early stopping, else the latest checkpoint)
    into the deploy file ``out``; returns the packing report. ``keep_lora``: keep a LoRA run's
    adapters beside the quantized base weights (float16, added at run time) instead of merging
    them before rounding. ``calibration``: pack()'s ``calib``, ``bits_per_weight``,
    ``quant_method`` and ``awq``."""
    from ..pack import pack

    src = checkpoint_source(run, best=best, keep_lora=keep_lora)
    lora = src.provenance.get("lora") or {}
    # a QAT run, or adapters kept beside the INT4 base they trained on, is exported to the
    # grid it trained against (min-max, no search: the base is on that grid already)
    qat = bool(lora.get("qat_group") or (keep_lora and lora.get("base_grid")))
    if qat and group_size != 32:
        raise FormatError(f"{run} was trained against the INT4 grid of group size 32; export "
                          "it with --group-size 32")
    return pack(src, out, group_size=group_size, embed_bits=embed_bits, progress=progress,
                int4_search=not qat, **calibration)
