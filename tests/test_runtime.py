"""runtime: device resolution, autocast rule, PPL."""
import math

import pytest
import torch

from loopscale.config import ConfigError
from loopscale.runtime import autocast, ppl, resolve_device, uses_bf16


def test_auto_picks_an_available_device_and_explicit_unavailable_ones_fail():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device("cuda")
    with pytest.raises(ConfigError, match="unknown device"):
        resolve_device("tpu")


def test_bf16_autocast_on_cuda_under_auto_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert uses_bf16(cuda, "auto") and uses_bf16(cpu, "bf16") and uses_bf16(cuda, "bf16")
    assert not uses_bf16(cpu, "auto") and not uses_bf16(cuda, "fp32")
    with autocast(cpu, "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast(cpu, "auto"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_ppl_is_exp_ce_with_overflow_and_missing_values():
    assert ppl(math.log(20.0)) == pytest.approx(20.0)
    assert ppl(0) == 1.0
    assert ppl(800.0) == math.inf and ppl(math.inf) == math.inf
    assert math.isnan(ppl(math.nan)) and math.isnan(ppl(None))
