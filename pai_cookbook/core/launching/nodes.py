"""Host-side steps of a multi-node job: node 0 does them, the other nodes wait and get its result.

A scheduler job (PAI-DLC and the like) runs the same notebook or script on every node. The torchrun
workers of a training run span all nodes, but the steps around them run in each node's own process:
preparing data, converting, exporting, making a tiny model. Run on every node, they write the same
files at once and delete each other's `.partial` folders. So each such step is decorated with
`@nodes.node0_only`: on node 0 it runs; every other node waits for it at a rendezvous on node 0
(a `torch.distributed.TCPStore` at MASTER_ADDR, port MASTER_PORT + 1) and returns node 0's result,
or raises node 0's error. The k-th such step of one node meets the k-th of every other (every node
runs the same cells in the same order). Node 0 returns only after every node has the result, so no
node is left waiting on a store that has gone.

On a single machine (no scheduler variables) `node0_only` calls the function and nothing else happens.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pai_cookbook.core.machine import runtime

START_TIMEOUT_S = float(os.environ.get("PAI_COOKBOOK_NODE_TIMEOUT_S", 600))
"""Seconds a node waits for node 0 to reach the same step (a peer that never starts fails here)."""
FINISH_TIMEOUT_S = float(os.environ.get("PAI_COOKBOOK_STEP_TIMEOUT_S", 24 * 3600))
"""Seconds a node waits for node 0 to finish a step once started (a 70B conversion takes a while)."""
PORT_ENV = "PAI_COOKBOOK_HOST_PORT"
"""Port of the host-side rendezvous on node 0; default MASTER_PORT + 1 (torchrun uses MASTER_PORT)."""

F = TypeVar("F", bound=Callable[..., Any])
_store = None
_steps = 0
_depth = 0  # > 0 inside a node0_only step: nested steps run where they are called (node 0)


class NodeError(RuntimeError):
    """Node 0 failed a host-side step, or did not reach it in time."""


def _encode(value: Any) -> bytes:
    return json.dumps(value, default=lambda o: {"__path__": str(o)} if isinstance(o, Path) else repr(o)).encode()


def _decode(raw: bytes) -> Any:
    return json.loads(raw, object_hook=lambda d: Path(d["__path__"]) if set(d) == {"__path__"} else d)


def _rendezvous(env: runtime.LaunchEnv):
    global _store
    if _store is None:
        from torch.distributed import TCPStore

        port = int(os.environ.get(PORT_ENV, env.master_port + 1))
        try:
            _store = TCPStore(env.master_addr, port, env.nnodes, env.node_rank == 0,
                              timeout=datetime.timedelta(seconds=START_TIMEOUT_S), wait_for_workers=False)
        except Exception as err:  # torch raises its own DistStoreError / RuntimeError on a timeout
            raise NodeError(f"node {env.node_rank}: no host rendezvous with node 0 at {env.master_addr}:{port} within "
                            f"{START_TIMEOUT_S:.0f}s ({err}). Is node 0 running the same job? Set {PORT_ENV} if that "
                            f"port is taken.") from None
    return _store


def _wait(store, key: str, seconds: float, what: str, env: runtime.LaunchEnv) -> None:
    store.set_timeout(datetime.timedelta(seconds=seconds))
    try:
        store.wait([key])
    except Exception as err:
        raise NodeError(f"node {env.node_rank}: node 0 did not {what} within {seconds:.0f}s ({type(err).__name__}). "
                        f"Check node 0's log; raise PAI_COOKBOOK_NODE_TIMEOUT_S / PAI_COOKBOOK_STEP_TIMEOUT_S for "
                        f"slow steps.") from None


def node0_only(fn: F) -> F:
    """Run `fn` on node 0 only; on the other nodes of a multi-node job, wait for it and return its result.

    The result crosses nodes as JSON (paths stay paths); an exception on node 0 is raised on every node.
    """

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        global _steps, _depth
        env = runtime.detect_launch_env()
        if not env.multi_node or _depth:
            return fn(*args, **kwargs)
        store, step = _rendezvous(env), _steps
        _steps += 1
        key, name = f"step{step}", f"{fn.__module__}.{fn.__qualname__}"
        if env.node_rank == 0:
            store.set(f"{key}/started", name)
            _depth += 1
            try:
                result = fn(*args, **kwargs)
            except BaseException as err:
                store.set(f"{key}/done", _encode({"error": f"{type(err).__name__}: {err}"}))
                raise
            finally:
                _depth -= 1
            store.set(f"{key}/done", _encode({"result": result}))
            for node in range(1, env.nnodes):  # every node has it before node 0 may go on (and exit)
                _wait(store, f"{key}/ack{node}", START_TIMEOUT_S, f"see node {node} take step {step}", env)
            return result
        print(f"node {env.node_rank}: waiting for node 0 to run {name} (step {step})", file=sys.stderr, flush=True)
        _wait(store, f"{key}/started", START_TIMEOUT_S, f"reach step {step} ({name})", env)
        started = store.get(f"{key}/started").decode()
        if started != name:
            raise NodeError(f"node {env.node_rank}: step {step} is {name} here but {started} on node 0; every node "
                            f"must run the same cells in the same order.")
        _wait(store, f"{key}/done", FINISH_TIMEOUT_S, f"finish {name}", env)
        outcome = _decode(store.get(f"{key}/done"))
        store.set(f"{key}/ack{env.node_rank}", "1")
        if "error" in outcome:
            raise NodeError(f"node 0 failed {name}: {outcome['error']}")
        return outcome["result"]

    return run  # type: ignore[return-value]
