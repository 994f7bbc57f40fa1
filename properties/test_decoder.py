"""The K3 decoder stack: schedule, fp64 walks against the definitions, serving scenarios, planted
serving bugs, the first-divergence search and the low-precision walk's verdict.

Rules used: fp64-agreement (≤ 1e-10 normwise) for every fp64 comparison, bit-for-bit equality
where the computation is the same (page placement, a resumed walk on one host), and the
same-dtype baseline rule (k = 2 plus the noise floor, fp64 truth) for the low-precision walk.
Most tests run a 4-layer stack (layers 0–3: KDA ×3 then MLA; the dense MLP, then MoE) at
the CPU width; the schedule-wide ones all 93 layers on a few tokens.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import weakref
from dataclasses import replace

import pytest
import torch

from k3verify import attnres
from k3verify.decoder import (
    KDA,
    MLA,
    Decoder,
    DecoderConfig,
    fp64_plan,
    naive_plan,
    tiled_plan,
)
from k3verify.decoder.mutants import MUTANTS
from k3verify.decoder.scenarios import SCENARIOS, ScenarioSizes, check, embeddings
from k3verify.decoder.walks import attribute, first_divergence, plant, reference_walk, walk
from k3verify.mla.cache import allocate, append, live_entries, release
from k3verify.numerics.policy import BASELINE_RULE, POLICY
from k3verify.numerics.validate import require_finite_parameter

SMALL = ScenarioSizes(prompt=16, decode=2, short=12)


@pytest.fixture(scope="module")
def four() -> Decoder:
    return Decoder(DecoderConfig.cpu(num_layers=4))


@pytest.fixture(scope="module")
def k3() -> Decoder:
    return Decoder(DecoderConfig.cpu())


def test_the_stack_follows_k3s_schedule(k3: Decoder) -> None:
    cfg = k3.config
    assert cfg.counts() == {"kda": 69, "mla": 24, "dense": 1, "moe": 92, "attnres": 187}
    assert [layer for layer in range(93) if cfg.token_mixer(layer) == MLA] == [*range(3, 92, 4), 92]
    assert cfg.channel_mixer(0) == "dense" and {cfg.channel_mixer(layer) for layer in range(1, 93)} == {"moe"}
    calls = cfg.schedule.calls()
    assert len({c.sources[-1].first for c in calls if c.sources[-1].kind == "block"}) + 1 == 8  # b0 + 7 blocks
    assert cfg.schedule.max_sources == 9
    # Each sublayer call has its own AttnRes weights.
    w = k3.weights.attnres.w
    assert w.shape == (187, cfg.hidden) and len({tuple(r[:4].tolist()) for r in w}) == 187


def test_fp64_forms_walk_agrees_with_the_definitions_walk(k3: Decoder) -> None:
    """fp64-agreement: chunkwise KDA, MLA, MoE and two-phase AttnRes through all 93 layers
    against the recurrent definitions, every sublayer's stream and the output."""
    tokens = embeddings(k3, 10, seed=3)
    definitions = reference_walk(k3, fp64_plan("recurrent"), tokens)
    forms = walk(k3, fp64_plan("chunkwise"), tokens, definitions)
    assert POLICY["fp64-agreement"].judge(forms.out.double(), definitions.out).verdict.passed
    assert max(forms.h_err) < 1e-12, max(forms.h_err)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_serving_scenarios_agree_in_fp64(four: Decoder, name: str) -> None:
    """fp64-agreement of the served path with its definition, outputs and carried states
    (page placement: bit for bit)."""
    checked = check(SCENARIOS[name], four, SMALL)
    assert checked.passed, (checked.y.reason, checked.state.reason)
    assert checked.where is None
    assert checked.served.out.shape == checked.definition.out.shape and checked.served.out.shape[0] >= 6
    if SCENARIOS[name].bitwise:
        assert torch.equal(checked.served.out, checked.definition.out)


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_a_planted_serving_bug_fails_its_scenario_and_names_the_token(four: Decoder, mutant) -> None:
    bad = mutant.decoder(four.config, weights=four.weights)
    plan = mutant.plan(fp64_plan("chunkwise")) if mutant.plan else None
    checked = check(SCENARIOS[mutant.scenario], four, SMALL, served_decoder=bad, served_plan=plan,
                    rollback=mutant.rollback)
    assert not checked.passed
    assert checked.where is not None and "@" in checked.where
    if mutant.plan is not None:  # the state is read transposed only when non-zero: decode is unaffected
        assert check(SCENARIOS["prefill_decode"], four, SMALL, served_plan=plan).passed


