"""Average the weights of a fairseq run's last N checkpoints (what fairseq's
scripts/average_checkpoints.py does: that script is not in the pip package). Runs in the fairseq
venv.

    python fairseq_average.py SAVE_DIR OUT [--last 5]

The candidates are the interval checkpoints (checkpoint_E_U.pt) and checkpoint_last.pt, one per
update count, newest last; the averaged file keeps the newest one's settings.
"""

import argparse
import json
from pathlib import Path

import torch


def updates(state: dict) -> int:
    return int(state["optimizer_history"][-1]["num_updates"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("save_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--last", type=int, default=5)
    args = ap.parse_args()
    paths = sorted(args.save_dir.glob("checkpoint_*_*.pt")) + [args.save_dir / "checkpoint_last.pt"]
    by_updates = {}
    for path in paths:
        if path.exists():
            state = torch.load(path, map_location="cpu", weights_only=False)
            by_updates[updates(state)] = (path, state["model"])
    chosen = [by_updates[u] for u in sorted(by_updates)[-args.last :]]
    newest = torch.load(chosen[-1][0], map_location="cpu", weights_only=False)
    newest["model"] = {
        k: (sum(m[k].double() for _, m in chosen) / len(chosen)).to(v.dtype) for k, v in chosen[-1][1].items()
    }
    torch.save(newest, args.out)
    print(json.dumps({"averaged": [p.name for p, _ in chosen], "updates": sorted(by_updates)[-args.last :]}))


if __name__ == "__main__":
    main()
