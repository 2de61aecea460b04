"""Pre-training and supervised fine-tuning of a :class:`~pocketlm.train.model.PocketLM`.

One entry point, :func:`train`, runs on a laptop CPU for the ``tiny`` preset and, unchanged, under
``torchrun --nproc_per_node N`` with PyTorch DDP (``--fsdp`` shards the model with FSDP for the
large presets). What it does:

* AdamW with decoupled weight decay (not on norms and biases), linear warm-up then cosine decay to
  ``min_lr_ratio * lr``, gradient accumulation, gradient clipping, bf16 autocast where the
  hardware has it (``dtype="auto"``: CUDA with bf16; float32 on CPUs, where it is predictable);
* batches that are a pure function of ``(seed, step)`` (:class:`~pocketlm.train.data.TokenShards`
  for pre-training, :class:`SFTData` for chats), so a run stopped at any point and resumed from
  its last checkpoint continues with exactly the losses it would have had;
* checkpoints written atomically every ``save_every`` steps (model, optimizer, step, RNG states,
  the tokenizer and both configs, in one file), held-out loss every ``eval_every`` steps, metrics
  as JSON lines, a loss-curve picture, and a progress bar with tokens/s and ETA;
* SFT: chats formatted with the chat template, loss on the assistant tokens only;
* distillation: logit distillation from a teacher with the same vocabulary (any GGUF or
  Hugging Face model, loaded into torch through the runtime's importers).

A run directory holds ``checkpoint.pt`` (the latest state), ``metrics.jsonl``, ``loss.svg`` and
``train_config.json``; :mod:`pocketlm.train.export` turns it into a deploy file.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..errors import FormatError, PocketError
from ..tokenizer import Tokenizer
from .model import PocketLM, preset_config

__all__ = ["BEST", "CHECKPOINT", "SFTData", "TrainConfig", "checkpoint_weights",
           "load_checkpoint", "model_from_checkpoint", "train"]

CHECKPOINT = "checkpoint.pt"
BEST = "best.pt"  # with early stopping: the weights of the best held-out loss
MAX_LR = float(torch.finfo(torch.float32).max)  # beyond, the optimizer failed mid-step
MAX_COUNT = 1 << 20  # --batch-size, --grad-accum, --threads
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class TrainConfig:
    """Everything a run needs; stored in the checkpoint and in ``train_config.json``."""

    out: str
    data: str
    preset: str | None = "tiny"  # None when fine-tuning a base model
    mode: str = "pretrain"  # "pretrain" | "sft"
    steps: int = 200
    batch_size: int = 8  # sequences per process per micro-step
    grad_accum: int = 1
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 8
    save_every: int = 50
    seed: int = 0
    dtype: str = "auto"  # "auto" | "bf16" | "fp32"
    init_from: str | None = None  # a run or checkpoint to start from (SFT after pre-training)
    distill_from: str | None = None  # teacher model: registry name, GGUF, HF folder, run
    distill_alpha: float = 0.5  # weight of the distillation term
    distill_temperature: float = 1.0
    fsdp: bool = False
    threads: int | None = None
    base: str | None = None  # fine-tune this model (registry name, GGUF, HF folder, run)
    lora_rank: int = 0  # 0: full fine-tuning; else LoRA adapters of this rank
    lora_alpha: float | None = None  # LoRA scale numerator (default 2 * rank)
    val_data: str | None = None  # held-out chats for SFT (default: 5 % of --data)
    early_stop: int = 0  # stop after this many evaluations without a better held-out loss
    strict: bool = False  # SFT: refuse malformed JSONL lines instead of skipping them
    qat: bool = False  # LoRA: train against the INT4 grid the export uses (group 32)
    # LoRA: the frozen base rounded to that grid once, the adapters trained in float beside it
    # (the deploy file of `--keep-lora`, which adds float16 adapters to INT4 weights)
    qat_base: bool = False

    def check(self) -> None:
        if self.mode not in ("pretrain", "sft"):
            raise PocketError(f"mode must be 'pretrain' or 'sft', got {self.mode!r}")
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "eval_every",
                     "eval_batches", "save_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PocketError(f"--{name.replace('_', '-')} must be a positive integer, "
                                  f"got {v!r}")
        # NaN, inf or a negative value here trains to NaN weights or up the loss, silently;
        # past float32's range torch fails mid-step (a traceback)
        if not 0 < self.lr <= MAX_LR:
            raise PocketError(f"--lr must be a positive finite number, got {self.lr} (at most "
                              f"{MAX_LR:.3g}, float32's largest)")
        for name in ("batch_size", "grad_accum", "threads"):  # a traceback past C's integers
            v = getattr(self, name)
            if v is not None and v > MAX_COUNT:
                raise PocketError(f"--{name.replace('_', '-')} must be at most {MAX_COUNT:,}, "
                                  f"got {v:,}")
        if not isinstance(self.warmup, int) or isinstance(self.warmup, bool) or self.warmup < 0:
            raise PocketError(f"--warmup must be 0 or more steps, got {self.warmup!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise PocketError(f"min_lr_ratio must be from 0 to 1, got {self.min_lr_ratio}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise PocketError(f"--weight-decay must be a non-negative finite number, got "
                              f"{self.weight_decay}")
        if not self.clip > 0:
            raise PocketError(f"--clip must be a positive gradient norm, got {self.clip}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or \
                not 0 <= self.seed < 2**63:
            raise PocketError(f"--seed must be an integer from 0 to 2**63 - 1, got "
                              f"{self.seed!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or
                                         not isinstance(self.threads, int) or self.threads < 1):
            raise PocketError(f"--threads must be a positive integer, got {self.threads!r}")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise PocketError(f"dtype must be auto, bf16 or fp32, got {self.dtype!r}")
        if not 0 <= self.distill_alpha <= 1:
            raise PocketError(f"--distill-alpha must be from 0 to 1, got {self.distill_alpha}")
        if not 0 < self.distill_temperature < math.inf:
            raise PocketError(f"--distill-temperature must be a positive finite number, got "
                              f"{self.distill_temperature}")
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise PocketError(f"--lora-rank must be 0 (full fine-tuning) or positive, got "
                              f"{self.lora_rank!r}")
        if self.lora_alpha is not None and not self.lora_rank:
            raise PocketError("--lora-alpha scales LoRA adapters: give --lora-rank too")
        if self.lora_alpha is not None and not 0 < self.lora_alpha < math.inf:
            raise PocketError(f"--lora-alpha must be a positive finite number, got "
                              f"{self.lora_alpha}")
        if (self.qat or self.qat_base) and not self.lora_rank:
            raise PocketError("--qat trains LoRA adapters against the INT4 grid: give "
                              "--lora-rank too")
        if self.qat and self.qat_base:
            raise PocketError("qat (adapters merged into the INT4 grid) and qat_base (adapters "
                              "beside an INT4 base) exclude each other")
        if self.lora_rank and self.fsdp:
            raise PocketError("LoRA with --fsdp is not supported; use DDP (no --fsdp)")
        if not isinstance(self.early_stop, int) or self.early_stop < 0:
            raise PocketError(f"--early-stop must be a non-negative integer, got "
                              f"{self.early_stop!r}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)


# ---------------------------------------------------------------------------------------------
# supervised fine-tuning data
# ---------------------------------------------------------------------------------------------


class SFTData:
    """Chats (JSONL, one ``{"messages": [{"role", "content"}, ...]}`` per line) as token ids and
    a mask of the tokens that carry loss: every assistant message (its text and end-of-turn),
    nothing of the system and user turns or the assistant header.

    The chat template renders each prefix of the conversation; the ids of message ``i`` are the
    tokens of ``render(messages[:i+1])`` past ``render(messages[:i])`` (with the generation
    prompt for an assistant turn), so any template whose turns end in a special token works.

    Why piece by piece, not the rendered chat as one text: the pieces start with a turn's
    special token (no BPE merge crosses one, so there the ids are the one text's), except an
    answer, which starts after its generation prompt. That is where the runtime cuts too: it
    encodes the prompt up to the generation prompt as one text (``chat_ids``) and the answer's
    tokens follow it. An answer starting with whitespace ("\n\nSure") would, encoded with its
    prompt as one text, merge with the prompt's last newline into a token across the two, a
    prompt the runtime never has (tests/test_finetune.py checks this on the registry
    tokenizers). The one place these ids are not the runtime's: such an answer as history of a
    later turn, which the runtime encodes with the history as one text.
    """

    def __init__(self, path: str | Path, tokenizer: Tokenizer, chat_template: str | None,
                 seq_len: int, *, holdout: float = 0.05, seed: int = 0, strict: bool = False):
        from ..chat import encode_rendered, mark_control_text
        from ..chat import render as render_chat

        self.path = Path(path)
        self.seq_len = seq_len
        template = chat_template or CHATML
        examples: list[tuple[np.ndarray, np.ndarray]] = []
        bad: list[str] = []
        cut = 0
        unfit = 0  # chats the template does not render prefix by prefix
        # the token texts the runtime renders chats with (PocketModel.render_chat): a template
        # that closes each turn with {{ eos_token }} must teach the model that token, or the
        # tuned model never learns to stop
        bos = tokenizer.id_to_token(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
        eos = tokenizer.id_to_token(tokenizer.eos_ids[0]) if tokenizer.eos_ids else ""
        bos, eos = bos or "", eos or ""
        from ..textfile import json_line, jsonl_lines, read_text_file

        try:
            lines = jsonl_lines(read_text_file(self.path, what="JSONL file"))
        except PocketError as e:
            if "the file is empty" not in str(e):
                raise
            lines = []  # reported below as "no chats"
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                msgs = _chat_record(json_line(line))
                # a message's text is text, even where it spells a control token, as the
                # runtime encodes it (PocketModel.chat_ids): rendered with markers for it
                marked = mark_control_text(msgs, tokenizer, template)
                msgs = marked.messages if marked else msgs
                ids: list[int] = []
                mask: list[bool] = []
                prev = ""
                for i, m in enumerate(msgs):
                    if m["role"] == "assistant":
                        head = render_chat(template, msgs[:i], add_generation_prompt=True,
                                           bos_token=bos, eos_token=eos)
                        part = encode_rendered(tokenizer, head[len(prev):], marked)
                        ids += part
                        mask += [False] * len(part)
                        prev = head
                    full = render_chat(template, msgs[: i + 1], add_generation_prompt=False,
                                       bos_token=bos, eos_token=eos)
                    if not full.startswith(prev):
                        # a template that adds a system turn unless the chat opens with one
                        # renders a chat that opens with an answer one way alone and another
                        # way after the answer: this chat, not every chat (unless all fail)
                        unfit += 1
                        raise ValueError("the chat template does not render this conversation "
                                         "prefix by prefix (its text changes once a later "
                                         "message is added)")
                    part = encode_rendered(tokenizer, full[len(prev):], marked)
                    ids += part
                    mask += [m["role"] == "assistant"] * len(part)
                    prev = full
            except FormatError:
                raise  # the template itself (it does not parse): every line would fail
            except (ValueError, KeyError, TypeError, PocketError) as e:
                # a line the template refuses (roles that do not alternate) or text no
                # tokenizer encodes (a lone surrogate) is as malformed as bad JSON: one line,
                # skipped or (--strict) refused with its number, never the whole run
                if strict:
                    raise FormatError(f"{self.path}: line {n}: {e}") from None
                bad.append(f"line {n}: {e}")
                continue
            # as the runtime does: BOS unless the template wrote it already
            if tokenizer.add_bos and tokenizer.bos_id is not None and not (
                    bos and prev.startswith(bos)):
                ids, mask = [tokenizer.bos_id, *ids], [False, *mask]
            if any(mask[1: seq_len + 1]):  # an answer token within the window is a target
                examples.append((np.asarray(ids[: seq_len + 1], dtype=np.int64),
                                 np.asarray(mask[: seq_len + 1], dtype=bool)))
            elif any(mask):
                cut += 1
        if bad and not examples and not cut and unfit == len(bad):
            raise FormatError(f"{self.path}: the chat template does not render conversations "
                              "prefix by prefix; SFT needs one that does")
        if bad and not examples and not cut:
            raise FormatError(f"{self.path}: no valid chat records ({bad[0]})")
        if not examples and cut:
            raise FormatError(f"{self.path}: every chat's answer starts after the first "
                              f"{seq_len} tokens, so nothing is left to learn; raise --seq-len")
        if not examples:
            raise FormatError(f"{self.path}: no chats with an assistant message")
        self.cut = cut  # chats whose answers lie wholly past seq_len: left out
        self.skipped = bad
        self.pad_id = tokenizer.eos_ids[0] if tokenizer.eos_ids else 0
        order = np.random.default_rng(seed).permutation(len(examples))
        # holdout 0 (--val-data given): every chat trains; 1 (the --val-data file itself):
        # every chat is held out, one chat as well; between: at least one each side
        if holdout <= 0:
            n_val = 0
        elif holdout >= 1:
            n_val = len(examples)
        else:
            n_val = max(1, int(round(holdout * len(examples)))) if len(examples) > 1 else 0
        self.val = [examples[i] for i in order[:n_val]]
        self.train = [examples[i] for i in order[n_val:]] or self.val
        if holdout > 0 and not self.val:
            # one chat cannot be split: measure it, rather than an empty held-out set's loss
            # of 0 (which early stopping would read as a perfect model that never improves)
            self.val = self.train

    @property
    def n_train(self) -> int:
        return len(self.train)

    def _stack(self, rows: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        # padded to the longest chat of the batch, not to seq_len: short chats cost less
        T = max(len(x) for x, _ in rows)
        ids = np.full((len(rows), T), self.pad_id, dtype=np.int64)
        tgt = np.full((len(rows), T), -100, dtype=np.int64)
        for r, (x, m) in enumerate(rows):
            ids[r, : len(x)] = x
            tgt[r, : len(x)] = np.where(m, x, -100)
        return ids, tgt

    def batch(self, step: int, batch_size: int, *, seed: int = 0, rank: int = 0,
              world: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Ids and targets (-100 where no loss) ``[batch_size, T]``, ``T <= seq_len + 1`` the
        longest chat of the batch (shorter ones padded); rank ``r`` gets
        rows ``r*batch_size..`` of the global batch drawn for ``(seed, step)``."""
        rng = np.random.default_rng([seed, step])
        pick = rng.integers(0, len(self.train), batch_size * world)
        rows = [self.train[i] for i in pick[rank * batch_size:(rank + 1) * batch_size]]
        return self._stack(rows)

    def eval_batches(self, batch_size: int, max_batches: int) -> Iterator[tuple[np.ndarray,
                                                                                np.ndarray]]:
        for b in range(0, min(len(self.val), batch_size * max_batches), batch_size):
            yield self._stack(self.val[b:b + batch_size])


def _chat_record(rec: object) -> list[dict]:
    """The messages of one JSONL record: ``{"messages": [...]}`` or ``{"prompt", "completion"}``
    (a user turn and the assistant's answer)."""
    if not isinstance(rec, dict):
        raise ValueError("each line must be a JSON object")
    if "messages" in rec:
        msgs = rec["messages"]
    elif "prompt" in rec and "completion" in rec:
        msgs = [{"role": "user", "content": rec["prompt"]},
                {"role": "assistant", "content": rec["completion"]}]
    else:
        raise ValueError(f"expected 'messages' or 'prompt' and 'completion', found fields "
                         f"{sorted(rec)}")
    if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
            and isinstance(m.get("content"), str) for m in msgs):
        raise ValueError("messages must be a non-empty list of {role: system|user|assistant, "
                         "content: str}")
    return msgs


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