def test_the_mutants_are_caught_where_they_should_be_named(four: Decoder) -> None:
    """Each mutant's first failing token is one of the requests its bug touches."""
    touched = {"length-1 request in a mixed batch": ("decode@", "decode2@"),
               "rollback keeps a rejected token": ("s0@", "s1@", "s3@"),
               "conv history reset at a chunk boundary": ("r@",), "state read transposed when non-zero": ("r@",)}
    for mutant in MUTANTS:
        bad = mutant.decoder(four.config, weights=four.weights)
        plan = mutant.plan(fp64_plan("chunkwise")) if mutant.plan else None
        checked = check(SCENARIOS[mutant.scenario], four, SMALL, served_decoder=bad, served_plan=plan,
                        rollback=mutant.rollback)
        assert checked.where.startswith(touched[mutant.name]), (mutant.name, checked.where)


@pytest.mark.parametrize("layer,module", [
    (0, KDA), (47, MLA),
    # The last layer walks the whole stack twice (3.4 s on one core): the same search as layer
    # 47's over more sublayers, in the thorough session.
    pytest.param(92, "moe", marks=pytest.mark.slow),
])
def test_first_divergence_names_the_planted_sublayer(k3: Decoder, layer: int, module: str) -> None:
    tokens = embeddings(k3, 6, seed=4)
    found = first_divergence(k3, tokens, plant(fp64_plan("chunkwise"), layer, module), fp64_plan("chunkwise"))
    assert (found.layer, found.module) == (layer, module)
    assert found.sublayer == 2 * layer + (module not in (KDA, MLA))
    # Two walks in lockstep, each up to the planted sublayer and no further.
    assert found.evaluations == 2 * (found.sublayer + 1)
    # Observed at checkpoints only (every 16th sublayer), the bisection finds the same sublayer.
    bisected = first_divergence(k3, tokens, plant(fp64_plan("chunkwise"), layer, module), fp64_plan("chunkwise"),
                                stride=16)
    assert bisected.sublayer == found.sublayer


def test_no_divergence_is_reported_between_equal_walks(four: Decoder) -> None:
    tokens = embeddings(four, 6, seed=5)
    for stride in (1, 3):
        found = first_divergence(four, tokens, fp64_plan("recurrent"), fp64_plan("chunkwise"), stride=stride)
        assert not found.found and found.evaluations == 2 * four.config.schedule.num_sublayers


def test_the_low_precision_walk_is_judged_and_a_planted_error_fails(four: Decoder) -> None:
    """Baseline rule: the tiled bf16 walk's final state within 2x the naive bf16 walk's error
    plus the floor; the same walk with one sublayer's output negated fails it. Judged sublayer
    by sublayer, the tiled walk never leaves the rule and one sublayer 50 % off is named."""
    tokens = embeddings(four, 16, seed=6)
    reference = reference_walk(four, fp64_plan("chunkwise"), tokens)
    base = walk(four, naive_plan(), tokens, reference)

    def verdict(plan):
        out = walk(four, plan, tokens, reference).out
        return POLICY[BASELINE_RULE].judge(out, reference.out, dtype="bf16", baseline=base.out, rms_n=16,
                                           bias_n=16).verdict

    assert verdict(tiled_plan()).passed
    assert not verdict(plant(tiled_plan(), 2, KDA, scale=-1.0)).passed

    def search(plan):
        return first_divergence(four, tokens, plan, fp64_plan("chunkwise"), baseline=naive_plan(),
                                routes=reference.routes)

    assert not search(tiled_plan()).found
    found = search(plant(tiled_plan(), 2, KDA, scale=1.5))
    assert (found.sublayer, found.layer, found.module) == (4, 2, KDA)
    assert found.evaluations == 3 * 5  # three walks in lockstep, each up to the planted sublayer


def test_attribution_shares_add_up_and_name_every_module(four: Decoder) -> None:
    tokens = embeddings(four, 8, seed=7)
    reference = reference_walk(four, fp64_plan("chunkwise"), tokens)
    table = attribute(four, tokens, tiled_plan(), fp64_plan("chunkwise"), reference)
    singles = [a for a in table if a.module != "all"]
    assert {a.module for a in singles} == {"kda", "mla", "dense", "moe", "attnres"}
    assert math.isclose(sum(a.share for a in singles), 1.0, rel_tol=1e-12)
    assert all(a.out_err > 0 for a in table)


