"""FP8 numerics, emulated (core/modeling/fp8.py): the quantizer against the formats' own value grids, Transformer
Engine's delayed-scaling rules step by step, and training: FP8 is never silently BF16, and TP=2 quantizes as
TP=1 does (the amax of a split tensor is reduced over the group)."""

import pytest
import torch

from pai_cookbook import fp8 as verdicts
from pai_cookbook.core.configs.config import FP8Config, OptimizerConfig, ParallelConfig, PrecisionConfig
from pai_cookbook.core.modeling import fp8
from tests.conftest import tiny_run


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 2.0 ** 5, 2.0 ** -3])
def test_representable_values_round_trip_exactly(fmt, scale):
    grid = fp8.representable(fmt)
    assert len(grid) == {"e4m3": 253, "e5m2": 247}[fmt]  # 256 codes less NaNs (and infs), one zero
    out, counts = fp8.quantize(grid / scale, scale, fmt)
    assert torch.equal(out, grid / scale) and counts.overflow == 0
    assert counts.underflow == 0


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rounding_error_is_within_half_a_unit_in_the_last_place(fmt):
    fmax = fp8.FORMATS[fmt][1]
    x = (torch.rand(20000, generator=torch.Generator().manual_seed(0)) * 2 - 1) * fmax
    x = torch.cat([x, x / 1e3, x / 1e6])  # normal and subnormal ranges
    out, _ = fp8.quantize(x, 1.0, fmt)
    error = (out - x).abs()
    assert (error <= fp8.ulp_bound(x.abs(), fmt)).all()
    assert error.max() > 0  # the check compared rounded values, not copies


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_saturation_and_underflow_are_counted(fmt):
    fmax = fp8.FORMATS[fmt][1]
    grid = fp8.representable(fmt)
    assert fp8.SATURATES_ABOVE[fmt] == grid[-1] + (grid[-1] - grid[-2]) / 2
    x = torch.tensor([fmax * 4, -fmax * 1.5, float("inf"), 1.0, 1e-30, 0.0, fmax * 1.01])
    out, counts = fp8.quantize(x, 1.0, fmt)
    assert out[:3].tolist() == [fmax, -fmax, fmax]  # saturated at the largest finite value, as TE's satfinite cast
    # the exact 0.0 is no underflow; 1.01 x fmax rounds to fmax without saturating (what a tensorwise scale
    # does to the amax itself, a float rounding above fmax): no overflow
    assert counts.overflow == 3 and counts.underflow == 1 and counts.numel == 7 and out[-1] == fmax


def test_delayed_scaling_uses_the_history_up_to_the_previous_step():
    state = fp8.DelayedScaling("e4m3", history=3, algorithm="max")
    used = []
    for amax in [2.0, 8.0, 4.0, 1.0, 1.0, 1.0]:
        used.append(float(state.scale))
        state.record(torch.tensor(amax))
        state.update()
    # step t's scale is 448 / max(amax of steps t-3 .. t-1); step 0 starts at 1; a history of 3 forgets step 1's 8
    assert used == [1.0, 448 / 2, 448 / 8, 448 / 8, 448 / 8, 448 / 4]
    recent = fp8.DelayedScaling("e4m3", history=3, algorithm="most_recent")
    for amax in [8.0, 2.0]:
        recent.record(torch.tensor(amax))
        recent.update()
    assert float(recent.scale) == 448 / 2


def test_delayed_scaling_keeps_its_scale_when_amax_is_zero_or_not_finite_and_margin_halves_it():
    state = fp8.DelayedScaling("e5m2", history=1, margin=0)
    state.record(torch.tensor(4.0))
    state.update()
    kept = float(state.scale)
    for bad in [0.0, float("inf"), float("nan")]:
        state.record(torch.tensor(bad))
        state.update()
        assert float(state.scale) == kept, bad
    for margin in range(4):
        m = fp8.DelayedScaling("e5m2", history=1, margin=margin)
        m.record(torch.tensor(4.0))
        m.update()
        assert float(m.scale) == 57344 / 4 / 2 ** margin


def test_tensorwise_and_blockwise_scales_come_from_the_tensor_itself():
    assert float(fp8.current_scale(torch.tensor(7.0), "e4m3")) == 64.0
    x = torch.ones(3, 256)
    x[0, :128] *= 1000  # one 1 x 128 block large, the rest small
    scales = fp8.block_scales(x, "e4m3", weight=False)
    assert scales[0, 0] == 2.0 ** -2 and scales[0, 200] == 2.0 ** 8 and scales[2, 0] == 2.0 ** 8
    weight = fp8.block_scales(x, "e4m3", weight=True)  # 128 x 128 blocks: rows 0-2 share one per column block
    assert weight[2, 0] == 2.0 ** -2 and weight[2, 200] == 2.0 ** 8


def test_a_verdict_needs_the_band_and_the_relative_bound_over_the_last_steps_only():
    def run(tail: float) -> list[float]:
        return [9.0] * 50 + [tail] * verdicts.TAIL_STEPS  # the first 50 steps are not in the verdict

    band = verdicts.seed_band({1: run(2.99), 2: run(3.0), 3: run(3.01)})  # mean 3.0, spread 0.02
    assert band["mean"] == pytest.approx(3.0) and band["spread"] == pytest.approx(0.02)
    assert verdicts.verdict([run(3.01), run(3.0)], band)["ok"]  # mean over seeds 3.005: in both bounds
    wide = verdicts.verdict([run(3.03)], band)  # within 2 x 0.02 of the mean, but 1% off
    assert wide["in_band"] and not wide["within_relative"] and not wide["ok"]
    tight = verdicts.seed_band({1: run(2.999), 2: run(3.001)})  # spread 0.002
    narrow = verdicts.verdict([run(3.01)], tight)  # within 0.5%, outside 2 x 0.002
    assert narrow["within_relative"] and not narrow["in_band"] and not narrow["ok"]
    with pytest.raises(ValueError, match="no 100-step tail"):
        verdicts.verdict([[3.0] * 99], band)


