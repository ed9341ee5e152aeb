"""DeviceGuard: host/device mix-ups that only a GPU would show, caught on the CPU."""

import contextlib
import inspect
import typing

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pai_cookbook.core.machine import device_guard
from pai_cookbook.core.machine.device_guard import ACCELERATOR, DeviceGuard, DeviceMismatch

THIS_FILE = "tests/test_device_guard.py"
guard_free_long = torch.LongTensor


def _line() -> int:
    """The caller's line number, for asserting the creation site in a message."""
    return inspect.currentframe().f_back.f_lineno


@pytest.fixture
def model():
    torch.manual_seed(0)
    return torch.nn.Linear(2, 2)


def test_host_tensor_added_to_model_output_raises_and_names_its_site(model):
    with DeviceGuard() as guard:
        guard.place(model)
        out = model(torch.ones(3, 2, device=ACCELERATOR))
        padding, line = torch.tensor([1, 2]), _line()
        with pytest.raises(DeviceMismatch, match="Expected all tensors to be on the same device") as caught:
            out + padding
    message = str(caught.value)
    assert f"made at {THIS_FILE}:{line} in test_host_tensor_added_to_model_output_raises_and_names_its_site" in message
    assert "cuda:0" in message and "device=x.device" in message
    assert isinstance(caught.value, RuntimeError)


def test_tensor_made_on_the_outputs_device_passes(model):
    with DeviceGuard() as guard:
        guard.place(model)
        out = model(torch.ones(3, 2, device=ACCELERATOR))
        total = out + torch.tensor([1.0, 2.0], device=out.device)
        assert guard.tags[total] == device_guard.DEVICE
    torch.testing.assert_close(total, out + torch.tensor([1.0, 2.0]))  # values are real


def test_host_scalar_times_device_tensor_passes(model):
    with DeviceGuard() as guard:
        guard.place(model)
        scaled = torch.tensor(2.0) * model.weight
        assert guard.tags[scaled] == device_guard.DEVICE


def test_copy_into_device_tensor_from_host_passes(model):
    with DeviceGuard() as guard:
        guard.place(model)
        buffer = torch.zeros_like(model.weight)
        buffer.copy_(torch.ones(2, 2))
        assert guard.tags[buffer] == device_guard.DEVICE
    assert buffer.sum().item() == 4


@pytest.mark.parametrize("move", [lambda t: t.cuda(), lambda t: t.to(ACCELERATOR), lambda t: t.to("cpu:0"),
                                  lambda t: t.to(device=ACCELERATOR), lambda t: t.to("cpu:0", torch.float64).float()])
def test_moving_a_host_tensor_to_the_device_gives_a_usable_alias(model, move):
    with DeviceGuard() as guard:
        guard.place(model)
        host = torch.ones(2)
        moved = move(host)
        assert moved is not host and guard.tags[moved] == device_guard.DEVICE
        model(moved)  # usable with the model
        with pytest.raises(DeviceMismatch):
            model(host)  # the original is still on the host
        assert guard.tags[host.to(torch.float64)] == device_guard.HOST  # dtype alone keeps the tag


def test_cpu_of_device_tensor_is_host_and_numpy_of_device_tensor_raises(model):
    with DeviceGuard() as guard:
        guard.place(model)
        out = model(torch.ones(1, 2, device=ACCELERATOR))
        with pytest.raises(DeviceMismatch, match="numpy"):
            out.detach().numpy()
        with pytest.raises(DeviceMismatch, match="numpy"):
            np.asarray(out.detach())
        back, line = out.detach().cpu(), _line()
        assert guard.tags[back] == device_guard.HOST
        assert back.numpy().shape == (1, 2)
        assert out.tolist() and out[0, 0].item() is not None  # fine on a GPU too
        with pytest.raises(DeviceMismatch, match=f"{THIS_FILE}:{line}"):
            out + back


def test_indexing_a_device_tensor_with_a_host_index_passes_but_not_the_reverse(model):
    with DeviceGuard() as guard:
        guard.place(model)
        picked = model.weight[torch.tensor([1, 0])]
        assert guard.tags[picked] == device_guard.DEVICE
        with pytest.raises(DeviceMismatch):
            torch.ones(2, 2)[torch.tensor([0], device=ACCELERATOR)]
        model.weight.data[torch.tensor([0])] = torch.zeros(2, device=ACCELERATOR)  # a host index: index_put_ takes it
        model.weight.data[0] = torch.zeros(2)  # a basic index: a copy, legal across devices


