"""A run's checkpoints by name, without torch: translating with a kept CTranslate2 conversion
finds the run's model without importing it (ct2_cache.py)."""

from __future__ import annotations

import re
from pathlib import Path

NAME = re.compile(r"checkpoint_(\d{8})\.json$")


def listed(folder: Path) -> list[Path]:
    """Committed checkpoints (those with a record), oldest first."""
    if not Path(folder).is_dir():
        return []
    found = sorted((int(m.group(1)), p) for p in Path(folder).iterdir() if (m := NAME.match(p.name)))
    return [p.with_suffix(".pt") for _, p in found]