def test_fp8_statistics_become_arrays_and_name_the_worst_linear():
    def step(under: float) -> dict:
        figures = {"amax": 1.0, "scale": 2.0, "overflow": 0.0, "underflow": 0.0}
        return {"1.mlp.linear_fc1": {r: dict(figures) for r in fp8.ROLES},
                "1.mlp.linear_fc2": {r: dict(figures) | ({"underflow": under} if r == "grad" else {})
                                     for r in fp8.ROLES}}
    history = [step(0.9), step(0.2), step(0.4)]  # step 0 (scale 1 under delayed scaling) is skipped
    names, values = verdicts.statistics(history, "grad", "underflow")
    assert names == ["1.mlp.linear_fc1", "1.mlp.linear_fc2"] and values.shape == (3, 2)
    layer, fraction = verdicts.worst(history)["grad underflow"]
    assert layer == "1.mlp.linear_fc2" and fraction == pytest.approx(0.3)
    with pytest.raises(ValueError, match="no FP8 statistics"):
        verdicts.statistics([], "grad", "underflow")


FP8_RUN = dict(precision=PrecisionConfig(dtype="bf16", fp8=FP8Config(recipe="delayed", amax_history_len=16)),
               optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=1))


def test_an_fp8_request_never_trains_as_bf16(run_scenario):
    steps = dict(train_iters=4, optimizer=FP8_RUN["optimizer"])
    bf16, delayed, ends = run_scenario.layouts([
        tiny_run(precision=PrecisionConfig(dtype="bf16"), **steps),
        tiny_run(precision=FP8_RUN["precision"], **steps),
        tiny_run(model_overrides={"num_layers": 4}, precision=PrecisionConfig(
            dtype="bf16", fp8=FP8Config(recipe="tensorwise", first_last_layers_bf16=True)), **steps)], nproc=1)
    assert delayed["fp8_backend"] == "emulated" and len(delayed["fp8"]) == 4
    step = delayed["fp8"][-1]
    # every GEMM linear of both layers (QKV, attention output, FC1, FC2), each operand quantized
    assert len(step) == 2 * 4 and all(set(roles) == {"input", "weight", "grad"} for roles in step.values())
    assert all(r["amax"] > 0 and r["scale"] != 1.0 for roles in step.values() for r in roles.values())
    assert delayed["losses"] != bf16["losses"]  # the FP8 numerics changed the run
    # first and last of 4 layers in BF16: only layers 2 and 3 report FP8 statistics
    assert sorted({name.split(".")[0] for name in ends["fp8"][-1]}) == ["2", "3"]


def test_a_split_tensor_quantizes_as_the_whole_only_with_the_amax_of_the_whole():
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    weight[3, 5] = 9.0  # the amax lies in the first TP shard
    whole, _ = fp8.quantize(weight, fp8.current_scale(weight.abs().max(), "e4m3"), "e4m3")
    shards = weight.chunk(2)
    group = torch.stack([s.abs().max() for s in shards]).max()  # what the all-reduce MAX gives every rank
    assert torch.equal(torch.cat([fp8.quantize(s, fp8.current_scale(group, "e4m3"), "e4m3")[0] for s in shards]), whole)
    local = torch.cat([fp8.quantize(s, fp8.current_scale(s.abs().max(), "e4m3"), "e4m3")[0] for s in shards])
    assert not torch.equal(local, whole)  # each shard's own amax: another rounding for the second shard


@pytest.mark.multiproc
def test_fp8_at_tp2_quantizes_as_tp1(run_scenario):
    """fp32 around the FP8 GEMMs, so the only TP difference is the all-reduce's summation order (1e-7).

    FP8 rounding turns such differences into whole-step flips of single values (an e4m3 step is 1/8 of the
    value) from step 3 on. Measured over 20 steps (lr 1e-3): the right amax group 1.2e-7, 1.2e-6, then
    2e-5 to 5e-4 per step; a shard's own amax (the known field bug) 2.5e-4 at step 1, then 5e-5 to 8e-4. So a
    20-step loss bound (the issue's 1e-4) cannot tell the two apart, and plain bf16 without FP8 already
    differs by up to 1.5e-4. Step 1 can (2,000x apart): the check is every tensor's amax and scale and the
    loss in the first two steps (a unit test above shows a shard's own amax rounds differently).
    """
    config = dict(precision=PrecisionConfig(dtype="fp32", fp8=FP8Config(amax_history_len=16)),
                  optimizer=FP8_RUN["optimizer"], train_iters=2)
    tp1 = run_scenario(tiny_run(**config))
    tp2 = run_scenario(tiny_run(parallel=ParallelConfig(tensor_model_parallel_size=2), **config), 2)
    gaps = [abs(a - b) for a, b in zip(tp1["losses"], tp2["losses"])]
    assert max(gaps) < 1e-5, gaps
    for step in range(2):  # step 1's scales come from step 0's amaxes
        for name, roles in tp1["fp8"][step].items():
            for role, figures in roles.items():
                other = tp2["fp8"][step][name][role]
                assert figures["scale"] == pytest.approx(other["scale"], rel=1e-5), (step, name, role)
                assert figures["amax"] == pytest.approx(other["amax"], rel=1e-5), (step, name, role)
