"""Editing a Megatron-Core module spec in place: what the layer choices (`core.modeling.layer_spec`) and the CPU converters
(`pai_cookbook.cpu`) share, below both of them.

A spec is a tree of `ModuleSpec`s, submodules dataclasses, lists and classes; from Megatron-Core 0.18 on some of its
nodes are builders instead, `functools.partial(SomeClass, submodules=...)` or `partial(SomeClass.as_mlp_submodule,
...)` (the MLP and MoE layers, the experts). `swap_classes` walks every form, so the cookbook's swaps read the same on
each release (docs/megatron-core-on-cpu.md, "per release").
"""

from __future__ import annotations

import functools
from typing import Any


def swap_classes(spec, swapped: dict[type, type]) -> None:
    """Replace every module class in a layer or block spec (submodules, experts and builders included) that is a key
    of `swapped` with its value, in place. A builder is rebuilt around the swapped class (a partial cannot be edited)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    done: dict[int, Any] = {}

    def walk(node):
        if id(node) in done:
            return done[id(node)]
        done[id(node)] = node  # a cycle or a shared node is walked once
        if isinstance(node, type):  # a class is a leaf (a dataclass *class* is not a submodules instance)
            new = swapped.get(node, node)
        elif isinstance(node, functools.partial):
            new = _swap_builder(node, walk, swapped)
        elif isinstance(node, ModuleSpec) or hasattr(node, "__dataclass_fields__"):
            names = ("module", "submodules") if isinstance(node, ModuleSpec) else node.__dataclass_fields__
            for name in names:
                value = getattr(node, name)
                if (changed := walk(value)) is not value:
                    setattr(node, name, changed)
            new = node
        elif isinstance(node, list):
            for i, item in enumerate(node):
                node[i] = walk(item)
            new = node
        elif isinstance(node, tuple):
            new = type(node)(walk(item) for item in node) if not hasattr(node, "_fields") else node
        else:
            new = node
        done[id(node)] = new
        return new

    walk(spec)


def _swap_builder(builder: functools.partial, walk, swapped: dict[type, type]) -> functools.partial:
    """`partial(cls, ...)` or `partial(cls.method, ...)` with `cls` swapped and its arguments walked."""
    func = builder.func
    owner = getattr(func, "__self__", None)  # a classmethod bound to its class: MLP.as_mlp_submodule
    if isinstance(func, type):
        new_func = walk(func)
    elif isinstance(owner, type) and owner in swapped:
        new_func = getattr(swapped[owner], func.__name__)
    else:
        new_func = func
    args = tuple(walk(a) for a in builder.args)
    keywords = {k: walk(v) for k, v in builder.keywords.items()}
    unchanged = (new_func is func and all(a is b for a, b in zip(args, builder.args))
                 and all(keywords[k] is v for k, v in builder.keywords.items()))
    return builder if unchanged else functools.partial(new_func, *args, **keywords)


def builder_class(node) -> type | None:
    """The module class a spec node builds: a `ModuleSpec`'s module, a class, or a builder's class (see the module)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(node, ModuleSpec):
        node = node.module
    if isinstance(node, functools.partial):
        node = node.func
        node = getattr(node, "__self__", node)
    return node if isinstance(node, type) else None


def submodules_of(node):
    """The submodules a spec node builds with: a `ModuleSpec`'s or a builder's `submodules` keyword (None if none)."""
    if isinstance(node, functools.partial):
        return node.keywords.get("submodules")
    return getattr(node, "submodules", None)
