"""A tiny MarianMTModel shaped like OPUS-MT's, made the way its folders are: two sentencepiece
models learned on Multi30k (Marian's ids: UNK 0, BOS 1, EOS 2, no PAD), one shared vocab.json
over both (EOS 0, UNK 1, PAD last, as OPUS-MT's), swish, post-norm, a non-zero final logits bias,
random weights, written by transformers' own save_pretrained."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

# Pieces of the target's sentencepiece model left out of vocab.json, as a corpus-made Marian
# vocabulary leaves rare ones out: the import must map them as Marian's tokenizer does.
LEFT_OUT = 3


def lines(multi30k: Path, split: str, lang: str, n: int | None = None) -> list[str]:
    with gzip.open(multi30k / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        out = f.read().splitlines()
    return out[:n] if n else out


def make_marian(
    folder: Path,
    multi30k: Path,
    *,
    d_model: int = 32,
    layers: int = 2,
    heads: int = 4,
    ffn: int = 64,
    vocab_size: int = 0,
    init_std: float = 0.2,
    seed: int = 0,
) -> Path:
    """The folder; `vocab_size`: vocab.json filled up to that many entries with pieces neither
    sentencepiece model has (OPUS-MT's hold 58101 over corpora far larger than Multi30k)."""
    import sentencepiece as spm
    import torch
    from transformers import MarianConfig, MarianMTModel

    folder.mkdir(parents=True, exist_ok=True)
    for lang, name, size in (("en", "source", 400), ("de", "target", 500)):
        text = folder / f"train.{lang}"
        text.write_text("\n".join(lines(multi30k, "train", lang, 5000)) + "\n")
        spm.SentencePieceTrainer.train(
            input=str(text),
            model_prefix=str(folder / name),
            vocab_size=size,
            model_type="unigram",
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            minloglevel=2,
        )
        (folder / f"{name}.model").rename(folder / f"{name}.spm")
        (folder / f"{name}.vocab").unlink()
        text.unlink()
    vocab = {"</s>": 0, "<unk>": 1}
    for name in ("source", "target"):
        sp = spm.SentencePieceProcessor(model_file=str(folder / f"{name}.spm"))
        pieces = [sp.id_to_piece(i) for i in range(3, sp.get_piece_size())]
        if name == "target":  # the last pieces only the target has
            own = [p for p in pieces if p not in vocab]
            pieces = [p for p in pieces if p not in own[-LEFT_OUT:]]
        for piece in pieces:
            vocab.setdefault(piece, len(vocab))
    while len(vocab) < vocab_size - 1:
        vocab[f"▁filler{len(vocab)}"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"source_lang": "en", "target_lang": "de", "tokenizer_class": "MarianTokenizer"})
    )
    config = MarianConfig(
        vocab_size=len(vocab),
        decoder_vocab_size=len(vocab),
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        activation_function="swish",
        max_position_embeddings=128,
        pad_token_id=len(vocab) - 1,
        eos_token_id=0,
        decoder_start_token_id=len(vocab) - 1,
        forced_eos_token_id=0,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        init_std=init_std,
    )
    torch.manual_seed(seed)
    model = MarianMTModel(config)
    with torch.no_grad():
        model.final_logits_bias.normal_(0, 1.0)
        # Marian starts the decoder from a zero vector: OPUS-MT's PAD row (its start) is zeros
        model.get_input_embeddings().weight[config.pad_token_id] = 0.0
    jitter_layer_norms(model)
    model.generation_config.bad_words_ids = [[config.pad_token_id]]
    model.save_pretrained(folder)
    return folder


def jitter_layer_norms(model) -> None:
    """Trained LayerNorms are not all ones and zeros: a transformers model's, moved a little."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
