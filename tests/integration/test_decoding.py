"""Decoding beyond the beam: sampling, scores beside every translation, scoring given pairs
(forced decoding), prefixes, constraints, tags and alignments, in nmt's engine and CTranslate2's,
on a small trained Multi30k model."""

import dataclasses
import math
import re
import shutil
from pathlib import Path

import pytest
from conftest import TINY, one_error_line, run_ok

from nmt_cli.config import DecodeOptions, TranslateConfig
from nmt_cli.config.translation import RANGES
from nmt_cli.errors import NmtError
from nmt_cli.inference.models import locate
from nmt_cli.inference.translator import Translator
from nmt_cli.rundir import RunDir

ENGINES = ("nmt", "ctranslate2")


@pytest.fixture(scope="module")
def sources(trained_longer) -> list[str]:
    return RunDir(trained_longer).text("valid", "en", raw=True).read_text().splitlines()[:24]


def translator(run, engine="nmt", **options) -> Translator:
    config = TranslateConfig(engine=engine, decode=DecodeOptions(**options))
    return Translator(locate(run), config)


def texts(t: Translator, lines: list[str], **options) -> list[list[str]]:
    return t.texts(t.hypotheses(lines, dataclasses.replace(t.config.decode, **options) if options else None))


def draws_apart(run, engine: str, sources: list[str], **options) -> int:
    """On how many lines one draw under seed 7 and one under seed 8 differ: how often two
    independent draws of this model differ, the yardstick of the sampling tests."""
    one = translator(run, engine, sample=True, nbest=1, **options)
    return sum(a != b for a, b in zip(texts(one, sources, seed=7), texts(one, sources, seed=8)))


def test_a_seed_draws_the_same_samples_whatever_shares_the_batch_but_for_floats(trained_longer, sources):
    """What holds (docs/guide.md, "Sampling"): the same call draws the same; batched otherwise,
    a line draws the same but where its model's probabilities, changed in their last bits by
    other padding and shapes, move a boundary past its random number: rarely, against how often
    two seeds' draws differ."""
    held_out = RunDir(trained_longer).text("test", "en", raw=True).read_text().splitlines()[:120]
    drawn = translator(trained_longer, sample=True, nbest=2, seed=7)
    first, hyps = texts(drawn, held_out), drawn.hypotheses(held_out)
    assert texts(drawn, held_out) == first  # again, in the same process
    apart = draws_apart(trained_longer, "nmt", held_out)
    for size in (1, 3):
        other = Translator(locate(trained_longer), dataclasses.replace(drawn.config, batch_size=size))
        alone = other.hypotheses(held_out)
        moved = sum(a != b for a, b in zip(other.texts(alone), first))
        assert moved <= apart // 10, (size, moved, apart)
        same = [i for i, (a, b) in enumerate(zip(other.texts(alone), first)) if a == b]
        assert [h.score for i in same for h in alone[i]] == pytest.approx(
            [h.score for i in same for h in hyps[i]], abs=1e-3
        )
    assert all(len(t) == 2 for t in first)
    # A line's two draws differ about as often as two draws of separate seeds do (measured
    # here, on this model): each is a draw of its own, not the first twice.
    apart = draws_apart(trained_longer, "nmt", sources)
    first = texts(drawn, sources)
    assert sum(a != b for a, b in first) >= apart // 2 > 0
    assert texts(drawn, sources, seed=8) != first
    greedy = texts(translator(trained_longer, beam=1), sources)
    assert sum(t[0] != g[0] for t, g in zip(first, greedy)) >= apart // 2


