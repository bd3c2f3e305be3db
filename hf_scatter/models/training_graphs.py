"""Repeated blocks of a training step replayed as CUDA graphs (opt-in): the MoE blocks
(``patch_model(model, moe_graphs=True)``) or whole decoder layers (``layer_graphs=True``).

A patched training step is bound by host time: the GPU finishes a layer's kernels faster than Python issues
them (an MoE block makes about 20 launches and 40 torch ops, forward and backward; attention, its norms and
rotary embeddings as many again). Here every block's forward and backward is captured once and then replayed
as one graph launch each way. MoE-block graphs leave attention eager; layer graphs take the whole layer.

Capture: at the first eligible call of the first block, every block is warmed up and captured into one
memory pool, in the order a step runs them (forward 0..n-1, then backward n-1..0), so the pool reuses
memory across layers as eager execution does and peak memory stays the eager one. That shared pool is why
replays must keep that order: forward ``i`` right after forward ``i-1`` of the same step (or ``i == 0``
with no backward outstanding), backward in reverse. Anything else runs eagerly, with the same result: a
call out of order, another input shape or dtype (only the first one seen is captured: the pool holds a
step's activations), eval mode, ``no_grad``, autocast, gradient checkpointing, random numbers (router
jitter, attention dropout), module hooks (transformers' inactive output recorders excepted),
``torch.compile``, an outer capture, or CPU. A backward that would replay out of order (``retain_graph``
twice, or an interleaving no step makes) raises instead of corrupting gradients.

A decoder layer's other arguments (rotary cos/sin, position ids, an attention mask) are copied into the
layer's own static buffers when they are not the tensors its last replay read; constants (flags, None) must
equal the captured ones, and an object such as a KV cache sends the call eager. So under ``layer_graphs``
a training forward builds no KV cache unless the caller asks for one (``use_cache=True``: then the layers
run eagerly), as transformers does under gradient checkpointing.

Parameter gradients are not copied out of the pool: each replay's gradient tensors become the parameters'
``.grad`` (autograd takes a gradient it is handed alone rather than copying it), so the blocks' gradients
exist once (a 16-layer Qwen3-MoE-style model's experts: 2.25 GiB that a copy would double). Their memory
is where the next step's replays write, so before its first replay a ``.grad`` still holding the last
step's gradient (accumulation over micro-batches, ``zero_grad(set_to_none=False)``) is moved out, and a
gradient kept anywhere else (a reference taken before ``zero_grad``) is an error naming the fix, not a
silent overwrite.

Why not ``torch.cuda.make_graphed_callables``: it captures from positional tensor arguments given up front and
asks that its callables then run in the captured order, but replays without checking either, and it refuses
modules with hooks; a decoder layer's keyword arguments (rotary cos/sin, masks, a cache), a call out of order,
another shape, autocast or ``no_grad`` would need the checks above around it anyway. Why not
``torch.compile(mode="reduce-overhead")``: it compiles what it traces (again for each new input shape) and graphs
only the regions without a graph break, where this module replays the patched eager layers as they are. Neither
has been timed against this module on a GPU.
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

_ATTR = "_hf_scatter_moe_graphs"  # block.__dict__ entry: (BlockGraphs, index)
MOE_GRAPHS = "moe_graphs"
LAYER_GRAPHS = "layer_graphs"
IMPL = {MOE_GRAPHS: "CUDA-graph replay of training steps (moe_graphs)",
        LAYER_GRAPHS: "CUDA-graph replay of training steps (layer_graphs)"}
# What transformers' output recorders would collect from each kind of block: recording it sends a call eager.
_RECORDS = {MOE_GRAPHS: ("router_logits",), LAYER_GRAPHS: ("router_logits", "hidden_states", "attentions")}
_WARMUPS = 3  # eager fwd+bwd per block before capture: autotuning and lazy CUDA initialisation happen here
_RECAPTURES = 2  # parameter moves (model.to, load_state_dict(assign=True)) tolerated before graphs give up
_MISMATCH_WARNING = 8  # eager calls for other input shapes before a warning says why graphs are not used
_CONSTANTS = (type(None), bool, int, float, str)  # argument values a captured call can be keyed by


def _output_recorder_only(module: nn.Module, records: tuple[str, ...] = _RECORDS[MOE_GRAPHS]) -> bool:
    """Whether ``module``'s hooks are only transformers' output recorders, and none of them records now
    (their collector is inactive, or asks for none of ``records``)."""
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
    return collected is None or not any(key in collected for key in records)


def _sharding_warning(engine: str, kind: str) -> str:
    return (f"hf_scatter: {kind} turned off: the model's parameters are sharded by {engine}, which gathers them "
            "into new memory every step, and a CUDA graph replays fixed addresses; the blocks run eagerly.")


def _global_hooks() -> bool:
    m = torch.nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)


def _side_inputs(args: tuple, kwargs: dict) -> tuple[tuple, list[torch.Tensor]] | None:
    """A block call's arguments after the hidden states as (key, tensors): the key holds their structure,
    the constants and each tensor's shape and dtype; None when the call cannot replay (a tensor that needs
    gradients, or an object such as a KV cache, whose updates a replay would not make)."""
    from torch.utils._pytree import tree_flatten

    leaves, spec = tree_flatten((args, kwargs))
    tensors, described = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                return None
            tensors.append(leaf)
            described.append((torch.Tensor, tuple(leaf.shape), leaf.dtype, leaf.device))
        elif type(leaf) in _CONSTANTS:
            described.append(leaf)
        else:
            return None
    return (spec, tuple(described)), tensors


def _with_tensors(key: tuple, tensors: list[torch.Tensor]) -> tuple[tuple, dict]:
    """The (args, kwargs) that ``key`` describes, with ``tensors`` in its tensors' places."""
    from torch.utils._pytree import tree_unflatten

    spec, described = key
    it = iter(tensors)
    leaves = [next(it) if isinstance(d, tuple) else d for d in described]  # constants are never tuples
    return tree_unflatten(leaves, spec)


