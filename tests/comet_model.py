"""A tiny random COMET model, built the same way in nmt's venv and in unbabel-comet's: a 2-layer
XLM-R encoder (d 32) with a sentencepiece vocabulary of its own, random weights from a seeded
generator, a random layer mix and head, saved as COMET's Lightning checkpoint and hparams.yaml.
`large` is the same at XLM-R large's shape, for benchmarks/comet_speed.py.

    python tests/comet_model.py DIR [ESTIMATOR [tiny|large]]   # ESTIMATOR: regression_metric, ...

It needs torch, transformers, sentencepiece and PyYAML only (no nmt), so that
benchmarks/peers/comet_score.py can score the very folder the tests score.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

ENCODER = "tiny-xlmr"  # the encoder's folder, inside the model's (hparams' pretrained_model)
# Segments the tests and the peer score: (source, translation, reference)
SEGMENTS = [
    ("Ein Mann fährt Fahrrad.", "A man rides a bicycle.", "A man is riding a bike."),
    ("Zwei Hunde spielen im Schnee.", "Two dogs play in the snow.", "Two dogs are playing in snow."),
    ("Eine Frau liest ein Buch im Park.", "A woman reads.", "A woman is reading a book in the park."),
    ("Kinder.", "Children are running on a long sandy beach near the sea.", "Children."),
    ("Ein Koch bereitet Essen zu.", "A cook prepares food.", "A chef is preparing food."),
    ("", "Nothing.", "Nothing at all."),
    ("Ein sehr langer Satz " * 40, "A very long sentence " * 40, "A really long sentence " * 40),
    ("Der Zug kommt an.", "The train arrives.", "The train is arriving."),
]


def corpus(n: int = 400) -> list[str]:
    """Text to learn the vocabulary from: the segments, and words made from a seeded generator."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyzäöü"
    lines = [x for triple in SEGMENTS for x in triple if x]
    for _ in range(n):
        lines.append(
            " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(8))
        )
    return lines


# (hidden size, layers, heads, feed-forward width, vocabulary rows, head's hidden sizes); "large"
# is XLM-R large's shape (wmt22-comet-da's encoder), its vocabulary rows unused past the first
SHAPES = {"tiny": (32, 2, 4, 64, 258, (16, 8)), "large": (1024, 24, 16, 4096, 250002, (3072, 1024))}


def build(folder: Path, estimator: str = "regression_metric", seed: int = 0, shape: str = "tiny") -> Path:
    import sentencepiece as spm
    import yaml
    from transformers import XLMRobertaConfig, XLMRobertaModel

    encoder = folder / ENCODER
    encoder.mkdir(parents=True, exist_ok=True)
    (folder / "checkpoints").mkdir(exist_ok=True)
    text = encoder / "corpus.txt"
    text.write_text("\n".join(corpus()) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(encoder / "sentencepiece.bpe"), vocab_size=256,
        model_type="unigram", character_coverage=1.0, num_threads=1, seed_sentencepiece_size=10000,
        bos_id=-1, eos_id=-1, unk_id=0, minloglevel=2,
    )  # fmt: skip
    text.unlink()
    (encoder / "sentencepiece.bpe.vocab").unlink()
    hidden, layers, heads, ffn, rows, sizes = SHAPES[shape]
    config = {
        "architectures": ["XLMRobertaModel"], "model_type": "xlm-roberta", "vocab_size": rows,
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "intermediate_size": ffn,
        "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": 514, "type_vocab_size": 1, "initializer_range": 0.02,
        "layer_norm_eps": 1e-05, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
        "position_embedding_type": "absolute",
    }  # fmt: skip
    (encoder / "config.json").write_text(json.dumps(config, indent=2))
    (encoder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "XLMRobertaTokenizer", "model_max_length": 512})
    )
    model = XLMRobertaModel(XLMRobertaConfig(**config), add_pooling_layer=False)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, value in sorted(model.state_dict().items()):
        if name.endswith("position_ids"):
            continue
        noise = torch.randn(value.shape, generator=generator) * 0.2
        state["encoder.model." + name] = (1 + noise) if name.endswith("LayerNorm.weight") else noise
    for i in range(layers + 1):
        state[f"layerwise_attention.scalar_parameters.{i}"] = torch.randn(1, generator=generator)
    state["layerwise_attention.gamma"] = 1 + 0.1 * torch.randn(1, generator=generator)
    inputs = {"regression_metric": 6, "referenceless_regression_metric": 4, "unified_metric": 1}
    widths = (hidden * inputs[estimator], *sizes, 1)
    for index, (n_in, n_out) in zip((0, 3, 6), zip(widths, widths[1:])):
        state[f"estimator.ff.{index}.weight"] = torch.randn(n_out, n_in, generator=generator) / n_in**0.5
        state[f"estimator.ff.{index}.bias"] = 0.1 * torch.randn(n_out, generator=generator)
    hparams = {
        "class_identifier": estimator, "encoder_model": "XLM-RoBERTa", "pretrained_model": ENCODER,
        "layer": "mix", "sent_layer": "mix", "layer_transformation": "sparsemax",
        "layer_norm": estimator != "regression_metric", "pool": "avg", "hidden_sizes": list(sizes),
        "activations": "Tanh", "final_activation": None, "dropout": 0.1, "batch_size": 4,
        "load_pretrained_weights": False, "keep_embeddings_frozen": True, "nr_frozen_epochs": 0.3,
        "optimizer": "AdamW", "encoder_learning_rate": 1e-06, "learning_rate": 1.5e-05,
        "layerwise_decay": 0.95, "loss": "mse", "train_data": [], "validation_data": [],
    }  # fmt: skip
    if estimator == "unified_metric":
        hparams |= {"input_segments": ["mt", "src"], "word_level_training": False, "word_layer": 2}
    (folder / "hparams.yaml").write_text(yaml.safe_dump(hparams))
    checkpoint = {  # as Lightning 2 dumps a module's checkpoint for inference
        "epoch": 0, "global_step": 0, "pytorch-lightning_version": "2.6.6", "state_dict": state,
        "hparams_name": "kwargs", "hyper_parameters": hparams,
    }  # fmt: skip
    torch.save(checkpoint, folder / "checkpoints" / "model.ckpt")
    return folder


if __name__ == "__main__":
    build(Path(sys.argv[1]), *(sys.argv[2:3] or ["regression_metric"]), shape=(sys.argv[3:4] or ["tiny"])[0])
