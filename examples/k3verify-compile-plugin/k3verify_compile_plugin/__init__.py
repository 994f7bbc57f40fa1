"""An example k3verify plugin: ``torch.compile`` of k3verify's own KDA chunkwise form.

Installed beside k3verify, it shows up in ``k3verify list``, in ``k3verify run`` rows, in the KDA
overflow map and in ``k3verify golden verify``, judged against the fp64 oracle like every other
implementation; nothing in k3verify names it. ``K3V_EXAMPLE_COMPILE_BACKEND`` picks the
``torch.compile`` backend (default ``inductor``; ``eager`` skips code generation).
"""

from __future__ import annotations

import os


def implementations() -> list:
    """The implementations this plugin adds (k3verify calls it once per process)."""
    import torch

    from k3verify import kda
    from k3verify.harness.registry import implementation

    backend = os.environ.get("K3V_EXAMPLE_COMPILE_BACKEND", "inductor")
    compiled = torch.compile(kda.chunkwise, backend=backend, dynamic=False)
    return [
        # fp32 inputs, chunk 64: held to what the plain chunkwise form achieves in fp32.
        implementation("kda", compiled, name=f"torch.compile[{backend}]", form="chunkwise", dtype="fp32",
                       baseline="chunkwise", in_map=True, chunk_size=64),
    ]
