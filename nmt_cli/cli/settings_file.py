"""Settings files for `--config`: YAML or JSON, read as a flat mapping of option names, each
with the line it is on (for an error that points at it)."""

from __future__ import annotations

import json
from pathlib import Path

from nmt_cli.errors import NmtError
from nmt_cli.files import read_regular

MAX_BYTES = 1 << 20  # a settings file is a page of options


def read_settings(path: Path) -> tuple[dict, dict]:
    """The file's settings, and each key's line (from 1)."""
    import yaml

    try:  # a regular file of a sane size: a link to /dev/zero or a FIFO is refused, not read
        text = read_regular(path, MAX_BYTES).decode("utf-8")
    except NmtError as e:
        raise NmtError(f"--config {e}") from None
    except UnicodeDecodeError:
        raise NmtError(f"--config {path} is not UTF-8 text") from None
    loader = yaml.SafeLoader(text)  # YAML reads JSON too
    try:  # parsed once: the node gives each key's line, the same node the settings
        node = loader.get_single_node()
        settings = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        raise NmtError(
            f"--config {path}{where} is not valid YAML or JSON: {getattr(e, 'problem', e)}"
        ) from None
    finally:
        loader.dispose()
    if settings is None:
        return {}, {}
    if not isinstance(settings, dict) or not isinstance(node, yaml.MappingNode):
        raise NmtError(f"--config {path} must hold a mapping of option names to values")
    lines = {key.value: key.start_mark.line + 1 for key, _ in node.value if isinstance(key, yaml.ScalarNode)}
    for key, value in settings.items():
        if isinstance(value, dict):
            raise NmtError(
                f"--config {path}, line {lines.get(key, '?')}: {key!r} must be a value, not a mapping"
            )
    return settings, lines


def write_settings(settings: dict) -> str:
    """`settings` as a file --config reads (JSON, which YAML reads too)."""
    return json.dumps(settings, indent=2) + "\n"
