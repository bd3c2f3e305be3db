"""patch_model(model, moe_graphs=True / layer_graphs=True): MoE blocks or whole decoder layers of training
steps replayed as CUDA graphs give the eager results (losses, weights, accumulated gradients), fall back to
eager wherever a graph would not be valid, and refuse a backward that would replay out of order."""

import copy

import pytest
import torch

import hf_scatter
from hf_scatter.models.training_graphs import IMPL as GRAPHS_IMPL
from hf_scatter.models.training_graphs import graphs_of
from hf_scatter.tiny import TINY_BUILDERS, tiny_dbrx, tiny_mixtral

# CUDA graphs capture on a GPU only: on the CPU these tests hold the bookkeeping (reports, fallbacks, unpatching),
# which runs the same with the kernels' torch reference as under the interpreter
pytestmark = pytest.mark.kernel_bodies("reference")

IMPL = GRAPHS_IMPL["moe_graphs"]
LAYER_IMPL = GRAPHS_IMPL["layer_graphs"]

BUILDERS = {"mixtral": tiny_mixtral, "dbrx": tiny_dbrx}
SIZES = dict(hidden=72, experts=6, top_k=3, intermediate=40, layers=3)


def _blocks(model):
    return [m for m in model.modules() if graphs_of(m) is not None]


def _ids(device, batch=2, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (batch, length), generator=g).to(device)


def _pair(family, device):
    eager = hf_scatter.patch_model(BUILDERS[family](**SIZES).to(device).train())
    eager.set_attn_implementation("eager")  # deterministic attention backward: differences are ours
    return eager, hf_scatter.patch_model(copy.deepcopy(eager), moe_graphs=True)


@pytest.mark.parametrize("family", ["mixtral", "dbrx"])
def test_moe_graphs_patch_is_reported_keeps_weights_and_unpatches(family):
    eager, graphed = _pair(family, "cpu")
    blocks = _blocks(graphed)
    report = hf_scatter.patch_report(graphed)
    assert len(blocks) == 3 and all(report[n].endswith(IMPL) for n, m in graphed.named_modules() if m in blocks)
    assert all(graphs_of(b) is graphs_of(blocks[0]) for b in blocks)  # one pool for the whole step
    state = graphed.state_dict()
    assert state.keys() == eager.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in eager.state_dict().items())

    ids = _ids("cpu")
    for model in (eager, graphed):  # CPU: the blocks run eagerly, same numbers
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
    assert torch.equal(eager(input_ids=ids).logits, graphed(input_ids=ids).logits)
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        assert torch.equal(p.grad, q.grad), name

    twin = copy.deepcopy(graphed)  # a copy replays its own graphs, over its own blocks
    assert graphs_of(_blocks(twin)[0]).blocks == _blocks(twin)
    hf_scatter.patch_model(graphed)  # moe_graphs is opt-in: the default patch removes it
    assert not _blocks(graphed)  # (the root's own forward is the fused loss's, reported as such)
    assert all("forward" not in m.__dict__ for name, m in graphed.named_modules() if name)
    assert not any(IMPL in v for v in hf_scatter.patch_report(graphed).values())


def test_graphed_model_pickles_and_is_freed_by_del(pickled_copy, freed_by_del):
    model = hf_scatter.patch_model(tiny_mixtral(**SIZES), moe_graphs=True)
    loaded = pickled_copy(model)
    assert hf_scatter.patch_report(loaded) == hf_scatter.patch_report(model)
    assert graphs_of(_blocks(loaded)[0]).blocks == _blocks(loaded)  # the copy's graphs hold the copy's blocks
    holder = [model]
    del model
    assert freed_by_del(holder)


def test_moe_graphs_needs_the_scattermoe_experts():
    with pytest.raises(ValueError, match="moe_graphs=True .* needs moe=True"):
        hf_scatter.patch_model(tiny_mixtral(), moe=False, moe_graphs=True)