@dataclass
class _Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0


def _init_distributed(timeout=None) -> _Dist:
    """torchrun's group, joined once (``timeout``: a ``datetime.timedelta`` for its collectives,
    else torch's default)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        return _Dist(device=dev)
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        backend, dev = "nccl", torch.device("cuda", local)
    else:
        backend, dev = "gloo", torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend, **({"timeout": timeout} if timeout else {}))
        # left to the interpreter's own teardown, the group's threads sometimes outlive it:
        # "terminate called without an active exception" and SIGABRT after a finished run
        atexit.register(_leave_group)
    return _Dist(dist.get_rank(), dist.get_world_size(), local, dev)


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX); without it
    PyTorch's bfloat16 products on the CPU run far slower than float32 (about 100 times on an
    AVX2 machine)."""
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return True  # cannot tell (not Linux): say nothing
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _warn_slow_bf16(cfg: TrainConfig, device: torch.device) -> None:
    if cfg.dtype == "bf16" and device.type == "cpu" and not _cpu_has_bf16():
        print("pocket: warning: --dtype bf16 on a CPU without native bfloat16 (no AVX-512 BF16 "
              "or AMX) trains far slower than float32; --dtype auto picks float32 here",
              file=sys.stderr, flush=True)


def _autocast(cfg: TrainConfig, device: torch.device):
    use_bf16 = cfg.dtype == "bf16" or (
        cfg.dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())
    if not use_bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=1e-8)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_text(path: Path, text: str) -> None:
    """Write ``path`` through a temporary beside it; an error, Ctrl-C or SIGTERM mid-write
    leaves neither a half-written file nor the temporary."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # an error, Ctrl-C or SIGTERM mid-write: no half-written file left
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _checkpoint_path(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / CHECKPOINT
    if not p.is_file():
        raise PocketError(f"{path}: no pocketlm training checkpoint there (expected a run "
                          f"folder with {CHECKPOINT} or the file itself)")
    return p


def load_checkpoint(path: str | Path) -> dict:
    """The checkpoint dict of a run folder (or ``checkpoint.pt``): ``model_config``,
    ``train_config``, ``step``, ``model`` (state dict), ``tokenizer`` (JSON), ``chat_template``."""
    p = _checkpoint_path(path)
    try:
        ck = torch.load(p, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises many kinds for a damaged file
        raise FormatError(f"{p}: not a readable training checkpoint ({e})") from None
    if not isinstance(ck, dict) or ck.get("format") != "pocketlm-checkpoint":
        raise FormatError(f"{p}: not a pocketlm training checkpoint")
    bad = [k for k, kind in (("step", int), ("model_config", dict), ("train_config", dict),
                             ("model", dict), ("tokenizer", str))
           if not isinstance(ck.get(k), kind) or isinstance(ck.get(k), bool)]
    if bad:
        raise FormatError(f"{p}: a damaged training checkpoint ({', '.join(bad)} missing or "
                          "malformed)")
    return ck


def checkpoint_step(path: str | Path) -> int | None:
    """The step of the checkpoint in a run folder (or ``checkpoint.pt``), read without its
    tensors (memory-mapped); None when there is none or it does not read."""
    p = _checkpoint_path(path)
    try:
        ck = torch.load(p, map_location="cpu", weights_only=False, mmap=True)
    except Exception:  # absent, damaged: torch raises many kinds
        return None
    step = ck.get("step") if isinstance(ck, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def checkpoint_weights(ck: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's model weights under the runtime's names (LoRA adapters merged)."""
    if ck.get("lora"):
        from .lora import merge_lora_state

        return merge_lora_state(ck["model"], ck["lora"])
    return ck["model"]


