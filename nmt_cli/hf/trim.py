"""`nmt import --trim FILE`: a multilingual model's vocabulary cut to the pieces a corpus uses.

NLLB's 256k pieces are most of a small model's weights and of every decoding step's output layer;
a user's corpus and languages use a few thousand. The import keeps nmt's specials, the tokens of
the languages kept, every piece sentencepiece cuts the corpus into, and every piece of the model
that is part of one of those (a BPE model reaches a piece through merges of smaller ones: with
all of them kept, the corpus is cut exactly as before, and a piece never formed in the corpus is
never a merge it needs). The embedding rows and output biases of the kept pieces are gathered;
the sentencepiece model keeps its normaliser and rules, so any text still encodes: a word of
kept characters into kept pieces (perhaps more of them than before), a character the corpus
never had as <unk> (or its bytes, where the model falls back to bytes).

What changes: the output layer holds the kept pieces only, so a translation's probabilities are
renormalised over them; on text whose pieces were all kept the greedy translation is the same
wherever the untrimmed model's was made of kept pieces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from nmt_cli.errors import NmtError
from nmt_cli.hf.pieces import spm_proto
from nmt_cli.normalize import normalize
from nmt_cli.vocab import EOS

if TYPE_CHECKING:
    from nmt_cli.hf.imported import Marian

LONGEST_PIECE = 64  # characters: past any sentencepiece model's max_sentencepiece_length


def trimmed(marian: Marian, corpus: Iterable[str], languages: list[str], where: str) -> Marian:
    """`marian` (a joint-vocabulary import) with the pieces of `corpus` (and of the `languages`
    kept) and those they are made of."""
    import sentencepiece as spm
    import torch

    if marian.config.src_vocab_size or marian.source != marian.target:
        raise NmtError("--trim cuts one vocabulary shared by both sides (M2M100, NLLB): this model has two")
    unknown = [code for code in languages if code not in marian.languages]
    if unknown:
        raise NmtError(f"--languages {unknown[0]!r:.40} is not a language of {where}")
    proto = spm_proto(marian.target, Path(where))
    sp = spm.SentencePieceProcessor(model_proto=marian.target)
    kept = set(range(EOS + 1))
    kept |= {sp.piece_to_id(marian.languages[code]) for code in languages}
    lines = 0
    for line in corpus:
        lines += 1
        kept.update(sp.encode(line))
        kept.update(sp.encode(normalize(line, "en")))  # as the translator cleans it
    if not lines:
        raise NmtError("--trim: the corpus is empty")
    t = type(proto.pieces[0])
    ids = {p.piece: i for i, p in enumerate(proto.pieces) if p.type in (t.NORMAL, t.USER_DEFINED)}
    for i in list(kept):  # the pieces each kept one is merged from
        piece = proto.pieces[i].piece
        for start in range(len(piece)):
            for end in range(start + 1, min(len(piece), start + LONGEST_PIECE) + 1):
                found = ids.get(piece[start:end])
                if found is not None:
                    kept.add(found)
    if proto.trainer_spec.byte_fallback:
        kept |= {i for i, p in enumerate(proto.pieces) if p.type == t.BYTE}
    order = sorted(kept)
    pieces = [proto.pieces[i] for i in order]
    del proto.pieces[:]
    proto.pieces.extend(pieces)
    proto.trainer_spec.vocab_size = len(pieces)
    rows = torch.tensor(order)
    weights = {
        k: v[rows].clone() if k in ("embed.weight", "output_bias") else v for k, v in marian.weights.items()
    }
    config = dataclasses.replace(marian.config, vocab_size=len(order))
    model = proto.SerializeToString()
    return dataclasses.replace(
        marian,
        config=config,
        weights=weights,
        source=model,
        target=model,
        languages={code: marian.languages[code] for code in languages},
    )