def test_a_depth_walk_resumes_from_a_copy_bit_for_bit() -> None:
    """Same host, same operations: a walk copied half way and finished equals the walk."""
    schedule = attnres.Schedule.layers(2, num_layers=4)
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(5, 16, generator=gen, dtype=torch.float64)
    weights = attnres.init_weights(schedule, 16)
    sub = attnres.StandInSublayers.make(schedule.num_sublayers, 16)

    def finish(w: attnres.DepthWalk) -> torch.Tensor:
        while not w.done:
            s, x = w.next_input()
            w.push(sub(s, x))
        return w.result().output

    whole = attnres.DepthWalk(e, weights, schedule, attnres.Options(), attnres.MIXERS["chunkwise"])
    for _ in range(3):
        s, x = whole.next_input()
        whole.push(sub(s, x))
    half = copy.deepcopy(whole)
    assert torch.equal(finish(half), finish(whole))
    assert torch.equal(finish(attnres.DepthWalk(e, weights, schedule, attnres.Options(), attnres.MIXERS["chunkwise"])),
                       attnres.chunkwise(e, weights, sub, schedule=schedule).output)


def test_release_poisons_the_freed_slots_and_keeps_the_rest() -> None:
    cache = allocate(2, 8, 4, 3, page_order="shuffled", generator=torch.Generator().manual_seed(0))
    entries = torch.arange(2 * 6 * 3, dtype=torch.float64).reshape(2, 6, 3)
    full = append(cache, entries)
    cut = release(full, [2, 5])
    assert cut.lengths == [2, 5]
    assert torch.equal(live_entries(cut)[0, :2], entries[0, :2]) and torch.equal(live_entries(cut)[1], entries[1, :5])
    assert int(torch.isnan(cut.pool).all(-1).sum()) == int(torch.isnan(full.pool).all(-1).sum()) + 5
    with pytest.raises(ValueError, match="release keeps"):
        release(full, [7, 1])


def test_a_parameter_checked_once_is_checked_again_after_a_write() -> None:
    w = torch.ones(4, dtype=torch.float64)
    require_finite_parameter("w", w)
    w[2] = math.inf
    with pytest.raises(ValueError, match="w has 1 non-finite"):
        require_finite_parameter("w", w)


def test_walk_writes_its_rows_and_study(tmp_path, four: Decoder) -> None:
    from k3verify.cli import main

    out = tmp_path / "walk"
    code = main(["walk", "--layers", "4", "--prompt", "8", "--decode", "1", "--workers", "1", "--out", str(out),
                 "--jobs", "walks,prefill_decode,mixed_batch", "--plant", "2:moe", "--quiet"])
    assert code == 0
    doc = json.loads((out / "report.json").read_text())
    forms = {(r["form"], r["dtype"]): r["status"] for r in doc["rows"]}
    assert forms == {("walk/fp64 forms", "fp64"): "pass", ("walk/tiled bf16", "bf16"): "pass",
                     ("serving/prefill_decode", "fp64"): "pass", ("serving/prefill_decode", "bf16"): "pass",
                     ("serving/mixed_batch", "fp64"): "pass", ("serving/mixed_batch", "bf16"): "pass"}
    study = json.loads((out / "decoder_walk.json").read_text())
    assert study["first_divergence"]["layer"] == 2 and study["first_divergence"]["module"] == "moe"
    assert len(study["depth_drift"]["curves"]["tiled bf16"]) == 8
    assert len(study["decode_steps"]["served"]) == 9
    assert not (out / ".partial").exists()  # the finished jobs' file goes once the report is written


def test_an_interrupted_walk_resumes_with_the_missing_jobs_only(tmp_path) -> None:
    """Rule: bit for bit (same host, same code): the jobs read back from the partial file are
    the ones computed before the interrupt, and the resumed walk's rows equal an uninterrupted
    walk's. Another code version takes nothing from the file."""
    from k3verify.harness.decoder_walk import WalkOptions, run_all

    options = WalkOptions(num_layers=4, prompt=8, decode=1, jobs=("prefill_decode", "mixed_batch", "speculative"))
    partial = tmp_path / ".partial" / "decoder.jsonl"
    said: list[str] = []

    def stop_after_one(line: str) -> None:
        said.append(line)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_all(options, partial=partial, commit="c1", progress=stop_after_one)
    assert len(partial.read_text().splitlines()) == 1 and "prefill_decode" in said[0]
    said.clear()
    resumed = run_all(options, partial=partial, commit="c1", progress=said.append)
    assert [line.endswith("from the partial file)") for line in said] == [True, False, False]
    fresh = run_all(options)
    verdicts = lambda results: [(r.name, [(row["form"], row["verdict"]) for row in r.rows]) for r in results]  # noqa: E731
    assert verdicts(resumed) == verdicts(fresh)
    said.clear()
    run_all(replace(options, jobs=("prefill_decode",)), partial=partial, commit="c2", progress=said.append)
    assert not said[0].endswith("from the partial file)")


