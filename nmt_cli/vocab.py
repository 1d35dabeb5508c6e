"""The special pieces (the same ids in every sentencepiece model bpe.py makes, the binarized data
and the model's embeddings), and the sentencepiece models a model encodes and decodes with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nmt_cli.errors import NmtError
from nmt_cli.files import read_regular

PAD, UNK, BOS, EOS = 0, 1, 2, 3
MAX_SPM_BYTES = 64 << 20  # several times what a sentencepiece model of a million pieces holds


def processor(spm_model: Path, follow: bool = False):
    """The sentencepiece processor of `spm_model`, read as a regular file of at most
    MAX_SPM_BYTES (sentencepiece would read a link to /dev/zero for ever, and wait on a FIFO),
    not through a symbolic link unless `follow` (a file the user names)."""
    import sentencepiece as spm

    data = read_regular(spm_model, MAX_SPM_BYTES, follow=follow)
    try:
        # one thread for a call on a list: by default each such call starts a pool of threads,
        # which costs more than encoding a request's few lines (bulk encoding asks for threads)
        return spm.SentencePieceProcessor(model_proto=data, num_threads=1)
    except (RuntimeError, OSError, TypeError) as e:
        raise NmtError(f"{spm_model} is not a sentencepiece model ({str(e).strip()[:200]})") from None


def pieces(spm_model: Path) -> list[str]:
    """A sentencepiece model's pieces in id order: the vocabulary as CTranslate2 and
    transformers' tokenizers take it."""
    sp = processor(spm_model)
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def folds_case(spm_model: Path) -> bool:
    """Whether a sentencepiece model lowercases what it encodes (`nmt bpe --lowercase`)."""
    sp = processor(spm_model)
    return sp.decode(sp.encode("A")) == "a"


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
        source = processor(self.source)
        return source, source if self.joint else processor(self.target)