def _train(model, batches, steps, accumulate):
    """Losses, and the accumulated gradients each optimizer step saw (SGD: AdamW's first steps are sign
    descent, where float noise in a near-zero gradient flips a whole learning-rate-sized update). A batch is
    input ids, or (ids, attention mask, labels)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, grads = [], []
    for step in range(steps):
        for micro in range(accumulate):
            batch = batches[(step * accumulate + micro) % len(batches)]
            ids, mask, labels = batch if isinstance(batch, tuple) else (batch, None, batch)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)  # both ways of clearing gradients
    return losses, grads


def _assert_trained_alike(eager, graphed, trained_eager, trained_graphed, grad_atol):
    """Every step's accumulated gradients, the losses and the final weights of two ``_train`` runs agree."""
    (want, want_grads), (got, got_grads) = trained_eager, trained_graphed
    for step, (w, g) in enumerate(zip(want_grads, got_grads)):
        assert w.keys() == g.keys()
        for name in w:
            torch.testing.assert_close(g[name], w[name], rtol=1e-5, atol=grad_atol, msg=f"step {step}: {name}")
    assert got == pytest.approx(want, rel=1e-5)
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


def _assert_same_call(eager, graphed, run):
    """``run(model)`` gives the same result and parameter gradients on both models; gradients then cleared."""
    want, got = run(eager), run(graphed)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    eager.zero_grad(set_to_none=True)
    graphed.zero_grad(set_to_none=True)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mixtral", "dbrx"])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_moe_graphs_training_matches_eager(family, accumulate):
    eager, graphed = _pair(family, "cuda")
    batches = [_ids("cuda", seed=s) for s in range(3)]
    trained_eager, trained_graphed = _train(eager, batches, 4, accumulate), _train(graphed, batches, 4, accumulate)
    captured = graphs_of(_blocks(graphed)[0]).captured
    assert captured is not None and captured.replays >= 3 * (4 * accumulate - 1)  # every step after the first
    _assert_trained_alike(eager, graphed, trained_eager, trained_graphed, grad_atol=1e-7)


@pytest.mark.gpu
def test_moe_graphs_fall_back_where_a_replay_would_be_wrong():
    eager, graphed = _pair("mixtral", "cuda")
    graphs = graphs_of(_blocks(graphed)[0])
    ids, other = _ids("cuda", seed=1), _ids("cuda", length=17, seed=2)
    for model in (eager, graphed):
        model(input_ids=ids, labels=ids).loss.backward()  # captures
        model.zero_grad(set_to_none=True)
    replays = graphs.captured.replays

    def same(run):
        _assert_same_call(eager, graphed, run)

    def two_forwards_one_backward(model):  # the second forward must not overwrite the first one's pool
        a, b = model(input_ids=ids, labels=ids).loss, model(input_ids=other, labels=other).loss
        (a + 2 * b).backward()
        return torch.stack([a, b]).detach()

    def another_shape(model):
        loss = model(input_ids=other, labels=other).loss
        loss.backward()
        return loss.detach()

    def no_grad(model):
        with torch.no_grad():
            return model(input_ids=ids).logits

    def evaluation(model):
        model.eval()
        try:
            return model(input_ids=ids).logits
        finally:
            model.train()

    def autocast(model):
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    def dropped_then_trained(model):  # a forward whose graph is dropped unused leaves no step outstanding
        model(input_ids=ids, labels=ids)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    for run in (two_forwards_one_backward, another_shape, no_grad, evaluation, autocast):
        same(run)
    assert graphs.captured.replays == replays + 3  # only the first forward of the first case replayed
    same(dropped_then_trained)
    assert graphs.captured.replays == replays + 9

    def one_step(model):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    for model in (eager, graphed):
        model.double().float()  # every parameter moves (values unchanged): the graphs are captured again
    before = graphs.captured
    same(one_step)
    assert graphs.captured is not before and graphs.captured.replays == 3 and graphs.recaptures == 1

    loss = graphed(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"backward once per forward.*moe_graphs=False"):
        loss.backward()


