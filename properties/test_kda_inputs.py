"""Bad input gives an error that names the argument and the problem (structural checks)."""

from __future__ import annotations

import pytest
import torch
from verdicts import assert_identical

from k3verify import kda
from k3verify.kda.samples import make_problem

FORMS = [kda.recurrent, kda.chunkwise, kda.tiled]


def _args():
    p = make_problem(1, 10, 2, 8, 4, seed=0)
    return list(p.args()), p.state()


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("mutate", "error", "words"),
    [
        (lambda a, s: a.__setitem__(1, a[1][..., :4]), ValueError, ["k", "shape"]),
        (lambda a, s: a.__setitem__(4, a[4][..., None]), ValueError, ["beta", "shape"]),
        (lambda a, s: a.__setitem__(2, a[2].float()), TypeError, ["dtype", "v=torch.float32"]),
        (lambda a, s: a.__setitem__(0, a[0].to(torch.int64)), TypeError, ["q", "dtype"]),
        (lambda a, s: a[0].__setitem__((0, 3, 1, 2), float("nan")), ValueError, ["q", "non-finite", "(0, 3, 1, 2)"]),
        (lambda a, s: a[3].__setitem__((0, 5, 0, 0), 0.25), ValueError, ["g", "<= 0", "(0, 5, 0, 0)"]),
        (lambda a, s: a.__setitem__(3, a[3].abs()), ValueError, ["g", "log-decay"]),
        (lambda a, s: a.__setitem__(0, "q"), TypeError, ["q", "torch.Tensor"]),
    ],
    ids=["k-shape", "beta-rank", "mixed-dtype", "int-dtype", "nan", "positive-g", "positive-g-all", "not-tensor"],
)
def test_bad_inputs_name_the_problem(form, mutate, error, words) -> None:
    args, state = _args()
    mutate(args, state)
    with pytest.raises(error) as info:
        form(*args, initial_state=state)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value!s}"


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
def test_bad_initial_state(form) -> None:
    args, state = _args()
    with pytest.raises(ValueError, match="initial_state"):
        form(*args, initial_state=state[..., :2])
    bad = state.clone()
    bad[0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="initial_state has 1 non-finite"):
        form(*args, initial_state=bad)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"tile": 24}, ["tile 24", "chunk_size 64"]),
        ({"anchor": "tile_end"}, ["anchor", "tile_start"]),
        ({"operand_dtype": "int8"}, ["dtype", "bf16"]),
        ({"diagonal": "exact"}, ["diagonal", "matmul"]),
        ({"chunk_size": 0}, ["chunk_size", "positive"]),
        ({"overflow": "wrap"}, ["overflow", "nonfinite"]),
        ({"anchor_shift": -1.0}, ["anchor_shift"]),
    ],
)
def test_bad_tiling_options(kwargs, words) -> None:
    args, _state = _args()
    with pytest.raises(ValueError) as info:
        kda.tiled(*args, **kwargs)
    for w in words:
        assert w in str(info.value)


def test_bad_scale_and_chunk() -> None:
    args, _ = _args()
    with pytest.raises(ValueError, match="scale"):
        kda.recurrent(*args, scale=-1.0)
    with pytest.raises(ValueError, match="chunk_size"):
        kda.chunkwise(*args, chunk_size=2.5)


def test_inputs_are_not_modified() -> None:
    """Forms must not write into their arguments (a harness reuses inputs across forms)."""
    args, state = _args()
    before = [a.clone() for a in args] + [state.clone()]
    for form in FORMS:
        form(*args, initial_state=state, output_final_state=True)
    for a, b in zip([*args, state], before):
        assert_identical(a, b)  # bitwise: the clones are copies, no arithmetic
