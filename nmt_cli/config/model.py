"""A model's shape: what `nmt train` builds, a checkpoint and a package record, and `nmt import`
reads from a model made elsewhere, with the bounds a declared shape must keep."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nmt_cli.errors import NmtError


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int  # the target's, whose embedding is also the output projection
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    d_model: int = 512
    ffn: int = 2048
    heads: int = 8
    dropout: float = 0.1  # on residual branches and embeddings
    attention_dropout: float = 0.1  # on attention probabilities
    relu_dropout: float = 0.1  # after the FFN ReLU
    post_norm: bool = False
    max_positions: int = 1024
    # 0: the source is embedded with the target's embedding (one joint vocabulary, all three
    # tied); else the source's own embedding of this many pieces (separate vocabularies, or
    # --no-share-embeddings)
    src_vocab_size: int = 0
    # What models made elsewhere differ in (`nmt import`: Marian's are swish, eps 1e-5, Marian's
    # sinusoid layout and a bias on the output); nmt's own keep the defaults.
    activation: str = "relu"  # of the FFN: relu, swish (SiLU) or gelu
    norm_eps: float = 1e-6  # LayerNorm's epsilon
    positions: str = "tensor2tensor"  # the sinusoids' layout (model.sinusoids): or "marian"
    output_bias: bool = False  # a fixed bias on the output scores (Marian's final_logits_bias)
    scale_embedding: bool = True  # embeddings times sqrt(d_model)
    # The first token's position: M2M100 and NLLB number positions after their padding id (2)
    position_offset: int = 0

    def __post_init__(self) -> None:
        """Every setting within bounds before anything is built from it: a model file may come
        from anyone, and its settings decide what is allocated (max_positions sinusoids, layers
        built one by one) and the server's length ceiling."""
        for name, (lo, hi) in MODEL_BOUNDS.items():
            value = getattr(self, name)
            if type(value) is not int or not lo <= value <= hi:
                raise NmtError(
                    f"model setting {name} must be an integer from {lo} to {hi}, not {value!r:.40}"
                )
        for name in ("dropout", "attention_dropout", "relu_dropout"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not 0 <= value < 1:
                raise NmtError(f"model setting {name} must be a number in [0, 1), not {value!r:.40}")
        if not isinstance(self.post_norm, bool):
            raise NmtError(f"model setting post_norm must be true or false, not {self.post_norm!r:.40}")
        for name, allowed in (("activation", ACTIVATIONS), ("positions", POSITIONS)):
            value = getattr(self, name)
            if value not in allowed:
                raise NmtError(f"model setting {name} must be one of {', '.join(allowed)}, not {value!r:.40}")
        if type(self.norm_eps) is not float or not 0 < self.norm_eps < 1:
            raise NmtError(f"model setting norm_eps must be a number in (0, 1), not {self.norm_eps!r:.40}")
        for name in ("output_bias", "scale_embedding"):
            if not isinstance(getattr(self, name), bool):
                raise NmtError(f"model setting {name} must be true or false, not {getattr(self, name)!r:.40}")
        if self.d_model % self.heads:
            raise NmtError(f"model setting d_model {self.d_model} is not divisible by heads {self.heads}")


ACTIVATIONS = ("relu", "swish", "gelu")
POSITIONS = ("tensor2tensor", "marian")
# The settings models made elsewhere set (`nmt import`), with nmt's own values (their defaults):
# a package whose model keeps them all is written without them, readable by an nmt from before.
FOREIGN = ("activation", "norm_eps", "positions", "output_bias", "scale_embedding", "position_offset")
FOREIGN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in FOREIGN}

# What a model may declare: past the largest models in use, short of what one file could make its
# reader allocate or build for hours.
MODEL_BOUNDS = {
    "vocab_size": (1, 1_000_000),
    "src_vocab_size": (0, 1_000_000),
    "num_encoder_layers": (1, 64),
    "num_decoder_layers": (1, 64),
    "d_model": (1, 16_384),
    "ffn": (1, 65_536),
    "heads": (1, 256),
    "max_positions": (2, 16_384),
    "position_offset": (0, 16_384),
}
