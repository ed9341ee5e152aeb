"""What a torch_dist checkpoint holds across the Megatron-Core releases the cookbook supports (`core.machine.versions`), so
that one saved on either end loads on the other (tests/test_versions.py) and a resumed run is the run asked for.
`core.checkpoints.checkpoint` calls both steps on every release; each does nothing where its release needs nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def common_state_where_older_releases_read_it(folder: Path) -> None:
    """Where this Megatron-Core keeps the common state inside the torch_dist files (`versions.common_state_in_shards`),
    also write it as `common.pt` and name that backend in metadata.json, as 0.16 writes and reads a checkpoint: a
    checkpoint saved on 0.19 then loads on 0.16 (tests/test_versions.py), and 0.19 reads the same state from either."""
    from pai_cookbook.core.machine import versions

    if not versions.common_state_in_shards():
        return
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    torch.save(load_common_state_dict(str(folder)), folder / "common.pt")
    metadata = folder / "metadata.json"
    config = json.loads(metadata.read_text())
    metadata.write_text(json.dumps(config | {"common_backend": "torch", "common_backend_version": 1}))


_SCHEDULE_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")
"""A parameter group's schedule, which Megatron-Core 0.19 on also matches saved groups to current ones by."""


def schedule_asked_for(current: list[dict], saved: dict) -> None:
    """Give each saved parameter group (every "param_groups" list in the optimizer's `saved` state, whatever the
    optimizer's nesting) the schedule of the current group it restores, in place.

    A resumed run trains on the schedule asked for (`override_opt_param_scheduler`, `workers.training.build`). From
    0.19 on, Megatron-Core pairs saved and current groups by a tuple that includes the schedule
    (`param_group_identifier_keys`), so a run resumed with another learning rate or schedule would find no group
    ("Could not find parameter group with key"; tests/test_work_never_lost.py). Pairing by the other
    keys (weight-decay and learning-rate multipliers, expert-parallel, decoupled) and taking the schedule from the
    current group is what the override does anyway; before 0.19 the tuple holds no schedule key and nothing changes."""
    from megatron.core.optimizer import optimizer as megatron_optimizer

    identifiers = tuple(megatron_optimizer.param_group_identifier_keys)
    schedule = [key for key in _SCHEDULE_KEYS if key in identifiers]
    if not schedule:
        return
    others = [key for key in identifiers if key not in schedule]

    def identity(group: dict) -> tuple:
        return tuple(group.get(key, group.get(f"pre_{key}")) for key in others)

    by_identity = {identity(group): group for group in current}

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "param_groups" and isinstance(value, list):
                    for group in value:
                        asked = by_identity.get(identity(group))
                        if asked is not None:
                            group.update({k: asked[k] for k in schedule if k in asked})
                else:
                    walk(value)

    walk(saved)
