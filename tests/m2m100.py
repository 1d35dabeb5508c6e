"""Tiny M2M100 and NLLB-shaped models made the way their published folders are: one sentencepiece
model (BPE) learned on Multi30k's English, German, French and Czech; M2M100's numbering in a
vocab.json (fairseq's dictionary: <s> 0, <pad> 1, </s> 2, <unk> 3, then the pieces in an order of
their own, some left out) with its 100 language tokens (`__de__`) after it, NLLB's in a
tokenizer.json (the sentencepiece ids plus one) with its language codes (`deu_Latn`) as added
tokens; random pre-norm weights with scaled embeddings, saved by transformers' save_pretrained."""

from __future__ import annotations

import json
import random
from pathlib import Path

from marian import jitter_layer_norms, lines

LANGUAGES = ("en", "de", "fr", "cs")
NLLB_CODES = {"en": "eng_Latn", "de": "deu_Latn", "fr": "fra_Latn", "cs": "ces_Latn"}
# Pieces of the sentencepiece model left out of M2M100's vocab.json, as fairseq's dictionary
# leaves rare ones out: its tokenizer makes them <unk>
LEFT_OUT = 3


def _sentencepiece(folder: Path, multi30k: Path, size: int) -> Path:
    import sentencepiece as spm

    text = folder / "train.txt"
    text.write_text("\n".join(x for lang in LANGUAGES for x in lines(multi30k, "train", lang, 2000)) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(folder / "sentencepiece.bpe"),
        vocab_size=size,
        model_type="bpe",
        unk_id=3,
        bos_id=0,
        eos_id=2,
        pad_id=1,
        character_coverage=1.0,
        minloglevel=2,
    )
    text.unlink()
    (folder / "sentencepiece.bpe.vocab").unlink()
    return folder / "sentencepiece.bpe.model"


def make_m2m100(
    folder: Path,
    multi30k: Path,
    kind: str = "m2m100",
    *,
    d_model: int = 32,
    layers: int = 2,
    heads: int = 4,
    ffn: int = 64,
    seed: int = 0,
) -> Path:
    """The folder of a tiny random `kind` ("m2m100" or "nllb") model."""
    import sentencepiece as spm
    import torch
    from transformers import AutoTokenizer, M2M100ForConditionalGeneration

    folder.mkdir(parents=True, exist_ok=True)
    model_file = _sentencepiece(folder, multi30k, 1000)
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    if kind == "m2m100":
        from transformers import M2M100Tokenizer

        own = [sp.id_to_piece(i) for i in range(4, sp.get_piece_size())]
        random.Random(seed).shuffle(own)  # fairseq's dictionary is by frequency, not the model's order
        vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
        for piece in own[LEFT_OUT:]:
            vocab[piece] = len(vocab)
        (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
        tokenizer = M2M100Tokenizer(str(folder / "vocab.json"), str(model_file), src_lang="en", tgt_lang="de")
        size = len(vocab) + 100 + 8  # its languages and 8 "made-up words" after them
    else:
        from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

        (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "NllbTokenizer"}))
        tokenizer = AutoTokenizer.from_pretrained(folder)  # converted from the sentencepiece model
        tokenizer.add_special_tokens({"additional_special_tokens": FAIRSEQ_LANGUAGE_CODES})
        (folder / "tokenizer_config.json").unlink()
        size = len(tokenizer)
    tokenizer.save_pretrained(folder)
    config = shaped(size, d_model, layers, heads, ffn, 128, 0.2)
    config.tokenizer_class = "M2M100Tokenizer" if kind == "m2m100" else "NllbTokenizer"
    torch.manual_seed(seed)
    model = M2M100ForConditionalGeneration(config)
    jitter_layer_norms(model)
    model.save_pretrained(folder)
    return folder


def shaped(size: int, d_model: int, layers: int, heads: int, ffn: int, positions: int, init_std: float):
    """transformers' M2M100Config of a model of this shape, numbered as fairseq numbers (<s> 0,
    <pad> 1, </s> 2, the decoder starting from </s>), embeddings scaled, no dropout."""
    from transformers import M2M100Config

    return M2M100Config(
        vocab_size=size,
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        max_position_embeddings=positions,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        scale_embedding=True,
        init_std=init_std,
        dropout=0.0,
    )
