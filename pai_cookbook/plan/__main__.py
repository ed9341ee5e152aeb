"""`python -m pai_cookbook.plan --model Llama-3-8B --gpus-per-node 8 --nodes 1 --gpu H100-80GB --seq-length 4096
--global-batch 256 --tokens 1e11`: the layouts that fit, fastest first, each term of memory and time shown."""

from __future__ import annotations

import argparse
import sys

from pai_cookbook.core.configs.model_config import ConfigError
from pai_cookbook.core.machine.build import LOCAL_LAYERS, TE_LAYERS
from pai_cookbook.plan import search
from pai_cookbook.plan.hardware import GPUS, Cluster, gpu
from pai_cookbook.plan.layouts import Workload
from pai_cookbook.plan.memory import FRAMEWORK_OVERHEAD_GIB
from pai_cookbook.plan.search import plan, table
from pai_cookbook.plan.shapes import SHAPES, model_shape


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pai_cookbook.plan", description=__doc__)
    parser.add_argument("--model", required=True, help=f"one of {sorted(SHAPES)}, or a Hugging Face folder")
    parser.add_argument("--gpu", default="H100-80GB", help=f"one of {sorted(GPUS)}")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--seq-length", type=int, required=True)
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--tokens", type=float, default=None, help="training tokens, for the days column")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--layers", default=TE_LAYERS, choices=(TE_LAYERS, LOCAL_LAYERS),
                        help="the layer path the run builds: Transformer Engine's spec (GPU images with TE) or the local "
                             "spec (no TE; what the cookbook's CPU memory check measures)")
    parser.add_argument("--moe-imbalance", type=float, default=1.0,
                        help="MoE: the busiest expert-parallel rank's routed tokens over the mean (1.0: balanced); "
                             "pai_cookbook.moe.ep_imbalance measures it from a run's router figures")
    parser.add_argument("--overhead-gib", type=float, default=FRAMEWORK_OVERHEAD_GIB)
    parser.add_argument("--top", type=int, default=15, help="rows shown")
    args = parser.parse_args(argv)
    try:
        if args.tokens is not None and not args.tokens > 0:
            raise ConfigError(f"--tokens {args.tokens:g}: the training tokens must be > 0 (1e11 is 100 B tokens).")
        if not 0 <= args.overhead_gib < float("inf"):  # nan fails both comparisons
            raise ConfigError(f"--overhead-gib {args.overhead_gib:g}: the memory a framework holds beside the model "
                              f"must be a finite number of GiB >= 0 (default {FRAMEWORK_OVERHEAD_GIB:g}); a negative one "
                              f"would count layouts that do not fit as fitting.")
        for flag in ("gpus_per_node", "nodes", "top"):
            if getattr(args, flag) < 1:
                raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1.")
        model = model_shape(args.model)
        cluster = Cluster(gpu=gpu(args.gpu), gpus_per_node=args.gpus_per_node, nodes=args.nodes)
        workload = Workload(seq_length=args.seq_length, global_batch_size=args.global_batch, dtype=args.dtype,
                            layers=args.layers, moe_imbalance=args.moe_imbalance)
        options = plan(model, cluster, workload, args.overhead_gib)
    except (ConfigError, FileNotFoundError) as err:  # a folder without config.json among them
        print(f"error: {err}", file=sys.stderr)
        return 2
    fitting = sum(o.fits for o in options)
    routing = "balanced" if args.moe_imbalance == 1 else f"{args.moe_imbalance:g}x the mean on the busiest rank"
    print(f"{args.model} on {cluster.nodes} x {cluster.gpus_per_node} {cluster.gpu.name}, {args.layers} layers: "
          f"{len(options)} valid layouts, {fitting} fit in {cluster.gpu.memory_gib} GiB (MFU {cluster.gpu.mfu_for(model):.3f}: "
          f"{cluster.gpu.mfu_source}); speeds within {search.TIED_WITHIN:.0%} of each other are a tie"
          + (f"; MoE routing {routing} (--moe-imbalance)" if model.is_moe else ""))
    print(table(options, args.tokens, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