@pytest.mark.parametrize("engine", ENGINES)
def test_lines_of_one_call_keep_their_own_alpha_and_seed(trained_longer, sources, engine):
    """What `nmt serve` does with requests that differ only in alpha or seed: one batch, each
    line searched and ranked as alone (nmt's engine: each draws from its own stream too)."""
    t = translator(trained_longer, engine, nbest=2)
    kinds = [dataclasses.replace(t.config.decode, alpha=a) for a in (0.0, 2.0, 0.6)]
    each = [kinds[i % 3] for i in range(len(sources))]
    together = t.texts(t.hypotheses(sources, each, keys=list(range(len(sources)))))
    alone = {}
    for k, o in enumerate(kinds):
        mine = list(range(k, len(sources), 3))
        for i, found in zip(mine, t.texts(t.hypotheses([sources[i] for i in mine], o, keys=mine))):
            alone[i] = found
    assert together == [alone[i] for i in range(len(sources))]
    # ... and alpha tells: the same lines ranked by one alpha come out otherwise
    assert texts(t, sources, alpha=0.0) != texts(t, sources, alpha=2.0)
    if engine == "ctranslate2":  # its draws come from one stream per thread (backend_ct2.search)
        return
    drawn = dataclasses.replace(t.config.decode, sample=True)
    seeds = [dataclasses.replace(drawn, seed=7 + i % 2) for i in range(len(sources))]
    together = t.texts(t.hypotheses(sources, seeds, keys=list(range(len(sources)))))
    for seed in (7, 8):
        mine = [i for i in range(len(sources)) if seeds[i].seed == seed]
        alone = t.texts(t.hypotheses([sources[i] for i in mine], seeds[mine[0]], keys=mine))
        assert [together[i] for i in mine] == alone
    with pytest.raises(ValueError, match="seed and alpha only"):
        t.hypotheses(sources[:2], [drawn, dataclasses.replace(drawn, topk=5)])


@pytest.mark.parametrize("engine", ENGINES)
def test_lines_nobody_waits_for_end_at_once_and_the_others_decode_as_before(trained_longer, sources, engine):
    """`nmt serve`'s `gone`, through the translator's batches (sorted by length): nmt's engine
    ends every line nobody waits for at its first step; CTranslate2 finishes what it has begun.
    Either way the lines still waited for are translated as always; none waited for: Stopped."""
    from nmt_cli.errors import Stopped

    t = Translator(locate(trained_longer), TranslateConfig(engine=engine, batch_size=8))
    plain = t.hypotheses(sources)
    odd = [i % 2 == 1 for i in range(len(sources))]
    found = t.hypotheses(sources, gone=lambda: odd)
    assert [h[0].tokens for h in found[::2]] == [h[0].tokens for h in plain[::2]]
    if engine == "nmt":
        assert all(h[0].tokens == [] for h in found[1::2])
    else:
        assert [h[0].tokens for h in found[1::2]] == [h[0].tokens for h in plain[1::2]]
    with pytest.raises(Stopped):
        t.hypotheses(sources, gone=lambda: [True] * len(sources))


@pytest.mark.parametrize("engine", ENGINES)
def test_top_k_1_and_a_cold_temperature_are_greedy(trained_longer, sources, engine):
    greedy = texts(translator(trained_longer, engine, beam=1), sources)
    assert texts(translator(trained_longer, engine, sample=True, topk=1), sources) == greedy
    assert texts(translator(trained_longer, engine, sample=True, temperature=1e-6), sources) == greedy


def test_ctranslate2_samples_as_many_draws_as_asked(trained_longer, sources):
    drawn = texts(translator(trained_longer, "ctranslate2", sample=True, nbest=3, topp=0.9, seed=2), sources)
    greedy = texts(translator(trained_longer, "ctranslate2", beam=1), sources)
    assert all(len(t) == 3 for t in drawn)
    # the yardstick drawn by nmt's engine: CTranslate2 seeds each call of a batch alike
    apart = draws_apart(trained_longer, "nmt", sources, topp=0.9)
    assert sum(len(set(t)) > 1 for t in drawn) >= apart // 2 > 0  # draws, not one thrice
    assert sum(t[0] != g[0] for t, g in zip(drawn, greedy)) >= apart // 2


def test_sampling_options_are_checked(trained_longer, nmt):
    for flags, message in (
        (["--topk", "5"], "add --sample"),
        (["--sample", "--topp", "0"], "--topp must be in (0, 1]"),
        (["--sample", "--temperature", "0"], "--temperature must be from 1e-06 to 100, not 0"),
        (["--sample", "--topk", "-1"], "--topk must be from 0 to 100000, not -1"),
        (["--alpha", "nan"], "--alpha must be from 0 to 10, not nan"),
        (["--max-len-a", "inf"], "--max-len-a must be from 0 to 100, not inf"),
        (["--sample", "--coverage-penalty", "0.2"], "--coverage-penalty ranks a search's translations"),
        (["--coverage-penalty", "-1"], "--coverage-penalty must be from 0 to 10, not -1"),
    ):
        assert message in one_error_line(nmt("translate", "--run-dir", trained_longer, *flags, stdin=b"x\n"))


