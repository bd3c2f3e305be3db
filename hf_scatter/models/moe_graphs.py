"""MoE blocks of a training step replayed as CUDA graphs (opt-in: ``patch_model(model, moe_graphs=True)``).

A patched training step is bound by host time: the GPU finishes an MoE block's kernels faster than Python
issues its router, routing sort and expert kernels (about 20 launches and 40 torch ops per layer, forward
and backward). Here every MoE block's forward and backward is captured once and then replayed as one graph
launch each way.

Capture: at the first eligible call of the first block, every block is warmed up and captured into one
memory pool, in the order a step runs them (forward 0..n-1, then backward n-1..0), so the pool reuses
memory across layers as eager execution does and peak memory stays the eager one. That shared pool is why
replays must keep that order: forward ``i`` right after forward ``i-1`` of the same step (or ``i == 0``
with no backward outstanding), backward in reverse. Anything else runs eagerly, with the same result: a
call out of order, another input shape or dtype (only the first one seen is captured: the pool holds a
step's activations), eval mode, ``no_grad``, autocast, gradient checkpointing, router jitter, module
hooks (transformers' inactive output recorders excepted), ``torch.compile``, an outer capture, or CPU.
A backward that would replay out of order (``retain_graph`` twice, or an interleaving no step makes)
raises instead of corrupting gradients.

Parameter gradients are not copied out of the pool: each replay's gradient tensors become the parameters'
``.grad`` (autograd takes a gradient it is handed alone rather than copying it), so the blocks' gradients
exist once (a 16-layer Qwen3-MoE-style model's experts: 2.25 GiB that a copy would double). Their memory
is where the next step's replays write, so before its first replay a ``.grad`` still holding the last
step's gradient (accumulation over micro-batches, ``zero_grad(set_to_none=False)``) is moved out, and a
gradient kept anywhere else (a reference taken before ``zero_grad``) is an error naming the fix, not a
silent overwrite.
"""

from __future__ import annotations

import copy
import gc
import warnings
import weakref
from typing import Callable

import torch
from torch import nn

from .class_patch import set_instance_method
from .sharding import sharded_by

_ATTR = "_hf_scatter_moe_graphs"  # block.__dict__ entry: (MoEGraphs, index)
IMPL = "CUDA-graph replay of training steps (moe_graphs)"
_WARMUPS = 3  # eager fwd+bwd per block before capture: autotuning and lazy CUDA initialisation happen here
_RECAPTURES = 2  # parameter moves (model.to, load_state_dict(assign=True)) tolerated before graphs give up
_MISMATCH_WARNING = 8  # eager calls for other input shapes before a warning says why graphs are not used


def _output_recorder_only(module: nn.Module) -> bool:
    """Whether ``module``'s hooks are only transformers' output recorders, and none of them records now
    (their collector is inactive, or asks for nothing a MoE block produces)."""
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values(), *module._backward_hooks.values(),
             *module._backward_pre_hooks.values()]
    if not hooks:
        return True
    if any(getattr(h, "__name__", "") != "output_capturing_hook" for h in hooks):
        return False
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return False
    collected = _active_collector.get()
    return collected is None or "router_logits" not in collected


def _sharding_warning(engine: str) -> str:
    return (f"hf_scatter: moe_graphs turned off: the model's parameters are sharded by {engine}, which gathers them "
            "into new memory every step, and a CUDA graph replays fixed addresses; the blocks run eagerly.")


def _global_hooks() -> bool:
    m = torch.nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)


class _Pending:
    """Alive while a replayed forward's autograd node is: a graph dropped without backward frees it."""

    __slots__ = ("__weakref__",)


