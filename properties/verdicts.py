"""The assertion every property test uses to state a verdict: the policy's rule decides, and a
failure says which rule, by how much, and where the greatest difference sits (the message
``torch.testing.assert_close`` would give, for k3verify's rules)."""

from __future__ import annotations

import torch

from k3verify.numerics import Verdict, fp64_agreement, relative_max_error


def where_worst(x: torch.Tensor, ref: torch.Tensor) -> str:
    """The greatest difference and its index, e.g. ``greatest difference 3.1e-09 at (0, 4, 1)``."""
    if x.shape != ref.shape:
        return f"shapes differ: {list(x.shape)} vs {list(ref.shape)}"
    if not x.numel():
        return "empty tensors"
    diff = (x.detach().double() - ref.detach().double()).abs().nan_to_num(nan=float("inf"))
    flat = int(diff.reshape(-1).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    return (f"greatest difference {float(diff.reshape(-1)[flat]):.3e} at {index} "
            f"(got {float(x.reshape(-1)[flat]):.6g}, expected {float(ref.reshape(-1)[flat]):.6g})")


def assert_verdict(verdict: Verdict, x: torch.Tensor | None = None, ref: torch.Tensor | None = None,
                   what: str = "") -> None:
    """Pass unless ``verdict`` failed; the message names the rule, its reason and, given the
    tensors, where they differ most."""
    if verdict.passed:
        return
    where = f"; {where_worst(x, ref)}" if x is not None and ref is not None else ""
    raise AssertionError(f"{what + ': ' if what else ''}rule {verdict.rule}: {verdict.reason}{where}")


def assert_fp64_agrees(x: torch.Tensor, ref: torch.Tensor, what: str = "",
                       term_sizes: torch.Tensor | None = None) -> None:
    """Rule fp64-agreement: fp64 stays fp64, and the normwise relative max error is <= 1e-10
    (each element relative to its terms' size too, where ``term_sizes`` gives it)."""
    assert x.dtype == torch.float64, f"{what + ': ' if what else ''}fp64 input came back as {x.dtype}"
    assert_verdict(fp64_agreement(x, ref, term_sizes=term_sizes), x, ref, what)


def assert_identical(x: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """Bitwise equality (``torch.equal``: same shape and values, NaN never equal); a failure
    gives the mismatch count, the greatest difference and where, as ``assert_close`` would.
    Use it only where equality holds on any host (copies, permutations, selections, the same
    kernel on the same inputs); the reason belongs in a comment or in ``what``."""
    if torch.equal(x, ref):
        return
    head = f"{what + ': ' if what else ''}not bitwise identical"
    if x.shape != ref.shape:
        raise AssertionError(f"{head}; shapes differ: {list(x.shape)} vs {list(ref.shape)}")
    a, b = x.detach().cpu(), ref.detach().cpu()
    if a.dtype == torch.bool or b.dtype == torch.bool:
        a, b = a.to(torch.int8), b.to(torch.int8)
    differ = (a != b) | a.isnan() if a.is_floating_point() else a != b
    dtypes = f" ({a.dtype} vs {b.dtype})" if a.dtype != b.dtype else ""
    count = f"{int(differ.sum())} of {differ.numel()} elements differ"
    raise AssertionError(f"{head}{dtypes}; {count}; {where_worst(a, b)}")


def assert_rel_within(x: torch.Tensor, ref: torch.Tensor, limit: float, what: str = "") -> None:
    """Normwise relative max error ``<= limit`` (the limit's rule is named at the call); a
    failure says by how much and where."""
    err = relative_max_error(x, ref)
    if err <= limit:
        return
    raise AssertionError(f"{what + ': ' if what else ''}relative max error {err:.3e} > {limit:.1e}; "
                         f"{where_worst(x, ref)}")