class _Pending:
    """Alive while a replayed forward's autograd node is: a graph dropped without backward frees it."""

    __slots__ = ("__weakref__",)


class _Captured:
    """One input signature's graphs for every block, sharing one memory pool, and the replay order state."""

    def __init__(self, blocks: list[nn.Module], forward: Callable, sample: torch.Tensor, extra_key: tuple | None = None,
                 extra: list[torch.Tensor] = (), kind: str = MOE_GRAPHS):
        self.kind = kind  # MOE_GRAPHS or LAYER_GRAPHS: the option the errors tell the user to turn off
        self.signature = (_signature(sample), extra_key)
        self.extra_key = extra_key  # the blocks' other arguments (a decoder layer's cos/sin, mask): one per block
        self.static_extra = [[t.detach().clone() for t in extra] for _ in blocks]
        self.extra_sources: list = [None] * len(blocks)
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
                    out = forward(i, self.static_in[i], *self.arguments(i))
                    torch.autograd.grad(out, grad_inputs[i], torch.ones_like(out), allow_unused=True)
                del out
        torch.cuda.synchronize()

        pool = torch.cuda.graph_pool_handle()
        self.forward_graphs, self.static_out = [], []
        for i in range(n):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = forward(i, self.static_in[i], *self.arguments(i))
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

    def arguments(self, i: int) -> tuple[tuple, dict]:
        """Block ``i``'s other arguments, its static buffers in the tensors' places."""
        return _with_tensors(self.extra_key, self.static_extra[i]) if self.extra_key is not None else ((), {})

    def load_extra(self, i: int, tensors: list[torch.Tensor]) -> None:
        """Copies a call's other tensors into block ``i``'s buffers, unless they are the tensors, unchanged,
        that its last replay read (held here, so no new tensor can take their identity)."""
        sources = self.extra_sources[i]
        for k, (t, static) in enumerate(zip(tensors, self.static_extra[i])):
            if sources is None or sources[k][0] is not t or sources[k][1] != t._version:
                static.copy_(t)
        self.extra_sources[i] = [(t, t._version) for t in tensors]

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
                f"hf_scatter: the CUDA graphs of {self.kind} replay backward once per forward and in reverse "
                f"layer order, but block {i}'s backward came {'again' if i not in live else 'out of order'}. "
                f"Patch without {self.kind} (patch_model(model, {self.kind}=False)) for retain_graph or "
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
                    f"hf_scatter: a gradient of an earlier step of the {self.kind} blocks is still referenced "
                    f"(a tensor of shape {list(grad.shape)} kept after zero_grad?). With {self.kind} the blocks' "
                    "gradients live in the CUDA graphs' memory, which this step's replays overwrite. Keep a copy "
                    f"instead (p.grad.clone()), or patch without {self.kind} "
                    f"(patch_model(model, {self.kind}=False)).")


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
                "hf_scatter: the block's parameters moved between its replayed forward and its backward "
                "(an engine that gathers parameters per pass?); the captured backward would read stale memory. "
                f"Patch without {captured.kind} (patch_model(model, {captured.kind}=False)).")
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


