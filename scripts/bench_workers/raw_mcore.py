"""A minimal raw Megatron-Core training loop (the shape of Megatron-LM's run_simple_mcore_train_loop):
GPTModel + torch Adam + get_forward_backward_func, no DDP wrapper, no Megatron optimizer, no logging.
Run by scripts/benchmark_train.py under torchrun; prints the median step time in seconds."""

import json
import statistics
import sys
import time

import torch

from pai_cookbook.core.configs.config import RunConfig
from pai_cookbook.core.machine import runtime
from pai_cookbook.workers.models import build_model


def main(config_path: str, steps: str) -> None:
    config = RunConfig.load(config_path)
    device = runtime.init_distributed(config.parallel, config.seed)  # gloo + the CPU layer, as any CPU run needs
    from megatron.core.pipeline_parallel import get_forward_backward_func

    (model,) = build_model(config.model, config.parallel, config.precision, device, config.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.optimizer.lr)
    d = config.data
    tokens = torch.randint(0, config.model.vocab_size, (d.micro_batch_size, d.seq_length + 1),
                           generator=torch.Generator().manual_seed(0))
    positions = torch.arange(d.seq_length).unsqueeze(0).expand(d.micro_batch_size, -1)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach().clone()}

    def forward_step(iterator, model):
        batch = next(iterator)
        return model(batch[:, :-1], positions, attention_mask=None, labels=batch[:, 1:]), loss_func

    micro = d.global_batch_size // d.micro_batch_size
    times = []
    for _ in range(int(steps)):
        start = time.perf_counter()
        optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens] * micro), model=model,
                                    num_microbatches=micro, seq_length=d.seq_length, micro_batch_size=d.micro_batch_size,
                                    forward_only=False)
        optimizer.step()
        times.append(time.perf_counter() - start)
    print(json.dumps({"median_step_s": statistics.median(times[2:])}), flush=True)
    runtime.destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
