"""Plan a training run before launching it: for a model, a cluster, a sequence length and a global batch, every valid
layout with its predicted peak memory per GPU (term by term) and step time, ranked (notebook 09, docs/planning.md).

- `plan.shapes`: named model shapes, or a Hugging Face folder;
- `plan.hardware`: GPUs (memory, datasheet peak, links, calibrated MFU) and clusters;
- `plan.layouts`: `Layout`, `Workload` and the valid layouts (by `RunConfig.validate`);
- `plan.states`, `plan.activations`, `plan.memory`: the memory model, checked against `core.measures.memory_probe`;
- `plan.speed`: step time from the training log's FLOP count, calibrated MFU and communication terms;
- `plan.search`: rank the layouts that fit; `python -m pai_cookbook.plan` prints them;
- `plan.explain`: what notebook 09 shows of a plan (tables, memory bars, why the fastest wins).
"""