@pytest.mark.parametrize("engine", ENGINES)
def test_max_len_caps_every_translation(trained_longer, sources, engine):
    longest = max(len(h[0].tokens) for h in translator(trained_longer, engine).hypotheses(sources))
    cap = longest // 2  # tokens counting the EOS: the texts keep cap - 1
    for options in ({}, {"beam": 1}, {"sample": True, "nbest": 2}):
        found = translator(trained_longer, engine, max_len=cap, **options).hypotheses(sources)
        assert max(len(h.tokens) for hs in found for h in hs) == cap - 1, options


@pytest.mark.parametrize("engine", ENGINES)
def test_every_option_at_the_end_of_its_range_decodes(trained_longer, sources, engine):
    """The ranges' upper ends are answers, not errors or NaN (a top-k past the vocabulary, a
    seed of 32 bits, the longest length allowed, penalties of 10)."""
    searching = ("beam", "nbest", "max_len", "coverage_penalty", "candidates")  # not sampling's
    widest = {f"{name}": hi for name, (_, hi) in RANGES.items() if name not in searching}
    if engine == "ctranslate2":  # nmt's alone (test_mbr.py)
        del widest["epsilon"]
    found = translator(trained_longer, engine, sample=True, nbest=2, max_len=40, **widest).hypotheses(
        sources[:2]
    )
    assert all(len(h.tokens) <= 39 and math.isfinite(h.score) for hs in found for h in hs)
    beam = dict(beam=8, alpha=10.0, max_len_a=100.0, coverage_penalty=10.0)
    found = translator(trained_longer, engine, **beam).hypotheses(sources[:2])
    assert all(math.isfinite(h.score) for hs in found for h in hs)


def _repeats(tokens: list[int], n: int) -> bool:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) != len(set(grams))


@pytest.mark.parametrize("engine", ENGINES)
def test_min_len_and_no_repeat_ngram_shape_every_search(trained_longer, sources, engine):
    """--min-len: no translation ends before it; --no-repeat-ngram N: no N-gram twice; in beam
    search, greedy search and sampling (and constrained search, nmt's engine) alike. The test
    bites only where the plain outputs are shorter or repeat, which it checks: the bans are
    tried on outputs made longer by --min-len, which repeat where the model's own need not."""
    plain = [h[0].tokens for h in translator(trained_longer, engine).hypotheses(sources)]
    least = max(map(len, plain)) + 3
    longer = [h[0].tokens for h in translator(trained_longer, engine, min_len=least).hypotheses(sources)]
    assert any(_repeats(t, 1) for t in longer)  # some token twice: what the ban must prevent
    searches = [{}, {"beam": 1}, {"sample": True, "nbest": 2}]
    if engine == "nmt":
        searches.append({"constraints": [[s.split()[0]] for s in sources]})
    for search in searches:
        kw = {"constraints": search.pop("constraints")} if "constraints" in search else {}
        t = translator(trained_longer, engine, min_len=least, **search)
        assert min(len(h.tokens) for hs in t.hypotheses(sources, **kw) for h in hs) >= least, search
        for n in (1, 2):
            t = translator(trained_longer, engine, no_repeat_ngram=n, min_len=least, **search)
            found = t.hypotheses(sources, **kw)
            assert not any(_repeats(h.tokens, n) for hs in found for h in hs), (search, n)


def test_both_engines_apply_min_len_and_no_repeat_ngram_alike(trained_longer, sources):
    """Greedy search chooses alike in both engines under the rules (a beam may rank a candidate
    differently: CTranslate2 bans before its softmax, nmt after, as fairseq)."""
    for options in ({"min_len": 12}, {"no_repeat_ngram": 2}, {"no_repeat_ngram": 1, "min_len": 6}):
        ours = texts(translator(trained_longer, "nmt", beam=1, **options), sources)
        theirs = texts(translator(trained_longer, "ctranslate2", beam=1, **options), sources)
        assert sum(a == b for a, b in zip(ours, theirs)) >= len(sources) - 1, options


def test_both_engines_apply_the_repetition_penalty_alike(trained_longer, sources):
    """Both scale the logits of the tokens a row holds before their softmax (CTRL's penalty):
    greedy and beam search choose alike. The penalty's effect is shown on greedy outputs made long
    enough by --min-len to hold repeats (in a beam, --min-len itself ranks differently in the two
    engines: CTranslate2 bans before its softmax)."""
    least = max(len(h[0].tokens) for h in translator(trained_longer).hypotheses(sources)) + 3
    for search in ({"beam": 1, "min_len": least}, {"beam": 4}):
        ours = texts(translator(trained_longer, "nmt", repetition_penalty=1.5, **search), sources)
        theirs = texts(translator(trained_longer, "ctranslate2", repetition_penalty=1.5, **search), sources)
        assert sum(a == b for a, b in zip(ours, theirs)) >= len(sources) - 1, search
        if search["beam"] == 1:
            plain = texts(translator(trained_longer, "nmt", **search), sources)
            assert sum(a != b for a, b in zip(plain, ours)) >= 3  # the penalty is felt


