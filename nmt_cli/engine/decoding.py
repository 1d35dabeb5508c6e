"""Translation by nmt's engine: a model (or an ensemble) and a padded batch of source ids wired to
the search the options ask for: beam search (beam.py), with lexical constraints (constrained.py),
greedy or sampling (sampling.py)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from nmt_cli.config import DecodeOptions
from nmt_cli.engine import beam, constrained, graphed, sampling
from nmt_cli.engine.batches import pad_sources, pad_targets
from nmt_cli.engine.cache import DecoderCache, FixedCache, RowCache
from nmt_cli.engine.hypothesis import Hypothesis, coverage_penalty, limits, stream_of
from nmt_cli.engine.model import Transformer
from nmt_cli.engine.packing import PACK_MIN, PackedLinear
from nmt_cli.engine.rules import NextToken
from nmt_cli.errors import Stopped
from nmt_cli.vocab import BOS, EOS, PAD


@torch.no_grad()
def translate(
    model: Transformer | Sequence[Transformer],
    src: Tensor,
    options: DecodeOptions = DecodeOptions(),
    use_cache: bool = True,
    streams: Sequence[int] | None = None,
    prefixes: Sequence[Sequence[int]] | None = None,
    constraints: Sequence[Sequence[Sequence[int]]] | None = None,
    gone: Callable[[], Sequence[bool]] | None = None,
    alphas: Sequence[float] | None = None,
    graphs: bool | None = None,
    among: Tensor | None = None,
) -> list[list[Hypothesis]]:
    """Translate a padded (B, S) batch of source ids (with EOS); `options.nbest` hypotheses each.
    `streams`: the sentences' random streams under --sample (hypothesis.stream_of; default:
    `options.seed`'s for lines 0, 1, ...). `prefixes`: the ids each translation must begin with
    (none: []); `constraints`: the phrases (ids) each must contain (none: []), found by beam
    search only. `alphas`: each sentence's length penalty (default: the options').

    Several models (an ensemble sharing one vocabulary) search together: each keeps its own
    encoder output and cache, and a step's log-probs are the mean of theirs. `gone` is asked
    before every step, for each sentence whether anyone still waits for it: a sentence nobody
    waits for ends at that step (its hypotheses are for nobody), and once none is waited for,
    errors.Stopped (every search takes its steps from here).

    `graphs`: each step over a cache of fixed shapes (cache.FixedCache), replayed as a CUDA
    graph on a GPU (graphed.py); default: on a GPU, unless under autocast (its cache of cast
    weights and a graph's memory do not mix). Off a GPU it runs the same steps unrecorded (what
    tests compare with the CPU's own cache).

    `among`: a lexical shortlist, the sorted target ids (PAD, UNK, BOS, EOS and every prefix's
    and constraint's among them) the translations are made of: each step projects onto these
    alone and normalises over them, and the search runs on their positions in `among` (its
    rules see the same tokens as without a shortlist, numbered apart), which the hypotheses
    are given back in ids. Not with `graphs`."""
    models = [model] if isinstance(model, torch.nn.Module) else list(model)
    if graphs is None:
        graphs = among is None and src.device.type == "cuda" and not torch.is_autocast_enabled("cuda")
    if among is not None:
        if graphs:
            raise ValueError("a shortlist's steps are not graphed")
        position = torch.full((models[0].config.vocab_size,), -1, dtype=torch.long)
        position[among.cpu()] = torch.arange(len(among))
        if int(position[: EOS + 1].min()) < 0:
            raise ValueError("a shortlist keeps PAD, UNK, BOS and EOS")
        prefixes = [position[list(p)].tolist() for p in prefixes] if prefixes is not None else None
        constraints = (
            [[position[list(x)].tolist() for x in c] for c in constraints]
            if constraints is not None
            else None
        )
        if any(t < 0 for p in prefixes or [] for t in p) or any(
            t < 0 for c in constraints or [] for x in c for t in x
        ):
            raise ValueError("a shortlist keeps every token of the prefixes and constraints")
    hyps = _search(
        models, src, options, use_cache, streams, prefixes, constraints, gone, alphas, graphs, among
    )
    if among is not None:
        ids = among.tolist()
        for found in hyps:
            for h in found:
                h.tokens = [ids[t] for t in h.tokens]
    if options.coverage_penalty:
        return _covered(models, src, hyps, options)
    return hyps


def _search(
    models: list[Transformer],
    src: Tensor,
    options: DecodeOptions,
    use_cache: bool,
    streams: Sequence[int] | None,
    prefixes: Sequence[Sequence[int]] | None,
    constraints: Sequence[Sequence[Sequence[int]]] | None,
    gone: Callable[[], Sequence[bool]] | None,
    alphas: Sequence[float] | None,
    graphs: bool,
    among: Tensor | None = None,
) -> list[list[Hypothesis]]:
    """The search `options` ask for, on translate's arguments."""
    src_lengths = (src != PAD).sum(1).tolist()
    o = options
    if o.coverage_penalty:  # every finished translation of the beam, ranked with it afterwards
        o = dataclasses.replace(o, nbest=o.beam)
    ceiling = int(min([m.config.max_positions - 1 for m in models] + [o.max_len or math.inf]))
    bound = constraints is not None and any(constraints)
    if bound and o.sample:
        raise ValueError("constraints are met by beam search, not by sampling")
    max_lens = limits(
        [n - 1 for n in src_lengths],
        o.max_len_a,
        o.max_len_b,
        ceiling,
        prefixes,
        constraints if bound else None,
    )
    if prefixes is not None:  # max_len wins: a prefix past its sentence's limit ends there
        prefixes = [p[: n - 1] for p, n in zip(prefixes, max_lens)]
    forced = _prefix_tensor(prefixes, src.device) if prefixes is not None and any(prefixes) else None
    streams = [stream_of(o.seed, i) for i in range(len(max_lens))] if streams is None else streams
    alphas = [o.alpha] * len(max_lens) if alphas is None else list(alphas)
    if o.sample:  # each draw a row of its own, as a sentence of its own
        src = src.repeat_interleave(o.nbest, 0)
        max_lens = [n for n in max_lens for _ in range(o.nbest)]
        alphas = [a for a in alphas for _ in range(o.nbest)]
        forced = forced.repeat_interleave(o.nbest, 0) if forced is not None else None
    k = 1 if o.sample else o.beam
    rules = NextToken(o, max_lens, k, src.device, forced, alphas)
    pool = graphed.Pool()  # this search's graphs', given back with them
    decoders = [
        _decoder(m, src, k, max(max_lens) + 1, use_cache, rules.logits, graphs, among, pool) for m in models
    ]
    step, reorder = _together(decoders)
    if gone is not None:
        step = _stoppable(step, gone, rules, o.nbest if o.sample else 1)
    if bound and constraints is not None:
        return constrained.search(step, reorder, rules, constraints, src.device)
    if o.sample:
        seeds = [sampling.seed_of(stream, j) for stream in streams for j in range(o.nbest)]
        drawn = sampling.sample(step, reorder, rules, seeds, src.device)
        groups = [drawn[i : i + o.nbest] for i in range(0, len(drawn), o.nbest)]
        return [sorted(g, key=lambda h: -h.score) for g in groups]
    if o.beam == 1 and o.nbest == 1:
        return sampling.greedy(step, reorder, rules, src.device)
    return beam.search(step, reorder, rules, src.device)


class Running:
    """nmt serve's running batch (iteration-level scheduling): one beam search that sentences
    `join` between its steps and leave as soon as they end, or `drop` out when nobody waits
    for them, each with its own seed, alpha and length limits, on one model and a cache whose
    rows each have their own position (cache.RowCache). Each sentence is searched as
    `translate` searches it: the same rules, ranking and ending; it only shares the steps'
    matrices with whatever else is live.

    For the options whose search can take sentences midway (`takes`): beam search and greedy,
    with their limits, min_len and repetition penalty; not sampling, prefixes, constraints,
    no_repeat_ngram or the coverage penalty."""

    def __init__(self, model: Transformer, options: DecodeOptions, device: torch.device | str):
        if not Running.takes(options):
            raise ValueError("these options need every sentence of a search to begin together")
        model.eval()
        self.model, self.options = model, options
        self.rules = NextToken(options, [], options.beam, device)
        self.beams = beam.Beams(self.rules, device, open=True)
        c, dtype = model.config, model.embed.weight.dtype
        self.cache = RowCache(
            c.num_decoder_layers, c.heads, c.d_model // c.heads, options.beam, dtype, device
        )
        self.device = device

    @staticmethod
    def takes(options: DecodeOptions) -> bool:
        o = options
        return not (o.sample or o.chooses or o.no_repeat_ngram or o.coverage_penalty)

    @property
    def live(self) -> int:
        """Sentences being searched."""
        return len(self.beams.active)

    def age(self, sentence: int) -> int:
        """The steps `sentence` has taken (live, or ended at the last step)."""
        return self.rules.t - self.rules.begun[sentence]

    def oldest(self) -> int:
        """The steps the live sentence that began first has taken (0: none is live)."""
        return max((self.age(int(s)) for s in self.beams.active), default=0)

    @torch.no_grad()
    def join(self, sources: Sequence[Sequence[int]], options: Sequence[DecodeOptions]) -> list[int]:
        """Sentences (ids without EOS, none empty) begin at the next step, each with its options
        (alike but for the seed, alpha and length limits: DecodeOptions.joint); their numbers."""
        if any(o.joint() != self.options.joint() for o in options):
            raise ValueError("the sentences of a running batch differ in seed, alpha and length limits only")
        src = torch.from_numpy(pad_sources([list(x) for x in sources])).to(self.device)
        memory, src_mask = self.model.encode(src)
        self.cache.join(self.model.memory_keys_values(memory), src_mask)
        most = self.model.config.max_positions - 1
        max_lens = [
            limits([len(x)], o.max_len_a, o.max_len_b, int(min(most, o.max_len or math.inf)))[0]
            for x, o in zip(sources, options)
        ]
        return self.beams.join(max_lens, [o.alpha for o in options])

    def drop(self, sentences: Sequence[int]) -> None:
        """`sentences` leave unfinished."""
        if len(sentences):
            self.cache.reorder(self.beams.drop(list(sentences)))

    @torch.no_grad()
    def step(self) -> list[tuple[int, list[Hypothesis]]]:
        """One decoding step of every live sentence: those it ended, with their `nbest` best."""
        m = self.model
        h = m.decode(self.beams.tokens, self.cache.memory_kv, self.cache.src_mask, self.cache)
        lprobs = F.log_softmax(self.rules.logits(m.logits(h[:, -1]).float()), dim=-1)
        rows = self.beams.advance(lprobs)
        assert rows is not None  # an open search
        self.cache.reorder(rows)
        return [(int(s), self.beams.found(int(s))) for s in self.beams.ended]


def _covered(
    models: list[Transformer], src: Tensor, hyps: list[list[Hypothesis]], options: DecodeOptions
) -> list[list[Hypothesis]]:
    """Each sentence's translations ranked with the coverage penalty added to their scores, the
    `options.nbest` best. The attention is the last decoder layer's (heads and models averaged),
    teacher-forced over each translation and its EOS (what the search's own steps computed), to
    the source's tokens: its EOS is left out, as CTranslate2 leaves it out."""
    flat = [(i, h) for i, found in enumerate(hyps) for h in found]
    if flat:
        rows = torch.tensor([i for i, _ in flat], device=src.device)
        tgt_in, tgt_out = pad_targets([h.tokens for _, h in flat])
        tgt_in_t = torch.from_numpy(tgt_in).to(src.device)
        sources = src[rows]
        weights = torch.stack([m.cross_attention(sources, tgt_in_t).float() for m in models]).mean(0)
        steps = torch.from_numpy(tgt_out != PAD).to(src.device)  # the translation's and its EOS's
        coverage = (weights * steps[..., None]).sum(1)  # (N, S)
        words = (sources != EOS) & (sources != PAD)  # the source's EOS is not a word to cover
        for (_, h), received in zip(flat, coverage.masked_fill(~words, 0.0).tolist()):
            h.score += coverage_penalty(received, options.coverage_penalty)
    return [sorted(found, key=lambda h: -h.score)[: options.nbest] for found in hyps]


def _stoppable(
    step: Callable[[Tensor], Tensor], gone: Callable[[], Sequence[bool]], rules: NextToken, draws: int
) -> Callable[[Tensor], Tensor]:
    """`step`, asking `gone` first: the sentences nobody waits for end (rules.end; under
    --sample each sentence is `draws` rows of the rules), and if that is all of them, Stopped."""
    ended: set[int] = set()

    def checked(tokens: Tensor) -> Tensor:
        now = gone()
        if all(now):
            raise Stopped("nobody waits for this search any more")
        left = [i for i, g in enumerate(now) if g and i not in ended]
        if left:
            ended.update(left)
            rules.end([i * draws + j for i in left for j in range(draws)])
        return step(tokens)

    return checked


def _prefix_tensor(prefixes: Sequence[Sequence[int]], device: torch.device | str) -> Tensor:
    """(n, P): each sentence's prefix ids, -1 after them."""
    out = np.full((len(prefixes), max(len(p) for p in prefixes)), -1, dtype=np.int64)
    for row, p in enumerate(prefixes):
        out[row, : len(p)] = p
    return torch.from_numpy(out).to(device)


def _together(
    parts: list[tuple[Callable[[Tensor], Tensor], Callable[[Tensor], None]]],
) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], None]]:
    """One `step` and `reorder` for several models' (an ensemble): the mean of their log-probs."""
    if len(parts) == 1:
        return parts[0]

    def step(tokens: Tensor) -> Tensor:
        return torch.stack([own(tokens) for own, _ in parts]).mean(0)

    def reorder(indices: Tensor) -> None:
        for _, own in parts:
            own(indices)

    return step, reorder


