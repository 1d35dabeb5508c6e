"""A run of three directions (`nmt prep multi30k --pair ...`) trains in one process and on 2 gloo
ranks, each validation recording BLEU and chrF per direction and, as `valid_bleu`, their mean,
which --best-metric reads; its model translates each direction by the target's token."""

import json
import shutil
import subprocess

import pytest
from conftest import TINY, Server, nmt_command, prepared_pairs

PAIRS = ("en-de", "de-en", "en-fr")


@pytest.fixture(scope="module")
def many(tmp_path_factory, multi30k_dir):
    return prepared_pairs(tmp_path_factory.mktemp("many"), PAIRS, 1000)


@pytest.mark.parametrize("procs", [1, 2])
def test_each_direction_is_validated_and_best_metric_reads_their_mean(many, tmp_path, procs):
    run_dir = tmp_path / "run"
    shutil.copytree(many, run_dir)
    train = nmt_command("train", "--run-dir", run_dir, *TINY, "--max-steps", 4, "--eval-every", 2,
                        "--save-every", 2, "--eval-bleu", "--best-metric", "bleu", "--keep-best", 1,
                        "--procs", procs, "--device", "cpu")  # fmt: skip
    done = subprocess.run(train, capture_output=True)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["kind"] == "valid"]
    assert [r["step"] for r in valid] == [2, 4]
    for r in valid:
        per_pair = [r[f"valid_bleu_{p}"] for p in PAIRS]
        assert all(f"valid_chrf_{p}" in r for p in PAIRS), r
        assert r["valid_bleu"] == pytest.approx(sum(per_pair) / len(PAIRS))
    # --keep-best ranked the validations by the mean (a tie keeps the earlier)
    kept = sorted((run_dir / "checkpoints" / "best").glob("best_*.pt"))
    best = max(valid, key=lambda r: (r["valid_bleu"], -r["step"]))
    assert [p.name for p in kept] == [f"best_{best['step']:08d}.pt"], valid

    # the model translates a direction asked by its token, or by --tgt-lang
    def translated(*options) -> subprocess.CompletedProcess:
        command = nmt_command("translate", "--run-dir", run_dir, "--engine", "nmt", *options)
        return subprocess.run(command, input=b"A dog runs.\nTwo men sit.\n", capture_output=True)

    for lang in ("de", "fr"):
        by_tag, by_lang = translated("--tag", f"<2{lang}>"), translated("--tgt-lang", lang)
        assert by_tag.returncode == 0 and len(by_tag.stdout.splitlines()) == 2, by_tag.stderr[-2000:]
        assert by_lang.stdout == by_tag.stdout, by_lang.stderr[-2000:]
    refused = translated("--tgt-lang", "cs")
    assert refused.returncode == 1 and b"translates into de, en, fr" in refused.stderr, refused.stderr
    server = Server(run_dir, "--engine", "nmt")  # and a request's "tgt_lang", as --tgt-lang
    try:
        status, body, _ = server.post({"text": ["A dog runs.", "Two men sit."], "tgt_lang": "fr"})
        assert status == 200 and body["translations"] == by_lang.stdout.decode().splitlines(), body
        status, body, _ = server.post({"text": ["A dog runs."], "tgt_lang": "cs"})
        assert status == 400 and "translates into de, en, fr" in body["error"], body
    finally:
        assert server.stop() == 0
    if procs == 1:  # `nmt score`: a row for each direction, and their mean
        out = subprocess.run(
            nmt_command("score", "--run-dir", run_dir, "--metrics", "bleu", "--beam", 1, "--engine", "nmt"),
            capture_output=True,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        rows = [line.split("\t") for line in out.stdout.decode().splitlines()]
        assert [r[0] for r in rows] == [*PAIRS, "mean"], rows
        figures = [float(r[1].split("=")[1].split()[0]) for r in rows]
        assert figures[-1] == pytest.approx(sum(figures[:-1]) / len(PAIRS), abs=0.01)
        saved = json.loads((run_dir / "scores" / "test.json").read_text())
        assert list(saved["pairs"]) == list(PAIRS) and saved["scores"][0]["score"] == pytest.approx(
            figures[-1], abs=0.01
        )