def model_from_checkpoint(ck: dict) -> tuple[PocketLM, Tokenizer]:
    cfg = ModelConfig.from_dict(ck["model_config"])
    model = PocketLM(cfg, init_seed=None)
    _load_weights(model, checkpoint_weights(ck), "the checkpoint")
    return model, Tokenizer.from_json(ck["tokenizer"])


def _load_weights(model: torch.nn.Module, state: dict, origin: str) -> None:
    """``load_state_dict`` with a one-line error when the weights do not fit the config."""
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        detail = next((x.strip() for x in first[1:] if x.strip()), first[0] if first else "")
        raise FormatError(f"{origin}: the weights do not fit the model config ({detail})") \
            from None


def _base_model(spec: str):
    """A model to fine-tune: a training run, or any GGUF file / Hugging Face folder / registry
    model through the runtime's importers (dequantized to float32). Returns the config, a
    function that loads the weights (called once the data has been checked), the tokenizer and
    the chat template."""
    if Path(spec).is_dir() and (Path(spec) / CHECKPOINT).is_file():
        from ..formats import run_checkpoint

        # the run's model is what export and the runtime take from the folder: its
        # early-stopping best weights where it kept them, not the later, worse ones
        ck = load_checkpoint(run_checkpoint(spec))
        return (ModelConfig.from_dict(ck["model_config"]), lambda: checkpoint_weights(ck),
                Tokenizer.from_json(ck["tokenizer"]), ck.get("chat_template"), ck.get("vocab"))
    from ..formats import open_source, sniff
    from ..registry import resolve

    path = resolve(spec, quiet=True)
    if sniff(path) == "pocket":
        raise PocketError(f"{spec}: a deploy file is quantized; fine-tune from the GGUF file, the "
                          "Hugging Face folder, a registry name or a training run")
    src = open_source(path)

    def weights() -> dict[str, torch.Tensor]:
        return {n: torch.tensor(np.asarray(t.to_float(), dtype=np.float32))
                for n, t in src.tensors.items()}

    return src.config, weights, src.tokenizer, src.chat_template, vocab_record(src)


