"""How many problems a kernel property test draws when the kernels run under Triton's CPU
interpreter, where one launch costs about a second of CPU.

The derandomised ``ci`` profile (``nox -s tests``) draws 2 beside each test's pinned
``@example`` problems: the same CI session judges every kernel by the same rule again, on the
built-in cases in ``k3verify run`` and on the golden inputs in ``k3verify golden verify``. Any
other profile (``nox -s thorough``: ``HYPOTHESIS_PROFILE=thorough``) draws 4; on a GPU the
profile decides (``gpu``: 100 derandomised, ``gpu-explore``: 1000 fresh ones). The profile is
the one loaded when the test modules are imported (the conftest's, or ``--hypothesis-profile``).
"""

from __future__ import annotations

from hypothesis import settings

from k3verify.triton_support import interpreted

EXAMPLES = 2 if settings.get_current_profile_name() == "ci" else 4


def few(**kwargs: object) -> settings:
    """The kernel tests' settings: :data:`EXAMPLES` under the interpreter, else the profile's."""
    return settings(max_examples=EXAMPLES, **kwargs) if interpreted() else settings(**kwargs)