class _Captured:
    """One input signature's graphs for every block, sharing one memory pool, and the replay order state."""

    def __init__(self, blocks: list[nn.Module], forward: Callable, sample: torch.Tensor):
        self.signature = _signature(sample)
        self.params = [tuple(p for p in b.parameters() if p.requires_grad) for b in blocks]
        self.param_state = [_param_state(b) for b in blocks]
        self.static_in = [sample.detach().clone().requires_grad_(sample.requires_grad) for _ in blocks]
        grad_inputs = [((x,) if x.requires_grad else ()) + p for x, p in zip(self.static_in, self.params)]
        n = len(blocks)

        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(n):
                for _ in range(_WARMUPS):
                    out = forward(i, self.static_in[i])
                    torch.autograd.grad(out, grad_inputs[i], torch.ones_like(out), allow_unused=True)
                del out
        torch.cuda.synchronize()

        pool = torch.cuda.graph_pool_handle()
        self.forward_graphs, self.static_out = [], []
        for i in range(n):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = forward(i, self.static_in[i])
            self.forward_graphs.append(graph)
            self.static_out.append(out)
        # One incoming-gradient buffer serves every block: backward replays run one after another.
        shared = torch.empty_like(self.static_out[0])
        self.static_dout = [shared if _signature(o) == _signature(shared) else torch.empty_like(o)
                            for o in self.static_out]
        self.backward_graphs: list = [None] * n
        self.static_grads: list = [None] * n
        for i in reversed(range(n)):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                grads = torch.autograd.grad(self.static_out[i], grad_inputs[i], self.static_dout[i],
                                            allow_unused=True)
            self.backward_graphs[i] = graph
            self.static_grads[i] = grads
        self.static_out = [o.detach() for o in self.static_out]
        first = 1 if sample.requires_grad else 0  # static_grads[i]: (dx,) + parameter gradients
        self.param_grads = [tuple(grads[first:]) for grads in self.static_grads]
        self.grad_refs = [tuple(_storage_refs(g) for g in grads) for grads in self.param_grads]  # none handed out
        torch.cuda.synchronize()
        self.next_forward = 0
        self.outstanding: dict[int, weakref.ref] = {}
        self.replays = 0

    def _live(self) -> dict[int, weakref.ref]:
        self.outstanding = {i: ref for i, ref in self.outstanding.items() if ref() is not None}
        return self.outstanding

    def may_forward(self, i: int) -> bool:
        live = self._live()
        if i == 0:
            return not live
        return i == self.next_forward and (i - 1) in live

    def begin_forward(self, i: int) -> _Pending:
        if i == 0:
            self._reclaim_grads()
        token = _Pending()
        self.outstanding[i] = weakref.ref(token)
        self.next_forward = i + 1
        return token

    def begin_backward(self, i: int) -> None:
        live = self._live()
        if i not in live or i != max(live):
            raise RuntimeError(
                "hf_scatter: the CUDA graphs of the MoE blocks replay backward once per forward and in reverse "
                f"layer order, but block {i}'s backward came {'again' if i not in live else 'out of order'}. "
                "Patch without moe_graphs (patch_model(model, moe_graphs=False)) for retain_graph or "
                "interleaved backward passes.")
        del self.outstanding[i]

    def _reclaim_grads(self) -> None:
        """Before a step's first replay, gradients of the last one that are still alive move out of the pool:
        a block's gradient buffers may share memory with another block's or a forward's scratch space
        (captured earlier, when that memory was free), so any replay may overwrite them. A parameter's
        ``.grad`` (the first term of an accumulated sum) gets a copy; a reference held anywhere else cannot
        be moved, and is an error rather than a silent rewrite."""
        pairs = [(p, g, refs) for params, grads, counts in zip(self.params, self.param_grads, self.grad_refs)
                 for p, g, refs in zip(params, grads, counts) if g is not None and _storage_refs(g) > refs]
        if not pairs:
            return
        held = None
        for param, grad, _ in pairs:
            held = param.grad
            if held is not None and held.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr():
                with torch.no_grad():
                    held.set_(held.clone())
        del held
        for _, grad, refs in pairs:
            if _storage_refs(grad) > refs:
                gc.collect()  # a reference cycle that is garbage already
            if _storage_refs(grad) > refs:
                raise RuntimeError(
                    "hf_scatter: a gradient of an earlier step of the moe_graphs blocks is still referenced "
                    f"(a tensor of shape {list(grad.shape)} kept after zero_grad?). With moe_graphs the blocks' "
                    "gradients live in the CUDA graphs' memory, which this step's replays overwrite. Keep a copy "
                    "instead (p.grad.clone()), or patch without moe_graphs (patch_model(model, moe_graphs=False)).")


