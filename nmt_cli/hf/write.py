"""`nmt export --format huggingface`: an nmt model as a folder transformers loads.

The export is the other way, with nmt's own ids written into `vocab.json`. transformers' Marian
is post-norm with Marian's sinusoids; a pre-norm model with tensor2tensor's sinusoids is M2M100,
whose positions start after its padding id: PAD -1 there starts them at 0, as nmt's do.
LayerNorm's epsilon is 1e-5 in both architectures (nmt's own models: 1e-6; the export records the
model's own, which the import reads back). Of M2M100 folders the import reads only those.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from nmt_cli.config import ModelConfig
from nmt_cli.errors import NmtError
from nmt_cli.files import (
    atomic_write_json,
    copy_regular,
    new_file_mode,
)
from nmt_cli.hf.names import layer_names
from nmt_cli.inference.models import Model
from nmt_cli.vocab import BOS, EOS, MAX_SPM_BYTES, PAD, pieces


def export_huggingface(model: Model, out: Path) -> None:
    """Write `model` as a folder transformers loads (AutoModelForSeq2SeqLM, AutoTokenizer)."""
    from nmt_cli.inference import packages as export

    c = model.config
    if model.load_weights is None:
        raise NmtError(
            f"{model.where} is a CTranslate2 export: export from the run directory or an nmt package"
        )
    if c.post_norm and c.positions != "marian":
        raise NmtError(
            "no Hugging Face architecture computes a post-norm model with tensor2tensor's sinusoids "
            "(transformers' Marian has its own): export a pre-norm model, or a model `nmt import` made"
        )
    if not c.post_norm and (c.positions != "tensor2tensor" or c.output_bias):
        raise NmtError(
            "no Hugging Face architecture computes a pre-norm model with Marian's sinusoids or an "
            "output bias (M2M100 has neither)"
        )
    if c.position_offset:
        raise NmtError(
            "this model numbers its positions as M2M100 and NLLB do: `nmt export --format huggingface` "
            "writes models of nmt's numbering only for now"
        )
    if not c.post_norm and c.src_vocab_size:
        raise NmtError(
            "M2M100, the Hugging Face architecture of pre-norm models, has one vocabulary for both "
            "sides: this model's are separate"
        )
    weights = {k: v.float().contiguous() for k, v in model.weights().items()}
    with export.staged(out) as staging:
        write_tokenizer(model, staging)
        if c.post_norm:
            config, tensors = _as_marian(c, weights)
        else:
            config, tensors = _as_m2m100(c, weights)
        from safetensors.torch import save_file

        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(staging / "model.safetensors", new_file_mode())  # safetensors writes it 0600
        atomic_write_json(staging / "config.json", config)
        atomic_write_json(staging / "generation_config.json", _generation(config))
        atomic_write_json(
            staging / "nmt_provenance.json", {"exported_from": str(model.where), **model.provenance}
        )


def write_tokenizer(model: Model, folder: Path) -> None:
    """MarianTokenizer's files with nmt's ids: the sentencepiece models cut the text, vocab.json
    (and target_vocab.json) number the pieces as nmt's model does."""
    vocabs = model.vocabs
    copy_regular(vocabs.source, folder / "source.spm", MAX_SPM_BYTES, follow=False)
    copy_regular(vocabs.target, folder / "target.spm", MAX_SPM_BYTES, follow=False)
    source = {p: i for i, p in enumerate(pieces(vocabs.source))}
    # a language tag `nmt import` made one piece with its word boundary: MarianTokenizer looks
    # it up bare, as it takes it from the start of a line
    source.update({p[1:]: i for p, i in source.items() if re.fullmatch(r"\u2581>>[^<>\s]+<<", p)})
    atomic_write_json(folder / "vocab.json", source)
    if not vocabs.joint:
        atomic_write_json(folder / "target_vocab.json", {p: i for i, p in enumerate(pieces(vocabs.target))})
    atomic_write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "MarianTokenizer",
            "source_lang": model.src,
            "target_lang": model.tgt,
            "separate_vocabs": not vocabs.joint,
            "unk_token": "<unk>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "model_max_length": model.config.max_positions - 1,
        },
    )


