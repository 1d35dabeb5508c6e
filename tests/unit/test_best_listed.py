"""The kept best models a run lists (engine/checkpoint.best_listed)."""

import json

from nmt_cli.engine.checkpoint import best_listed


def test_a_damaged_best_record_is_not_a_best_model(tmp_path):
    """A record cut short by a kill, one that is JSON but not an object, or one without a score
    is passed over; the others are listed, best (lowest) first."""
    for step, score in ((10, 2.5), (20, 1.5)):
        (tmp_path / f"best_{step:08d}.json").write_text(json.dumps({"best": {"score": score}}))
    (tmp_path / "best_00000030.json").write_text('{"best": {"sco')
    (tmp_path / "best_00000040.json").write_text("[]")
    (tmp_path / "best_00000050.json").write_text("{}")
    assert best_listed(tmp_path) == [
        (1.5, tmp_path / "best_00000020.pt"),
        (2.5, tmp_path / "best_00000010.pt"),
    ]