@pytest.mark.gpu
def test_moe_graphs_hand_gradients_over_without_a_copy_and_refuse_to_overwrite_a_kept_one():
    """A replayed block's parameter gradients become .grad in place (no second copy of the experts'
    gradients); a gradient kept past zero_grad is an error before the next replay would rewrite it."""
    _, graphed = _pair("mixtral", "cuda")
    ids = _ids("cuda", seed=1)

    def step():
        graphed(input_ids=ids, labels=ids).loss.backward()

    step()  # captures
    graphed.zero_grad(set_to_none=True)
    step()
    captured = graphs_of(_blocks(graphed)[0]).captured
    assert captured.replays > 0
    in_pool = {g.data_ptr() for grads in captured.param_grads for g in grads if g is not None}
    experts = [p for block in _blocks(graphed) for p in block.experts.parameters()]
    assert experts and all(p.grad.data_ptr() in in_pool for p in experts)
    kept = experts[0].grad
    want = kept.clone()
    graphed.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"still referenced .*p\.grad\.clone\(\).*moe_graphs=False"):
        step()
    torch.testing.assert_close(kept, want, rtol=0, atol=0)  # refused before the replay wrote over it


def test_moe_graphs_see_through_transformers_output_recorders_only_while_inactive():
    """transformers hooks every router once to record its logits on request: graphs must still be used while
    nobody asks for them (or no block would ever replay), and not while ``output_router_logits`` is on."""
    from hf_scatter.models.training_graphs import _output_recorder_only

    model = hf_scatter.patch_model(tiny_mixtral(**SIZES).train(), moe_graphs=True)
    seen = []
    block = _blocks(model)[0]
    probe = block.register_forward_pre_hook(lambda m, args: seen.append(_output_recorder_only(m.gate)))
    ids = _ids("cpu")
    model(input_ids=ids)
    model(input_ids=ids, output_router_logits=True)
    probe.remove()
    assert block.gate._forward_hooks  # the recorder hooks really are there
    assert seen == [True, False]
    block.gate.register_forward_hook(lambda m, args, out: None)  # anyone else's hook: never captured
    assert not _output_recorder_only(block.gate)


# ------------------------------------------------------------------------------------------- layer graphs
LAYER_FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"]
LAYER_SIZES = dict(hidden=64, experts=6, top_k=3, intermediate=40, layers=3)


def _layers(model):
    return [m for m in model.modules() if graphs_of(m) is not None and graphs_of(m).kind == "layer_graphs"]


def _layer_pair(family, device):
    eager = hf_scatter.patch_model(TINY_BUILDERS[family](**LAYER_SIZES).to(device).train())
    eager.set_attn_implementation("eager")  # deterministic attention backward: differences are ours
    return eager, hf_scatter.patch_model(copy.deepcopy(eager), layer_graphs=True)


@pytest.mark.parametrize("family", LAYER_FAMILIES)
def test_layer_graphs_cover_every_decoder_layer_build_no_training_cache_and_unpatch(family):
    model = hf_scatter.patch_model(TINY_BUILDERS[family](**LAYER_SIZES).train(), layer_graphs=True)
    layers = _layers(model)
    assert layers and layers == list(model.model.layers)  # DeepSeek's dense first layer too
    report = hf_scatter.patch_report(model)
    assert all(report[f"model.layers.{i}"].endswith(LAYER_IMPL) for i in range(len(layers)))
    ids = _ids("cpu")
    assert model(input_ids=ids, labels=ids).past_key_values is None  # a replay makes no cache updates
    assert model(input_ids=ids, labels=ids, use_cache=True).past_key_values is not None  # asked for: eager
    with torch.no_grad():
        assert model(input_ids=ids, use_cache=True).past_key_values is not None
    hf_scatter.unpatch_model(model)
    assert not _layers(model) and "forward" not in model.model.__dict__
    assert model(input_ids=ids, labels=ids).past_key_values is not None  # transformers' own default again


def test_layer_graphs_refuse_what_they_cannot_replay():
    with pytest.raises(ValueError, match="pass one of moe_graphs=True or layer_graphs=True"):
        hf_scatter.patch_model(tiny_mixtral(), moe_graphs=True, layer_graphs=True)
    with pytest.raises(ValueError, match="layer_graphs is not available for dbrx"):
        hf_scatter.patch_model(tiny_dbrx(), layer_graphs=True)


