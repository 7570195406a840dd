"""The paper's effect on the builtin corpus, at the cpu preset, in a couple of minutes."""
import pytest

from loopscale import data as D
from loopscale.config import preset
from loopscale.train import train

STEPS = 100


@pytest.mark.slow
def test_rmsnorm_readout_lets_the_norm_drift(tmp_path):
    base = preset("cpu", {"train": {"max_steps": STEPS, "threads": 1, "eval_tokens": 8192}})
    D.prepare_data(base.data, tmp_path / "data", show_progress=False)
    final = {}
    for readout in ("rmsnorm", "raw"):
        cfg = preset("cpu", {"model": {"readout": readout}, "objective": {"loss": "per_loop"},
                             "train": {"max_steps": STEPS, "threads": 1, "eval_tokens": 8192}})
        s = train(cfg, tmp_path / "data", tmp_path / readout, progress=False)
        assert s["status"] == "completed"
        final[readout] = s["validation"]["val_norm"][-1]
    ratio = final["rmsnorm"] / final["raw"]
    print(f"final-loop norm after {STEPS} steps: rmsnorm {final['rmsnorm']:.1f}, raw {final['raw']:.1f}, "
          f"ratio {ratio:.1f}x")
    assert ratio >= 10.0