def _storage_refs(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) share ``t``'s memory: torch's own liveness test for CUDA-graph
    outputs (``torch.compile``'s graph trees ask the same)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _signature(x: torch.Tensor) -> tuple:
    return tuple(x.shape), x.dtype, x.device, x.requires_grad


def _param_state(block: nn.Module) -> tuple:
    return tuple((p.data_ptr(), p.dtype, p.requires_grad) for p in block.parameters())


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, captured: _Captured, i: int, block: nn.Module, x: torch.Tensor, *params):
        ctx.pending = captured.begin_forward(i)
        ctx.captured, ctx.i, ctx.x_is_leaf, ctx.block = captured, i, x.is_leaf, block
        static_in = captured.static_in[i]
        if static_in.data_ptr() != x.data_ptr():
            static_in.copy_(x)
        captured.forward_graphs[i].replay()
        captured.replays += 1
        return captured.static_out[i].detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        captured, i = ctx.captured, ctx.i
        captured.begin_backward(i)
        if _param_state(ctx.block) != captured.param_state[i]:
            raise RuntimeError(
                "hf_scatter: the MoE block's parameters moved between its replayed forward and its backward "
                "(an engine that gathers parameters per pass?); the captured backward would read stale memory. "
                "Patch without moe_graphs (patch_model(model, moe_graphs=False)).")
        static_dout = captured.static_dout[i]
        if static_dout.data_ptr() != dout.data_ptr():
            static_dout.copy_(dout)
        captured.backward_graphs[i].replay()
        grads = list(captured.static_grads[i])
        dx = grads.pop(0) if captured.static_in[i].requires_grad else None
        # dx is read by the layer below before any other replay, so it is handed over in place unless x is a
        # leaf (its .grad would outlive the pool's next use by another block). Parameter gradients are handed
        # over in place too; the next step's first replay moves out any still alive (_reclaim_grads).
        if dx is not None:
            dx = dx.clone() if ctx.x_is_leaf else dx.detach()
        return (None, None, None, dx, *(g.detach() if g is not None else None for g in grads))