def test_a_layer_call_is_keyed_by_its_shapes_and_constants_and_refused_with_a_cache():
    from transformers import DynamicCache

    from hf_scatter.models.training_graphs import _side_inputs, _with_tensors

    cos, sin, mask = torch.randn(1, 5, 8), torch.randn(1, 5, 8), torch.zeros(2, 1, 5, 5)
    key, tensors = _side_inputs((), dict(position_embeddings=(cos, sin), attention_mask=mask, use_cache=False,
                                         cache=None))
    assert [t is u for t, u in zip(tensors, (cos, sin, mask))] == [True] * 3
    args, kwargs = _with_tensors(key, [c := cos.clone(), s := sin.clone(), m := mask.clone()])
    assert args == () and kwargs["position_embeddings"][0] is c and kwargs["position_embeddings"][1] is s
    assert kwargs["attention_mask"] is m and kwargs["use_cache"] is False and kwargs["cache"] is None
    same, _ = _side_inputs((), dict(position_embeddings=(sin, cos), attention_mask=mask.clone(), use_cache=False,
                                    cache=None))
    assert same == key
    other, _ = _side_inputs((), dict(position_embeddings=(cos, sin), attention_mask=mask[:1], use_cache=False,
                                     cache=None))
    flag, _ = _side_inputs((), dict(position_embeddings=(cos, sin), attention_mask=mask, use_cache=True,
                                    cache=None))
    assert other != key and flag != key
    assert _side_inputs((), dict(cache=DynamicCache())) is None
    assert _side_inputs((), dict(position_embeddings=(cos.requires_grad_(), sin))) is None


def _padded_batches(device, count=3, batch=2, length=24):
    """Batches of one shape whose attention masks differ: a replay must read each step's own mask."""
    out = []
    for seed in range(count):
        ids = _ids(device, batch, length, seed)
        mask = torch.ones_like(ids)
        mask[0, : 3 + 4 * seed] = 0  # left padding of another length every batch
        labels = ids.masked_fill(mask == 0, -100)
        out.append((ids, mask, labels))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("family", LAYER_FAMILIES)
@pytest.mark.parametrize("accumulate", [1, 3])
def test_layer_graphs_training_matches_eager_with_each_steps_own_mask(family, accumulate):
    eager, graphed = _layer_pair(family, "cuda")
    batches = _padded_batches("cuda")
    trained_eager, trained_graphed = _train(eager, batches, 4, accumulate), _train(graphed, batches, 4, accumulate)
    graphs = graphs_of(_layers(graphed)[0])
    n = len(_layers(graphed))
    assert graphs.captured is not None and graphs.captured.replays >= n * (4 * accumulate - 1), graphs.failed
    _assert_trained_alike(eager, graphed, trained_eager, trained_graphed, grad_atol=1e-6)


@pytest.mark.gpu
def test_layer_graphs_fall_back_where_a_replay_would_be_wrong():
    eager, graphed = _layer_pair("qwen3_moe", "cuda")
    graphs = graphs_of(_layers(graphed)[0])
    n = len(_layers(graphed))
    ids, other = _ids("cuda", seed=1), _ids("cuda", length=17, seed=2)

    def step(model, **kwargs):
        out = model(input_ids=kwargs.pop("input_ids", ids), labels=kwargs.pop("labels", ids), **kwargs)
        out.loss.backward()
        return out.loss.detach()

    for model in (eager, graphed):
        step(model)  # captures
        model.zero_grad(set_to_none=True)
    replays = graphs.captured.replays

    def same(run):
        _assert_same_call(eager, graphed, run)

    def with_cache(model):  # a cache asked for: the layers update it eagerly
        return step(model, use_cache=True)

    def another_shape(model):
        return step(model, input_ids=other, labels=other)

    def checkpointed(model):
        model.gradient_checkpointing_enable()
        try:
            return step(model)
        finally:
            model.gradient_checkpointing_disable()

    for run in (with_cache, another_shape, checkpointed):
        same(run)
    assert graphs.captured.replays == replays
    same(step)
    assert graphs.captured.replays == replays + n
