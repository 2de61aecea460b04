"""A stand-in for ``MNN.llm`` that logs how the bench worker drives it.

Like MNN it prints on file descriptor 1 when imported. After ``position`` tokens the logits'
argmax is ``position * 7 % VOCAB``: greedy decoding is checkable, and at position 64 the argmax
is 0, end-of-sequence, which the benchmark must decode past. Every call is appended to the
JSON-lines file ``$FAKE_MNN_LOG``.
"""

import json
import os

import numpy as np

VOCAB = 64
os.write(1, b"The device supports: fake\n")


def _log(**entry) -> None:
    with open(os.environ["FAKE_MNN_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\n")


class _Var:
    def __init__(self, logits):
        self._logits = logits

    def read(self):
        return self._logits


class Llm:
    def __init__(self, config_path: str):
        self.config_path, self.settings, self.position = config_path, {}, None

    def set_config(self, settings: dict) -> None:
        self.settings.update(settings)

    def load(self) -> None:
        _log(load=self.config_path, settings=self.settings)

    def reset(self) -> None:
        self.position = 0
        _log(reset=True)

    def forward(self, ids: list[int]):
        self.position += len(ids)
        _log(ids=ids)
        logits = np.zeros((1, 1, VOCAB), np.float32)
        logits[..., self.position * 7 % VOCAB] = 1.0
        return _Var(logits)


def create(config_path: str) -> Llm:
    return Llm(config_path)