class MoEGraphs:
    """A model's MoE blocks in run order and their captured graphs (one input signature)."""

    def __init__(self, blocks: list[nn.Module], layers: list[nn.Module], uses_rng: Callable[[nn.Module], bool],
                 model: nn.Module | None = None):
        # Weak references: the blocks hold this object, so the model (and the graphs' memory pool) is freed
        # by reference counting alone, without waiting for the garbage collector.
        self._blocks = [weakref.ref(b) for b in blocks]
        self._layers = [weakref.ref(m) for m in layers]
        self._model = weakref.ref(model) if model is not None else None
        self.uses_rng = uses_rng
        self.captured: _Captured | None = None
        self.failed = False
        self.mismatches = 0
        self.recaptures = 0

    @property
    def blocks(self) -> list[nn.Module]:
        return [ref() for ref in self._blocks]

    @property
    def layers(self) -> list[nn.Module]:
        return [ref() for ref in self._layers]

    @property
    def model(self) -> nn.Module | None:
        return self._model() if self._model is not None else None

    def __reduce__(self):  # pickled (torch.save of the model): the blocks, not the graphs, which a load captures anew
        return MoEGraphs, (self.blocks, self.layers, self.uses_rng, self.model)

    def __deepcopy__(self, memo):  # graphs are bound to this model's memory: a copy captures its own
        return MoEGraphs([copy.deepcopy(b, memo) for b in self.blocks], [copy.deepcopy(m, memo) for m in self.layers],
                         self.uses_rng, memo.get(id(self.model)))  # the model's copy, when the model is what is copied

    def _eligible(self, i: int, x: torch.Tensor) -> bool:
        block = self._blocks[i]()
        return (x.is_cuda and block.training and torch.is_grad_enabled()
                and not torch.is_autocast_enabled("cuda") and not torch.compiler.is_compiling()
                and not torch.cuda.is_current_stream_capturing()
                and not getattr(self._layers[i](), "gradient_checkpointing", False)
                and not self.uses_rng(block) and not _global_hooks()
                and all(_output_recorder_only(m) and not hasattr(m, "_hf_hook") for m in block.modules())
                and (x.requires_grad or any(p.requires_grad for p in block.parameters())))

    def _eager(self, i: int, x: torch.Tensor) -> torch.Tensor:
        block = self._blocks[i]()
        return type(block).forward(block, x)

    def _capture(self, x: torch.Tensor) -> _Captured | None:
        engine = sharded_by(self.model) if self.model is not None else None
        if engine is not None:  # sharded after patching: found at the first training step
            self.failed = True
            warnings.warn(_sharding_warning(engine), RuntimeWarning, stacklevel=4)
            return None
        try:
            return _Captured(self.blocks, self._eager, x)
        except Exception as error:  # an op that cannot be captured: stay eager, say so once
            self.failed = True
            warnings.warn(f"hf_scatter: moe_graphs could not capture the MoE blocks ({type(error).__name__}: "
                          f"{error}); they run eagerly.", RuntimeWarning, stacklevel=4)
            return None

    def __call__(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if not self._eligible(i, x):
            return self._eager(i, x)
        captured = self.captured
        if captured is not None and captured.param_state[i] != _param_state(self._blocks[i]()):
            self.captured = captured = None  # parameters moved or changed requires_grad: capture again,
            self.recaptures += 1  # unless they move every step (sharded parameters): then stay eager
            if self.recaptures > _RECAPTURES:
                self.failed = True
                warnings.warn("hf_scatter: moe_graphs turned off: the MoE blocks' parameters keep moving in memory "
                              "(sharded or offloaded parameters?), and a graph replays fixed addresses.",
                              RuntimeWarning, stacklevel=3)
        if captured is None:
            if i != 0 or self.failed:
                return self._eager(i, x)
            self.captured = captured = self._capture(x)
            if captured is None:
                return self._eager(i, x)
        if captured.signature != _signature(x):
            self.mismatches += 1
            if self.mismatches == _MISMATCH_WARNING:
                warnings.warn(
                    f"hf_scatter: moe_graphs captured inputs of shape {list(captured.signature[0])}; "
                    f"{_MISMATCH_WARNING} calls with other shapes (the latest {list(x.shape)}) ran eagerly. "
                    "Pad batches to one shape (e.g. padding='max_length') to replay graphs every step.",
                    RuntimeWarning, stacklevel=3)
            return self._eager(i, x)
        if not captured.may_forward(i):
            return self._eager(i, x)
        return _Replay.apply(captured, i, self._blocks[i](), x, *captured.params[i])


def _graphed_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    graphs, i = self.__dict__[_ATTR]
    return graphs(i, hidden_states)


def set_moe_graphs(blocks: list[nn.Module], layers: list[nn.Module], on: bool,
                   uses_rng: Callable[[nn.Module], bool], model: nn.Module | None = None) -> None:
    """Install (``on``) or remove graph replay on ``blocks`` (MoE blocks in run order, each called as
    ``block(hidden_states)``); ``layers[i]`` is the decoder layer holding ``blocks[i]`` (its
    ``gradient_checkpointing`` flag sends the block eager); ``uses_rng(block)`` for random jitter. ``model``
    (the whole model) is checked for a sharding engine now and again at capture: graphs stay off under one."""
    installed = [b.__dict__.get(_ATTR) for b in blocks]
    if on and blocks and all(entry is not None for entry in installed) \
            and len({id(entry[0]) for entry in installed}) == 1:
        return  # already on: keep the captured graphs
    engine = sharded_by(model) if on and model is not None else None
    if engine is not None:
        warnings.warn(_sharding_warning(engine), RuntimeWarning, stacklevel=4)
        on = False
    if on and any("forward" in b.__dict__ and _ATTR not in b.__dict__ for b in blocks):
        warnings.warn("hf_scatter: moe_graphs left off: the MoE blocks' forward is already wrapped (accelerate's "
                      "device_map hooks?); graphs need the blocks on one GPU without hooks.", RuntimeWarning,
                      stacklevel=4)
        on = False
    graphs = MoEGraphs(list(blocks), list(layers), uses_rng, model) if on else None
    for i, block in enumerate(blocks):
        if on:
            block.__dict__[_ATTR] = (graphs, i)
            set_instance_method(block, "forward", _graphed_forward)
        elif _ATTR in block.__dict__:
            del block.__dict__[_ATTR]
            block.__dict__.pop("forward", None)


def graphs_of(block: nn.Module) -> MoEGraphs | None:
    entry = block.__dict__.get(_ATTR)
    return entry[0] if entry is not None else None