def test_assignment_with_a_tensor_index_needs_values_on_the_tensors_device(model):
    """`x[index] = v` with a tensor index is index_put_, which CUDA refuses for host values (other than a scalar) on a
    device tensor, device values on a host one, and a device index into a host tensor; `__setitem__` went unchecked."""
    with DeviceGuard() as guard:
        guard.place(model)
        weight = model.weight.data
        values, line = torch.zeros(2), _line()
        with pytest.raises(DeviceMismatch, match=rf"__setitem__ \(index_put_\).*made at {THIS_FILE}:{line}"):
            weight[torch.tensor([0])] = values
        with pytest.raises(DeviceMismatch):
            weight[weight > 0] = torch.zeros(int((weight > 0).sum()))
        with pytest.raises(DeviceMismatch):
            torch.zeros(3)[torch.tensor([0])] = torch.ones(1, device=ACCELERATOR)
        with pytest.raises(DeviceMismatch, match="indexes by a device tensor"):
            torch.zeros(3)[torch.tensor([0], device=ACCELERATOR)] = 1.0
        weight[torch.tensor([1])] = torch.tensor(0.5)  # a 0-dim host value is moved, as CUDA moves it
        weight[weight > 0] = 0.0


def test_a_host_scalar_inside_stack_or_cat_raises(model):
    """CUDA takes a host scalar as an operand (`2 * x`), not as a member of the tensor list of `stack` or `cat`."""
    with DeviceGuard() as guard:
        guard.place(model)
        total = model.weight.sum()
        for join in (torch.stack, torch.cat):
            members = [total.reshape(1), torch.tensor([1.0])] if join is torch.cat else [total, torch.tensor(1.0)]
            with pytest.raises(DeviceMismatch):
                join(members)
        with pytest.raises(DeviceMismatch):
            torch.stack([total, torch.tensor(0.0)])
        assert guard.tags[torch.stack([total, torch.tensor(0.0, device=total.device)])] == device_guard.DEVICE
        assert guard.tags[total * torch.tensor(2.0)] == device_guard.DEVICE  # the operand exception stays


def test_the_legacy_constructors_make_host_tensors(model):
    """`torch.LongTensor([...])` makes a host tensor on a GPU machine as well: mixed with the model's output it raises
    there, and now here; `isinstance` against the legacy types still answers as before."""
    with DeviceGuard() as guard:
        guard.place(model)
        ids, line = torch.LongTensor([0, 1]), _line()
        assert guard.tags[ids] == device_guard.HOST and isinstance(ids, torch.LongTensor)
        assert not isinstance(torch.zeros(2), torch.LongTensor)
        assert torch.LongTensor | None == typing.Union[guard_free_long, None]  # noqa: UP007 (an annotation evaluated while active)
        assert int | torch.LongTensor == typing.Union[int, guard_free_long]  # noqa: UP007 (transformers writes these)
        with pytest.raises(DeviceMismatch, match=f"made at {THIS_FILE}:{line}"):
            model.weight[0] + ids.float()
        with pytest.raises(DeviceMismatch):
            model.weight[0] * torch.FloatTensor([1.0, 2.0])


def test_shaped_like_a_device_tensor_a_host_tensor_stays_host(model):
    """`x.view_as(y)` reads y's shape only (CUDA allows a host x with a device y): it passes and stays host, so a host
    tensor shaped so and then mixed with the model's output is still caught (the router statistics do the first)."""
    with DeviceGuard() as guard:
        guard.place(model)
        for shaped in (torch.zeros(4).view_as(model.weight), torch.zeros(4).reshape_as(model.weight),
                       torch.zeros(1, 2).expand_as(model.weight)):
            assert guard.tags[shaped] == device_guard.HOST
        with pytest.raises(DeviceMismatch):
            model.weight + torch.zeros(4).view_as(model.weight)


def test_attention_with_a_host_mask_raises(model):
    with DeviceGuard():
        q, k, v = (torch.randn(1, 1, 4, 8, device=ACCELERATOR) for _ in range(3))
        mask = torch.ones(4, 4, dtype=torch.bool).tril()
        with pytest.raises(DeviceMismatch, match="scaled_dot_product_attention"):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        good = torch.ones(4, 4, dtype=torch.bool, device=q.device).tril()
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=good)


def test_tensors_made_before_entering_are_wildcards(model):
    before = torch.ones(2)
    with DeviceGuard() as guard:
        guard.place(model)
        out = model(before) + before
        assert before not in guard.tags
        assert guard.tags[out] == device_guard.DEVICE


def test_host_tag_and_site_propagate_through_a_chain(model):
    with DeviceGuard() as guard:
        guard.place(model)
        positions, line = torch.arange(4), _line()
        mask = (positions[None, :] <= positions[:, None]).logical_not()
        assert guard.tags[mask] == device_guard.HOST
        with pytest.raises(DeviceMismatch, match=f"{THIS_FILE}:{line} in"):
            model(torch.ones(4, 2, device=ACCELERATOR)).unsqueeze(-1).masked_fill(mask[:, :2, None], 0.0)
        like = torch.zeros_like(mask)
        assert guard.tags[like] == device_guard.HOST and guard.tags[mask.new_ones(2)] == device_guard.HOST
        assert guard.tags[torch.zeros_like(mask, device=ACCELERATOR)] == device_guard.DEVICE


