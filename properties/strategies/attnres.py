"""What Block AttnRes's tests share beyond the drawn problems (which are
``k3verify.attnres.samples``' :func:`aggregations` and :func:`walks`, the users' strategy too):
every form of one aggregation, the stream dtypes, and one intra-op thread.
"""

from __future__ import annotations

import pytest

from k3verify import attnres
from k3verify.harness.environment import one_thread as single_thread

# Every form of one aggregation, with the options that make it what it is.
FORMS = {
    "recurrent": (attnres.aggregate, {}),
    "chunkwise": (attnres.aggregate_two_phase, {}),
    "tiled tile=1": (attnres.aggregate_tiled, {"tile": 1}),
    "tiled tile=3": (attnres.aggregate_tiled, {"tile": 3}),
    "tiled no-max": (attnres.aggregate_tiled, {"tile": 2, "subtract_max": False}),
}
MAX_SUBTRACTING = tuple(name for name, (_, opts) in FORMS.items() if opts.get("subtract_max", True))
STREAMS = ("fp64", "fp32", "bf16", "fp16")


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny: a second intra-op thread only spins (4x slower on a busy 2-core box)."""
    with single_thread():
        yield