def test_a_walk_in_this_process_says_which_sublayer_runs_in_which_form() -> None:
    """Rule: structural. ``run_all``'s ``doing`` hears the weights being drawn, then before every
    sublayer call the job, the plan and the sublayer (1-based, of the schedule's count) with its
    module and form: every plan the scenario runs passes every sublayer, in order. The cached
    decoder tells no one afterwards (it outlives the command)."""
    import re

    from k3verify.decoder.model import naive_plan
    from k3verify.harness.decoder_walk import _DECODERS, WalkOptions, run_all

    options = WalkOptions(num_layers=4, prompt=8, decode=1, jobs=("page_placement",))
    said: list[str] = []
    run_all(options, doing=said.append)
    assert said[0] == "drawing the weights (cpu)", said[:2]
    line = re.compile(r"page_placement, (?P<plan>.+): sublayer (?P<s>\d+)/(?P<n>\d+) \((?P<module>\w+), (?P<form>.+)\)")
    calls = [line.fullmatch(text) for text in said[1:]]
    assert all(calls), [t for t, c in zip(said[1:], calls) if not c]
    n = options.decoder_config().schedule.num_sublayers
    assert {int(c["n"]) for c in calls} == {n}
    runs: dict[str, list[int]] = {}
    for c in calls:
        runs.setdefault(c["plan"], []).append(int(c["s"]))
        assert c["module"] in c["form"], c.group(0)  # the form's label names its module
    assert {"fp64 chunkwise", options.low().label, naive_plan(options.dtype).label} <= set(runs), runs.keys()
    for plan, order in runs.items():  # whole passes, sublayer 1 to n each
        assert order == list(range(1, n + 1)) * (len(order) // n), (plan, order)
    assert all(decoder.doing is None for decoder in _DECODERS.values())


@pytest.mark.parametrize("tamper", [
    lambda p: p | {"extra": 1},
    lambda p: p | {"rows": "not a list"},
    lambda p: p | {"rows": [{"module": "decoder"}]},
    lambda p: p | {"seconds": True},
    lambda p: p | {"name": "speculative"},
])
def test_a_partial_line_that_is_not_a_job_result_runs_the_job_again(tmp_path, tamper) -> None:
    """The partial file is untrusted input: a line under the job's key whose fields, rows or name
    are not a job result's is not taken (the job runs again, its rows the computed ones)."""
    from k3verify.harness.decoder_walk import WalkOptions, run_all

    options = WalkOptions(num_layers=4, prompt=8, decode=1, jobs=("prefill_decode",))
    partial = tmp_path / "decoder.jsonl"
    first = run_all(options, partial=partial, commit="c")
    record = json.loads(partial.read_text())
    partial.write_text(json.dumps(record | {"cell": tamper(record["cell"])}) + "\n")
    said: list[str] = []
    again = run_all(options, partial=partial, commit="c", progress=said.append)
    assert not said[0].endswith("from the partial file)")
    assert [row["verdict"] for row in again[0].rows] == [row["verdict"] for row in first[0].rows]


@pytest.mark.parametrize("args,message", [
    (["--plant", "5:nope"], "the module is one of"),
    (["--jobs", "walks,nope"], "unknown job"),
    (["--layers", "0"], "--layers"),
    (["--prompt", "2"], "--prompt"),
    (["--device", "foo"], "is not a device"),
    (["--device", "cuda:99"], "CUDA device(s)"),
    (["--experts", "0"], "[1, 1024] experts"),
    (["--distinct-layers", "0"], "[1, 93] weight sets"),
])
def test_walk_refuses_bad_options_by_name(tmp_path, capsys, args: list[str], message: str) -> None:
    from k3verify.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["walk", "--out", str(tmp_path / "w"), *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("args,message", [
    (["--config", "wide"], "run it with --device cuda"),
    (["--plan", "kernels", "--dtype", "bf16"], "not faithful for bf16"),
])
def test_a_walk_this_machine_cannot_run_is_a_usage_error(tmp_path, capsys, args: list[str], message: str) -> None:
    """Structural: K3's widths on the CPU (the worker was killed for memory, exit 3) and the
    kernel plan in bf16 under Triton's CPU interpreter (a RuntimeError, exit 3) are usage
    errors, exit 2, before anything runs."""
    from k3verify.cli import main

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs both")
    assert main(["walk", "--out", str(tmp_path / "w"), "--layers", "2", *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("args", [["--experts", "3"], ["--distinct-layers", "4"]])
def test_the_wide_stacks_options_need_the_wide_stack(tmp_path, capsys, args: list[str]) -> None:
    """Structural: --experts and --distinct-layers shape --config wide only; on the CPU stack they
    were accepted and ignored, a run of another stack than the one asked for."""
    from k3verify.cli import main

    assert main(["walk", "--out", str(tmp_path / "w"), "--layers", "2", *args]) == 2
    assert "give them with --config wide" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("plant,message", [("99:kda", "the stack has layers 0 to 3"),
                                           ("3:kda", "layer 3 runs mla and moe"),
                                           ("0:moe", "layer 0 runs kda and dense")])
def test_a_plant_the_stack_does_not_have_is_refused(tmp_path, capsys, plant: str, message: str) -> None:
    """Structural: a bug planted at a layer past the stack, or in a module its layer does not
    run, was planted nowhere, and the walk reported "no divergence" as if the search had missed
    it; it is a usage error naming what the stack has, before anything runs."""
    from k3verify.cli import main

    assert main(["walk", "--out", str(tmp_path / "w"), "--layers", "4", "--plant", plant]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_pooled_weights_repeat_and_the_wide_config_has_k3s_widths() -> None:
    cfg = DecoderConfig.wide(num_experts=8, distinct_layers=4)
    assert (cfg.hidden, cfg.kda.heads, cfg.mla.num_heads, cfg.moe.latent_size, cfg.moe.expert_hidden) == (
        7168, 96, 96, 3584, 3072)
    assert [cfg.pool_index(layer) for layer in (0, 4, 93 - 1)] == [0, 0, 0]
    small = replace(DecoderConfig.cpu(num_layers=8), distinct_layers=2)
    d = Decoder(small)
    assert d.weights.layers[4][KDA] is d.weights.layers[0][KDA]
    with pytest.raises(ValueError, match="width"):
        replace(DecoderConfig.cpu(), hidden=128)


def test_a_registered_implementation_runs_in_the_stack(tmp_path, capsys) -> None:
    """fla-core's chunkwise KDA (fp32, CPU), its label as `list --json` gives it, in every KDA layer
    of the low-precision plan, judged by the baseline rule against the fp64 walk like our own
    forms; an unknown label is refused with the known ones listed."""
    from k3verify.cli import main
    from k3verify.harness.decoder_walk import WalkOptions

    pytest.importorskip("fla")
    assert main(["list", "--modules", "kda", "--json"]) == 0
    (label,) = [i["label"] for i in json.loads(capsys.readouterr().out)
                if i["implementation"].startswith("fla-core ") and i["form"] == "chunkwise"]
    assert label == "kda/fla-core 0.6.0:chunkwise[fp32]"
    out = tmp_path / "w"
    assert main(["walk", "--layers", "4", "--prompt", "8", "--decode", "1", "--dtype", "fp32", "--workers", "1",
                 "--jobs", "walks", "--use", label, "--out", str(out), "--quiet"]) == 0
    rows = json.loads((out / "report.json").read_text())["rows"]
    assert [(r["form"], r["status"]) for r in rows if r["dtype"] == "fp32"] == [(f"walk/tiled fp32 + {label}", "pass")]
    with pytest.raises(ValueError, match=r"no such implementation of kda; known: .*fla-core"):
        WalkOptions(use=("kda/nope",)).low()


def test_a_used_moe_implementation_computes_the_stacks_pinned_choices(tmp_path) -> None:
    """A walk pins every low-precision run's expert choices to the fp64 run's; a registered MoE
    implementation used in it gets those choices with each call. Rule: bit for bit (same process)
    for the call given choices unlike its own router's: it equals the form run on those choices;
    the baseline rule for the walk's row. The bridge that let the implementation route again on
    the bf16 input failed this row at 0.41 against a limit of 0.11 (the flipped tokens) and
    fails the first check."""
    from k3verify import moe
    from k3verify.cli import main
    from k3verify.harness.decoder_walk import registered_form

    label = "moe/k3verify:tiled[bf16 tile_m=16 tile_k=16]"
    _, form = registered_form(label)
    cfg = DecoderConfig.cpu().moe
    w = moe.init_weights(cfg, seed=3)
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    own = moe.route(x, w.w_router, w.bias, cfg)
    other = moe.Routing((own.indices + 1) % cfg.num_experts, own.weights.flip(-1))  # never the router's choice
    y = form.fn(x.to(torch.bfloat16), w.to(torch.bfloat16), cfg, routing=other)
    want = moe.tiled(x.to(torch.bfloat16).double(), w.to(torch.bfloat16).to(torch.float64), cfg, routing=other,
                     tile_m=16, tile_k=16, operand_dtype=torch.bfloat16).to(torch.bfloat16)
    assert torch.equal(y, want)

    out = tmp_path / "w"
    assert main(["walk", "--layers", "8", "--prompt", "16", "--decode", "2", "--workers", "1",
                 "--jobs", "prefill_decode", "--use", label, "--out", str(out), "--quiet"]) == 0
    rows = json.loads((out / "report.json").read_text())["rows"]
    assert [(r["dtype"], r["status"], r["params"]["routing"]) for r in rows if r["dtype"] == "bf16"] == [
        ("bf16", "pass", "pinned to fp64")]


def test_a_used_moe_implementation_that_routes_itself_is_a_usage_error() -> None:
    """Our Triton router kernel chooses its experts itself: handed a call whose pinned choices
    are not its own, it cannot stand in a walk, and the error names it and the tokens that
    differ instead of judging other experts' arithmetic as its own. Rule: structural."""
    from k3verify import moe
    from k3verify.harness.decoder_walk import registered_form
    from k3verify.harness.files import UsageError

    label = "moe/k3verify:kernel:router[fp32]"
    _, form = registered_form(label)
    cfg = DecoderConfig.cpu().moe
    w = moe.init_weights(cfg, seed=3, dtype=torch.float32)
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    own = moe.route(x, w.w_router, w.bias, cfg)
    assert form.fn(x, w, cfg, routing=own).shape == x.shape
    other = moe.Routing((own.indices + 1) % cfg.num_experts, own.weights)
    with pytest.raises(UsageError, match=r"kernel:router\[fp32\]' chose its own experts for 5 of 5 tokens"):
        form.fn(x, w, cfg, routing=other)
    # an implementation of one's own that reports no experts is taken at its word: it used the given ones
    from k3verify.harness import registry
    from k3verify.harness.decoder_walk import _moe_bridge

    quiet = registry.Implementation(module="moe", implementation="vendor-moe 1.0", form="kernel:grouped",
                                    dtype="fp32", params={}, rule=registry.BASELINE_RULE,
                                    run=lambda case: {"y": case.inputs["x"].clone()})
    assert torch.equal(_moe_bridge(quiet)(x, w, cfg, routing=other), x)


def test_a_call_the_used_implementation_refuses_is_a_usage_error(tmp_path, monkeypatch, capsys) -> None:
    """A plugin's KDA kernel built for other head dims (as FlashKDA is for K = V = 128) refuses the
    stack's first call: the walk ends with exit 2 and one line naming the implementation, the
    call's shapes and the kernel's own reason, not as an internal error (exit 3)."""

    def refuse(case):
        raise ValueError(f"built for K = V = 128; got K = {case.inputs['q'].shape[-1]}")

    code, err, label = _walk_using(monkeypatch, capsys, tmp_path / "w", "kda", "kernel:chunk", refuse)
    assert code == 2, err
    assert f"--use '{label}' refused a call of the stack" in err and "got K = 32" in err, err
    assert "internal error" not in err


def test_held_casts_are_made_once_and_again_after_any_write() -> None:
    """Rule: bit for bit (same process: a cast's values are its source's, cast). ``Casts`` makes a
    cast once per source; a write into the source or into the cast (an implementation scribbling
    on its inputs) makes the next call get a fresh one; with ``copy`` a source already in the
    dtype is copied, never handed over; inference tensors are cast every time. ``cast_once``
    keeps casts only inside ``held_casts``."""
    from k3verify.numerics import Casts, cast_once, held_casts

    held = Casts(copy=True)
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    first = held(w, torch.float64)
    assert first.dtype == torch.float64 and torch.equal(first, w.double()) and held(w, torch.float64) is first
    first.mul_(0)  # the implementation wrote into its input
    second = held(w, torch.float64)
    assert second is not first and torch.equal(second, w.double())
    w.add_(1)  # the source changed
    third = held(w, torch.float64)
    assert third is not second and torch.equal(third, w.double())
    w64 = torch.ones(3, dtype=torch.float64)
    own = held(w64, torch.float64, "cpu")
    assert torch.equal(own, w64) and own.data_ptr() != w64.data_ptr()
    with torch.inference_mode():
        frozen = torch.ones(3, dtype=torch.bfloat16)
    assert held(frozen, torch.float64) is not held(frozen, torch.float64)
    assert cast_once(w, torch.float32) is not cast_once(w, torch.float32)  # outside: every time
    with held_casts():
        assert cast_once(w, torch.float32) is cast_once(w, torch.float32)
        assert cast_once(w64, torch.float64) is w64  # nothing to make: as .to
        assert cast_once(w64, torch.float64, torch.device("cpu", 0)) is w64  # the same place, named otherwise
    assert cast_once(w, torch.float32) is not cast_once(w, torch.float32)


def test_kept_casts_go_with_their_holder_at_once() -> None:
    """A :class:`Casts` and what it keeps (a wide layer's copies are gigabytes) are freed when the
    last reference to it goes, not when the cyclic collector next runs: nothing it keeps refers
    back to it. Rule: structural."""
    from k3verify.numerics import Casts

    w = torch.randn(64, 64, dtype=torch.float64)
    held = Casts(copy=True)
    cast = held(w, torch.float32)
    holder, kept = weakref.ref(held), weakref.ref(cast)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del held, cast
        assert holder() is None and kept() is None
    finally:
        if enabled:
            gc.enable()


def _write_unseen(t: torch.Tensor) -> None:
    """Change one element of CPU tensor ``t`` through its memory, as a kernel writes through a
    pointer: torch's version counter does not move."""
    t.view(torch.int16 if t.element_size() == 2 else torch.int64).numpy().reshape(-1)[0] += 1


def test_a_held_cast_is_checked_once_at_the_end_not_around_each_call() -> None:
    """Rule: structural. Inside held_casts a function handed a kept cast is not guarded by a copy
    per call (a wide MoE layer's weights are 448 M values); the block's end finds a cast written
    behind torch's back, and only such a one (a write torch saw gets the next call a fresh cast).
    Outside, the per-call guard still names the write."""
    from k3verify.harness.guard import InputMutated, checked_call
    from k3verify.numerics import cast_once, held, held_casts

    source = torch.randn(8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with held_casts() as casts:
        cast = cast_once(source, torch.bfloat16)
        assert held(cast) and casts.changed() == []
        checked_call(_write_unseen, (cast,), ("w",), {})
        assert casts.changed() == ["the bfloat16 [8, 8] copy on cpu"]
    with held_casts() as casts:
        cast = cast_once(source, torch.bfloat16)
        cast.mul_(2)
        assert not held(cast) and casts.changed() == [] and cast_once(source, torch.bfloat16) is not cast
    with pytest.raises(InputMutated, match=r"modified its input w in place \(1 of 64"):
        checked_call(_write_unseen, (cast_once(source, torch.bfloat16),), ("w",), {})


@pytest.mark.parametrize("collected", [False, True], ids=["as run", "collector run before the end"])
def test_a_used_implementation_writing_into_its_weights_unseen_ends_the_walk(tmp_path, monkeypatch, capsys,
                                                                              collected) -> None:
    """A used MoE implementation that writes into the weights it computes with, through their
    memory (no in-place operation torch records), would have later calls compute with other
    weights: the job's end finds it and the walk ends with exit 2 naming the implementation.
    Whether Python's cyclic collector runs before that end or not (when it runs depends on
    everything the process did before) changes nothing: the weights' copies the casts are
    made from live to the job's end. Rule: structural."""
    from k3verify import moe
    from k3verify.harness.modules.moe import call
    from k3verify.numerics import Casts

    if collected:
        changed = Casts.changed
        monkeypatch.setattr(Casts, "changed", lambda self: (gc.collect(), changed(self))[1])

    def writing(x, w, cfg, *, routing):
        _write_unseen(w.w_latent_up)
        return moe.chunkwise(x.float(), w.to(torch.float32), cfg, routing=routing)

    def writing_x(x, w, cfg, *, routing):
        x.mul_(2)
        return moe.chunkwise(x.float(), w.to(torch.float32), cfg, routing=routing)

    code, err, label = _walk_using(monkeypatch, capsys, tmp_path / "w", "moe", "kernel:grouped",
                                   lambda case: call(writing, case, torch.bfloat16))
    assert code == 2, err
    assert f"prefill_decode: --use '{label}' wrote into weights given to them" in err, err
    assert "the bfloat16 [" in err and "internal error" not in err
    # a write into the activations is named at the call, as every row's guard names it
    code, err, label = _walk_using(monkeypatch, capsys, tmp_path / "x", "moe", "kernel:grouped",
                                   lambda case: call(writing_x, case, torch.bfloat16))
    assert code == 2 and f"--use '{label}' modified its input x in place" in err, err


def _walk_using(monkeypatch, capsys, out, module: str, form: str, run) -> tuple[int, str, str]:
    """``walk`` (4 layers, prefill_decode) using an in-process plugin's bf16 implementation of
    ``module`` that runs ``run(case)``: (exit status, stderr on one line, its label)."""
    from k3verify.cli import main
    from k3verify.harness import registry

    fake = registry.Implementation(module=module, implementation=f"vendor-{module} 1.0", form=form, dtype="bf16",
                                   params={}, rule=registry.BASELINE_RULE, run=run,
                                   source=f"vendor-{module} 1.0 (plugin)")
    monkeypatch.setattr(registry, "plugin_implementations", lambda m: [fake] if m == module else [])
    code = main(["walk", "--layers", "4", "--prompt", "8", "--decode", "1", "--workers", "1",
                 "--jobs", "prefill_decode", "--use", fake.label, "--out", str(out), "--quiet"])
    return code, " ".join(capsys.readouterr().err.split()), fake.label


def test_a_used_moe_implementation_gets_each_weight_set_copied_once(tmp_path, monkeypatch) -> None:
    """A used MoE implementation (ours in bf16 behind a plugin's label) gets the same fp64 copies
    of a layer's weights at every call of the walk (one copy per weight set, not per call: at K3's
    widths a copy is 3.6 GB), and scribbling on them after each call changes nothing for the next
    (each call sees its layer's weights as the stack holds them; the row passes). Rule: baseline,
    as every bf16 row; bit for bit for the weights seen (same process)."""
    from k3verify.cli import main
    from k3verify.harness import registry

    label = "moe/k3verify:tiled[bf16 tile_m=16 tile_k=16]"
    (ours,) = [i for i in registry.get("moe").implementations() if i.label == label]
    seen: list[dict[str, torch.Tensor]] = []  # kept alive: the ids stay unique
    by_value: dict[float, list[dict[str, torch.Tensor]]] = {}  # a layer's weights, told by their sum

    def scribbling(case):
        weights = case.inputs["weights"].tensors()
        seen.append(weights)
        by_value.setdefault(float(sum(t.sum() for t in weights.values())), []).append(weights)
        out = ours.run(case)
        if len(seen) == 1:
            for t in weights.values():
                t.mul_(0)
        return out

    fake = registry.Implementation(module="moe", implementation="vendor-moe 1.0", form="kernel:grouped",
                                   dtype="bf16", params={}, rule=registry.BASELINE_RULE, run=scribbling,
                                   source="vendor-moe 1.0 (plugin)")
    monkeypatch.setattr(registry, "plugin_implementations", lambda m: [fake] if m == "moe" else [])
    out = tmp_path / "w"
    assert main(["walk", "--layers", "4", "--prompt", "8", "--decode", "2", "--workers", "1",
                 "--jobs", "prefill_decode", "--use", fake.label, "--out", str(out), "--quiet"]) == 0
    rows = json.loads((out / "report.json").read_text())["rows"]
    assert [r["status"] for r in rows if r["dtype"] == "bf16"] == ["pass"]
    # three MoE layers with weights of their own, each called at the prefill and two decode steps;
    # the scribbled-on set never came back (no sum of 0, no fourth set)
    assert len(seen) == 9 and sorted(len(calls) for calls in by_value.values()) == [3, 3, 3], by_value.keys()
    copies = sorted(len({id(w["w_router"]) for w in calls}) for calls in by_value.values())
    assert copies == [1, 1, 2], copies  # one copy per set, and one more after the scribbling


def test_a_registered_kda_implementation_runs_the_decode_steps_too(tmp_path) -> None:
    """A bf16 implementation in place of KDA takes every call of the served path, one-token decode
    steps included, with the state handed over in fp32 as to a kernel (the decode steps once fell
    back to our recurrence with a bf16/fp32 mix and a TypeError). Rule: baseline, as every bf16 row."""
    from k3verify.cli import main
    from k3verify.harness.decoder_walk import WalkOptions

    label = "kda/k3verify:recurrent[bf16]"
    plan = WalkOptions(use=(label,)).low()
    assert plan.forms[KDA].decode is plan.forms[KDA].fn
    out = tmp_path / "w"
    assert main(["walk", "--layers", "4", "--prompt", "8", "--decode", "2", "--workers", "1",
                 "--jobs", "prefill_decode", "--use", label, "--out", str(out), "--quiet"]) == 0
    rows = json.loads((out / "report.json").read_text())["rows"]
    assert [r["status"] for r in rows if r["dtype"] == "bf16"] == ["pass"]
