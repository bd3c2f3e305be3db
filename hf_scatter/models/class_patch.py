"""Swapping a live module's class for a subclass that computes differently (where transformers has no hook),
and methods given to one instance.

A swap keeps the instance, its parameters and its hooks; only the methods change. Modules already wrapped
by accelerate (``device_map``) call ``module._old_forward``, a bound method of the old class: it is re-bound
so the hook calls the new forward and still moves tensors between devices.

Where one instance computes differently and its class must stay (the causal LM's fused-loss forward: its
class names the checkpoint's architecture), the method goes into the instance's ``__dict__`` as an
:class:`InstanceMethod`. A plain bound method there would be a reference cycle (module -> method ->
module): ``del model`` would then leave its memory, GPU memory included, to the garbage collector, and
``torch.save(model)`` would pickle the method as a lookup of itself.
"""

from __future__ import annotations

import inspect
import types
import weakref

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


def vanilla_class(cls: type) -> type:
    """The class a swapped-in subclass computes differently from: the base right after the first class in
    ``cls``'s MRO that defines ``hf_scatter_impl`` (an engine such as FSDP2 may subclass the swapped class again)."""
    mro = cls.__mro__
    ours = next(i for i, c in enumerate(mro) if "hf_scatter_impl" in c.__dict__)
    return mro[ours + 1]


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


class InstanceMethod:
    """``func`` bound to ``module`` through a weak reference (see the module docstring). Calls, signature
    (without ``self``: what ``inspect.signature(module.forward)`` shows the Trainer), ``__func__`` and
    ``__self__`` behave as a bound method's; it pickles as (``func``, ``module``), ``func`` by its name."""

    __slots__ = ("__func__", "_module", "__weakref__")

    def __init__(self, func, module: nn.Module):
        self.__func__ = func
        self._module = weakref.ref(module)

    @property
    def __self__(self) -> nn.Module:
        return self._module()

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(types.MethodType(self.__func__, self._module()))

    @property
    def __name__(self) -> str:
        return self.__func__.__name__

    def __call__(self, *args, **kwargs):
        return self.__func__(self._module(), *args, **kwargs)

    def __reduce__(self):
        return InstanceMethod, (self.__func__, self._module())


def set_instance_method(module: nn.Module, name: str, func) -> None:
    """``module.<name>`` calls ``func(module, ...)``, for this instance only, without a reference cycle."""
    module.__dict__[name] = InstanceMethod(func, module)