class BlockGraphs:
    """A model's repeated blocks in run order (MoE blocks, or decoder layers) and their captured graphs (one
    input signature)."""

    def __init__(self, blocks: list[nn.Module], layers: list[nn.Module], uses_rng: Callable[[nn.Module], bool],
                 model: nn.Module | None = None, kind: str = MOE_GRAPHS):
        # Weak references: the blocks hold this object, so the model (and the graphs' memory pool) is freed
        # by reference counting alone, without waiting for the garbage collector.
        self._blocks = [weakref.ref(b) for b in blocks]
        self._layers = [weakref.ref(m) for m in layers]
        self._model = weakref.ref(model) if model is not None else None
        self.uses_rng = uses_rng
        self.kind = kind
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
        return BlockGraphs, (self.blocks, self.layers, self.uses_rng, self.model, self.kind)

    def __deepcopy__(self, memo):  # graphs are bound to this model's memory: a copy captures its own
        return BlockGraphs([copy.deepcopy(b, memo) for b in self.blocks],
                           [copy.deepcopy(m, memo) for m in self.layers], self.uses_rng,
                           memo.get(id(self.model)), self.kind)  # the model's copy, when the model is what is copied

    def _eligible(self, i: int, x: torch.Tensor) -> bool:
        block = self._blocks[i]()
        records = _RECORDS[self.kind]
        return (x.is_cuda and block.training and torch.is_grad_enabled()
                and not torch.is_autocast_enabled("cuda") and not torch.compiler.is_compiling()
                and not torch.cuda.is_current_stream_capturing()
                and not getattr(self._layers[i](), "gradient_checkpointing", False)
                and not self.uses_rng(block) and not _global_hooks()
                and all(_output_recorder_only(m, records) and not hasattr(m, "_hf_hook") for m in block.modules())
                and (x.requires_grad or any(p.requires_grad for p in block.parameters())))

    def _eager(self, i: int, x: torch.Tensor, args: tuple = (), kwargs: dict | None = None) -> torch.Tensor:
        block = self._blocks[i]()
        return type(block).forward(block, x, *args, **(kwargs or {}))

    def _capture(self, x: torch.Tensor, extra_key: tuple | None, extra: list[torch.Tensor]) -> _Captured | None:
        engine = sharded_by(self.model) if self.model is not None else None
        if engine is not None:  # sharded after patching: found at the first training step
            self.failed = True
            warnings.warn(_sharding_warning(engine, self.kind), RuntimeWarning, stacklevel=4)
            return None
        try:
            return _Captured(self.blocks, self._eager, x, extra_key, extra, self.kind)
        except Exception as error:  # an op that cannot be captured: stay eager, say so once
            self.failed = True
            warnings.warn(f"hf_scatter: {self.kind} could not capture the blocks ({type(error).__name__}: "
                          f"{error}); they run eagerly.", RuntimeWarning, stacklevel=4)
            return None

    def __call__(self, i: int, x: torch.Tensor, args: tuple = (), kwargs: dict | None = None) -> torch.Tensor:
        if not self._eligible(i, x):
            return self._eager(i, x, args, kwargs)
        extra_key, extra = None, []
        if args or kwargs:
            found = _side_inputs(args, kwargs or {})
            if found is None:  # a KV cache, or an argument that needs gradients
                return self._eager(i, x, args, kwargs)
            extra_key, extra = found
        captured = self.captured
        if captured is not None and captured.param_state[i] != _param_state(self._blocks[i]()):
            self.captured = captured = None  # parameters moved or changed requires_grad: capture again,
            self.recaptures += 1  # unless they move every step (sharded parameters): then stay eager
            if self.recaptures > _RECAPTURES:
                self.failed = True
                warnings.warn(f"hf_scatter: {self.kind} turned off: the blocks' parameters keep moving in memory "
                              "(sharded or offloaded parameters?), and a graph replays fixed addresses.",
                              RuntimeWarning, stacklevel=3)
        if captured is None:
            if i != 0 or self.failed:
                return self._eager(i, x, args, kwargs)
            self.captured = captured = self._capture(x, extra_key, extra)
            if captured is None:
                return self._eager(i, x, args, kwargs)
        if captured.signature != (_signature(x), extra_key):
            self.mismatches += 1
            if self.mismatches == _MISMATCH_WARNING:
                warnings.warn(
                    f"hf_scatter: {self.kind} captured inputs of shape {list(captured.signature[0][0])}; "
                    f"{_MISMATCH_WARNING} calls with other shapes or arguments (the latest {list(x.shape)}) ran "
                    "eagerly. Pad batches to one shape (e.g. padding='max_length') to replay graphs every step.",
                    RuntimeWarning, stacklevel=3)
            return self._eager(i, x, args, kwargs)
        if not captured.may_forward(i):
            return self._eager(i, x, args, kwargs)
        captured.load_extra(i, extra)
        return _Replay.apply(captured, i, self._blocks[i](), x, *captured.params[i])


