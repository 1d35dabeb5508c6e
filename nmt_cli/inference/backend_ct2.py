"""The CTranslate2 backend of `nmt translate` (`--engine ctranslate2`, --int8, an export):
CTranslate2's beam search answering as nmt's own does (translate.Backend). An nmt model is
converted once and kept (ct2_cache.py). Nothing here imports torch: a CTranslate2 export starts
without it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

from nmt_cli.config import DecodeOptions, TranslateConfig, cpus, resolve_device_name, resolve_precision
from nmt_cli.engine.hypothesis import Hypothesis, Source, coverage_penalty, length_penalty
from nmt_cli.engine.hypothesis import limits as output_limits
from nmt_cli.errors import NmtError, Stopped
from nmt_cli.inference import ct2_cache
from nmt_cli.inference.ct2_spec import require_ctranslate2
from nmt_cli.inference.models import Model
from nmt_cli.vocab import EOS, pieces

# A CTranslate2 call takes one length limit for all its sentences, where nmt's engine keeps each
# sentence's own: where outputs run to their limits (a weak model's repetitions) the shorter
# sentences of a call run on to its limit. Calls of sentences whose limits share a band a quarter
# wide bound that; calls cut finer leave too little in each to keep the workers busy
# (docs/benchmarks.md, "Engines").
SPREAD = 1.25
# nmt's --precision as CTranslate2's compute type
COMPUTE_TYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class Backend:
    """Beam search by CTranslate2 on batches of source ids, answering as nmt's search does."""

    def __init__(self, model: Model, config: TranslateConfig, gpus: int = 0, serving: bool = False):
        """`serving`: for `nmt serve`, with a spare worker (below), each batch's calls handed
        over one after another (search)."""
        self.serving = serving
        ct2 = self._ct2 = require_ctranslate2()
        self._seeded = False
        kind, one = device_of(ct2, config.device)
        index: int | list[int] = one
        if gpus:  # a replica on each GPU; search() hands over all its batches at once
            if gpus > ct2.get_cuda_device_count():
                raise NmtError(f"--gpus {gpus}, but CTranslate2 sees {ct2.get_cuda_device_count()} GPUs")
            kind, index = "cuda", list(range(gpus))
        if config.int8:
            compute_type = "int8"
        elif config.precision == "auto" and model.ct2_dir is not None and not model.converted:
            compute_type = "default"  # the export's own type
        else:  # converted from an nmt model: fp32 / bf16 as nmt's own engine would choose
            precision = resolve_precision(config.precision, kind, decoding=True)
            if precision not in COMPUTE_TYPES:
                raise NmtError(
                    f"--precision {precision} is for nmt's engine; CTranslate2 has fp32, bf16, fp16, int8"
                )
            compute_type = COMPUTE_TYPES[precision]
        threads = config.threads or cpus()
        self.shortlist = config.shortlist
        if config.shortlist:  # CTranslate2 reads the file itself, as its vmap.txt
            from nmt_cli.inference import shortlist  # (numpy: imported where it is used)

            shortlist.path_of(model)
        self._tmp = None
        if model.ct2_dir is None:  # converted once (float32; compute_type quantises on load)
            model, self._tmp = ct2_cache.converted(model)
        where = model.ct2_dir
        assert where is not None
        try:
            # On a CPU, `threads` workers of one thread each decode `threads` batches at once:
            # CTranslate2's threads within one batch scale poorly on small matrices
            # (docs/benchmarks.md). The workers share the weights. On GPUs, one worker each.
            cpu = kind == "cpu"
            # batches it decodes side by side: a worker per CPU thread, or one per GPU
            self.workers = threads if cpu else (len(index) if isinstance(index, list) else 1)
            # On a CPU, one more for `nmt serve`'s long batches: a batch cannot be stopped midway,
            # so one that decodes for minutes would hold a worker the others need; on the spare
            # it shares the cores with them instead (serve/batcher.py). Not elsewhere: a third
            # worker on two threads' cores would only make them take turns.
            self.spare = 1 if cpu and serving else 0
            self.translator = ct2.Translator(
                str(where),
                device=kind,
                device_index=index,
                compute_type=compute_type,
                inter_threads=threads + self.spare if cpu else 1,
                intra_threads=1 if cpu else threads,
            )
        except (RuntimeError, ValueError) as e:
            raise NmtError(
                f"CTranslate2 cannot load {model.where} on {config.device} as {compute_type}: {e}"
            ) from None
        self.source_pieces, self.pieces = pieces(model.vocabs.source), pieces(model.vocabs.target)
        self.ids = {p: i for i, p in enumerate(self.pieces)}  # the target's
        self.ceiling = model.config.max_positions - 1

    def search(
        self,
        sentences: list[list[Source]],
        options: DecodeOptions,
        gone: list[Callable[[], list[bool]]] | None = None,
    ) -> Iterator[list[list[Hypothesis]]]:
        """nmt's beam search on each batch of `sentences`; the batches are all handed over at
        once, so that every worker has one, and their answers come back in order.

        CTranslate2 divides by |Y| ** alpha where nmt divides by GNMT's ((5 + |Y|) / 6) ** alpha.
        Its search ranks by the raw log-probability and applies the penalty only to finished
        hypotheses, so: ask for all `beam` of them unpenalised, and rank them as nmt does.
        One call has one length limit (nmt's is each sentence's own): the sentences go in calls
        of those whose limits share a band, each call's limit its band's top (parts), pooled from
        every batch (_pooled). A server counts a batch as one worker's (serve/batcher.py): there
        each batch goes in its own calls, one after another (_in_turn).

        --sample: CTranslate2 draws from one random stream per worker thread, seeded once per
        process (by the first --seed it is given), so its draws are repeatable only where the
        batches meet its threads in the same order; the sentences' streams cannot seed them.
        CTranslate2 has no lexical constraints: translator.Translator refuses them before.
        """
        a, b = options.max_len_a, options.max_len_b
        ceiling = min(self.ceiling, options.max_len or self.ceiling)
        if options.sample and not self._seeded:
            self._ct2.set_random_seed(options.seed)
            self._seeded = True
        batches = [[s.ids for s in batch] for batch in sentences]
        starts_of = [[s.prefix for s in b] if any(s.prefix for s in b) else None for b in sentences]
        owns = [
            output_limits([len(x) for x in batch], a, b, ceiling, starts)
            for batch, starts in zip(batches, starts_of)
        ]
        # max_len wins: a prefix past its sentence's limit ends there, as in nmt's engine
        starts_of = [
            [p[: n - 1] for p, n in zip(starts, own)] if starts else None
            for starts, own in zip(starts_of, owns)
        ]
        # Its scores leave out a prefix's own tokens, which nmt's count: their log-probability,
        # the same for every hypothesis of a sentence, is added before the length penalty.
        given = [
            self._sums([batch], [starts], eos=False) if starts and any(starts) else None
            for batch, starts in zip(batches, starts_of)
        ]
        answers: Callable[[int], list]
        if self.serving:
            answers = functools.partial(self._in_turn, batches, starts_of, owns, ceiling, options)
        else:
            answers = self._pooled(batches, starts_of, owns, ceiling, options)
        for k, (batch, scored) in enumerate(zip(sentences, given)):
            # A batch handed over runs on (CTranslate2 cannot drop its rows); once nobody waits for
            # the rest, their answers are not awaited.
            if gone is not None and all(all(g()) for g in gone):
                raise Stopped("nobody waits for this search any more")
            offsets = next(scored) if scored is not None else [0.0] * len(batch)
            found = answers(k)
            covered = (
                self._coverage(batch, found, options.coverage_penalty)
                if options.coverage_penalty
                else [None] * len(batch)
            )
            yield [
                self.ranked(r, options, offset, s.alpha, c)
                for r, offset, s, c in zip(found, offsets, batch, covered)
            ]

    def _pooled(
        self,
        batches: list[list[list[int]]],
        starts_of: list[list[list[int]] | None],
        owns: list[list[int]],
        ceiling: int,
        options: DecodeOptions,
    ) -> Callable[[int], list]:
        """Every call of every batch handed over now, so that every worker has one, the sentences
        of all batches pooled by band (calls no larger than the largest batch, in sentences and
        in padded source tokens); what awaits batch k's results."""
        at = [(k, i) for k, batch in enumerate(batches) for i in range(len(batch))]
        filled = [s or [[]] * len(b) for s, b in zip(starts_of, batches)]
        starts = [filled[k][i] for k, i in at]
        most = max(map(len, batches), default=1)
        tokens = max((len(b) * (max(map(len, b)) + 1) for b in batches), default=1)
        pending: list[list] = [[None] * len(batch) for batch in batches]
        sources = [batches[k][i] for k, i in at]
        limits = [owns[k][i] for k, i in at]
        for part, call in self._calls(sources, starts if any(starts) else None, limits, ceiling, options):
            for chunk in shares(part, [len(sources[j]) for j in part], most, tokens):
                for j, r in zip(chunk, call(chunk)):
                    k, i = at[j]
                    pending[k][i] = r
        return lambda k: [r.result() for r in pending[k]]

    def _in_turn(
        self,
        batches: list[list[list[int]]],
        starts_of: list[list[list[int]] | None],
        owns: list[list[int]],
        ceiling: int,
        options: DecodeOptions,
        k: int,
    ) -> list:
        """Batch k's results, its calls handed over one after another, each once the one before
        has answered: a server counts a batch as one worker's (serve/batcher.py)."""
        found: list = [None] * len(batches[k])
        for part, call in self._calls(batches[k], starts_of[k], owns[k], ceiling, options):
            for i, r in zip(part, call(part)):
                found[i] = r.result()
        return found

    def _calls(
        self,
        batch: list[list[int]],
        starts: list[list[int]] | None,
        own: list[int],
        ceiling: int,
        options: DecodeOptions,
    ) -> list[tuple[list[int], Callable[..., list]]]:
        """CTranslate2's searches of `batch` within `own`, nmt's limits, by band (parts): the
        positions of each band's sentences and what hands some of them over as one call (and
        returns its pending results)."""
        calls: list[tuple[list[int], Callable[..., list]]] = []
        for top, part in parts(own, ceiling):
            # nmt's limit counts the EOS it adds at the limit; CTranslate2 stops there without
            # one, so one step fewer gives the same tokens
            limit = max(1, top - 1)

            def call(chosen: list[int], limit: int = limit) -> list:
                return self.translator.translate_batch(
                    self._as_pieces([batch[i] for i in chosen], self.source_pieces),
                    target_prefix=self._as_pieces([starts[i] for i in chosen]) if starts else None,
                    length_penalty=0.0,
                    max_decoding_length=limit,
                    max_input_length=0,
                    return_scores=True,
                    return_end_token=True,
                    asynchronous=True,
                    use_vmap=self.shortlist,
                    **_search_settings(options, len(self.pieces)),
                    **_rules(options, limit),
                )

            calls.append((part, call))
        return calls

    def _coverage(self, batch: list[Source], found: list, beta: float) -> list[list[float]]:
        """The coverage penalty of each hypothesis of each sentence, from CTranslate2's attention
        over it teacher-forced (its beam search's own first attention row differs from it in
        batches of several sentences; the forced one is nmt's to 1e-7)."""
        sources = [s.ids for s, r in zip(batch, found) for _ in r.hypotheses]
        targets = [[self.ids[t] for t in h if t != self.pieces[EOS]] for r in found for h in r.hypotheses]
        # a row for each token and one for the step after it, where its EOS comes
        forced = zip(self._forced(sources, targets), targets)
        rows = (r.result().attention[0][: len(y) + 1] for r, y in forced)
        return [
            [coverage_penalty([sum(c) for c in zip(*next(rows))], beta) for _ in r.hypotheses] for r in found
        ]

    def _forced(self, sources: list[list[int]], targets: list[list[int]]) -> list:
        """CTranslate2's pass over each target forced as a prefix after its source (pending):
        its attention has a row for each step and a column for each token of the source (its EOS
        left out)."""
        return self.translator.translate_batch(
            self._as_pieces(sources, self.source_pieces),
            target_prefix=self._as_pieces(targets),
            beam_size=1,
            max_decoding_length=max(map(len, targets)) + 1,
            max_input_length=0,
            return_attention=True,
            return_end_token=True,
            asynchronous=True,
        )

    def score(self, batches: list[list[list[int]]], targets: list[list[list[int]]]) -> Iterator[list[float]]:
        """The log-probability of each target (ids without EOS; CTranslate2 adds it and scores
        it) given its source, batch by batch, all handed over at once as in `search`."""
        return self._sums(batches, targets, eos=True)

    def _sums(
        self, batches: list[list[list[int]]], targets: list[list[list[int]]], eos: bool
    ) -> Iterator[list[float]]:
        pending = [
            self.translator.score_batch(
                self._as_pieces(batch, self.source_pieces),
                self._as_pieces(batch_targets),
                max_input_length=0,
                asynchronous=True,
            )
            for batch, batch_targets in zip(batches, targets)
        ]
        for results in pending:
            found = [r.result().log_probs for r in results]
            yield [float(sum(lp if eos else lp[:-1])) for lp in found]

    def align(
        self, batches: list[list[list[int]]], targets: list[list[list[int]]]
    ) -> Iterator[list[list[tuple[int, int]]]]:
        """Each target's (source position, target position) pairs, as nmt's engine gives them
        (forced.aligned): the target forced as a prefix, each of its tokens paired with the
        source token (not the EOS) that the last decoder layer's attention weighs most."""
        pending = [self._forced(batch, batch_targets) for batch, batch_targets in zip(batches, targets)]
        for results, batch, batch_targets in zip(pending, batches, targets):
            found = [r.result().attention[0] for r in results]
            yield [
                [(max(range(len(x)), key=row.__getitem__), j) for j, row in enumerate(weights[: len(y)])]
                if x and y
                else []
                for weights, x, y in zip(found, batch, batch_targets)
            ]

    def _as_pieces(self, rows: list[list[int]], pieces: list[str] | None = None) -> list[list[str]]:
        """Ids as pieces: the target's, or those of `pieces`."""
        pieces = self.pieces if pieces is None else pieces
        return [[pieces[i] for i in row] for row in rows]

    def ranked(
        self, result, options: DecodeOptions, offset: float, alpha: float, covered: list[float] | None
    ) -> list[Hypothesis]:
        """`result`'s hypotheses ranked as nmt ranks them, by the sentence's own `alpha` (and
        their coverage penalties, `covered`, where asked)."""
        scored = []
        for k, (tokens, score) in enumerate(zip(result.hypotheses, result.scores)):
            # |Y| counts the EOS, as in nmt; a hypothesis cut at the limit has none.
            penalised = (float(score) + offset) / length_penalty(len(tokens), alpha)
            if covered is not None:
                penalised += covered[k]
            scored.append((penalised, tokens))
        scored.sort(key=lambda h: -h[0])  # stable: ties keep CTranslate2's order
        ids, eos = self.ids, self.pieces[EOS]
        hyps = [
            Hypothesis([ids[t] for t in tokens if t != eos], score)
            for score, tokens in scored[: options.nbest]
        ]
        return hyps * options.nbest if len(hyps) == 1 else hyps  # top-k 1: one draw