def test_the_coverage_penalty_ranks_the_beam_by_the_attention_each_word_received(trained_longer, sources):
    """--coverage-penalty B: each of the beam's translations scores B x the sum over source tokens
    of log(min(attention received, 1)) more, recomputed here from the model's teacher-forced
    attention (last layer, heads averaged, the translation's steps and its EOS, the source's EOS
    left out); the n-best are ranked by it. Both engines give a translation they both find the
    same penalty (CTranslate2 from its own attention)."""
    import torch

    from nmt_cli.engine.batches import pad_targets

    beta, found = 2.0, {}
    for engine in ENGINES:
        for b in (0.0, beta):
            t = translator(trained_longer, engine, nbest=4, coverage_penalty=b)
            found[engine, b] = t.hypotheses(sources)
    ids, model = t.encode(sources), translator(trained_longer).backend.models[0]
    shifts = {}
    for engine in ENGINES:
        for i, (plain, covered) in enumerate(zip(found[engine, 0.0], found[engine, beta])):
            assert [h.score for h in covered] == sorted((h.score for h in covered), reverse=True)
            before = {tuple(h.tokens): h.score for h in plain}
            for h in covered:
                if tuple(h.tokens) in before:
                    shifts[engine, i, tuple(h.tokens)] = h.score - before[tuple(h.tokens)]
    checked = [(i, y) for engine, i, y in shifts if engine == "nmt"]
    assert len(checked) >= len(sources)
    for i, y in checked:
        tgt_in, _ = pad_targets([list(y)])
        src = torch.tensor([ids[i] + [3]])
        attention = model.cross_attention(src, torch.from_numpy(tgt_in))[0, :, :-1]  # its tokens, not its EOS
        expected = beta * torch.log(attention.sum(0).clamp(max=1.0)).sum().item()
        assert shifts["nmt", i, y] == pytest.approx(expected, rel=1e-5, abs=1e-4)
        if ("ctranslate2", i, y) in shifts:
            assert shifts["ctranslate2", i, y] == pytest.approx(expected, rel=1e-4, abs=1e-3)
    assert sum(("ctranslate2", i, y) in shifts for i, y in checked) >= len(sources)
    # The penalty re-ranks: some sentence's best translation is another than without it.
    assert any(a[0].tokens != b[0].tokens for a, b in zip(found["nmt", 0.0], found["nmt", beta]))


def test_scores_print_beside_the_1_best_as_the_n_best_prints_them(trained_longer, sources, nmt):
    stdin = "\n".join(sources[:6]).encode() + b"\n"
    plain = nmt("translate", "--run-dir", trained_longer, stdin=stdin).out.splitlines()
    scored = nmt("translate", "--run-dir", trained_longer, "--scores", stdin=stdin).out.splitlines()
    nbest = nmt("translate", "--run-dir", trained_longer, "--nbest", "2", stdin=stdin).out.splitlines()
    assert [line.split("\t") for line in scored] == [
        [str(i), nbest[2 * i].split("\t")[1], text] for i, text in enumerate(plain)
    ]


@pytest.mark.parametrize("engine", ENGINES)
def test_scoring_the_beams_own_outputs_gives_the_beams_own_scores(trained_longer, sources, engine):
    t = translator(trained_longer, engine, nbest=4)
    hyps = t.hypotheses(sources)
    # A hypothesis cut at the length limit (a * |X| + b) has no EOS in CTranslate2's search, and
    # scoring it counts one; and text is scored in its own pieces, which a search may have spelled
    # otherwise: those are left out.
    limits = [len(x) + 50 for x in t.encode(sources)]
    pairs = [
        (s, text, h.score)
        for s, ts, hs, limit in zip(sources, t.texts(hyps), hyps, limits)
        for text, h in zip(ts, hs)
        if len(h.tokens) < limit and t.encode_targets([text]) == [h.tokens]
    ]
    assert len(pairs) > 80
    scored = t.score_pairs([p[0] for p in pairs], [p[1] for p in pairs])
    assert [s.score for s in scored] == pytest.approx([p[2] for p in pairs], abs=2e-3)
    assert all(s.total <= s.score <= 0 and s.tokens >= 1 for s in scored)
    # the other side's log-probability: each engine scores as the other does
    other = translator(trained_longer, ENGINES[engine == "nmt"])
    assert [
        s.total for s in other.score_pairs([p[0] for p in pairs], [p[1] for p in pairs])
    ] == pytest.approx([s.total for s in scored], abs=2e-3)


