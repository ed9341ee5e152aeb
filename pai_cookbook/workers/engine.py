"""Megatron-Core's own inference stack as the generation and RL workers use it on every rank (a library beside them).

Each rank builds the model at the job's layout, loads the checkpoint (Megatron-Core reshards it), and
runs `StaticInferenceEngine` -> `TextGenerationController` -> `GPTInferenceWrapper` with a
`StaticInferenceContext` (the KV cache): one prefill forward over every prompt, then one forward of one
token per step. On the local paths (`DeviceInfo.layers`: a GPU without Transformer Engine, a CPU) prompts of
different lengths share a batch *left-padded* (`generate_batch`), as Hugging Face's batched `generate` does: each
row's positions count from 0 at its first real token and its padding is masked (`core.modeling.attention`'s
`left_padded_kv_cache` swap), so every row computes what it would alone, and every row samples from the first
step on. Megatron-Core's static batching right-pads instead: the longer prompts are fed one token a step
while the shorter rows sample, (longest - shortest) extra forward steps a batch (measured: 70 steps instead
of 64 for SmolLM2's 8 x 64 benchmark, docs/megatron-core-on-cpu.md); Transformer Engine's spec, upstream's
unchanged, generates that way. The RL worker samples its rollouts through `generate_batch` too. Every tensor the
controller makes for the model is made on the model's device.

The controller is subclassed only where Hugging Face semantics need something it lacks:
- repetition penalty (HF's rule: a seen token's logit divided by the penalty if positive, multiplied
  if negative; "seen" = prompt + generated so far, never padding), applied before temperature/top-k/p;
- logits of Megatron's vocabulary padding rows masked out (they are not tokens);
- several end-of-sequence ids (Llama 3 has two) and stop strings, which end a row early.
Sampling itself (temperature, top-k, top-p, greedy = top-k 1) is Megatron-Core's. Its generator is
reseeded per batch from (seed, batch index): every TP rank draws the same numbers from the same
gathered logits, and outputs do not depend on TP, PP or how batches are spread over DP ranks.

With `kv_cache=False` the wrapper recomputes the whole prefix at every step (the O(N^2) baseline the
benchmark compares against), through the same controller and sampler.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any

import torch

from pai_cookbook.core.configs.config import ParallelConfig
from pai_cookbook.core.configs.generation import GenerationConfig
from pai_cookbook.core.machine import runtime
from pai_cookbook.core.modeling.attention import LEFT_PADDING, left_padded_positions
from pai_cookbook.core.text.tokenizer import MegatronView

FINISH_EOS, FINISH_STOP, FINISH_LENGTH = "eos", "stop", "length"
BATCH_SEED_STRIDE = 1_000_003  # a prime above any batch count: distinct (seed, batch) -> distinct streams
# Pipeline-parallel inference on 0.16 splits a batch into micro-batches above this many batch x sequence
# tokens; -1 keeps one micro-batch (Megatron-LM's default threshold is 512). 0.17 on sends a batch whole.
_PP_MICROBATCH_TOKENS = 512


class NonFiniteLogits(RuntimeError):
    """The model's next-token logits hold NaN or Inf: nothing can be sampled from them."""


