"""Megatron-Core's distributed checkpoint layout as the conversions read and write it without building the model:
every stored chunk of every parameter (`chunk_layout`, from a meta-device model's own sharded state dict), the chunks
a checkpoint's metadata lacks, and each parameter read whole from a torch_dist checkpoint, one at a time
(`iter_megatron_params`). A library beside the conversion worker."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.configs.config import ModelConfig, ParallelConfig, PrecisionConfig


def meta_model(model: ModelConfig, dtype: torch.dtype, head: str = "lm"):
    """The TP=1/PP=1 GPTModel on the meta device: every name, shape and chunk layout, no memory.

    Built for the host on any machine (a meta tensor cannot move to a GPU); its checkpoint keys are those of
    the Transformer Engine spec too, which Megatron-Core's local spec maps its norms to
    (`sharded_state_dict_keys_map`), so a GPU run with TE loads what this layout writes."""
    from pai_cookbook.core.machine.runtime import host_device
    from pai_cookbook.workers.models import build_model

    precision = PrecisionConfig(dtype=checkpoint.DTYPE_NAMES[dtype])
    with torch.device("meta"):
        (gpt,) = build_model(model, ParallelConfig(), precision, host_device(), seed=0, head=head, initialize=False)
    return gpt


@dataclass(frozen=True)
class Chunk:
    """One stored piece of one Megatron parameter, as Megatron-Core's own save would lay it out."""

    param: str
    """Megatron parameter name (TP=1)."""
    key: str
    """Checkpoint key; layers (and experts) are stacked along leading axes of one tensor."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    """Where the chunk sits in the stacked global tensor."""
    view: tuple[tuple[int, ...], tuple[int, ...], int]
    """(size, stride, storage offset) of the chunk inside the parameter (SwiGLU fc1 has two chunks)."""


def chunk_layout(model: ModelConfig, dtype: torch.dtype, head: str = "lm"
                 ) -> tuple[list[Chunk], dict[str, Any], dict[str, torch.Size]]:
    """Every chunk of the checkpoint of `model`, the PyTorch-DCP state dict that describes them, and the shape of
    every parameter.

    Taken from a meta-device model's `sharded_state_dict()` with factories applied, so keys, stacking
    and the SwiGLU gate/up split are exactly Megatron-Core's.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.strategies.torch import (
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    gpt = meta_model(model, dtype, head)
    state = gpt.sharded_state_dict()
    # the parameters, and the buffers a checkpoint stores (the router's expert bias)
    shapes = {n: p.shape for n, p in gpt.named_parameters()} | {n: b.shape for n, b in gpt.named_buffers() if n in state}
    apply_factories(state)
    chunks = []
    for param, value in state.items():
        for sh in nested_values({param: value}):
            if isinstance(sh, ShardedTensor):
                sizes = (1,) * sh.prepend_axis_num + tuple(sh.data.shape)
                chunks.append(Chunk(param, sh.key, tuple(sh.global_offset), sizes,
                                    (tuple(sh.data.size()), tuple(sh.data.stride()), sh.data.storage_offset())))
    sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(state)
    return chunks, mcore_to_pyt_state_dict(sharded, is_loading=False), shapes


def unwritten_chunks(chunks: list[Chunk], metadata) -> list[Chunk]:
    """The chunks a DCP checkpoint's metadata has no stored location for."""
    stored = {(index.fqn, tuple(index.offset or ())) for index in metadata.storage_data}
    return [c for c in chunks if (c.key, tuple(c.offsets)) not in stored]


def region_planner(regions: dict[str, tuple[str, tuple[int, ...]]]):
    """A DCP load planner that reads given regions of stored tensors into the state dict's tensors.

    regions: state-dict key -> (checkpoint key, offsets of the region); the region's size is the tensor's.
    """
    import dataclasses as dc

    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RegionPlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            items = []
            for name, tensor in self.state_dict.items():
                key, offsets = regions[name]
                wanted = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.size())
                for item in create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [wanted]):
                    dest = MetadataIndex(name, item.dest_index.offset, item.dest_index.index)
                    items.append(dc.replace(item, dest_index=dest))
            return LoadPlan(items)

        def resolve_tensor(self, read_item):
            # dest_offsets are relative to the requested region, i.e. to our tensor.
            target = self.state_dict[read_item.dest_index.fqn]
            for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                target = target.narrow(dim, start, length)
            return target

    return RegionPlanner()