def _as_they_are(logits: Tensor) -> Tensor:
    return logits


def _decoder(
    model: Transformer,
    src: Tensor,
    k: int,
    max_len: int,
    use_cache: bool,
    shape: Callable[[Tensor], Tensor] = _as_they_are,
    graphs: bool = False,
    among: Tensor | None = None,
    pool: graphed.Pool | None = None,
) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], None]]:
    """`step` and `reorder` of one model for `search`, over `k` rows per sentence of `src`;
    `shape` changes the logits before their softmax (NextToken.logits); `graphs` and `among`:
    translate's (the steps take and score positions in `among`); `pool`: the search's graphs'."""
    model.eval()
    memory, src_mask = model.encode(src)
    ids: Callable[[Tensor], Tensor] = _as_they_are
    project: Callable[[Tensor], Tensor] = model.logits
    if among is not None:
        ids, project = among.__getitem__, _projection(model, among)
    if use_cache and graphs:
        fixed = FixedCache(model.memory_keys_values(memory), src_mask, k, max_len)

        def body() -> Tensor:
            h = model.decode(fixed.tokens, fixed.memory_kv, fixed.src_mask, fixed)
            return model.logits(h[:, -1])

        run = graphed.Replayed(body, src.device, pool)

        def step_fixed(tokens: Tensor) -> Tensor:
            fixed.put(tokens)
            return F.log_softmax(shape(fixed.take(run(fixed.parity)).float()), dim=-1)

        return step_fixed, fixed.reorder
    if use_cache:
        cache = DecoderCache(model.memory_keys_values(memory), src_mask, k, max_len)

        def step(tokens: Tensor) -> Tensor:
            h = model.decode(ids(tokens), cache.memory_kv, cache.src_mask, cache)
            return F.log_softmax(shape(project(h[:, -1]).float()), dim=-1)

        return step, cache.reorder
    # The reference: rerun the decoder's self-attention on the whole prefix every step (the
    # encoder side, memory and its keys/values, is computed once all the same).
    state: dict[str, Any] = {
        "kv": model.memory_keys_values(memory.repeat_interleave(k, 0)),
        "mask": src_mask.repeat_interleave(k, 0),
        "prefix": torch.full((src.shape[0] * k, 0), BOS, dtype=torch.long, device=src.device),
    }

    def step_uncached(tokens: Tensor) -> Tensor:
        state["prefix"] = torch.cat([state["prefix"], tokens], dim=1)
        h = model.decode(ids(state["prefix"]), state["kv"], state["mask"])
        return F.log_softmax(shape(project(h[:, -1]).float()), dim=-1)

    def reorder(indices: Tensor) -> None:
        state["kv"] = [(a.index_select(0, indices), b.index_select(0, indices)) for a, b in state["kv"]]
        state["mask"] = state["mask"].index_select(0, indices)
        state["prefix"] = state["prefix"].index_select(0, indices)

    return step_uncached, reorder


def _projection(model: Transformer, among: Tensor) -> Callable[[Tensor], Tensor]:
    """The output projection onto the target ids `among` alone: the rows of the tied embedding
    (and output bias) taken once per batch, packed for oneDNN on a CPU as the whole one is."""
    weight = model.embed.weight.index_select(0, among)
    bias = model.output_bias.index_select(0, among) if model.output_bias is not None else None
    if model.packed_output is not None and weight.numel() >= PACK_MIN:
        return PackedLinear(weight, bias)
    return lambda h: F.linear(h, weight, bias)