def _common(c: ModelConfig) -> dict:
    return {
        "d_model": c.d_model,
        "encoder_layers": c.num_encoder_layers,
        "decoder_layers": c.num_decoder_layers,
        "encoder_attention_heads": c.heads,
        "decoder_attention_heads": c.heads,
        "encoder_ffn_dim": c.ffn,
        "decoder_ffn_dim": c.ffn,
        "activation_function": c.activation,
        "dropout": c.dropout,
        "attention_dropout": c.attention_dropout,
        "activation_dropout": c.relu_dropout,
        "scale_embedding": c.scale_embedding,
        "max_position_embeddings": c.max_positions,
        "eos_token_id": EOS,
        "decoder_start_token_id": BOS,
        "forced_eos_token_id": EOS,  # nmt's search ends a translation at its limit with EOS
        # the model's own: transformers' Marian and M2M100 compute with 1e-5 and ignore this;
        # `nmt import` reads it back
        "layer_norm_eps": c.norm_eps,
        "is_encoder_decoder": True,
        "tie_word_embeddings": True,
    }


def _layers(c: ModelConfig, w: dict) -> dict:
    """nmt's layers under transformers' names (K/V cut apart)."""
    out = {}
    for mine, theirs in layer_names(c):
        for part in ("weight", "bias"):
            for name, chunk in zip(theirs, w[f"{mine}.{part}"].chunk(len(theirs))):
                out[f"model.{name}.{part}"] = chunk.contiguous()
    return out


def _as_marian(c: ModelConfig, w: dict) -> tuple[dict, dict]:
    separate = bool(c.src_vocab_size)
    config = {
        "model_type": "marian",
        "architectures": ["MarianMTModel"],
        **_common(c),
        "vocab_size": c.src_vocab_size or c.vocab_size,
        "decoder_vocab_size": c.vocab_size,
        "share_encoder_decoder_embeddings": not separate,
        "pad_token_id": PAD,
    }
    tensors = _layers(c, w)
    target = w["embed.weight"]
    if separate:
        tensors["model.encoder.embed_tokens.weight"] = w["src_embed.weight"]
        tensors["model.decoder.embed_tokens.weight"] = target
    else:
        tensors["model.shared.weight"] = target
    tensors["final_logits_bias"] = (
        w.get("output_bias", target.new_zeros(c.vocab_size)).reshape(1, -1).contiguous()
    )
    return config, tensors


def _as_m2m100(c: ModelConfig, w: dict) -> tuple[dict, dict]:
    config = {
        "model_type": "m2m_100",
        "architectures": ["M2M100ForConditionalGeneration"],
        **_common(c),
        "vocab_size": c.vocab_size,
        # M2M100's positions start at its padding id + 1: -1 starts them at 0, as nmt's do (its
        # padding is by the attention mask: the tokenizer pads with nmt's PAD)
        "pad_token_id": -1,
        "layerdrop": 0.0,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
    }
    tensors = _layers(c, w)
    tensors["model.shared.weight"] = w["embed.weight"]
    for side in ("encoder", "decoder"):
        tensors[f"model.{side}.layer_norm.weight"] = w[f"{side}_norm.weight"]
        tensors[f"model.{side}.layer_norm.bias"] = w[f"{side}_norm.bias"]
    return config, tensors


def _generation(config: dict) -> dict:
    """`generate`'s defaults: nmt's (beam 4) and its rules (PAD and BOS never emitted, EOS at
    the length limit)."""
    return {
        "decoder_start_token_id": BOS,
        "eos_token_id": EOS,
        "forced_eos_token_id": EOS,
        "pad_token_id": PAD,
        "bad_words_ids": [[PAD], [BOS]],
        "num_beams": 4,
        "max_length": config["max_position_embeddings"] - 1,
    }