def test_score_pairs_prints_a_line_per_pair_and_prefers_a_translation_to_its_words_reversed(
    trained_longer, tmp_path, nmt
):
    run = RunDir(trained_longer)
    src = run.text("valid", "en", raw=True).read_text().splitlines()[:30]
    ref = run.text("valid", "de", raw=True).read_text().splitlines()[:30]
    wrong = [" ".join(reversed(r.split())) for r in ref]  # the words of its translation, reversed
    (tmp_path / "src").write_text("\n".join(src + src) + "\n")
    (tmp_path / "tgt").write_text("\n".join(ref + wrong) + "\n")
    result = nmt(
        "score-pairs", "--run-dir", trained_longer, "--src", tmp_path / "src", "--tgt", tmp_path / "tgt"
    )
    assert result.code == 0, result.err
    rows = [[float(x) for x in line.split("\t")] for line in result.out.splitlines()]
    assert len(rows) == 60 and all(len(r) == 3 for r in rows)
    assert all(total <= score <= 0 and total <= per_token for total, per_token, score in rows)
    # per token: over the target's pieces and its EOS; the score: as the search ranks it
    from nmt_cli.engine.hypothesis import length_penalty

    pieces = [len(ids) + 1 for ids in Translator.load(trained_longer).encode_targets(ref + wrong)]
    for (total, per_token, score), n in zip(rows, pieces):
        assert per_token == pytest.approx(total / n, abs=1e-4)
        assert score == pytest.approx(total / length_penalty(n, 0.6), abs=1e-4)
    assert sum(rows[i][0] > rows[30 + i][0] for i in range(30)) >= 29
    # a filter: the pairs at or above a threshold of the per-token figure (printed to 4
    # places: the threshold half a place below), in their order
    cut = sorted(r[1] for r in rows)[30]
    kept = [tmp_path / "kept.src", tmp_path / "kept.tgt"]
    files = ["--src", tmp_path / "src", "--tgt", tmp_path / "tgt"]
    files += ["--kept-src", kept[0], "--kept-tgt", kept[1], "--min-score", f"{cut - 5e-5:.5f}"]
    result = nmt("score-pairs", "--run-dir", trained_longer, *files)
    wanted = [(a, b) for a, b, r in zip(src + src, ref + wrong, rows) if r[1] >= cut]
    assert list(zip(*(k.read_text().splitlines() for k in kept))) == wanted and len(wanted) >= 30
    assert f"kept {len(wanted)} of 60 pairs with log-probability per token >=" in result.err
    (tmp_path / "short").write_text("\n".join(ref[:3]) + "\n")
    assert "give line-aligned files" in one_error_line(
        nmt(
            "score-pairs", "--run-dir", trained_longer, "--src", tmp_path / "src", "--tgt", tmp_path / "short"
        )
    )


def test_the_python_api_translates_samples_and_scores_as_the_command_line(
    trained_longer, sources, tmp_path, nmt
):
    from nmt_cli import Translator

    model = Translator.load(trained_longer, beam=4, threads=1)
    stdin = "\n".join(sources[:8]).encode() + b"\n"
    assert (
        model.translate(sources[:8])
        == nmt("translate", "--run-dir", trained_longer, stdin=stdin).out.splitlines()
    )
    best = model.translations(sources[:8], nbest=2)
    assert all(len(t) == 2 and t[0].score >= t[1].score for t in best)
    assert [t[0].text for t in best] == model.translate(sources[:8])
    drawn = model.translations(sources[:8], sample=True, seed=5)
    cli = nmt(
        "translate", "--run-dir", trained_longer, "--sample", "--seed", "5", stdin=stdin
    ).out.splitlines()
    assert [t[0].text for t in drawn] == cli
    scored = model.score(sources[:8], [t[0].text for t in best])
    assert [s.score for s in scored] == pytest.approx([t[0].score for t in best], abs=2e-3)
    with pytest.raises(NmtError, match=r"unknown settings \['bem'\]"):
        Translator.load(trained_longer, bem=5)
    with pytest.raises(NmtError, match="unknown decoding options"):
        model.translate(sources[:1], bem=5)
    with pytest.raises(NmtError, match="--nbest 5 exceeds --beam 4"):
        model.translations(sources[:1], nbest=5)