def vocab_record(src) -> dict | None:
    """A trimmed base's vocabulary record and map back to its source's ids (pocketlm.vocab),
    kept in the run's checkpoints so that its exports record them as ``pack --vocab`` does."""
    if src.vocab is None or src.vocab_source_ids is None:
        return None
    return {"record": src.vocab,
            "source_ids": [int(i) for i in np.asarray(src.vocab_source_ids).tolist()]}


def _same_vocabulary(a: Tokenizer, b: Tokenizer) -> bool:
    if a.vocab_size != b.vocab_size:
        return False
    return all(a.id_to_token(i) == b.id_to_token(i) for i in range(a.vocab_size))


def _teacher(cfg: TrainConfig, tokenizer: Tokenizer, device) -> PocketLM:
    """The distillation teacher (a run, GGUF file, Hugging Face folder or registry model) in
    torch; it must have the student's vocabulary."""
    src = cfg.distill_from
    t_cfg, weights, t_tok, _, _ = _base_model(src)
    if not _same_vocabulary(tokenizer, t_tok):
        raise PocketError(
            f"the teacher {src!r} has another vocabulary ({t_tok.vocab_size} tokens vs "
            f"{tokenizer.vocab_size}): logit distillation needs the same tokenizer; train the "
            "student with the teacher's tokenizer (--tokenizer), or distill on the teacher's "
            "generated text instead (pocket distill-data, then --mode sft on its output)")
    teacher = PocketLM(t_cfg, init_seed=None)
    _load_weights(teacher, weights(), f"the teacher {src!r}")
    teacher.eval().requires_grad_(False)
    return teacher.to(device)