def test_from_numpy_and_range_are_host(model):
    with DeviceGuard() as guard:
        guard.place(model)
        assert guard.tags[torch.from_numpy(np.ones(2, dtype=np.float32))] == device_guard.HOST
        with pytest.raises(DeviceMismatch):
            model(torch.from_numpy(np.ones(2, dtype=np.float32)))


def test_module_cuda_and_to_place_the_module(model):
    with DeviceGuard() as guard:
        assert model.cuda() is model and guard.tags[model.weight] == device_guard.DEVICE
        other = torch.nn.Linear(2, 2)
        other.to(torch.float64)
        assert other.weight not in guard.tags  # a dtype alone does not place
        other.to("cpu:0")
        assert guard.tags[other.weight] == device_guard.DEVICE and guard.tags[other.bias] == device_guard.DEVICE
        loss = other(torch.ones(1, 2, dtype=torch.float64, device=ACCELERATOR)).sum()
    loss.backward()  # autograd still works after the module's move
    assert other.weight.grad is not None


def test_the_guard_counts_ops(model):
    with DeviceGuard() as guard:
        assert guard.ops_checked == 0
        guard.place(model)
        model(torch.ones(1, 2, device=ACCELERATOR))
    assert guard.ops_checked >= 2
    seen = guard.ops_checked
    model(torch.ones(1, 2))
    assert guard.ops_checked == seen  # nothing is counted once the guard is left


def test_from_environment(monkeypatch):
    monkeypatch.delenv(device_guard.ENV, raising=False)
    assert isinstance(device_guard.from_environment(), contextlib.nullcontext)
    monkeypatch.setenv(device_guard.ENV, "0")
    assert isinstance(device_guard.from_environment(), contextlib.nullcontext)
    monkeypatch.setenv(device_guard.ENV, "1")
    assert isinstance(device_guard.from_environment(), DeviceGuard)


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_collectives_refuse_host_tensors(world_of_one, model):
    with DeviceGuard() as guard:
        guard.place(model)
        with pytest.raises(DeviceMismatch, match="all_reduce"):
            dist.all_reduce(torch.ones(2))
        with pytest.raises(DeviceMismatch):
            dist.all_reduce(torch.tensor(1.0))  # NCCL refuses even host scalars
        total = torch.ones(2, device=ACCELERATOR)
        dist.all_reduce(total)
        gathered = [torch.zeros(2, device=ACCELERATOR)]
        dist.all_gather(gathered, total)
        objects = [None]
        dist.all_gather_object(objects, {"rank": 0})
        assert objects == [{"rank": 0}]
    assert total.tolist() == [1.0, 1.0]


def _patched_attributes() -> dict:
    names = device_guard._TENSOR_COLLECTIVES + device_guard._OBJECT_COLLECTIVES
    owners = [(torch.distributed, names), (torch.distributed.distributed_c10d, names),
              (torch, device_guard._UNSEEN_FACTORIES + device_guard._LEGACY_CONSTRUCTORS),
              (torch.nn.Module, ("cuda", "to")), (torch.Tensor, ("cuda",))]
    return {(owner.__name__, name): vars(owner).get(name) for owner, names in owners for name in names}


def test_every_patch_is_restored_on_exit(model):
    before = _patched_attributes()
    with DeviceGuard():
        during = _patched_attributes()
    assert _patched_attributes() == before
    changed = [key for key in before if during[key] is not before[key]]
    assert len(changed) == len(before)  # every one of them was patched while active
    with pytest.raises(ValueError), DeviceGuard():
        raise ValueError("restored on an error too")
    assert _patched_attributes() == before


def test_a_tensors_device_says_where_it_lives(model):
    """`x.device` is the accelerator for a device tensor and the CPU for a host one, so `device=x.device` follows x
    as on a GPU (a host tensor's companions stay on the host: no false alarm), and `torch.cuda.current_device()`
    is the accelerator while the guard is active."""
    with DeviceGuard() as guard:
        guard.place(model)
        rewards = torch.tensor([1.0, 0.0, 1.0])  # host-side arithmetic, as the RL worker's group advantages
        groups = torch.as_tensor([0, 0, 1], device=rewards.device)
        assert rewards.device == torch.device("cpu") and float(rewards[groups == 0].mean()) == 0.5
        assert model.weight.device == ACCELERATOR and torch.cuda.current_device() == ACCELERATOR
        assert guard.tags[torch.zeros(2, device=model.weight.device)] == device_guard.DEVICE
        with pytest.raises(DeviceMismatch):
            model(torch.ones(3, 2, device=rewards.device))
    assert model.weight.device == torch.device("cpu")