def _controller_class():
    from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController

    class CookbookController(TextGenerationController):
        """Megatron-Core's controller plus repetition penalty, vocabulary-padding mask, EOS ids, stops."""

        def configure(self, *, vocab_size: int, repetition_penalty: float, eos_ids: list[int],
                      stop: list[str], prompt_lengths: list[int], max_new_tokens: int,
                      track_logprobs: bool = False, left_padding: list[int] | None = None) -> None:
            """Settings for the next batch. `prompt_lengths`: each row's prompt as the engine sees it (with its
            padding); `left_padding`: how many of those tokens are padding (masked, never penalised)."""
            self.real_vocab, self.penalty, self.stop, self.max_new = vocab_size, repetition_penalty, stop, max_new_tokens
            self.eos = torch.tensor(eos_ids, dtype=torch.long)  # on the host: compared with `.cpu()` tokens
            self.prompt_lengths = prompt_lengths
            self.left_padding = None
            if left_padding and any(left_padding):  # read by the attention with the activations: the model's device
                self.left_padding = torch.tensor(left_padding, dtype=torch.long, device=self.model_device)
            setattr(self.inference_wrapped_model.inference_context, LEFT_PADDING, self.left_padding)
            self.finish = [FINISH_LENGTH] * len(prompt_lengths)
            # per sampling step, each row's log-probability of the token it sampled and the entropy of its
            # next-token distribution (the RL worker reads both; see `token_logprobs`)
            self.logprobs: list[torch.Tensor] | None = [] if track_logprobs else None
            self.entropies: list[torch.Tensor] | None = [] if track_logprobs else None

        @property
        def model_device(self) -> torch.device:
            return next(self.inference_wrapped_model.model.parameters()).device

        def pad_input_prompt_tokens(self, batch_prompt_tokens_list, padded_batch_size, padded_sequence_length):
            self.position = min(len(p) for p in batch_prompt_tokens_list)  # first sampled position
            self.tokens = super().pad_input_prompt_tokens(batch_prompt_tokens_list, padded_batch_size,
                                                          padded_sequence_length)
            return self.tokens  # updated in place by the controller as tokens are generated

        def sample_from_logits(self, last_token_logits, sampling_params=None, vocab_size=None, **kwargs):
            raw = last_token_logits.float()
            if not bool(torch.isfinite(raw[:, :self.real_vocab]).all()):  # else: torch.multinomial's own words
                raise NonFiniteLogits("the model's next-token logits hold NaN or Inf: its weights are broken (a "
                                      "diverged update or a damaged checkpoint), not the prompt")
            logits = raw.clone()
            logits[:, self.real_vocab:] = float("-inf")  # padding rows of the output layer
            if self.entropies is not None:
                self.entropies.append(entropy(raw[:, :self.real_vocab]).cpu())
            if self.penalty != 1.0:
                seen = self.tokens[:logits.shape[0], :self.position].to(logits.device)
                if self.left_padding is not None:  # padding is no token the row has seen: count its first real one
                    padding = self.left_padding.to(logits.device)
                    first = seen.gather(1, padding[:, None])
                    seen = torch.where(torch.arange(seen.shape[1], device=seen.device) < padding[:, None], first, seen)
                score = logits.gather(1, seen)
                score = torch.where(score < 0, score * self.penalty, score / self.penalty)
                logits.scatter_(1, seen, score)
            self.position += 1
            sampled = super().sample_from_logits(logits, sampling_params, vocab_size, **kwargs)
            if self.logprobs is not None:
                self.logprobs.append(token_logprobs(raw, sampled).cpu())
            return sampled

        def update_generation_status(self, updated_prompts_tokens, generation_started,
                                     current_context_end_position, is_generation_done_tensor,
                                     generated_sequence_lengths, termination_id=None):
            # As Megatron-Core's own rule (an end token ends a row and is not counted), for a set of
            # end ids; a stop string ends the row *after* counting the token that completed it.
            latest = updated_prompts_tokens[:, current_context_end_position].cpu()
            started, done = generation_started.cpu(), is_generation_done_tensor.cpu()
            # A row with a shorter prompt reaches its limit while longer prompts still run: it is done
            # ("length"), and what the batch samples for it afterwards (an end token, a stop) is not its.
            done = done | (started & (generated_sequence_lengths.cpu() >= self.max_new))
            hit_eos = torch.isin(latest, self.eos) & started & ~done
            done = done | hit_eos
            lengths = generated_sequence_lengths.cpu() + (~done & started).to(generated_sequence_lengths.dtype)
            for row in torch.nonzero(hit_eos).flatten().tolist():
                self.finish[row] = FINISH_EOS
            if self.stop:
                for row in torch.nonzero(started & ~done).flatten().tolist():
                    start = self.prompt_lengths[row]
                    text = self.tokenizer.detokenize(
                        updated_prompts_tokens[row, start:current_context_end_position + 1].tolist())
                    if any(s in text for s in self.stop):
                        done[row], self.finish[row] = True, FINISH_STOP
            device = is_generation_done_tensor.device
            return done.to(device), lengths.to(device).int()

    return CookbookController


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] of each row, over the whole output layer as the trainer's cross entropy
    normalises (its padding rows included), at temperature 1: the policy's own probability of the token.

    Written as logit - logsumexp rather than with `torch.log_softmax`, which Megatron-Core's
    `return_log_probs` uses: on CPU its fp32 kernel adds exp(logit - max) one by one, and a trained model's
    row (one logit near 10, tens of thousands of unused ones near -8, each under half an ulp of the running
    sum) loses up to 2.3e-4 nats over a 49,152-token vocabulary (docs/megatron-core-on-cpu.md). logsumexp's
    summation, like the trainer's cross entropy, stays within 1e-6 of float64.
    """
    logits = logits.float()
    return logits.gather(1, tokens.view(-1, 1).long()).squeeze(1) - torch.logsumexp(logits, -1)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's entropy (nats) of softmax(logits)."""
    logits = logits.float()
    log_p = logits - torch.logsumexp(logits, -1, keepdim=True)
    return -(log_p.exp() * log_p).sum(-1)