def _plot_losses(metrics: list[dict], path: Path, title: str) -> None:
    """A small SVG of the training and held-out loss by step."""
    train = [(m["step"], m["loss"]) for m in metrics if "loss" in m]
    val = [(m["step"], m["val_loss"]) for m in metrics if "val_loss" in m]
    if not train:
        return
    W, H, pad = 640, 360, 50
    steps = [s for s, _ in train + val]
    losses = [v for _, v in train + val]
    x0, x1 = min(steps), max(max(steps), min(steps) + 1)
    y0, y1 = min(losses), max(losses)
    y1 = y1 if y1 > y0 else y0 + 1

    def xy(s, v):
        return (pad + (W - 2 * pad) * (s - x0) / (x1 - x0),
                H - pad - (H - 2 * pad) * (v - y0) / (y1 - y0))

    def poly(points, color):
        pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(s, v) for s, v in points))
        return f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/>'

    from html import escape
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           'font-family="sans-serif" font-size="12">', '<rect width="100%" height="100%" '
           'fill="white"/>', f'<text x="{pad}" y="20" font-size="14">{escape(title)}</text>',
           f'<line x1="{pad}" y1="{H - pad}" x2="{W - pad}" y2="{H - pad}" stroke="#333"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{H - pad}" stroke="#333"/>',
           f'<text x="{pad}" y="{H - pad + 16}">{x0}</text>',
           f'<text x="{W - pad - 30}" y="{H - pad + 16}">step {x1}</text>',
           f'<text x="4" y="{pad + 4}">{y1:.2f}</text>',
           f'<text x="4" y="{H - pad}">{y0:.2f}</text>', poly(train, "#2f6fdf")]
    if val:
        out.append(poly(val, "#e07b39"))
    out.append(f'<text x="{W - 190}" y="40" fill="#2f6fdf">training loss</text>')
    out.append(f'<text x="{W - 190}" y="56" fill="#e07b39">held-out loss</text>')
    out.append("</svg>")
    _atomic_text(path, "\n".join(out))