@pytest.fixture(scope="module")
def prefixes(trained_longer, sources) -> list[str]:
    """Each source's reference's first two words; every fourth line none."""
    refs = RunDir(trained_longer).text("valid", "de", raw=True).read_text().splitlines()[: len(sources)]
    return ["" if i % 4 == 0 else " ".join(r.split()[:2]) for i, r in enumerate(refs)]


@pytest.mark.parametrize("engine", ENGINES)
def test_every_translation_begins_with_its_prefix(trained_longer, sources, prefixes, engine):
    model = Translator.load(trained_longer, engine=engine)
    plain = model.translate(sources)
    for options in ({}, {"beam": 1}, {"nbest": 2}, {"sample": True, "seed": 2}):
        found = model.translations(sources, prefixes, **options)
        for prefix, alone, hyps in zip(prefixes, plain, found):
            assert all(h.text.startswith(prefix) for h in hyps), (options, prefix, hyps)
            if not prefix and not options:  # a line without a prefix translates as before
                assert hyps[0].text == alone
    # Where the model would not begin with the prefix by itself, forcing it must change the line;
    # the test bites only if there are such lines, which this model's own output decides.
    unforced = [i for i, (p, alone) in enumerate(zip(prefixes, plain)) if p and not alone.startswith(p)]
    assert unforced, "every prefix is what the model says anyway: the test proves nothing"
    forced = model.translate(sources, prefixes)
    assert all(forced[i] != plain[i] and forced[i].startswith(prefixes[i]) for i in unforced)


@pytest.mark.parametrize("engine", ENGINES)
def test_max_len_cuts_a_prefix_longer_than_itself(trained_longer, sources, engine):
    """A prefix past the output limit ends at the limit (it gave no hypothesis at all: a 500 in
    `nmt serve`); the other lines of the batch are decoded as without it."""
    t = translator(trained_longer, engine, max_len=8)
    long = " ".join(["Hund"] * 100)
    found = t.hypotheses(sources[:3], prefixes=[long, "", ""])
    assert found[0][0].tokens == t.encode_targets([long])[0][:7]
    assert t.texts(found)[1:] == texts(t, sources[1:3])


def test_both_engines_continue_a_prefix_alike(trained_longer, sources, prefixes):
    ours = Translator.load(trained_longer, engine="nmt").translations(sources, prefixes)
    theirs = Translator.load(trained_longer, engine="ctranslate2").translations(sources, prefixes)
    assert sum(a[0].text == b[0].text for a, b in zip(ours, theirs)) >= len(sources) - 1
    same = [(a[0].score, b[0].score) for a, b in zip(ours, theirs) if a[0].text == b[0].text]
    assert [a for a, _ in same] == pytest.approx([b for _, b in same], abs=2e-3)


def test_prefix_from_the_command_line(trained_longer, sources, prefixes, tmp_path, nmt):
    (tmp_path / "prefixes").write_text("\n".join(prefixes[:6]) + "\n")
    stdin = "\n".join(sources[:6]).encode() + b"\n"
    out = nmt("translate", "--run-dir", trained_longer, "--prefix", tmp_path / "prefixes", stdin=stdin)
    assert out.out.splitlines() == Translator.load(trained_longer).translate(sources[:6], prefixes[:6])
    short = nmt("translate", "--run-dir", trained_longer, "--prefix", tmp_path / "prefixes", stdin=stdin * 2)
    assert "--prefix ends at line 6, before the input" in one_error_line(short)


@pytest.fixture(scope="module")
def constraints(trained_longer, sources) -> list[list[str]]:
    """Terminology from each source's reference: its longest word, on every other line also its
    last two words as one phrase; every fourth line none."""
    refs = RunDir(trained_longer).text("valid", "de", raw=True).read_text().splitlines()[: len(sources)]
    out = []
    for i, ref in enumerate(refs):
        words = re.findall(r"\w+", ref)
        phrases = [max(words, key=len)] + ([" ".join(words[-2:])] if i % 2 else [])
        out.append([] if i % 4 == 0 else phrases)
    return out