def _wrapper_class(kv_cache: bool):
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    class CountingWrapper(GPTInferenceWrapper):
        """Records the token count of every forward step (what the KV-cache test asserts on) and the seconds
        spent in them (the rest of a step is the controller's: sampling, bookkeeping)."""

        forward_lengths: list[int]
        forward_seconds: float = 0.0

        def prep_inference_input(self, prompts_tokens):
            batch = super().prep_inference_input(prompts_tokens)
            padding = getattr(self.inference_context, LEFT_PADDING, None)
            if padding is not None:  # positions from 0 at each row's first real token (learned position embeddings)
                batch["position_ids"] = left_padded_positions(padding, 0, batch["position_ids"].shape[1]).T
            return batch

        def run_one_forward_step(self, inference_input, recv_buffer_seq_len=None):
            self.forward_lengths.append(int(inference_input["tokens"].shape[1]))
            start = time.perf_counter()
            out = super().run_one_forward_step(inference_input, recv_buffer_seq_len)
            self.forward_seconds += time.perf_counter() - start
            return out

    class RecomputingWrapper(CountingWrapper):
        """No KV cache: every step runs the whole prefix again from position 0."""

        def get_batch_for_context_window(self, inference_input, context_start_position, context_end_position):
            return super().get_batch_for_context_window(inference_input, 0, context_end_position)

        def run_one_forward_step(self, inference_input, recv_buffer_seq_len=None):
            self.inference_context.reset()  # offsets back to 0: the cache is refilled, never reused
            return super().run_one_forward_step(inference_input, recv_buffer_seq_len)

    return CountingWrapper if kv_cache else RecomputingWrapper