class FileSlice(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a file of their own: what `torch.load` reads a DCP item
    from (it reads the item's storage straight into the tensor it creates, `readinto`)."""

    def __init__(self, file, offset: int, length: int):
        super().__init__()
        self.file, self.offset, self.length, self.pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence] + pos
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.file.seek(self.offset + self.pos)
        got = self.file.readinto(memoryview(buffer).cast("B")[:n])
        self.pos += got
        return got


def whole_items(metadata) -> dict[tuple[str, tuple[int, ...], tuple[int, ...]], Any]:
    """(key, offsets, sizes) -> storage location of every stored tensor chunk kept as one plain DCP item."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    items = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for chunk in md.chunks:
                info = metadata.storage_data.get(MetadataIndex(key, chunk.offsets))
                if info is not None and not getattr(info, "transform_descriptors", None):
                    items[key, tuple(chunk.offsets), tuple(chunk.sizes)] = info
    return items


def iter_megatron_params(ckpt: Path, model: ModelConfig, dtype: torch.dtype, head: str = "lm"):
    """Yield (Megatron name, whole tensor) from a torch_dist checkpoint, one parameter in memory at a time.

    A parameter whose chunks are stored as they are wanted (what `write_megatron` and any one-process save
    write) is read item by item, each with one `torch.load` of its bytes and no further copy when it is the
    whole parameter. Otherwise (a checkpoint saved at TP/PP/EP > 1 splits it across ranks' items) its chunks
    are read as regions of the stacked tensors with a DCP load, which assembles the pieces. Either way chunks
    are placed by the view geometry the writer used: the exact inverse of `write_megatron`.
    """
    from torch.distributed.checkpoint import FileSystemReader, load

    chunks, _, shapes = chunk_layout(model, dtype, head)
    reader = FileSystemReader(str(ckpt))
    whole = whole_items(reader.read_metadata())
    by_param: dict[str, list[Chunk]] = {}
    for chunk in chunks:
        by_param.setdefault(chunk.param, []).append(chunk)
    files: dict[str, Any] = {}
    try:
        for name, param_chunks in by_param.items():
            want = stored_dtype(name, dtype)  # the expert bias is stored in fp32 whatever the model's dtype
            stored = [whole.get((c.key, c.offsets, c.sizes)) for c in param_chunks]
            if all(stored):
                pieces = []
                for info in stored:
                    if info.relative_path not in files:
                        files[info.relative_path] = open(Path(ckpt) / info.relative_path, "rb")  # noqa: SIM115
                    piece = torch.load(FileSlice(files[info.relative_path], info.offset, info.length),
                                       map_location="cpu", weights_only=True)
                    pieces.append(piece.to(want))
                if len(param_chunks) == 1 and param_chunks[0].view == whole_view(shapes[name]):
                    yield name, pieces[0].view(shapes[name])
                    continue
                full = torch.empty(shapes[name], dtype=want)
                for c, piece in zip(param_chunks, pieces):
                    full.as_strided(*c.view).copy_(piece.reshape(c.view[0]))
                yield name, full
                continue
            full = torch.empty(shapes[name], dtype=want)
            # A chunk that is a contiguous block of the parameter (fc1's gate and up halves too) is read straight
            # into it; any other is read aside and placed.
            places = [full.as_strided(*c.view) for c in param_chunks]
            state = {f"chunk{i}": place.view(c.sizes) if place.is_contiguous() else torch.empty(c.sizes, dtype=want)
                     for i, (c, place) in enumerate(zip(param_chunks, places))}
            regions = {f"chunk{i}": (c.key, c.offsets) for i, c in enumerate(param_chunks)}
            load(state, storage_reader=FileSystemReader(str(ckpt)), planner=region_planner(regions))
            for i, place in enumerate(places):
                if not place.is_contiguous():
                    place.copy_(state[f"chunk{i}"].reshape(place.shape))
            yield name, full
    finally:
        for file in files.values():
            file.close()


FP32_BUFFERS = ("expert_bias",)
"""Checkpointed buffers kept in fp32 whatever the model's dtype: Megatron-Core's router expert bias
(`TopKRouter._maintain_float32_expert_bias`), as transformers keeps DeepSeek-V3's e_score_correction_bias."""


def stored_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a checkpoint of a `dtype` model stores the tensor `name` in."""
    return torch.float32 if name.endswith(FP32_BUFFERS) else dtype


def whole_view(shape: torch.Size) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(size, stride, storage offset) of a whole contiguous tensor of `shape`."""
    return tuple(shape), torch.empty(shape, device="meta").stride(), 0
