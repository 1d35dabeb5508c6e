"""The measures of `nmt score`: sacreBLEU's BLEU, chrF and TER with their signatures, and paired significance.

`moses_lc` is the measure of the small-data literature (e.g. Multi30k papers): text lowercased,
Moses-normalised and Moses-tokenised (with its escaping), then scored with no further
tokenisation. `compound_split` is the Transformer paper's WMT14 en-de measure (tensor2tensor's
get_ende_bleu.sh): cased, Moses-tokenised, hyphenated compounds split as `##AT##-##AT##`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nmt_cli.errors import NmtError

METRICS = ("bleu", "chrf", "ter")


@dataclass
class Score:
    metric: str
    score: float
    signature: str
    text: str  # sacrebleu's own formatting, e.g. "BLEU = 34.2 65.1/40.0/... (BP = ...)"

    def as_dict(self) -> dict:
        return {"metric": self.metric, "score": self.score, "signature": self.signature, "text": self.text}


def moses_lc(lines: list[str], lang: str) -> list[str]:
    """Lowercase, Moses punctuation normalisation, Moses tokenisation with escaping."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    normalizer, tokenizer = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    return [
        tokenizer.tokenize(normalizer.normalize(line.lower()), escape=True, return_str=True) for line in lines
    ]


def compound_split(lines: list[str], lang: str) -> list[str]:
    """Moses tokenisation (cased, with its escaping, as tokenizer.perl), then every hyphen between
    two non-spaces set apart as ` ##AT##-##AT## ` (get_ende_bleu.sh's `s{(\\S)-(\\S)}{...}g`)."""
    import re

    from sacremoses import MosesTokenizer

    tokenizer = MosesTokenizer(lang=lang)
    hyphen = re.compile(r"(\S)-(\S)")
    return [
        hyphen.sub(r"\1 ##AT##-##AT## \2", tokenizer.tokenize(line, escape=True, return_str=True))
        for line in lines
    ]


def _metric(name: str, tokenize: str, lowercase: bool):
    from sacrebleu.metrics import BLEU, CHRF, TER

    if name == "bleu":
        # --tokenize none scores tokenized text on purpose (--moses-lc, --compound-split): no
        # warning about it.
        return BLEU(tokenize=tokenize, lowercase=lowercase, force=tokenize == "none")
    if name == "chrf":
        return CHRF(lowercase=lowercase)
    if name == "ter":
        return TER(case_sensitive=not lowercase)
    raise NmtError(f"unknown metric {name!r}: choose from {', '.join(METRICS)}")


def check_lengths(hyps: list[str], refs: list[str], hyp_name: str, ref_name: str) -> None:
    if len(hyps) != len(refs):
        raise NmtError(
            f"{hyp_name} has {len(hyps)} lines but {ref_name} has {len(refs)}: "
            "hypotheses and references must be line-aligned"
        )


def score(
    hyps: list[str], refs: list[str], metrics: list[str], tokenize: str = "13a", lowercase: bool = False
) -> list[Score]:
    out = []
    for name in metrics:
        metric = _metric(name, tokenize, lowercase)
        result = metric.corpus_score(hyps, [refs])
        signature = str(metric.get_signature())
        out.append(Score(name, float(result.score), signature, str(result)))
    return out


def compare(
    hyps: list[str],
    other: list[str],
    refs: list[str],
    metrics: list[str],
    tokenize: str = "13a",
    lowercase: bool = False,
    samples: int = 1000,
) -> dict:
    """sacrebleu's paired bootstrap test of `hyps` against the baseline `other`."""
    from sacrebleu.significance import PairedTest

    test = PairedTest(
        [("baseline", other), ("system", hyps)],
        {m: _metric(m, tokenize, lowercase) for m in metrics},
        references=[refs],
        test_type="bs",
        n_samples=samples,
    )
    _, results = test()
    out = {}
    # Results are keyed by sacrebleu's display names (BLEU, chrF2, TER), in our order.
    for m, key in zip(metrics, [k for k in results if k != "System"]):
        base, system = results[key]
        out[m] = {
            "baseline": float(base.score),
            "system": float(system.score),
            "p_value": float(system.p_value),
            "system_mean": float(system.mean),
            "system_ci": float(system.ci),
        }
    return out


