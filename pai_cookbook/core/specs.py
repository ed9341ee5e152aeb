"""Editing a Megatron-Core module spec in place: what the layer choices (`core.layer_spec`) and the CPU converters
(`pai_cookbook.cpu`) share, below both of them."""

from __future__ import annotations


def swap_classes(spec, swapped: dict[type, type]) -> None:
    """Replace every module class in a layer or block spec (submodules and experts included) that is a key of
    `swapped` with its value, in place."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    def walk(node, seen):
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, ModuleSpec):
            if node.module in swapped:
                node.module = swapped[node.module]
            walk(node.submodules, seen)
        elif isinstance(node, type):  # a class is a leaf (a dataclass *class* is not a submodules instance)
            return
        elif hasattr(node, "__dataclass_fields__"):
            for name in node.__dataclass_fields__:
                value = getattr(node, name)
                if isinstance(value, type) and value in swapped:
                    setattr(node, name, swapped[value])
                else:
                    walk(value, seen)
        elif isinstance(node, (list, tuple)):
            for item in node:
                walk(item, seen)

    walk(spec, set())