def holds(text: str, phrase: str) -> bool:
    """Whether `phrase` is in `text` beginning where a word begins: a constraint's pieces begin
    with a word's (sentencepiece's word-start mark), so "und" is not met inside "Hund"; its last
    piece may go on in the next one ("Hund" in "Hunde"), as the search works on pieces."""
    return re.search(r"(?<!\w)" + re.escape(phrase), text) is not None


def test_every_translation_holds_its_constraints(trained_longer, sources, prefixes, constraints):
    model = Translator.load(trained_longer)
    plain = model.translate(sources)
    for options in ({}, {"beam": 1}, {"beam": 5, "nbest": 2}):
        found = model.translations(sources, constraints=constraints, **options)
        for phrases, alone, hyps in zip(constraints, plain, found):
            assert all(holds(hyps[0].text, p) for p in phrases), (options, phrases, hyps[0].text)
            if not phrases and not options:  # a line without constraints translates as before
                assert hyps[0].text == alone
    # Where a line asks for what the model would not say by itself, meeting it changes the line;
    # the test bites only if there are such lines, which this model's own output decides.
    unmet = [i for i, (c, alone) in enumerate(zip(constraints, plain)) if not all(holds(alone, p) for p in c)]
    assert unmet, "every constraint is what the model says anyway: the test proves nothing"
    bound = model.translate(sources, constraints=constraints)
    assert all(bound[i] != plain[i] for i in unmet)
    assert model.translate(sources[:2], constraints=[[" "], ["", "  "]]) == plain[:2]  # nothing asked
    both = model.translate(sources, prefixes, constraints)
    for text, prefix, phrases in zip(both, prefixes, constraints):
        assert text.startswith(prefix) and all(holds(text, p) for p in phrases), (prefix, phrases, text)


def test_constraints_from_the_command_line(trained_longer, sources, constraints, tmp_path, nmt):
    path = tmp_path / "constraints"
    path.write_text("".join("\t".join(c) + "\n" for c in constraints[:6]))
    stdin = "\n".join(sources[:6]).encode() + b"\n"
    out = nmt("translate", "--run-dir", trained_longer, "--constraints", path, stdin=stdin)
    assert out.out.splitlines() == Translator.load(trained_longer).translate(
        sources[:6], constraints=constraints[:6]
    )
    short = nmt("translate", "--run-dir", trained_longer, "--constraints", path, stdin=stdin * 2)
    assert "--constraints ends at line 6, before the input" in one_error_line(short)
    for refused, message in (
        (["--engine", "ctranslate2"], "--constraints need nmt's engine"),
        (["--sample"], "--constraints are met by beam search: drop --sample"),
    ):
        assert message in one_error_line(
            nmt("translate", "--run-dir", trained_longer, "--constraints", path, *refused, stdin=stdin)
        )
    with pytest.raises(NmtError, match="--constraints need nmt's engine"):
        Translator.load(trained_longer, engine="ctranslate2").translate(
            sources[:2], constraints=[["Hund"], []]
        )


@pytest.fixture(scope="module")
def tagged_model(tagged_bpe, tmp_path_factory) -> Path:
    """A TINY model trained briefly on a clean corpus and one tagged '<bt>', and its package."""
    root = tmp_path_factory.mktemp("tagged-model")
    shutil.copytree(tagged_bpe, root / "run")
    run_ok(
        [
            "train",
            "--run-dir",
            root / "run",
            *TINY,
            "--max-steps",
            20,
            "--eval-every",
            1000,
            "--save-every",
            20,
        ],
        ["export", root / "package", "--run-dir", root / "run"],
    )
    return root


def test_a_tag_goes_before_every_source_line_as_in_training(tagged_model, sources):
    for where in ("run", "package"):
        model = Translator.load(tagged_model / where, tag="<bt>", max_len_b=8)
        assert model.tags == ("<bt>",)
        pieces = [[model.source_sp.id_to_piece(i) for i in ids] for ids in model.encode(sources[:4], "<bt>")]
        assert all(p[:2] == ["▁", "<bt>"] and "<bt>" not in p[2:] for p in pieces)  # as prep wrote it
        assert model.encode([""], "<bt>") == [[]]  # an empty line stays empty
        by_hand = Translator.load(tagged_model / where, max_len_b=8)
        assert model.translate(sources[:6]) == by_hand.translate([f"<bt> {s}" for s in sources[:6]])
        assert model.translate(sources[:6], tag="") == by_hand.translate(sources[:6])


