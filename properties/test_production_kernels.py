"""The production K3 kernels as peers (FlashKDA, TokenSpeed's other wheels) and fla-core's own path.

What runs without a GPU: the rows are listed and ``unavailable`` with a reason naming the
package and why; FlashKDA's adapter maps k3verify's inputs (gates and ``beta`` after their
activations, state ``[B, H, K, V]``) onto the kernel's (logits, ``[B, H, V, K]``), checked by
running the kernel's documented math (:func:`k3verify.adapters.flash_kda.emulate`) on the mapped
arguments against our recurrent form: fp64 mapping to 1e-10 (fp64-agreement), the bf16 logits
to what their rounding costs; and fla-core's rows switch off its dispatch to FlashKDA. The kernel
itself runs in ``benchmarks/production_kernels_gpu.py`` and ``k3verify run`` on an SM90 GPU
(docs/modules/kda.md, "Production kernels").
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from k3verify import cli, kda
from k3verify.adapters import fla, flash_kda, tokenspeed
from k3verify.harness import registry
from k3verify.kda.gate import l2norm
from k3verify.kda.samples import make_problem, random_inputs, saturated_inputs
from k3verify.numerics import relative_max_error

NEW_KDA_ROWS = {"kernel:flash_kda": "tokenspeed-flashkda", "kernel:cutedsl_kda": "tokenspeed-cutedsl-kda"}
NEW_MLA_ROWS = {"tokenspeed-flashmla", "tokenspeed-mla", "tokenspeed-fa3"}
NEW_MOE_ROWS = {"tokenspeed-deepgemm"}
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the rows may run")


def _rows(module: str) -> dict[str, registry.Implementation]:
    return {i.implementation: i for i in registry.get(module).implementations()}


@no_gpu
def test_new_rows_are_listed_unavailable_with_their_reason(capsys: pytest.CaptureFixture[str]) -> None:
    """``k3verify list --modules kda,mla,moe`` shows each new row, ``available: no`` and why."""
    assert cli.main(["list", "--modules", "kda,mla,moe"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for package in [*NEW_KDA_ROWS.values(), *NEW_MLA_ROWS, *NEW_MOE_ROWS]:
        (line,) = [ln for ln in lines if f" {package} " in ln and "available:" in ln and ln.split()[1] == package]
        reason = line.split("available: ", 1)[1]
        assert reason.startswith("no: ") and package in reason, line
    kda_rows = {i.form: i for i in registry.get("kda").implementations() if i.form in NEW_KDA_ROWS}
    assert set(kda_rows) == set(NEW_KDA_ROWS)
    for form, package in NEW_KDA_ROWS.items():
        reason = kda_rows[form].unavailable()
        assert reason and package in reason and ("not installed" in reason or "CUDA" in reason), reason
    assert kda_rows["kernel:flash_kda"].baseline == "chunkwise" and kda_rows["kernel:flash_kda"].dtype == "bf16"


@no_gpu
def test_installed_wheels_without_a_gpu_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed wheel on a machine without CUDA: the reason says a CUDA device is needed."""
    monkeypatch.setattr(flash_kda, "version", lambda: "0.0.1.post20260901")
    assert "needs a CUDA device" in flash_kda.unavailable_reason()
    for wheel in tokenspeed.WHEELS.values():
        monkeypatch.setattr(tokenspeed.Wheel, "version", lambda self: "9.9")
        reason = tokenspeed.unavailable_reason(wheel.distribution)
        assert reason.startswith(f"{wheel.distribution} 9.9 needs a CUDA device"), reason


def test_every_wheel_row_is_unavailable_and_never_called() -> None:
    """TokenSpeed's wheels other than FlashKDA are listed only: their rows never claim to run
    (DeepGEMM's under MoE, beside torch's grouped GEMMs)."""
    rows = {**_rows("kda"), **_rows("mla"), **_rows("moe")}
    for wheel in tokenspeed.WHEELS.values():
        row = next(r for name, r in rows.items() if name.startswith(wheel.distribution + " "))
        assert row.unavailable() == tokenspeed.unavailable_reason(wheel.distribution)
        with pytest.raises(NotImplementedError):
            row.run(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("g_min", "finite"), [(-5.0, True), (-5.54, True), (-5.55, False), (-6.9, False)])
