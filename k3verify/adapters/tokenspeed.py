"""The other production kernels serving engines run for K3, as published in TokenSpeed's wheels:
what each is, what it needs, and why k3verify cannot call it here.

FlashKDA (``tokenspeed-flashkda``) has its own adapter, :mod:`k3verify.adapters.flash_kda`. The
wheels below are registered as rows that say why they do not run (``unavailable`` with the
reason), so a report shows the gap instead of hiding it: two are built for Blackwell only, three
pin torch 2.14.0 and link its C++ ABI and CUDA 13 runtime, and for none does k3verify call the
kernel yet. Facts are read from the wheels' metadata and sources (versions of 2026-09/10); a
newer wheel may differ. Nothing here imports the packages.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Wheel:
    """One production-kernel wheel: its distribution and import names, what it computes for K3,
    the GPUs it is built for (compute capability majors), its torch pin (``Requires-Dist``) and
    why k3verify does not call it."""

    distribution: str
    module: str
    computes: str
    needs: str
    majors: tuple[int, ...]
    torch_pin: str | None
    no_call: str

    def version(self) -> str | None:
        """The installed version, or ``None``."""
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    @property
    def name(self) -> str:
        """How k3verify's rows name it: ``<distribution> <version>`` or ``<distribution> (missing)``."""
        return f"{self.distribution} {self.version() or '(missing)'}"


WHEELS = {
    w.distribution: w
    for w in (
        Wheel("tokenspeed-cutedsl-kda", "tokenspeed_cutedsl_kda",
              "KDA chunked prefill, one fused tcgen05 kernel per (sequence, head) over 16-token chunks",
              "AOT CuTe-DSL cubins for sm_100a/sm_103a; nvidia-cutlass-dsl 4.8.0, apache-tvm-ffi, cuda-python 13",
              (10,), "2.14.0",
              "its lower bound -5 and fp32 state are baked into the cubin; q/k/v token-major [1, T, H, 128] with "
              "cu_seqlens, state [N, H, V, K]: an adapter is written once a Blackwell GPU can run it"),
        Wheel("tokenspeed-mla", "tokenspeed_mla",
              "MLA decode and prefill (CuTe DSL, compiled at first call)",
              "Blackwell (SM100/SM103, FP8 on SM107); nvidia-cutlass-dsl >= 4.8, apache-tvm-ffi, tokenspeed-triton",
              (10,), None,
              "its paged latent cache and workspace layout are not mapped onto k3verify's MLA cache"),
        Wheel("tokenspeed-flashmla", "flash_mla",
              "FlashMLA: MLA decode over a paged latent cache (flash_mla_with_kvcache + get_mla_metadata)",
              "links libtorch 2.14.0 and libcudart.so.13; the wheel is 38 MB",
              (9, 10), "2.14.0",
              "its paged cache (blocks of 64 latents, 576 wide) and scheduler metadata are not mapped onto "
              "k3verify's MLA cache"),
        Wheel("tokenspeed-fa3", "flash_attn_interface",
              "FlashAttention-3 forward (the expanded MLA prefill)",
              "SM90; links libtorch and libcudart.so.13; the wheel is 63 MB, its extension 300 MB",
              (9,), None,
              "built with FLASH_ATTENTION_DISABLE_HDIMDIFF192, so it refuses K3's q/k width 192 beside v width "
              "128 (flash_attn_config.CONFIG)"),
        Wheel("tokenspeed-deepgemm", "deep_gemm",
              "DeepGEMM: grouped bf16/fp8/fp4 GEMMs (MoE experts), JIT-compiled at first call",
              "SM90/SM100; links libtorch 2.14.0 and libcudart.so.13; compiles kernels with the CUDA toolkit",
              (9, 10), "2.14.0",
              "its grouped layout (tokens contiguous per expert, rows padded to its M alignment, a per-row "
              "expert index) has no adapter yet"),
    )
}  # fmt: skip


def _torch_release() -> str:
    return torch.__version__.split("+")[0]


def unavailable_reason(distribution: str) -> str:
    """Why the wheel's row cannot run here: not installed, no CUDA device, a GPU it is not built
    for, a torch other than its pin, or (all of those met) no adapter yet. Always a reason:
    k3verify calls none of these kernels."""
    w = WHEELS[distribution]
    v = w.version()
    pin = f"; pins torch=={w.torch_pin}" if w.torch_pin else ""
    if v is None:
        return f"{w.distribution} is not installed ({w.computes}; {w.needs}{pin})"
    if not torch.cuda.is_available():
        return f"{w.distribution} {v} needs a CUDA device ({w.needs}); none is visible"
    major, minor = torch.cuda.get_device_capability()
    if major not in w.majors:
        built = "/".join(f"SM{m}x" for m in w.majors)
        return f"{w.distribution} {v} is built for {built}; this device is sm_{major}{minor}"
    if w.torch_pin and _torch_release() != w.torch_pin:
        return (f"{w.distribution} {v} pins torch=={w.torch_pin} and is built against its C++ ABI; "
                f"this is torch {torch.__version__}")
    return f"{w.distribution} {v} is installed, but k3verify does not call it yet: {w.no_call}"