def build_engine(gpt, model, tokenizer: MegatronView, config: GenerationConfig, max_sequence: int,
                 parallel: ParallelConfig, dtype: torch.dtype, device: runtime.DeviceInfo):
    """Megatron-Core's static engine over `gpt` (built for `device`), with the cookbook's controller and wrapper."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.engines import StaticInferenceEngine

    from pai_cookbook.core.machine import versions

    context = StaticInferenceContext(config.batch_size, max_sequence)
    wrapper = _wrapper_class(config.kv_cache)
    if versions.inference_wrapper_takes_config():
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig

        wrapper_config = InferenceWrapperConfig(
            hidden_size=model.hidden_size, params_dtype=dtype, padded_vocab_size=model.padded_vocab_size(
                parallel.tensor_model_parallel_size), inference_batch_times_seqlen_threshold=_PP_MICROBATCH_TOKENS,
            inference_max_requests=config.batch_size, inference_max_seq_length=max_sequence)
        wrapped = wrapper(gpt, wrapper_config, context)
    else:  # 0.17 on: the model's own config and the context say it all (and a PP batch is one micro-batch)
        wrapped = wrapper(gpt, context)
    wrapped.forward_lengths, wrapped.kv_cache = [], config.kv_cache
    controller = _controller_class()(wrapped, tokenizer)
    controller.device_info = device  # read by generate_batch (left padding) and decoding_weights
    # legacy=True: the batched static path, chosen on every release (docs/installing.md, "Inference"): the cookbook's
    # controller and left-padding swap are written for it, and the dynamic engine (what legacy=False starts from 0.16
    # on, falling back to this path with a warning where it cannot) needs CUDA memory pools and CUDA graphs.
    # `engine_record` says which path ran, from the engine's own flag.
    with warnings.catch_warnings(), inference_mode():
        warnings.filterwarnings("ignore", message="The static engine will be deprecated")  # recorded instead
        return StaticInferenceEngine(controller, max_batch_size=config.batch_size, legacy=True)


@contextlib.contextmanager
def inference_mode():
    """Megatron-Core's process-wide "an engine is using the model" flag (`InferenceMode`, 0.18 on), set for the
    duration of a generation only. The static engine sets it when it is built and never clears it, and a model
    forward under it refuses what training does (logits left split over TP: "Inference must always gather TP
    logits"), so the RL worker, which trains the very model it samples from, would fail at its first update."""
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:  # 0.16, 0.17: no such flag
        yield
        return
    was = InferenceMode.is_active()
    InferenceMode.set_active()
    try:
        yield
    finally:
        if not was:
            InferenceMode.unset_active()


def engine_record(engine) -> dict[str, Any]:
    """Which inference engine and path ran a generation, as every generation result records it (`result["engine"]`,
    beside `result["layers"]`): Megatron-Core's release, the engine class, its path (`engine.legacy`: the static
    batching path, or the dynamic engine the static one runs underneath), how a batch is padded, and the KV cache."""
    from pai_cookbook.core.machine import versions

    wrapped = engine.controller.inference_wrapped_model
    return {"megatron_core": str(versions.megatron_core_version()), "engine": type(engine).__name__,
            "path": "static batching (legacy=True)" if engine.legacy else "dynamic engine (under the static one)",
            "padding": "left" if left_pads(engine) else "right", "kv_cache": wrapped.kv_cache}


def left_pads(engine) -> bool:
    """Whether `engine` left-pads a batch: on the local paths' layers, whose self-attention is the `left_padded_kv_cache`
    swap. Transformer Engine's spec is upstream's, and multi-latent attention rotates its keys inside its own
    projection (no swap reaches there): both right-pad as Megatron-Core's static batching does, which computes the same
    tokens (each row's prompt fed whole before it samples) in (longest - shortest prompt) more steps."""
    controller = engine.controller
    return (not controller.device_info.transformer_engine
            and not controller.inference_wrapped_model.model.config.multi_latent_attention)


def decoding_weights(engine, rows: int) -> contextlib.AbstractContextManager[int]:
    """Around a job's (or a rollout's) generation: oneDNN's packed weights on the CPU path
    (`core.machine.build.CPU_CONVERTERS["onednn_decode_packing"]`), nothing on the others. Yields how many weights were
    packed."""
    if not engine.controller.device_info.cpu_converters:
        return contextlib.nullcontext(0)
    from pai_cookbook.cpu import linear

    return linear.packed_for_decoding(engine.controller.inference_wrapped_model.model, rows)


def generate_batch(engine, prompts: list[list[int]], params, **settings: Any) -> list:
    """One static batch through `engine`: `prompts` left-padded to the longest where the engine's layers left-pad
    (the padding is masked and each row's positions start at its first real token; see the module), else as they
    are (Megatron-Core right-pads), the controller configured with `settings` (its `configure` keywords but the
    prompts'). Returns the engine's finished requests, in prompt order; their `generated_tokens` are the new tokens
    alone."""
    from megatron.core.inference.inference_request import InferenceRequest

    if left_pads(engine):
        width = max(map(len, prompts))
        padding = [width - len(p) for p in prompts]
        engine.controller.configure(prompt_lengths=[width] * len(prompts), left_padding=padding, **settings)
    else:
        padding = [0] * len(prompts)
        engine.controller.configure(prompt_lengths=[len(p) for p in prompts], **settings)
    # The padding's token id is never seen (masked in attention, skipped by the repetition penalty): 0 is in
    # every vocabulary.
    requests = [InferenceRequest(request_id=engine.get_new_request_id(), prompt="", prompt_tokens=[0] * pad + list(p),
                                 sampling_params=params) for p, pad in zip(prompts, padding)]
    with inference_mode():
        return list(engine.generate(inference_requests=requests))