def test_flash_kda_rows_predict_the_frontier_measured_on_the_gpu(g_min: float, finite: bool) -> None:
    """The FlashKDA row's prediction on the worst case at K3's head dims: finite down to -5.545
    (16 |g_min| < ln(max fp32)), the edge an H100 measured between -5.5449 and -5.5459."""
    row = next(i for i in registry.get("kda").implementations() if i.form == "kernel:flash_kda")
    x = saturated_inputs(1, 64, 1, 128, 128, g_min=g_min, one_hot=True)
    assert row.predict is not None
    assert row.predict(registry.Case("worst", x, {"g_min": g_min})).finite is finite


# --- FlashKDA's mapping ---------------------------------------------------------------------------


@pytest.mark.parametrize("lower_bound", [-5.0, -1.5, -12.0])
def test_gate_logits_invert_the_kernels_gate(lower_bound: float) -> None:
    """``lower_bound * sigmoid(z) = g`` for the mapped logits, the bound and 0 included; in the
    kernel's fp32 the saturated ends come back exactly (decay e^g = 1 at g = 0)."""
    x = random_inputs(1, 40, 2, 8, 8, g_min=lower_bound, seed=3)
    g = torch.cat([x["g"].flatten(), torch.tensor([lower_bound, 0.0], dtype=torch.float64)])
    z = flash_kda.gate_logits(g, lower_bound, torch.float64)
    assert relative_max_error(lower_bound * torch.sigmoid(z), g) < 1e-12
    ends = flash_kda.gate_logits(torch.tensor([lower_bound, 0.0]), lower_bound).float()
    assert float(lower_bound * torch.sigmoid(ends[0])) == lower_bound
    assert float(torch.exp(lower_bound * torch.sigmoid(ends[1]))) == 1.0
    with pytest.raises(ValueError, match="lower_bound"):
        flash_kda.gate_logits(torch.tensor([lower_bound * 1.01]), lower_bound)
    with pytest.raises(ValueError, match="lower_bound"):
        flash_kda.gate_logits(torch.tensor([0.01]), lower_bound)


def test_state_layout_is_transposed_both_ways() -> None:
    """k3verify's ``[B, H, K, V]`` is FlashKDA's ``[B, H, V, K]``: element (b, h, i, j) moves to (b, h, j, i)."""
    S = torch.randn(2, 3, 4, 5)
    T = flash_kda.to_kernel_state(S)
    assert T.shape == (2, 3, 5, 4) and T.is_contiguous()
    assert T[1, 2, 4, 3] == S[1, 2, 3, 4]
    assert torch.equal(flash_kda.from_kernel_state(T), S)


@pytest.mark.parametrize("kind", ["random", "saturated"])
def test_mapped_arguments_compute_our_kda_in_fp64(kind: str) -> None:
    """Rule: fp64-agreement (1e-10). The kernel's documented math on the mapped arguments (logits,
    zero A_log and dt_bias, in-kernel l2 norm, transposed state) is our recurrent KDA, output and
    state, on q and k normalised once more as the kernel does (its eps of 1e-6 alone moves a unit
    row by 5e-7, the outputs by 1e-6: far below bf16's rounding)."""
    p = make_problem(2, 37, 2, 16, 8, seed=11, kind=kind, g_min=-5.0)
    args = flash_kda.arguments(*p.args(), initial_state=p.state(), lower_bound=-5.0, operand_dtype=torch.float64,
                               state_dtype=torch.float64)  # fmt: skip
    assert args["A_log"].shape == (2,) and args["dt_bias"].shape == (2, 16)
    assert args["initial_state"].shape == (2, 2, 8, 16)
    o, S = flash_kda.emulate(args)
    q, k, v, g, beta = p.args()
    o_ref, S_ref = kda.recurrent(l2norm(q), l2norm(k), v, g, beta, initial_state=p.state(), output_final_state=True)
    assert relative_max_error(o, o_ref) < 1e-10
    assert relative_max_error(flash_kda.from_kernel_state(S), S_ref) < 1e-10