def _same_file(a: str | None, b: str | None) -> bool:
    """Whether paths ``a`` and ``b`` name one existing file or folder."""
    try:
        return bool(a and b) and os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def _kept(saved_step: int) -> str:
    """What a run stopped by an error leaves: its last checkpoint, if it wrote one."""
    return f"the checkpoint of step {saved_step} is kept" if saved_step else \
        "no checkpoint was written"


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says an allocation failed (MemoryError; torch's CPU allocator raises a
    RuntimeError "can't allocate memory", CUDA's an OutOfMemoryError)."""
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or "can't allocate memory" in text or \
        "out of memory" in text


def train(cfg: TrainConfig, *, tokenizer: Tokenizer | None = None,
          chat_template: str | None = None, progress: bool = True) -> dict:
    """Run (or resume) training; returns the final metrics. ``tokenizer`` is needed for a new
    run (a resumed run and ``init_from`` bring their own)."""
    cfg.check()
    dist = _init_distributed()
    if dist.main:
        _warn_slow_bf16(cfg, dist.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    ck_path = out / CHECKPOINT
    resume = ck_path.is_file()
    init = None
    base_state = None
    vocab = None  # a trimmed vocabulary's record, carried from the base (vocab_record)
    if resume:
        ck = load_checkpoint(ck_path)
        saved = TrainConfig.from_dict(ck["train_config"])
        # the base as the same file however it is spelled (./tiny.gguf was another model)
        base = saved.base if _same_file(cfg.base, saved.base) else cfg.base
        ours = (cfg.preset, cfg.mode, base, cfg.lora_rank, cfg.qat, cfg.qat_base)
        theirs = (saved.preset, saved.mode, saved.base, saved.lora_rank, saved.qat,
                  saved.qat_base)
        if ours != theirs:
            def say(t):
                grid = ", QAT" if t[4] else ", on the INT4 base" if t[5] else ""
                return (f"{t[1]} of {t[2]}" if t[2] else f"{t[0]} {t[1]}") + \
                    (f" (LoRA rank {t[3]}{grid})" if t[3] else "")
            raise PocketError(f"{out} holds a {say(theirs)} run; this one is {say(ours)}: use "
                              "another --out, or the same settings to resume")
        alpha = {c.lora_alpha if c.lora_alpha is not None else 2.0 * c.lora_rank
                 for c in (cfg, saved)}
        if cfg.lora_rank and len(alpha) > 1:
            # the adapters trained so far were scaled by the run's alpha: another one would
            # change the model they make, silently
            raise PocketError(f"{out} holds a LoRA run with --lora-alpha "
                              f"{saved.lora_alpha or 2 * saved.lora_rank:g}; resume it with "
                              "the same --lora-alpha, or use another --out")
        order = [f"--{k.replace('_', '-')} {getattr(saved, k)} (now {getattr(cfg, k)})"
                 for k in ("seed", "batch_size", "grad_accum", "seq_len", "data", "val_data",
                           "lr", "dtype")
                 if getattr(saved, k) != getattr(cfg, k)
                 and not (k in ("data", "val_data") and _same_file(getattr(saved, k),
                                                                     getattr(cfg, k)))]
        if order and dist.main:
            print(f"[resuming {out} with other settings than it ran with: "
                  f"{', '.join(order)}; it goes on, but not as the uninterrupted run would]",
                  file=sys.stderr)
        model_cfg = ModelConfig.from_dict(ck["model_config"])
        tokenizer = Tokenizer.from_json(ck["tokenizer"])
        chat_template = ck.get("chat_template")
        vocab = ck.get("vocab")
    elif cfg.base:
        model_cfg, base_state, tokenizer, base_template, vocab = _base_model(cfg.base)
        chat_template = chat_template or base_template  # (the weights load later)
    elif cfg.init_from:
        from ..formats import run_checkpoint

        # a run folder: its best weights where early stopping kept them (as export takes it)
        init = load_checkpoint(run_checkpoint(cfg.init_from) if Path(cfg.init_from).is_dir()
                               else cfg.init_from)
        model_cfg = ModelConfig.from_dict(init["model_config"])
        tokenizer = Tokenizer.from_json(init["tokenizer"])
        chat_template = chat_template or init.get("chat_template")
        vocab = init.get("vocab")
        if model_cfg.max_context < cfg.seq_len:
            raise PocketError(f"--seq-len {cfg.seq_len} exceeds the model's context "
                              f"{model_cfg.max_context}")
    else:
        if tokenizer is None:
            raise PocketError("a new run needs a tokenizer")
        model_cfg = preset_config(cfg.preset, tokenizer.vocab_size,
                                  max_context=max(cfg.seq_len, 256))
    if cfg.seq_len > model_cfg.max_context:
        raise PocketError(f"--seq-len {cfg.seq_len} exceeds the model's context "
                          f"{model_cfg.max_context}")
    # a model file without a template: its family's published format (Gemma 3's turns), which
    # is what the runtime renders chats with; ChatML only for families that have none
    from ..chat import FAMILY_TEMPLATES

    chat_template = chat_template or FAMILY_TEMPLATES.get(model_cfg.arch) or CHATML

    # data
    if cfg.mode == "pretrain":
        from .data import TokenShards

        train_data = TokenShards(Path(cfg.data), "train")
        val_data = TokenShards(Path(cfg.data), "val")
        for split, shards in (("training", train_data), ("held-out", val_data)):
            if shards.n_tokens < cfg.seq_len + 1:
                raise PocketError(
                    f"{cfg.data}: the {split} split has {shards.n_tokens} tokens, fewer than one "
                    f"sequence of --seq-len {cfg.seq_len} + 1; use more text, a larger "
                    "--holdout or a shorter --seq-len")
        if train_data.vocab_size > model_cfg.vocab_size:
            raise PocketError(f"{cfg.data}: shards were made with a {train_data.vocab_size}-token "
                              f"vocabulary; the model has {model_cfg.vocab_size}")
    else:
        train_data = SFTData(cfg.data, tokenizer, chat_template, cfg.seq_len, seed=cfg.seed,
                             strict=cfg.strict, holdout=0.0 if cfg.val_data else 0.05)
        val_data = train_data
        if cfg.val_data:
            val_data = SFTData(cfg.val_data, tokenizer, chat_template, cfg.seq_len,
                               seed=cfg.seed, strict=cfg.strict, holdout=1.0)
        if train_data.cut and dist.main:
            print(f"[{cfg.data}: left out {train_data.cut} chats whose answers start after "
                  f"--seq-len {cfg.seq_len} tokens]", file=sys.stderr)
        if train_data.skipped and dist.main:
            print(f"[{cfg.data}: skipped {len(train_data.skipped)} malformed lines, first: "
                  f"{train_data.skipped[0]}; --strict refuses them]", file=sys.stderr)

    def get_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = step * cfg.grad_accum + micro
        if cfg.mode == "pretrain":
            b = train_data.batch(k, cfg.batch_size, cfg.seq_len, seed=cfg.seed, rank=dist.rank,
                                 world=dist.world)
            x, y = b[:, :-1], b[:, 1:]
        else:
            ids, tgt = train_data.batch(k, cfg.batch_size, seed=cfg.seed, rank=dist.rank,
                                        world=dist.world)
            x, y = ids[:, :-1], tgt[:, 1:]
        return (torch.from_numpy(np.ascontiguousarray(x)).to(dist.device),
                torch.from_numpy(np.ascontiguousarray(y)).to(dist.device))

    # model and optimizer
    torch.manual_seed(cfg.seed)
    model = PocketLM(model_cfg, init_seed=None if (resume or base_state or init) else cfg.seed)
    if base_state is not None:
        _load_weights(model, base_state(), f"the base model {cfg.base!r}")
        del base_state
    elif init is not None:
        _load_weights(model, checkpoint_weights(init), f"{cfg.init_from}")
    lora = None
    if cfg.lora_rank:
        from .lora import add_lora

        n_train = add_lora(model, cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed,
                           qat_group=32 if cfg.qat else None,
                           base_grid=32 if cfg.qat_base else None)
        lora = model.lora
        if dist.main and progress:
            print(f"[LoRA rank {cfg.lora_rank}: {n_train:,} trainable parameters of "
                  f"{sum(p.numel() for p in model.parameters()):,}]", file=sys.stderr)
    if resume:
        _load_weights(model, ck["model"], str(ck_path))
    model.to(dist.device)
    teacher = _teacher(cfg, tokenizer, dist.device) if cfg.distill_from else None
    if cfg.mode == "pretrain":
        from .data import vocabulary_sha256

        theirs = (train_data.vocab_size, train_data.eos_id)
        ours = (tokenizer.vocab_size, (tokenizer.eos_ids or [0])[0])
        # two tokenizers trained to one size share the size and the end-of-text id: the token
        # strings tell them apart (shards written before that digest: size and end of text)
        made_with = train_data.meta.get("vocabulary_sha256")
        if theirs != ours or made_with not in (None, vocabulary_sha256(tokenizer)):
            # ids of another tokenizer would train the model on text it never sees, silently
            differ = (f"vocabulary {theirs[0]}, end of text {theirs[1]}; this run's: "
                      f"{ours[0]}, {ours[1]}" if theirs != ours else
                      f"the same size, {ours[0]}, but other tokens")
            raise PocketError(f"{cfg.data}: the shards were made with another tokenizer "
                              f"({differ}); give --tokenizer the one they were made with, or "
                              "prepare them again")
    wrapped: torch.nn.Module = model
    if dist.world > 1:
        if cfg.fsdp:
            from torch.distributed.fsdp import fully_shard

            for block in model.layers:
                fully_shard(block)
            fully_shard(model)
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            wrapped = DDP(model, device_ids=[dist.local_rank] if dist.device.type == "cuda"
                          else None)
    opt = _optimizer(model, cfg)
    start = 0
    metrics: list[dict] = []
    best_val, bad_evals = math.inf, 0  # early stopping
    if resume:
        _load_optimizer(model, opt, ck["optimizer"], cfg.fsdp and dist.world > 1)
        start = int(ck["step"])
        _set_rng_state(ck["rng"])
        metrics = _read_metrics(out / "metrics.jsonl", upto=start)
        best_val, bad_evals = ck.get("best_val", math.inf), ck.get("bad_evals", 0)
        if ck.get("stopped_early"):
            start = cfg.steps  # nothing left to do
            if dist.main:  # said, not done quietly: its result is the best weights kept
                print(f"[{out} stopped early at step {int(ck['step'])} (held-out loss not "
                      f"improving); nothing left to train: its result is {out / BEST}]",
                      file=sys.stderr)
        elif start > cfg.steps:  # it cannot go back: say so, instead of doing nothing quietly
            raise PocketError(f"{out} holds a run at step {start}, past --steps {cfg.steps}: "
                              f"give --steps {start} or more to go on, or use another --out")

    if dist.main and (not resume or (not cfg.early_stop and start < cfg.steps)):
        # best weights kept by another run in this folder (one stopped before its first
        # checkpoint), or by this run before it went on without early stopping: export and
        # -m RUN take best.pt where it exists, and would take those instead of this run's
        (out / BEST).unlink(missing_ok=True)
    if dist.main:
        out.mkdir(parents=True, exist_ok=True)
        _atomic_text(out / "train_config.json", json.dumps(
            {"train": cfg.to_dict(), "model": model_cfg.to_dict()}, indent=2))
        _write_metrics(out / "metrics.jsonl", metrics)

    def evaluate() -> float:
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad(), _autocast(cfg, dist.device):
            if cfg.mode == "pretrain":
                batches = ((b[:, :-1], b[:, 1:]) for b in val_data.iter_eval_batches(
                    cfg.batch_size, cfg.seq_len, cfg.eval_batches))
            else:
                batches = ((i[:, :-1], t[:, 1:]) for i, t in val_data.eval_batches(
                    cfg.batch_size, cfg.eval_batches))
            for x, y in batches:
                x = torch.from_numpy(np.ascontiguousarray(x)).to(dist.device)
                y = torch.from_numpy(np.ascontiguousarray(y)).to(dist.device)
                keep = y != -100  # the head only where there is a target, as in training
                logits = model(x, keep).float()
                loss = F.cross_entropy(logits, y[keep], reduction="sum")
                total += float(loss)
                count += int(keep.sum())
        model.train()
        return total / max(count, 1)

    def save(step: int, path: Path = ck_path, *, stopped_early: bool = False) -> None:
        # a step whose update left the weights NaN or inf (a finite loss and gradient, an
        # overflowing update) is not kept: it would replace the last good checkpoint
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters()
                     if p.requires_grad)
        if dist.world > 1:  # every rank decides alike (FSDP: each holds a shard)
            import torch.distributed as tdist

            flag = torch.tensor([1.0 if finite else 0.0], device=dist.device)
            tdist.all_reduce(flag, op=tdist.ReduceOp.MIN)
            finite = bool(flag.item() > 0)
        if not finite:
            raise PocketError(f"training diverged at step {step}: its update left weights "
                              f"that are not finite; {_kept(saved_step)}; lower --lr (now "
                              f"{cfg.lr:g})")
        state_model, state_opt = _state_dicts(model, opt, cfg.fsdp and dist.world > 1)
        if not dist.main:
            return
        _atomic_save({
            "format": "pocketlm-checkpoint", "version": 1, "step": step,
            "model_config": model_cfg.to_dict(), "train_config": cfg.to_dict(),
            "model": state_model, "optimizer": state_opt if path == ck_path else None,
            "rng": _rng_state(), "lora": lora, "best_val": best_val, "bad_evals": bad_evals,
            "stopped_early": stopped_early, "tokenizer": tokenizer.to_json(),
            "chat_template": chat_template, "saved": time.strftime("%Y-%m-%d %H:%M:%S"),
            "vocab": vocab,
        }, path)

    tokens_seen = 0 if not metrics else int(metrics[-1].get("tokens", 0))
    bar = None
    if progress and dist.main:
        from ..progress import bar as progress_bar

        base = Path(cfg.base or "")
        # a training run as the base: its folder and parent ("pocket-zh-en/sft", not "sft")
        what = cfg.preset or (f"{base.parent.name}/{base.name}" if cfg.base and base.is_dir()
                              else base.name)
        bar = progress_bar(cfg.steps, f"{cfg.mode} {what}", "step", initial=start)
    model.train()
    t_last = time.perf_counter()
    last: dict = dict(metrics[-1]) if metrics else {}  # a finished run: its last step
    saved_step = start  # the step of the checkpoint in the run folder (0: none yet)
    for step in range(start, cfg.steps):
        lr = _lr_at(cfg, step)
        for g in opt.param_groups:
            g["lr"] = lr
        loss_sum = 0.0
        step_tokens = 0
        for micro in range(cfg.grad_accum):
            x, y = get_batch(step, micro)
            step_tokens += x.numel() * dist.world  # (SFT: padding to the batch's longest chat)
            sync = contextlib.nullcontext()
            if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) and \
                    micro < cfg.grad_accum - 1:
                sync = wrapped.no_sync()
            try:
                with sync, _autocast(cfg, dist.device):
                    keep = y != -100  # the output head runs only where there is a target
                    logits = wrapped(x, keep).float()
                    target = y[keep]
                    loss = F.cross_entropy(logits, target)
                    if teacher is not None:
                        with torch.no_grad():
                            t_logits = teacher(x, keep).float()[:, : logits.shape[-1]]
                        T = cfg.distill_temperature
                        kd = F.kl_div(F.log_softmax(logits / T, dim=-1),
                                      F.log_softmax(t_logits / T, dim=-1),
                                      log_target=True, reduction="batchmean") * T * T
                        loss = (1 - cfg.distill_alpha) * loss + cfg.distill_alpha * kd
                    (loss / cfg.grad_accum).backward()
            except (MemoryError, RuntimeError) as e:  # torch's CPU allocator: RuntimeError
                if not _out_of_memory(e):
                    raise
                raise PocketError(f"out of memory at step {step + 1}: a batch of "
                                  f"{cfg.batch_size} x {cfg.seq_len} tokens does not fit; lower "
                                  f"--batch-size (now {cfg.batch_size}) or --seq-len, raising "
                                  "--grad-accum to keep the batch; "
                                  f"{_kept(saved_step)}") from None
            loss_sum += float(loss.detach())
        if dist.world > 1:  # report the global batch's loss, not this rank's share
            import torch.distributed as tdist

            t = torch.tensor([loss_sum], dtype=torch.float64, device=dist.device)
            tdist.all_reduce(t)
            loss_sum = float(t) / dist.world
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        # the loss is the global batch's and the gradients are synchronized, so every rank
        # stops here together; the weights and the last checkpoint stay those of a finite step
        if not (math.isfinite(loss_sum) and math.isfinite(float(grad_norm))):
            raise PocketError(f"training diverged at step {step + 1}: loss "
                              f"{loss_sum / cfg.grad_accum}, gradient norm {float(grad_norm)}; "
                              f"{_kept(saved_step)}; lower --lr (now {cfg.lr:g}) or raise "
                              "--warmup")
        opt.step()
        opt.zero_grad(set_to_none=True)
        now = time.perf_counter()
        dt, t_last = now - t_last, now
        row = {"step": step + 1, "loss": loss_sum / cfg.grad_accum, "lr": lr,
               "grad_norm": float(grad_norm), "tokens": tokens_seen + step_tokens,
               "tokens_per_s": step_tokens / dt if dt > 0 else None}
        tokens_seen += step_tokens
        done = step + 1
        stop_now = False
        if done % cfg.eval_every == 0 or done == cfg.steps:
            row["val_loss"] = evaluate()
            row["val_ppl"] = math.exp(min(row["val_loss"], 50))
            if cfg.early_stop:
                if row["val_loss"] < best_val:
                    best_val, bad_evals = row["val_loss"], 0
                    save(done, out / BEST)
                else:
                    bad_evals += 1
                    stop_now = bad_evals >= cfg.early_stop
                    if stop_now:
                        row["early_stop"] = True
        metrics.append(row)
        last = row
        if dist.main:
            with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
        if done % cfg.save_every == 0 or done == cfg.steps or stop_now:
            save(done, stopped_early=stop_now)
            saved_step = done
            if dist.main:
                _plot_losses(metrics, out / "loss.svg",
                             f"{cfg.preset or cfg.base} {cfg.mode}: {out.name}")
        if bar is not None:
            post = {"loss": f"{row['loss']:.3f}", "tok/s": f"{row['tokens_per_s'] or 0:.0f}"}
            if "val_loss" in row:
                post["val"] = f"{row['val_loss']:.3f}"
            bar.set_postfix(post)
            bar.update(1)
        if stop_now:
            if dist.main:  # with -q too: the result is not the last step's weights
                print(f"\n[early stop at step {done}: held-out loss has not improved for "
                      f"{cfg.early_stop} evaluations; best {best_val:.4f} in {out / BEST}]",
                      file=sys.stderr)
            break
    if bar is not None:
        bar.close()
    if dist.world > 1:
        import torch.distributed as tdist

        tdist.barrier()
    return last


def _state_dicts(model, opt, sharded: bool) -> tuple[dict, dict]:
    if not sharded:
        return ({k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                opt.state_dict())
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def _load_optimizer(model, opt, state: dict, sharded: bool) -> None:
    if not sharded:
        opt.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, opt, model_state_dict=model.state_dict(), optim_state_dict=state,
                   options=StateDictOptions(full_state_dict=True))


def _read_metrics(path: Path, upto: int) -> list[dict]:
    """The metrics of the steps up to the checkpoint: later ones are replayed on resume."""
    if not path.is_file():
        return []
    from ..textfile import jsonl_lines

    rows = []
    # a damaged line (a hard stop, bytes that are not UTF-8) is skipped, not a traceback
    for line in jsonl_lines(path.read_text(encoding="utf-8", errors="replace")):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a hard stop
        if isinstance(row, dict) and row.get("step", upto + 1) <= upto:
            rows.append(row)
    return rows


def _write_metrics(path: Path, rows: list[dict]) -> None:
    _atomic_text(path, "".join(json.dumps(r) + "\n" for r in rows))