def _graphed_forward(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    graphs, i = self.__dict__[_ATTR]
    return graphs(i, hidden_states, args, kwargs)


def layer_uses_rng(layer: nn.Module, mlp: str, moe_block: type, block_uses_rng: Callable[[nn.Module], bool]) -> bool:
    """Whether a decoder layer draws random numbers in training: dropout in its attention or anywhere in it, or
    its MoE block's (router jitter)."""
    if getattr(getattr(layer, "self_attn", None), "attention_dropout", 0.0):
        return True
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in layer.modules()):
        return True
    block = getattr(layer, mlp, None)
    return isinstance(block, moe_block) and block_uses_rng(block)


def set_moe_graphs(blocks: list[nn.Module], layers: list[nn.Module], on: bool,
                   uses_rng: Callable[[nn.Module], bool], model: nn.Module | None = None) -> None:
    """Install (``on``) or remove graph replay on ``blocks`` (MoE blocks in run order, each called as
    ``block(hidden_states)``); ``layers[i]`` is the decoder layer holding ``blocks[i]`` (its
    ``gradient_checkpointing`` flag sends the block eager); ``uses_rng(block)`` for random jitter. ``model``
    (the whole model) is checked for a sharding engine now and again at capture: graphs stay off under one."""
    _install(blocks, layers, on, uses_rng, model, MOE_GRAPHS)


def set_layer_graphs(layers: list[nn.Module], on: bool, uses_rng: Callable[[nn.Module], bool],
                     model: nn.Module | None = None, base_model: nn.Module | None = None) -> None:
    """Install (``on``) or remove graph replay on decoder ``layers`` (in run order, each called as
    ``layer(hidden_states, **arguments)``); ``uses_rng(layer)`` as :func:`layer_uses_rng`. ``base_model``
    (the module that loops over the layers) then builds no KV cache in training unless asked for one."""
    _install(layers, layers, on, uses_rng, model, LAYER_GRAPHS)
    if base_model is None:
        return
    ours = getattr(base_model.__dict__.get("forward"), "__func__", None) is _forward_without_training_cache
    if on and graphs_of(layers[0]) is not None and "forward" not in base_model.__dict__:
        set_instance_method(base_model, "forward", _forward_without_training_cache)
    elif not on and ours:
        del base_model.__dict__["forward"]


def _forward_without_training_cache(self: nn.Module, *args, **kwargs):
    """The base model's own forward, with ``use_cache=False`` in a training forward that did not ask for a cache:
    the layers' graphs replay no cache updates (transformers does the same under gradient checkpointing)."""
    if kwargs.get("use_cache") is None and len(args) <= 1 and self.training and torch.is_grad_enabled():
        kwargs["use_cache"] = False
    return type(self).forward(self, *args, **kwargs)


def _install(blocks: list[nn.Module], layers: list[nn.Module], on: bool, uses_rng: Callable[[nn.Module], bool],
             model: nn.Module | None, kind: str) -> None:
    installed = [b.__dict__.get(_ATTR) for b in blocks]
    if on and blocks and all(entry is not None and entry[0].kind == kind for entry in installed) \
            and len({id(entry[0]) for entry in installed}) == 1:
        return  # already on: keep the captured graphs
    engine = sharded_by(model) if on and model is not None else None
    if engine is not None:
        warnings.warn(_sharding_warning(engine, kind), RuntimeWarning, stacklevel=4)
        on = False
    if on and any("forward" in b.__dict__ and _ATTR not in b.__dict__ for b in blocks):
        warnings.warn(f"hf_scatter: {kind} left off: the blocks' forward is already wrapped (accelerate's "
                      "device_map hooks?); graphs need the blocks on one GPU without hooks.", RuntimeWarning,
                      stacklevel=4)
        on = False
    graphs = BlockGraphs(list(blocks), list(layers), uses_rng, model, kind) if on else None
    for i, block in enumerate(blocks):
        if on:
            block.__dict__[_ATTR] = (graphs, i)
            set_instance_method(block, "forward", _graphed_forward)
        elif _ATTR in block.__dict__ and block.__dict__[_ATTR][0].kind == kind:
            del block.__dict__[_ATTR]
            block.__dict__.pop("forward", None)


def graphs_of(block: nn.Module) -> BlockGraphs | None:
    entry = block.__dict__.get(_ATTR)
    return entry[0] if entry is not None else None
