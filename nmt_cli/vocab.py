"""The special pieces (the same ids in every sentencepiece model bpe.py makes, the binarized data
and the model's embeddings), and the sentencepiece models a model encodes and decodes with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PAD, UNK, BOS, EOS = 0, 1, 2, 3


def pieces(spm_model: Path) -> list[str]:
    """A sentencepiece model's pieces in id order: the vocabulary as CTranslate2 and
    transformers' tokenizers take it."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


@dataclass(frozen=True)
class Vocabularies:
    """A model's sentencepiece models: one joint model for both sides (`nmt bpe`), or the
    source's and the target's own (`nmt bpe --separate`)."""

    source: Path
    target: Path

    @classmethod
    def joint_model(cls, path: Path) -> Vocabularies:
        return cls(path, path)

    @classmethod
    def in_folder(cls, folder: Path, joint: bool | None = None) -> Vocabularies:
        """The models' files in a folder (a run's bpe/, a package): spm.model when joint, else
        spm.source.model and spm.target.model; `joint` None: whichever the folder holds."""
        if joint is None:
            joint = (folder / "spm.model").exists() or not (folder / "spm.source.model").exists()
        if joint:
            return cls.joint_model(folder / "spm.model")
        return cls(folder / "spm.source.model", folder / "spm.target.model")

    @property
    def joint(self) -> bool:
        return self.source == self.target

    def files(self) -> tuple[Path, ...]:
        return (self.source,) if self.joint else (self.source, self.target)

    def processors(self):
        """sentencepiece processors of the source and the target (one object when joint)."""
        import sentencepiece as spm

        source = spm.SentencePieceProcessor(model_file=str(self.source))
        return source, source if self.joint else spm.SentencePieceProcessor(model_file=str(self.target))