def valid_lines(run, lang: str) -> list[str]:
    """The run's validation lines in `lang` as released (as prepared, where it kept no copy)."""
    path = run.text("valid", lang, raw=True)
    return (path if path.exists() else run.text("valid", lang)).read_text(encoding="utf-8").splitlines()


def bleu_of_ids(run, tgt_lang: str) -> Callable[[list[list[int]]], dict[str, float]]:
    """What `nmt train --eval-bleu` hands the trainer: sacreBLEU of translations given as
    token ids of the validation set, against its references as released (case-insensitive
    where the BPE model lowercases), as `valid_bleu`. A run of several directions (`nmt prep
    multi30k --pair ...`): BLEU and chrF of each direction's lines (`valid_bleu_en-de`, ...), and
    as `valid_bleu` their mean, which --best-metric bleu reads."""
    from nmt_cli.vocab import folds_case, processor

    refs = valid_lines(run, tgt_lang)
    sp = processor(run.vocabularies().target)
    lowercase = folds_case(run.vocabularies().target)
    drop = language_ids(run, sp)
    pairs = run.load_manifest()["prep"]["splits"].get("valid", {}).get("pairs", [])

    def bleu(ids: list[list[int]]) -> dict[str, float]:
        texts = sp.decode([[t for t in x if t not in drop] for x in ids])
        if not pairs:
            return {
                "valid_bleu": score(texts[: len(refs)], refs[: len(ids)], ["bleu"], lowercase=lowercase)[
                    0
                ].score
            }
        out, start = {}, 0
        for pair in pairs:
            end = start + pair["lines"]
            name = f"{pair['src']}-{pair['tgt']}"
            found = score(texts[start:end], refs[start:end], ["bleu", "chrf"], lowercase=lowercase)
            out[f"valid_bleu_{name}"], out[f"valid_chrf_{name}"] = found[0].score, found[1].score
            start = end
        out["valid_bleu"] = sum(out[f"valid_bleu_{p['src']}-{p['tgt']}"] for p in pairs) / len(pairs)
        return out

    return bleu


def compare_means(system: list[float], baseline: list[float], samples: int = 1000) -> dict:
    """sacreBLEU's paired bootstrap test for a metric whose corpus score is the mean of its
    segments' (COMET): the same resampled indices, statistic, confidence interval and p-value."""
    import os

    import numpy as np

    seed = os.environ.get("SACREBLEU_SEED", "12345")
    rng = np.random.default_rng(None if seed.lower() == "none" else int(seed))
    ours, theirs = np.array(system, dtype=np.float64), np.array(baseline, dtype=np.float64)
    indices = rng.choice(len(ours), size=(samples, len(ours)), replace=True)
    resampled, resampled_base = ours[indices].mean(1), theirs[indices].mean(1)
    spread = np.abs(resampled - resampled_base)
    beyond = int(np.sum(spread - spread.mean() > abs(ours.mean() - theirs.mean())))
    ordered = np.sort(resampled)
    low = samples // 40
    return {
        "baseline": float(theirs.mean()),
        "system": float(ours.mean()),
        "p_value": (beyond + 1) / (samples + 1),
        "system_mean": float(resampled.mean()),
        "system_ci": float(0.5 * (ordered[samples - low - 1] - ordered[low])),
    }


def language_ids(run, sp) -> set[int]:
    """The language tokens of a run fine-tuning a multilingual model (`nmt bpe --from` one), as
    ids of `sp`: a translation's first, never its text."""
    bpe = run.load_manifest().get("bpe", {})
    return {sp.piece_to_id(p) for p in (bpe.get("languages") or {}).get("tokens", {}).values()}
