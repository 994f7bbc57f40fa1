"""Error metrics of an output against a reference.

How to compare lives here and nowhere else; what ran (a module, a form, a kernel) is the
harness's business. Every metric is computed in fp64 from whatever dtype came in.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from .dtypes import dtype_name
from .rounding import spacing


@dataclass(frozen=True)
class Metrics:
    """Errors of ``x`` against ``ref``; non-finite ``x`` entries make the error metrics inf.

    - ``max_abs``: ``max |x - ref|``
    - ``rms_ratio``: ``rms(x - ref) / rms(ref)`` (relative RMS error)
    - ``one_minus_cos``: ``1 - cos(x, ref)`` over the flattened tensors
    - ``sqnr_db``: ``10 log10(sum ref^2 / sum (x - ref)^2)``; inf when exact
    - ``ulp_max`` / ``ulp_mean`` / ``ulp_p99``: ``|x - ref|`` in units of the spacing of the
      comparison dtype at ``ref`` (how many representable steps away)
    - ``nonfinite``: count of non-finite entries of ``x``
    - ``bias``: ``<x - ref, ref> / <ref, ref>``, the error's projection on the reference: a
      scale error ``x = (1 + c) ref`` shows as ``c``; noise independent of ``ref`` gives about
      ``rms_ratio / sqrt(n)``
    - ``rms``: ``rms(x - ref)``, the absolute RMS error (what is left to compare where the
      reference is all zero)
    """

    n: int
    max_abs: float
    rms_ratio: float
    one_minus_cos: float
    sqnr_db: float
    ulp_max: float
    ulp_mean: float
    ulp_p99: float
    nonfinite: int
    ulp_dtype: str
    bias: float = 0.0
    rms: float = 0.0

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def quantile(v: torch.Tensor, q: float) -> float:
    """``torch.quantile(v, q)`` of a 1-D tensor without NaN (linear interpolation between the
    two order statistics around ``q (n − 1)``), the same value, from two selections instead of a
    sort: 4x faster at a million values, which a wide walk's outputs have."""
    pos = q * (v.numel() - 1)
    below = math.floor(pos)
    lo = torch.kthvalue(v, below + 1).values
    hi = torch.kthvalue(v, min(below + 2, v.numel())).values
    return float(torch.lerp(lo, hi, pos - below))


def compare(x: torch.Tensor, ref: torch.Tensor, *, ulp_dtype: torch.dtype | str) -> Metrics:
    """Metrics of ``x`` against ``ref`` (same shape); ULPs counted in ``ulp_dtype``."""
    if x.shape != ref.shape:
        raise ValueError(f"cannot compare shape {tuple(x.shape)} against {tuple(ref.shape)}")
    xd = x.detach().to("cpu", torch.float64).reshape(-1)
    rd = ref.detach().to("cpu", torch.float64).reshape(-1)
    if not bool(torch.isfinite(rd).all()):
        raise ValueError("the reference has non-finite values; an oracle must be finite")
    n = xd.numel()
    nonfinite = int((~torch.isfinite(xd)).sum())
    name = dtype_name(ulp_dtype)
    if nonfinite:
        inf = math.inf
        return Metrics(n, inf, inf, inf, -inf, inf, inf, inf, nonfinite, name, math.nan, inf)
    diff = xd - rd
    ref_sq = float((rd * rd).sum())
    err_sq = float((diff * diff).sum())
    rms_ratio = math.sqrt(err_sq / ref_sq) if ref_sq > 0 else (0.0 if err_sq == 0 else math.inf)
    x_sq = float((xd * xd).sum())
    if ref_sq > 0 and x_sq > 0:
        cos = float((xd * rd).sum()) / math.sqrt(ref_sq * x_sq)
        one_minus_cos = max(0.0, 1.0 - cos)
    else:
        one_minus_cos = 0.0 if ref_sq == x_sq else 1.0
    sqnr = math.inf if err_sq == 0 else (10 * math.log10(ref_sq / err_sq) if ref_sq > 0 else -math.inf)
    ulps = diff.abs() / spacing(rd, ulp_dtype)
    return Metrics(
        n=n,
        max_abs=float(diff.abs().max()) if n else 0.0,
        rms_ratio=rms_ratio,
        one_minus_cos=one_minus_cos,
        sqnr_db=sqnr,
        ulp_max=float(ulps.max()) if n else 0.0,
        ulp_mean=float(ulps.mean()) if n else 0.0,
        ulp_p99=quantile(ulps[: 1 << 24], 0.99) if n else 0.0,
        nonfinite=0,
        ulp_dtype=name,
        bias=float((diff * rd).sum()) / ref_sq if ref_sq > 0 else 0.0,
        rms=math.sqrt(err_sq / n) if n else 0.0,
    )


def relative_max_error(x: torch.Tensor, ref: torch.Tensor, term_sizes: torch.Tensor | None = None) -> float:
    """Normwise relative error ``max|x - ref| / max|ref|`` in fp64 (inf if x is non-finite).

    With ``term_sizes`` (``ref``'s shape: the sum of the absolute terms each element of an output
    formed as a sum is made of), each element's error is relative to the larger of ``max|ref|``
    and its own terms' size: a sum that cancels far below its terms carries their rounding,
    which no form can avoid."""
    xd = x.detach().to("cpu", torch.float64)
    rd = ref.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(xd).all()):
        return math.inf
    if not rd.numel():
        return 0.0
    diff = (xd - rd).abs()
    scale = rd.abs().max()
    if term_sizes is not None:
        scale = torch.maximum(term_sizes.detach().to("cpu", torch.float64).expand_as(rd), scale)
    # 0/0 is an exact zero; x/0 an error against a zero scale
    ratio = torch.where(diff == 0, 0.0, diff / scale)
    return float(ratio.max())


def worst_element(x: torch.Tensor, ref: torch.Tensor, axes: tuple[str, ...] = ()) -> dict[str, object]:
    """Where ``|x - ref|`` is largest (a non-finite ``x`` first): ``{"index", "axes", "got",
    "expected", "abs_diff"}``, the index one integer per axis of ``ref`` and ``axes`` their names
    when there is one per axis (else empty). Same shapes; computed in fp64."""
    xd = x.detach().to("cpu", torch.float64)
    rd = ref.detach().to("cpu", torch.float64)
    if rd.numel() == 0:
        return {"index": [], "axes": [], "got": None, "expected": None, "abs_diff": 0.0}
    diff = (xd - rd).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    flat = int(diff.reshape(-1).argmax())
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(rd.shape))]
    return {"index": index, "axes": list(axes) if len(axes) == len(index) else [],
            "got": float(xd.reshape(-1)[flat]), "expected": float(rd.reshape(-1)[flat]),
            "abs_diff": float(diff.reshape(-1)[flat])}


def where_text(index: list[int], axes: list[str]) -> str:
    """``[b=2, t=0, h=3, v=15]`` from an index and its axis names (``[2, 0, 3, 15]`` without)."""
    if axes and len(axes) == len(index):
        return "[" + ", ".join(f"{a}={i}" for a, i in zip(axes, index)) + "]"
    return "[" + ", ".join(str(i) for i in index) + "]"


def mismatch_fraction(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Fraction of rows (first axis) whose entries differ from ``ref``'s (a discrete output: which
    experts a token chose); 1 for a shape mismatch."""
    if out.shape != ref.shape:
        return 1.0
    if ref.numel() == 0:
        return 0.0
    rows = (out != ref).reshape(ref.shape[0], -1).any(-1) if ref.dim() else (out != ref).reshape(1)
    return float(rows.double().mean())