def test_an_unknown_tag_is_refused_in_one_line(tagged_model, trained_longer, nmt):
    refused = nmt("translate", "--run-dir", tagged_model / "run", "--tag", "<xx>", stdin=b"x\n")
    assert "--tag '<xx>' is not a tag of" in one_error_line(refused) and "'<bt>'" in refused.err
    untagged = nmt("translate", "--run-dir", trained_longer, "--tag", "<bt>", stdin=b"x\n")
    assert "it was trained without tags" in one_error_line(untagged)
    scored = nmt("score", "--run-dir", tagged_model / "run", "--split", "valid", "--tag", "<yy>")
    assert "--tag '<yy>' is not a tag of" in one_error_line(scored)
    with pytest.raises(NmtError, match="is not a tag of"):
        Translator.load(tagged_model / "package").translate(["x"], tag="<zz>")


@pytest.fixture(scope="module")
def copy_model(multi30k_dir, tmp_path_factory) -> Path:
    """A small model trained to copy English Multi30k captions (its 'target' is its source)."""
    import gzip

    root = tmp_path_factory.mktemp("copy")
    with gzip.open(multi30k_dir / "train.en.gz", "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()[:8000]
    (root / "train.txt").write_text("\n".join(lines[:7500]) + "\n")
    (root / "valid.txt").write_text("\n".join(lines[7500:]) + "\n")
    run = root / "run"
    files = ["--train-src", root / "train.txt", "--train-tgt", root / "train.txt"]
    files += ["--valid-src", root / "valid.txt", "--valid-tgt", root / "valid.txt"]
    run_ok(
        ["prep", "custom", "--run-dir", run, "--src", "en", "--tgt", "de", *files],
        ["bpe", "--run-dir", run, "--vocab-size", 1000],
        ["train", "--run-dir", run, *TINY, "--d-model", "64", "--ffn", "128", "--max-tokens", "1024"]
        + ["--max-steps", 600, "--warmup", 100, "--lr-scale", 2, "--eval-every", 10000, "--save-every", 600],
    )
    return run


@pytest.mark.parametrize("engine", ENGINES)
def test_the_alignment_of_a_copy_is_the_diagonal(copy_model, engine):
    model = Translator.load(copy_model, alignments=True, engine=engine)
    sources = (copy_model / "text" / "valid.raw.en").read_text().splitlines()[:60]
    found = [t[0] for t in model.translations(sources)]
    copied = [(s, t) for s, t in zip(sources, found) if t.text == s]
    assert len(copied) >= 30  # the model learned to copy
    pairs = [p.split("-") for _, t in copied for p in t.alignment.split()]
    on_the_diagonal = sum(a == b for a, b in pairs) / len(pairs)
    assert on_the_diagonal >= 0.9, on_the_diagonal
    assert all(
        {int(b) for _, b in (p.split("-") for p in t.alignment.split())} <= set(range(len(s.split())))
        for s, t in copied
    )


def test_both_engines_align_alike(trained_longer, sources):
    """On a model whose heads differ (the copy model's agree): the export must average all of
    the last layer's heads, as nmt's engine does."""
    ours = Translator.load(trained_longer, alignments=True).translations(sources)
    theirs = Translator.load(trained_longer, alignments=True, engine="ctranslate2").translations(sources)
    same = [(a[0].alignment, b[0].alignment) for a, b in zip(ours, theirs) if a[0].text == b[0].text]
    assert len(same) >= len(sources) - 1 and all(a == b for a, b in same)


def test_alignments_print_after_each_translation_alike_in_both_engines(copy_model, nmt):
    stdin = b"A man rides a bike .\nTwo dogs play .\n\n"
    out = nmt("translate", "--run-dir", copy_model, "--alignments", stdin=stdin).out.splitlines()
    assert len(out) == 3 and out[2] == "\t"
    assert all(re.fullmatch(r"[^\t]+\t(\d+-\d+)( \d+-\d+)*", line) for line in out[:2]), out
    scored = nmt("translate", "--run-dir", copy_model, "--alignments", "--nbest", "2", stdin=stdin)
    assert all(len(line.split("\t")) == 4 for line in scored.out.splitlines())
    theirs = nmt("translate", "--run-dir", copy_model, "--alignments", "--engine", "ctranslate2", stdin=stdin)
    assert theirs.out.splitlines() == out
