"""A tiny model and two hand-made batches, for the tests of one update (tests/unit/test_step.py,
tests/integration/test_compiled.py)."""

import numpy as np
import torch

from nmt_cli.config import ModelConfig
from nmt_cli.engine.batches import to_device
from nmt_cli.engine.model import Transformer
from nmt_cli.vocab import BOS, EOS, PAD


def batch_of(rows: list[tuple[list[int], list[int]]]):
    """A collated batch of (source ids, target ids), padded as engine.batches.collate pads."""
    s_len = max(len(s) for s, _ in rows) + 1
    t_len = max(len(t) for _, t in rows) + 1
    src = np.full((len(rows), s_len), PAD)
    tgt_in = np.full((len(rows), t_len), PAD)
    tgt_out = np.full((len(rows), t_len), PAD)
    for i, (s, t) in enumerate(rows):
        src[i, : len(s) + 1] = s + [EOS]
        tgt_in[i, : len(t) + 1] = [BOS] + t
        tgt_out[i, : len(t) + 1] = t + [EOS]
    return to_device((src, tgt_in, tgt_out), torch.device("cpu"))


BATCHES = [
    batch_of([([5, 6, 7], [8, 9]), ([10, 11], [12, 13, 14, 15])]),
    batch_of([([16, 17, 18, 19], [20])]),
]


def small_model():
    torch.manual_seed(0)
    return Transformer(
        ModelConfig(
            vocab_size=30,
            num_encoder_layers=1,
            num_decoder_layers=1,
            d_model=16,
            ffn=32,
            heads=2,
            dropout=0.0,
            attention_dropout=0.0,
            relu_dropout=0.0,
        )
    )