def test_bf16_logits_cost_little_next_to_the_bf16_baseline() -> None:
    """The kernel takes the gate and beta logits in bf16: that rounding alone (fp64 elsewhere)
    moves the output by under 2e-3 of its RMS, a fraction of the bf16 chunkwise baseline's 4e-3."""
    x = random_inputs(1, 64, 2, 32, 32, seed=5)
    names = ("q", "k", "v", "g", "beta")
    exact = flash_kda.arguments(*(x[n] for n in names), initial_state=x["initial_state"], operand_dtype=torch.float64,
                                state_dtype=torch.float64)  # fmt: skip
    exact["g"] = flash_kda.gate_logits(x["g"], -5.0).double()
    exact["beta"] = flash_kda.beta_logits(x["beta"]).double()
    o, _ = flash_kda.emulate(exact)
    o_ref, _ = kda.recurrent(*(x[n] for n in names), initial_state=x["initial_state"])
    err = float((o - o_ref).norm() / o_ref.norm())
    assert 1e-6 < err < 2e-3, err


def test_the_adapter_refuses_what_the_kernel_would_compute_otherwise() -> None:
    """Rows of q or k off unit length (the kernel normalises them) and head dims other than 128."""
    x = random_inputs(1, 8, 1, 16, 16, seed=1)
    with pytest.raises(ValueError, match="l2-normalises q"):
        flash_kda.arguments(2 * x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match="K = V = 128"):
        flash_kda.chunk(x["q"], x["k"], x["v"], x["g"], x["beta"])
    worst = saturated_inputs(1, 20, 1, 16, 16, one_hot=True)  # one-hot rows are unit rows
    flash_kda.arguments(worst["q"], worst["k"], worst["v"], worst["g"], worst["beta"])


# --- fla-core's own path -----------------------------------------------------------------------------

needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla-core is not installed")


def test_triton_only_switches_fla_backends_off_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLA_FLASH_KDA", "1")
    monkeypatch.delenv("FLA_TILELANG", raising=False)
    with fla.triton_only():
        assert os.environ["FLA_FLASH_KDA"] == "0" and os.environ["FLA_TILELANG"] == "0"
    assert os.environ["FLA_FLASH_KDA"] == "1" and "FLA_TILELANG" not in os.environ


@needs_fla
def test_fla_would_hand_gated_calls_to_flash_kda_but_not_under_triton_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``flash_kda`` importable, fla-core 0.6.0 sends a ``chunk_kda`` call that computes the gate,
    l2 norm and sigmoid in the kernel to FlashKDA; :func:`fla.triton_only` keeps it on fla's Triton
    kernels, and the pre-gated calls our rows make never go there."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.backends.flash_kda import FlashKDABackend
    monkeypatch.setattr(FlashKDABackend, "is_available", classmethod(lambda cls: True))
    monkeypatch.delenv("FLA_FLASH_KDA", raising=False)
    B, T, H, D = 1, 16, 2, 128
    q, k, v, g = (torch.zeros(B, T, H, D, dtype=torch.bfloat16) for _ in range(4))
    beta = torch.zeros(B, T, H, dtype=torch.bfloat16)
    gated = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 state_v_first=True, safe_gate=True, lower_bound=-5.0, A_log=torch.zeros(H), dt_bias=torch.zeros(H * D))
    ours = dict(safe_gate=True, lower_bound=-5.0, output_final_state=True)
    with torch.no_grad():
        assert fla.dispatched_backend(chunk_kda, q, k, v, g, beta, **gated) == "flash_kda"
        assert fla.dispatched_backend(chunk_kda, q, k, v, g, beta, **ours) == fla.TRITON
        with fla.triton_only():
            assert fla.dispatched_backend(chunk_kda, q, k, v, g, beta, **gated) == fla.TRITON
    fla_rows = [i for i in registry.get("kda").implementations()
                if i.implementation.startswith("fla-core") and i.form.startswith("kernel:")]
    assert fla_rows and all("Triton kernels, backend dispatch off" in i.source for i in fla_rows)
