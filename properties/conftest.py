"""Hypothesis profiles shared by every property test.

``ci`` (the default) is derandomised with bounded examples so CI is reproducible;
``thorough`` explores more; ``nightly`` also climbs toward the largest error through
``hypothesis.target``; ``gpu`` is ``thorough`` without deadlines for device runs.
Choose with ``--hypothesis-profile NAME`` or ``HYPOTHESIS_PROFILE=NAME``.
Every failure prints its reproduction blob (``print_blob=True``).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

_COMMON = dict(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

settings.register_profile("ci", derandomize=True, max_examples=25, **_COMMON)
settings.register_profile("thorough", max_examples=300, **_COMMON)
settings.register_profile(
    "nightly",
    max_examples=2000,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    **_COMMON,
)
settings.register_profile("gpu", max_examples=300, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
