"""Regenerate ``tests/golden_losses.json``: the 1-rank fp32 loss curves (``GOLDEN_STEPS``, 10 optimizer steps) of the
tiny presets in the configuration of ``tests/distributed/test_pipeline_training.py``.

Run it only when a change is *meant* to change the numerics, and say so in the commit::

    python -m tools.golden_losses
"""

import json
import tempfile

from folding.testing import RankPool


def main() -> None:
    from tests.distributed.test_pipeline_training import GOLDEN, GOLDEN_STEPS, MODELS, _train

    out = {}
    with RankPool(1) as pool:
        for name in MODELS:
            case = (name, {}, {}, False, {})
            (result,) = pool.run(_train, [case], tempfile.mkdtemp(), False, GOLDEN_STEPS)[0]  # rank 0's one case
            out[name] = result["losses"]
    with open(GOLDEN, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
