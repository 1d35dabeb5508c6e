"""Which models a run keeps and when it stops: --keep-best, --best-metric, --patience."""

import json
import shutil
import time

import torch
from conftest import (
    TINY,
    one_error_line,
    tiny_trainer,
)

from nmt_cli.engine import checkpoint


def test_patience_is_rank_zeros_decision_for_every_rank(run_copy):
    from nmt_cli.engine import distributed

    class TwoRanks(distributed.Group):
        """Rank 1 of two, whose rank 0 has run out of patience (what host_max would bring)."""

        def host_max(self, values):
            return [max(v, other) for v, other in zip(values, [0, 0, 1])]

    t = tiny_trainer(run_copy, patience=2)
    t._started = time.monotonic()
    assert t.agreed_stop() is None
    t.dist = TwoRanks(rank=1, world=2)
    t.state.bad_evals = 0  # this rank's own count would go on
    assert "did not improve in 2 evaluations" in t.agreed_stop()


def test_the_best_models_by_bleu_are_kept_and_averaged(trained_longer, tmp_path, nmt):
    """--keep-best 2 --best-metric bleu keeps the two evaluations of highest validation BLEU
    (whatever the pruning of the last checkpoints does), and `nmt average --best 2` averages
    exactly those. (A model that ends its sentences: validation BLEU is then quick.)"""

    run = tmp_path / "run"
    shutil.copytree(trained_longer, run)
    shape = [*TINY, "--d-model", "64", "--ffn", "128", "--max-tokens", "512"]
    result = nmt(
        "train",
        "--run-dir",
        run,
        *shape,
        "--max-steps",
        "840",
        "--eval-every",
        "10",
        "--save-every",
        "840",
        "--keep-last",
        "1",
        "--eval-bleu",
        "--keep-best",
        "2",
        "--best-metric",
        "bleu",
    )
    assert result.code == 0, result.err
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    bleu = {r["step"]: r["valid_bleu"] for r in records if r["kind"] == "valid" and r["step"] > 800}
    assert len(bleu) == 4 and len(set(bleu.values())) > 1, bleu
    top = sorted(bleu, key=lambda s: (-bleu[s], s))[:2]
    kept = sorted((run / "checkpoints" / "best").glob("best_*.pt"))
    assert [int(p.stem.split("_")[1]) for p in kept] == sorted(top)
    for p in kept:
        meta = json.loads(p.with_suffix(".json").read_text())
        assert meta["best"]["valid_bleu"] == bleu[meta["step"]]
    result = nmt("average", "--run-dir", run, "--best", "2")
    assert result.code == 0, result.err
    record = json.loads((run / "averaged.json").read_text())
    assert record["averaged"] == [p.name for p in kept]
    mean = checkpoint.average(kept)[0]
    averaged = checkpoint.load_tensors(run / "averaged.pt")[0]["model"]
    assert all(torch.equal(averaged[k], v) for k, v in mean.items())


def test_patience_watches_the_best_metric(run_copy):
    # The loss falls while BLEU falls too: only the chosen metric counts.
    figures = [
        {"valid_nll": 3.0, "valid_bleu": 10.0, "valid_ppl": 1.0},
        {"valid_nll": 2.0, "valid_bleu": 9.0, "valid_ppl": 1.0},
        {"valid_nll": 1.0, "valid_bleu": 8.0, "valid_ppl": 1.0},
    ]
    for metric, improved in (("bleu", [True, False, False]), ("nll", [True, True, True])):
        t = tiny_trainer(run_copy, eval_bleu=True, best_metric=metric)
        t._started = time.monotonic()
        t.validate = iter(figures).__next__
        got = []
        for _ in figures:
            t.evaluate()
            got.append(t.state.bad_evals == 0)
        assert got == improved, metric


def test_best_metric_errors(run_copy, nmt):
    assert "needs --eval-bleu" in one_error_line(
        nmt("train", "--run-dir", run_copy, *TINY, "--best-metric", "bleu")
    )
    assert "train with --keep-best" in one_error_line(nmt("average", "--run-dir", run_copy, "--best", "2"))
