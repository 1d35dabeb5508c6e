import pytest

from nmt_cli.config import resolve_precision
from nmt_cli.errors import NmtError


def test_auto_precision_is_bf16_for_gpu_training_and_fp32_for_gpu_decoding():
    """On an H100 bf16 decoding scored level with fp32 on the validation set but ran several
    times slower (docs/benchmarks.md, GPU check), so decoding's auto stays fp32 on a GPU."""
    assert resolve_precision("auto", "cuda") == "bf16"
    assert resolve_precision("auto", "cuda", decoding=True) == "fp32"
    assert resolve_precision("auto", "cpu", cpu_bf16=True) == "bf16"
    assert resolve_precision("auto", "cpu", cpu_bf16=True, decoding=True) == "bf16"
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("bf16", "cuda", decoding=True) == "bf16"  # asked for, given
    with pytest.raises(NmtError, match="fp16 needs a GPU"):
        resolve_precision("fp16", "cpu")