def parts(limits: list[int], ceiling: int) -> list[tuple[int, list[int]]]:
    """A batch's sentences, given their output limits, as CTranslate2's calls, longest first:
    each call's limit and its sentences' positions. A sentence's call limit is the top of its
    band of limits (band_top, within `ceiling`): at most SPREAD times its own, and its own
    alone, so that the batching does not change its line."""
    calls: dict[int, list[int]] = {}
    for i in sorted(range(len(limits)), key=lambda i: -limits[i]):
        calls.setdefault(min(band_top(limits[i]), ceiling), []).append(i)
    return list(calls.items())


def band_top(limit: int) -> int:
    """The top of the band of output limits that holds `limit`: the bands' tops grow by SPREAD
    (by one at least), so every limit of a band is within SPREAD of its top."""
    top = 1
    while top < limit:
        top = max(top + 1, int(top * SPREAD))
    return top


def shares(part: list[int], lengths: list[int], most: int, tokens: int) -> list[list[int]]:
    """`part`'s sentences (of source `lengths`) in calls of near-equal size, none past `most`
    sentences or `tokens` padded source tokens."""
    size = max(1, min(most, tokens // (max(lengths) + 1)))
    n = -(-len(part) // size)
    return [part[c * len(part) // n : (c + 1) * len(part) // n] for c in range(n)]


def _search_settings(options: DecodeOptions, vocab_size: int) -> dict:
    """`options` as translate_batch's arguments: nmt's beam (every hypothesis, unpenalised), or
    its sampling (a top-k past the vocabulary is all of it, as in nmt's engine; CTranslate2
    refuses it)."""
    if not options.sample:
        return {"beam_size": options.beam, "num_hypotheses": options.beam}
    return {
        "beam_size": 1,
        # top-k 1 is greedy, for which CTranslate2 returns one hypothesis only
        "num_hypotheses": 1 if options.topk == 1 else options.nbest,
        "sampling_topk": min(options.topk, vocab_size),
        "sampling_topp": options.topp,
        "sampling_temperature": options.temperature,
    }


def _rules(options: DecodeOptions, limit: int) -> dict:
    """nmt's rules on the next token (engine/rules.py) as translate_batch's arguments. CTranslate2
    bans on its logits before their softmax, nmt on the log-probs: greedy search and sampling
    choose alike, a beam may rank a candidate differently."""
    return {
        "min_decoding_length": min(options.min_len, limit),  # it refuses a minimum past the limit
        "no_repeat_ngram_size": options.no_repeat_ngram,
        "repetition_penalty": options.repetition_penalty,
    }


def device_of(ct2, name: str) -> tuple[str, int]:
    """--device as CTranslate2's (kind, index), GPUs counted by CTranslate2 itself."""
    kind, _, index = resolve_device_name(name, ct2.get_cuda_device_count() > 0).partition(":")
    return kind, int(index or 0)
