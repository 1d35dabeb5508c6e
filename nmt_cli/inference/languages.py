"""The language tokens of a multilingual model (an M2M100 or NLLB import: hf/m2m100.py): the
source's before its pieces, the target's forced first and left out of the translation, as
M2M100's tokenizer and `generate(forced_bos_token_id=…)` put them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from nmt_cli.engine.hypothesis import Hypothesis
from nmt_cli.errors import NmtError


@dataclass(frozen=True)
class Languages:
    """A model's languages: each code's token id, and the codes it translates unless told."""

    ids: dict[str, int]
    src: str
    tgt: str
    where: str

    @staticmethod
    def of(tokens: dict[str, str], piece_to_id, src: str, tgt: str, where: object) -> Languages | None:
        """`tokens` (code -> piece, as the package records them) as ids of the target's
        sentencepiece model (`piece_to_id`); None for a model of one pair."""
        if not tokens:
            return None
        ids = {code: piece_to_id(piece) for code, piece in tokens.items()}
        return Languages(ids, src, tgt, str(where))

    def tokens(self, src_lang: str, tgt_lang: str) -> tuple[list[int], list[int]]:
        """The source's first token and the target's, for --src-lang and --tgt-lang (empty:
        the model's own defaults); one error line for a code the model lacks."""
        return [self._id(src_lang or self.src, "--src-lang")], [self._id(tgt_lang or self.tgt, "--tgt-lang")]

    def _id(self, code: str, flag: str) -> int:
        if code not in self.ids:
            some = ", ".join(list(self.ids)[:6])
            raise NmtError(
                f"{flag} {code!r:.40} is not a language of {self.where} ({some}, … {len(self.ids)} in all)"
            )
        return self.ids[code]


def refuse(src_lang: str, tgt_lang: str, where: object) -> None:
    """--src-lang or --tgt-lang given to a model of one pair: one error line."""
    if src_lang or tgt_lang:
        raise NmtError(
            f"--src-lang and --tgt-lang choose the languages of a multilingual model (M2M100, NLLB): "
            f"{where} translates one pair"
        )


def stripped(hyps: list[list[Hypothesis]]) -> list[list[Hypothesis]]:
    """The hypotheses without their first token, the target language's."""
    return [[replace(h, tokens=h.tokens[1:]) for h in hs] for hs in hyps]
