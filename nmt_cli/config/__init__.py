"""One frozen dataclass per command, built once at the CLI boundary and saved in the run directory,
each option's --help text in its field (`knob`). Gathered here from where each lives:
`corpus.py` (prep, bpe), `model.py` (the model's shape), `training.py` (presets, train, the launcher),
`translation.py` (decoding options, translate, score), `serving.py` (serve), `common.py` (knob,
the JSON round trip, device and precision).

`to_json`/`from_json` round-trip a config; unknown keys are rejected so a typo in a saved or
hand-edited config is an error, not a silently ignored setting.
"""

from nmt_cli.config.common import (
    PRECISIONS,
    cpus,
    from_json,
    knob,
    resolve_device_name,
    resolve_precision,
    to_json,
)
from nmt_cli.config.corpus import BpeConfig, PrepConfig
from nmt_cli.config.model import ModelConfig
from nmt_cli.config.serving import ServeConfig
from nmt_cli.config.training import MULTI30K_CPU, PRESETS, CpuRecipe, LaunchConfig, TrainConfig
from nmt_cli.config.translation import ENGINES, DecodeOptions, ScoreConfig, TranslateConfig

__all__ = [
    "ENGINES",
    "MULTI30K_CPU",
    "PRECISIONS",
    "PRESETS",
    "BpeConfig",
    "CpuRecipe",
    "DecodeOptions",
    "LaunchConfig",
    "ModelConfig",
    "PrepConfig",
    "ScoreConfig",
    "ServeConfig",
    "TrainConfig",
    "TranslateConfig",
    "cpus",
    "from_json",
    "knob",
    "resolve_device_name",
    "resolve_precision",
    "to_json",
]
