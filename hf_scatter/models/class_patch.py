"""Swapping a live module's class for a subclass that computes differently (where transformers has no hook).

A swap keeps the instance, its parameters and its hooks; only the methods change. Modules already wrapped
by accelerate (``device_map``) call ``module._old_forward``, a bound method of the old class: it is re-bound
so the hook calls the new forward and still moves tensors between devices.
"""

from __future__ import annotations

import types

from torch import nn


def _rebind_accelerate_forward(module: nn.Module) -> None:
    if "_old_forward" in module.__dict__:
        module._old_forward = types.MethodType(type(module).forward, module)


def swap_class(module: nn.Module, new_class: type) -> None:
    """Make ``module`` an instance of ``new_class`` (a subclass of its current class, adding no state)."""
    if type(module) is new_class:
        return
    if not issubclass(new_class, type(module)):
        raise TypeError(f"swap_class: {new_class.__name__} is not a subclass of {type(module).__name__}")
    module.__class__ = new_class
    _rebind_accelerate_forward(module)


def restore_class(module: nn.Module, vanilla_class: type) -> None:
    """Undo :func:`swap_class`: ``module`` becomes a plain ``vanilla_class`` again."""
    if type(module) is vanilla_class:
        return
    if not isinstance(module, vanilla_class):
        raise TypeError(f"restore_class: {type(module).__name__} is not a {vanilla_class.__name__}")
    module.__class__ = vanilla_class
    _rebind_accelerate_forward(module)


def apply_swaps(model: nn.Module, swaps) -> None:
    """For each ``(vanilla_class, our_class, on)``: every ``vanilla_class`` module in ``model`` becomes
    ``our_class`` when ``on``, and plain ``vanilla_class`` again when not."""
    for module in model.modules():
        for vanilla, ours, on in swaps:
            if isinstance(module, vanilla):
                if on:
                    swap_class(module, ours)
                else:
                    restore_class(module, vanilla)
