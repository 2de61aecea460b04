"""The training model (pocketlm.train.model) against the independent torch reference and the
runtime: same names, same logits, for every family."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch_ref

from pocketlm.config import FAMILIES
from pocketlm.errors import PocketError
from pocketlm.runtime import Runtime
from pocketlm.train.model import PRESETS, PocketLM, preset_config, preset_report

IDS = [3, 17, 5, 250, 11, 9, 42, 7, 101, 64, 2, 300, 18, 1, 0, 77]


def _model(cfg, seed=3):
    sd = torch_ref.random_state_dict(cfg, seed=seed)
    m = PocketLM(cfg, init_seed=None)
    m.load_state_dict({k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in sd.items()})
    return m, sd


@pytest.mark.parametrize("arch", FAMILIES)
def test_names_and_shapes_are_the_runtime_contract(arch):
    cfg = torch_ref.tiny_config(arch)
    m = PocketLM(cfg)
    got = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert got == {k: tuple(v) for k, v in cfg.tensor_shapes().items()}
    assert sum(p.numel() for p in m.parameters()) == cfg.n_params()


@pytest.mark.parametrize("arch", FAMILIES)
def test_logits_match_the_reference_and_the_runtime(arch):
    cfg = torch_ref.tiny_config(arch)
    m, sd = _model(cfg)
    with torch.no_grad():
        ours = m(torch.tensor([IDS])).double().numpy()[0]
    ref = torch_ref.TorchRefModel(cfg, sd).forward(IDS)
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() / scale < 1e-5
    rt = Runtime(cfg, {k: np.asarray(v, dtype=np.float32) for k, v in sd.items()},
                 engine="numpy")
    got = rt.forward(IDS, rt.new_cache(len(IDS)), all_logits=True)
    assert np.abs(got - ref).max() / scale < 1e-4


def test_sliding_window_layers_are_masked():
    cfg = torch_ref.tiny_config("gemma3", sliding_window=4, max_context=64)
    m, sd = _model(cfg, seed=5)
    ids = list(range(1, 30))
    with torch.no_grad():
        ours = m(torch.tensor([ids])).double().numpy()[0]
    ref = torch_ref.TorchRefModel(cfg, sd).forward(ids)
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-5


def test_loss_ignores_masked_targets_and_init_is_seeded():
    cfg = preset_config("tiny", 300)
    a, b = PocketLM(cfg, init_seed=1), PocketLM(cfg, init_seed=1)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (2, 12), generator=gen)
    targets = torch.randint(0, 300, (2, 12), generator=gen)
    with torch.no_grad():
        full = float(a.loss(ids, targets))
        assert abs(full - np.log(300)) < 0.5  # near-uniform at initialisation
        targets[:, :6] = -100
        part = a.loss(ids, targets)
        logits = a(ids)
    manual = torch.nn.functional.cross_entropy(logits[:, 6:].reshape(-1, 300),
                                               targets[:, 6:].reshape(-1))
    assert torch.allclose(part, manual)


def test_presets():
    rows = {r["preset"]: r for r in preset_report()}
    assert set(rows) == set(PRESETS)
    assert 0.25 <= rows["pocket-0.3b"]["params_m"] / 1000 <= 0.4
    assert 10 <= rows["pocket-10m"]["params_m"] <= 20
    assert 25 <= rows["pocket-30m"]["params_m"] <= 45
    for r in rows.values():
        assert r["peak_mb_1024"] > r["peak_mb_512"] > r["int4_file_mb"] > 0
    # deep and thin: more layers than a same-size wide model would use
    cfg = preset_config("pocket-0.3b")
    assert cfg.n_layers >= 24 and cfg.d_model <= 1024 and cfg.qk_norm and cfg.tie_embeddings
    with pytest.raises(PocketError, match="unknown preset"):
        preset_config("huge")


def test_the_runtime_server_and_command_line_do_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, pocketlm, pocketlm.api, pocketlm.cli, pocketlm.train.cli, "
            "pocketlm.server.app, pocketlm.server.scheduler; "
            "pocketlm.cli.build_parser(); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
