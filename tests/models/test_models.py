"""Patched models of every MoE family behave exactly like vanilla transformers: logits, gradients, routing,
generate, checkpoints, class-level patching, autocast, gradient checkpointing and accelerate hooks
(torch.compile: test_models_compile.py).
One suite, parametrised over the families (tiny configs, odd sizes, k=3 of 6 experts)."""

import copy
import functools
import warnings

import pytest
import torch

import hf_scatter
from hf_scatter.models.bert import UNPADDED
from hf_scatter.tiny import (DECODER_FAMILIES, TINY_BUILDERS, tiny_bert, tiny_dbrx_config, tiny_decoder_config,
                             tiny_mixtral, tiny_mixtral_config)

FAMILIES = ["mixtral", "dbrx", *DECODER_FAMILIES]
CONFIGS = {"mixtral": tiny_mixtral_config, "dbrx": tiny_dbrx_config,
           **{f: functools.partial(tiny_decoder_config, f) for f in DECODER_FAMILIES}}
ODD = dict(hidden=72, experts=6, top_k=3, intermediate=40)  # odd sizes, k=3 of 6 experts
MOE_LAYERS = 2  # every tiny config has two MoE layers (DeepSeek's extra first layer is dense)
LINEAR_ATTENTION = {"qwen3_next", "qwen3_5_moe_text"}  # hybrid stacks with gated-delta-net layers
UNFUSED_NORMS = LINEAR_ATTENTION  # RMSNorms scaling by 1 + weight (Qwen3-Next's) stay vanilla
NO_ROPE = {"dbrx", "deepseek_v3", "deepseek_v2"} | LINEAR_ATTENTION  # RoPE stays vanilla (fused: the standard and GPT-OSS forms)
# the families whose tiny configs hold a dense gated MLP (shared experts, DeepSeek's dense first layer)
DENSE_MLP = {"deepseek_v3", "deepseek_v2", "qwen2_moe"} | LINEAR_ATTENTION


# Tests whose subject is how a patched model fits transformers, not the kernels' arithmetic, run the kernels' torch
# reference on the CPU (the same custom ops and autograd functions; only their bodies differ): routing outputs,
# gradient checkpointing, pickling, patch switching, accelerate hooks, autocast, torch.compile's tracing, what is
# saved for backward. Where the integration feeds the kernels shapes of its own (generate's one-token decode rows
# over a KV cache, the fused loss), Mixtral keeps the Triton interpreter in the loop. The kernels, and every
# family's logits and gradients, are held to references under the interpreter by the kernel tests and
# test_logits_and_every_gradient_match_vanilla_with_padding. On a GPU every family runs Triton.
INTERPRETED_FAMILIES = {"mixtral"}


@pytest.fixture
def integration_kernels(kernel_bodies):
    def choose(family: str, interpreted: bool = True) -> None:
        kernel_bodies(interpreted and family in INTERPRETED_FAMILIES)

    return choose


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def vanilla_and_patched(family, device, **config):
    vanilla = TINY_BUILDERS[family](**{**ODD, **config}).to(device)
    if family != "dbrx":
        vanilla.set_experts_implementation("eager")  # the family's own per-expert loop as the reference
    return vanilla, hf_scatter.patch_model(copy.deepcopy(vanilla))


def patched_experts(model) -> int:
    """How many experts modules run on ScatterMoE (the report also lists fused norms and routers)."""
    return sum(v.startswith("scattermoe") for v in hf_scatter.patch_report(model).values())


def _ids(device, batch=3, length=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (batch, length), generator=g).to(device)


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


GRAD_FLOOR = 1e-3  # a gradient smaller than this is compared to it: tol 1e-5 is then 1e-8 absolute


def _grad_error(a, b):
    """Relative error, with an absolute floor: a gradient summed from cancelling terms (Qwen3.5-MoE's linear
    attention ``A_log``, 1e-6 at init on CUDA) carries fp32 rounding of the larger terms in its last digits."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(GRAD_FLOOR)).item()


def _assert_same_grads(vanilla, patched, tol=1e-5):
    want, got = _grads(vanilla), _grads(patched)
    assert want.keys() == got.keys() and want
    worst = max(want, key=lambda n: _grad_error(got[n], want[n]))
    assert _grad_error(got[worst], want[worst]) < tol, worst


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_every_gradient_match_vanilla_with_padding(family, device):
    vanilla, patched = vanilla_and_patched(family, device)
    report = hf_scatter.patch_report(patched)
    assert patched_experts(patched) == MOE_LAYERS
    fused = {"router_topk", "fused_linear_cross_entropy"} | (set() if family in UNFUSED_NORMS else {"fused_add_norm"}) \
        | (set() if family in NO_ROPE else {"fused_rope"}) | ({"fused_swiglu"} if family in DENSE_MLP else set())
    assert {v for v in report.values() if not v.startswith("scattermoe")} == fused
    assert "experts_implementation=scattermoe" in repr(patched)
    ids = _ids(device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding in one row
    labels = ids.masked_fill(mask == 0, -100)
    want = vanilla(ids, attention_mask=mask, labels=labels)
    got = patched(ids, attention_mask=mask, labels=labels)
    assert _rel(got.logits, want.logits) < 1e-5
    want.loss.backward()
    got.loss.backward()
    _assert_same_grads(vanilla, patched)


def _seeded_forward(model, ids, **kwargs):
    torch.manual_seed(7)  # same jitter noise for both: the patch must not change what the router consumes
    try:
        return model(ids, **kwargs)
    except Exception as error:  # noqa: BLE001 - a vanilla failure must be reproduced, not hidden
        return error


@pytest.mark.kernel_bodies("reference")
@pytest.mark.parametrize("family", FAMILIES)
def test_routing_router_logits_aux_loss_and_jitter_are_the_familys(family, device):
    jitter = {"mixtral": {"router_jitter_noise": 0.1}, "dbrx": {"jitter_eps": 0.1}}.get(family, {})
    vanilla, patched = vanilla_and_patched(family, device, output_router_logits=True, **jitter)
    vanilla.train()
    patched.train()
    ids = _ids(device)
    want, got = _seeded_forward(vanilla, ids), _seeded_forward(patched, ids)
    # (transformers 5.17's DeepSeek outputs have no router_logits / aux_loss fields, and its DBRX records none)
    want_logits, got_logits = getattr(want, "router_logits", None), getattr(got, "router_logits", None)
    assert (got_logits is None) == (want_logits is None)
    if want_logits is not None:
        assert len(got_logits) == len(want_logits) == MOE_LAYERS
        for layer in range(MOE_LAYERS):  # router inputs differ by the fused norms' float rounding only
            assert _rel(got_logits[layer], want_logits[layer]) < 1e-5
    want_aux, got_aux = getattr(want, "aux_loss", None), getattr(got, "aux_loss", None)
    assert type(got_aux) is type(want_aux)
    if want_aux is not None:  # (DeepSeek defines none)
        assert torch.allclose(torch.as_tensor(got_aux), torch.as_tensor(want_aux), rtol=1e-6, atol=0)
    want, got = _seeded_forward(vanilla, ids, labels=ids), _seeded_forward(patched, ids, labels=ids)
    if isinstance(want, Exception):  # transformers 5.17's DBRX cannot add an unrecorded aux loss: same error
        assert type(got) is type(want) and str(got) == str(want)
    else:
        assert _rel(got.loss, want.loss) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_greedy_tokens_identical_with_kv_cache(family, device, integration_kernels):
    integration_kernels(family)
    vanilla, patched = vanilla_and_patched(family, device)
    ids = _ids(device, batch=2, length=7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    want, vanilla_says = _warned(lambda: vanilla.generate(ids, **kwargs))
    got, patched_says = _warned(lambda: patched.generate(ids, **kwargs))
    assert want.shape == (2, 17)
    assert torch.equal(got, want)
    assert patched_says <= vanilla_says  # e.g. no deprecation of an argument the user never passed


def _warned(call):
    """``call()`` and the messages of the warnings it raised (vanilla's class names made patched-neutral)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call()
    return out, {str(w.message).replace("Unpadded", "").replace("Fused", "") for w in caught}


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_round_trips_both_ways_bitwise(family, device, tmp_path):
    from transformers import AutoModelForCausalLM

    vanilla, patched = vanilla_and_patched(family, device)
    assert [(n, p.shape, p.dtype) for n, p in patched.named_parameters()] == \
           [(n, p.shape, p.dtype) for n, p in vanilla.named_parameters()]
    patched.save_pretrained(tmp_path / "patched")
    assert "scattermoe" not in (tmp_path / "patched" / "config.json").read_text(), \
        "a vanilla transformers install must be able to load what a patched model saves"
    hf_scatter.unpatch_transformers()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "patched")
    assert hf_scatter.patch_report(plain) == {}
    sd_plain, sd_patched = plain.state_dict(), patched.state_dict()
    assert list(sd_plain) == list(sd_patched)
    assert all(torch.equal(sd_plain[k], sd_patched[k].cpu()) for k in sd_plain)

    vanilla.save_pretrained(tmp_path / "vanilla")
    hf_scatter.patch_transformers()
    try:
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "vanilla")
    finally:
        hf_scatter.unpatch_transformers()
    assert patched_experts(loaded) == MOE_LAYERS
    sd_loaded, sd_vanilla = loaded.state_dict(), vanilla.state_dict()
    assert list(sd_loaded) == list(sd_vanilla)
    assert all(torch.equal(sd_loaded[k], sd_vanilla[k].cpu()) for k in sd_loaded)


@pytest.mark.kernel_bodies("reference")
@pytest.mark.parametrize("family", FAMILIES)
def test_patch_is_idempotent_switchable_and_reversible(family, device):
    vanilla, patched = vanilla_and_patched(family, device)
    ids = _ids(device)
    first = patched(ids).logits
    report = hf_scatter.patch_report(patched)
    assert ("fused_rope" in report.values()) == (family not in NO_ROPE)
    assert hf_scatter.patch_model(patched) is patched
    assert hf_scatter.patch_report(patched) == report
    assert torch.equal(patched(ids).logits, first)

    hf_scatter.patch_model(patched, moe=False)
    assert patched_experts(patched) == 0 and hf_scatter.patch_report(patched)
    hf_scatter.patch_model(patched, moe=False, norms=False, router=False, loss=False, rope=False, swiglu=False)
    assert hf_scatter.patch_report(patched) == {}
    hf_scatter.patch_model(patched, rope=False, swiglu=False)
    assert not {"fused_rope", "fused_swiglu"} & set(hf_scatter.patch_report(patched).values())
    hf_scatter.patch_model(patched, norms=False)
    assert "fused_add_norm" not in hf_scatter.patch_report(patched).values()
    assert "router_topk" in hf_scatter.patch_report(patched).values()
    hf_scatter.patch_model(patched)
    hf_scatter.unpatch_model(patched)
    assert hf_scatter.patch_report(patched) == {}
    assert "scattermoe" not in repr(patched) and repr(patched) == repr(vanilla)
    assert patched.config._experts_implementation == vanilla.config._experts_implementation
    assert torch.equal(patched(ids).logits, vanilla(ids).logits)


@pytest.mark.kernel_bodies("reference")
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_pickles_whole_and_is_freed_by_del(family, pickled_copy, freed_by_del):
    """torch.save of the whole patched model loads back patched, with the same logits; ``del model`` frees it
    without the garbage collector, as it frees a vanilla model (GPU memory comes back at once)."""
    _, patched = vanilla_and_patched(family, "cpu")
    loaded = pickled_copy(patched)
    ids = _ids("cpu")
    assert hf_scatter.patch_report(loaded) == hf_scatter.patch_report(patched)
    assert torch.equal(loaded(ids).logits, patched(ids).logits)
    holder = [patched]
    del patched
    assert freed_by_del(holder)


def test_patch_transformers_is_class_level_and_unpatch_restores_classes_exactly():
    from transformers import AutoModelForCausalLM

    bases = [hf_scatter.patching._family_base(f) for f in hf_scatter.models.families().values()]
    before = {cls: dict(vars(cls)) for cls in bases}
    hf_scatter.patch_transformers()
    hf_scatter.patch_transformers()  # twice is harmless
    try:
        for family in FAMILIES:
            model = AutoModelForCausalLM.from_config(CONFIGS[family]())
            assert patched_experts(model) == MOE_LAYERS, family
            assert "router_topk" in hf_scatter.patch_report(model).values(), family
        explicit = AutoModelForCausalLM.from_config(tiny_mixtral_config(), experts_implementation="eager")
        assert explicit.config._experts_implementation == "eager", "an explicit load-time choice wins"
        assert set(hf_scatter.patch_report(tiny_bert()).values()) == {"fused_add_norm", UNPADDED}
        hf_scatter.patch_transformers(moe=False, norms=False, router=False, loss=False)
        assert hf_scatter.patch_report(AutoModelForCausalLM.from_config(tiny_dbrx_config())) == {}
    finally:
        hf_scatter.unpatch_transformers()
    assert {cls: dict(vars(cls)) for cls in before} == before
    for family in FAMILIES:
        assert hf_scatter.patch_report(AutoModelForCausalLM.from_config(CONFIGS[family]())) == {}, family


def test_experts_implementation_switch_works_without_patching(tmp_path):
    from transformers import AutoModelForCausalLM

    tiny_mixtral().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="scattermoe")
    assert set(hf_scatter.patch_report(model).values()) == {"scattermoe (ExpertsInterface)"}
    model.set_experts_implementation("eager")
    assert hf_scatter.patch_report(model) == {}


def test_bad_input_gets_clear_errors():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match=r"model_type 'llama'.*Supported: bert, dbrx, deepseek_v2, .*, qwen3_moe, qwen3_next, and"):
        hf_scatter.patch_model(llama)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hf_scatter.patch_model(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="unknown option.*experts_kernel.*the options are moe"):
        hf_scatter.patch_model(tiny_mixtral(), experts_kernel=True)
    with pytest.raises(TypeError, match="moe must be True or False"):
        hf_scatter.patch_transformers(moe="yes")
    assert not hf_scatter.patching.transformers_patched()


@pytest.mark.parametrize("family,items", [(f, None) for f in FAMILIES] + [("qwen3_moe", 17)])
def test_training_loss_is_fused_and_equals_vanilla(family, items, device, integration_kernels):
    """Training with labels: no logits are made, and loss (router aux loss included) and every gradient are
    vanilla's; padded labels, and the Trainer's num_items_in_batch."""
    integration_kernels(family, interpreted=items is None)  # the item count is wiring: once interpreted is enough
    vanilla, patched = vanilla_and_patched(family, device, output_router_logits=family != "dbrx")
    assert hf_scatter.patch_report(patched)[""] == "fused_linear_cross_entropy"
    ids = _ids(device)
    labels = ids.clone()
    labels[0, :4] = -100
    kwargs = {} if items is None else {"num_items_in_batch": torch.tensor(items, device=device)}
    outs = []
    for model in (vanilla, patched):
        model.train()
        outs.append(_seeded_forward(model, ids, labels=labels, **kwargs))
    if isinstance(outs[0], Exception):  # transformers 5.17's Granite-MoE cannot add its unrecorded aux loss
        assert type(outs[1]) is type(outs[0]) and str(outs[1]) == str(outs[0])
        return
    for out in outs:
        out.loss.backward()
    assert outs[1].logits is None and outs[0].logits is not None
    assert "logits" not in outs[1] and outs[1]["loss"] is outs[1].loss and outs[1].to_tuple()[0] is outs[1].loss
    assert _rel(outs[1].loss, outs[0].loss) < 1e-6
    _assert_same_grads(vanilla, patched)
    as_tuple = patched(ids, labels=labels, return_dict=False, **kwargs)  # vanilla's tuple, logits included
    assert isinstance(as_tuple, tuple) and _rel(as_tuple[0], outs[0].loss) < 1e-6
    patched.eval()
    assert patched(ids, labels=labels).logits is not None, "eval keeps its logits"
    hf_scatter.patch_model(patched, loss=False)
    patched.train()
    assert patched(ids, labels=labels).logits is not None and "" not in hf_scatter.patch_report(patched)


@pytest.mark.kernel_bodies("reference")
@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_gives_the_same_gradients(family, device):
    vanilla, patched = vanilla_and_patched(family, device)
    for model in (vanilla, patched):
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        model.train()
        ids = _ids(device)
        model(ids, labels=ids).loss.backward()
    _assert_same_grads(vanilla, patched)


@pytest.mark.kernel_bodies("reference")
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_autocast_runs_in_bf16_and_stays_close(family, device):
    """Vanilla DBRX cannot run under autocast (its index_add_ mixes dtypes); the patched one can."""
    vanilla, patched = vanilla_and_patched(family, device)
    ids = _ids(device)
    want = vanilla(ids).logits
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = patched(ids, labels=ids)
    assert _rel(out.logits.float(), want) < 2e-2
    out.loss.backward()
    grads = _grads(patched)
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())


@pytest.mark.kernel_bodies("reference")
@pytest.mark.parametrize("family", FAMILIES)
def test_patching_a_model_under_accelerate_hooks(family, device):
    """``device_map`` / offloaded models run through accelerate hooks; patching afterwards must keep them.
    (Vanilla DBRX cannot run offloaded: its experts read ``mlp.w1`` outside the hooked ``mlp`` call.)"""
    from accelerate import cpu_offload

    vanilla, _ = vanilla_and_patched(family, device)
    ids = _ids(device)
    want = vanilla(ids).logits
    hooked = cpu_offload(copy.deepcopy(vanilla), execution_device=device)
    hf_scatter.patch_model(hooked)
    assert patched_experts(hooked) == MOE_LAYERS
    assert _rel(hooked(ids).logits, want) < 1e-5
    hf_scatter.unpatch_model(hooked)
    assert hf_scatter.patch_report(hooked) == {}
    if family != "dbrx":
        assert _rel(hooked(ids).logits, want) < 1e-5


@pytest.mark.parametrize("train", [False, True])
def test_bert_fused_add_layer_norm_matches_vanilla_outputs_and_gradients(train, device):
    """BERT's two dense -> dropout -> LayerNorm(h + input) blocks per layer, with padding; in training the
    dropout masks are the same draws as vanilla's (same modules, same order, same seed)."""
    vanilla = tiny_bert(hidden=72, heads=4, intermediate=100, hidden_dropout_prob=0.1).to(device)
    patched = hf_scatter.patch_model(copy.deepcopy(vanilla))
    assert list(hf_scatter.patch_report(patched).values()) == [UNPADDED] + ["fused_add_norm"] * 4
    ids = _ids(device)  # (gradients are asked for, so the padded path answers: this test is about the norms)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    outs, said = [], []
    for model in (vanilla, patched):
        model.train(train)
        torch.manual_seed(0)
        out, warned = _warned(lambda: model(ids, attention_mask=mask).last_hidden_state)
        said.append(warned)
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device)
        (out * probe).sum().backward()
        outs.append(out)
    assert _rel(outs[1], outs[0]) < 1e-5
    assert said[1] <= said[0]
    want, got = _grads(vanilla), _grads(patched)
    assert want.keys() == got.keys() and want
    scale = max(g.abs().max() for g in want.values())  # the key bias has an exactly-zero true gradient
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6 * scale, msg=name)


@pytest.mark.parametrize("bad", [None, "mistralai/Mixtral-8x7B-v0.1", 3])
def test_patch_functions_name_a_wrong_model_argument(bad):
    for fn in (hf_scatter.patch_model, hf_scatter.unpatch_model, hf_scatter.patch_report):
        with pytest.raises(TypeError, match="model argument"):
            fn(bad)
    if isinstance(bad, str):
        with pytest.raises(TypeError, match="from_pretrained"):
            hf_scatter.patch_model(bad)


def _renamed_kwarg(function):
    """A decorator shaped like transformers' ``deprecate_kwarg`` (5.24 wraps every attention forward)."""
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        if "past" in kwargs:
            kwargs["cache"] = kwargs.pop("past")
        return function(*args, **kwargs)
    return wrapped


def _rotate(x):
    return x + 1


@_renamed_kwarg
def _attention_like(x, cache=None):
    return _rotate(x) * (1 if cache is None else cache)


def test_rope_rebinding_reaches_through_decorators():
    from hf_scatter.models.fused_rope import forward_with_global
    rebound = forward_with_global(_attention_like, "_rotate", lambda x: x - 1)
    assert rebound is not None
    assert rebound(10, past=2) == 18 and _attention_like(10, past=2) == 22  # the original is untouched
    assert rebound.__wrapped__(10) == 9 and rebound.__name__ == "_attention_like"
    assert forward_with_global(_attention_like, "not_a_global_it_reads", None) is None


@pytest.mark.gpu
def test_a_missing_liger_kernel_is_said_once_per_op_and_the_step_stays_right(monkeypatch):
    """liger-kernel is a dependency on Linux x86-64 but an image can lack it: the RoPE then takes transformers'
    ops. Right results, but slower, so it says so once; the loss is hf-scatter's own and needs no Liger."""
    from hf_scatter.kernels import backend
    from hf_scatter.kernels import linear_cross_entropy as lce
    from hf_scatter.models import fused_rope

    monkeypatch.setattr(backend, "_warned", set())
    monkeypatch.setattr(fused_rope, "_liger_rope", lambda: None)
    monkeypatch.setattr(lce, "liger_available", lambda: False)
    vanilla, patched = vanilla_and_patched("qwen3_moe", "cuda")
    ids = _ids("cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            loss = patched.train()(input_ids=ids, labels=ids).loss
            loss.backward()
    said = [str(w.message) for w in caught if "liger-kernel does not import" in str(w.message)]
    assert [m.split()[1] for m in said] == ["fused_rope"], said
    want = vanilla.train()(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)


@pytest.mark.kernel_bodies("reference")  # the language layers' patching, not the kernels, is under test
def test_qwen3_5_moe_multimodal_model_patches_its_language_layers():
    """Qwen3.5-MoE checkpoints are multimodal (model_type "qwen3_5_moe"): patching the whole model fuses the routers
    and experts of its language layers, leaves the vision tower alone, and a text batch gives vanilla's logits,
    training loss and gradients."""
    import transformers
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    text = tiny_decoder_config("qwen3_5_moe_text", **ODD)
    config = transformers.Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=ODD["hidden"], patch_size=4,
        temporal_patch_size=1, spatial_merge_size=1))
    torch.manual_seed(0)
    vanilla = modeling_qwen3_5_moe.Qwen3_5MoeForConditionalGeneration(config)
    patched = hf_scatter.patch_model(copy.deepcopy(vanilla))
    report = hf_scatter.patch_report(patched)
    assert patched_experts(patched) == MOE_LAYERS
    assert not any(name.startswith("model.visual") for name in report)
    ids = _ids("cpu")
    with torch.no_grad():
        torch.testing.assert_close(patched.eval()(input_ids=ids).logits, vanilla.eval()(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    losses = [model.train()(input_ids=ids, labels=ids).loss for model in (vanilla, patched)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    _assert_same_grads(vanilla, patched)


def _saved_bytes(module, x):
    """Bytes autograd keeps for the backward of ``module(x)`` (each storage once), and the output."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    return sum(storages.values()), out


@pytest.mark.parametrize("hooked", [None, "module", "global"])
def test_fused_swiglu_keeps_one_activation_less_and_the_same_gradients(hooked):
    """DeepSeek's shared experts and dense layers: the patched MLP stores gate and up (not silu(gate) too) for
    the backward, and computes what vanilla does. A forward hook that keeps a projection's output (on it, or on
    every module) sees it unchanged after the backward (the gradients are then not written into it); without
    one, a second backward through the overwritten activations raises instead of computing with them."""
    model = TINY_BUILDERS["deepseek_v3"](**ODD)
    vanilla = model.model.layers[0].mlp  # the dense first layer's DeepseekV3MLP, I = 2 x 40
    patched = hf_scatter.patch_model(copy.deepcopy(model)).model.layers[0].mlp
    assert hf_scatter.patch_report(patched) == {"": "fused_swiglu"}
    tokens, width = 64, vanilla.gate_proj.out_features
    x = torch.randn(2, tokens // 2, ODD["hidden"], requires_grad=True)
    kept = []

    def keep(module, args, out):
        if module is patched.gate_proj:
            kept.append((out, out.detach().clone()))

    handle = (patched.gate_proj.register_forward_hook(keep) if hooked == "module" else
              torch.nn.modules.module.register_module_forward_hook(keep) if hooked == "global" else None)
    want_bytes, want = _saved_bytes(vanilla, x)
    try:
        got_bytes, got = _saved_bytes(patched, x)
    finally:
        if handle is not None:
            handle.remove()
    assert want_bytes - got_bytes == tokens * width * 4  # one fp32 [T, I] activation less
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    dy = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [x, *vanilla.parameters()], dy)
    got_grads = torch.autograd.grad(got, [x, *patched.parameters()], dy)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert len(kept) == (hooked is not None)
    for out, copied in kept:
        assert torch.equal(out, copied), "the backward wrote into an output a hook kept"
    if hooked is None:  # (a forward outside saved_tensors_hooks, which skip autograd's version check)
        again = patched(x)
        torch.autograd.grad(again, x, dy, retain_graph=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(again, x, dy)


def test_a_fused_class_subclassed_again_still_runs_the_familys_own_code():
    """FSDP2's fully_shard subclasses each wrapped module's class again: the fused dense MLP's fallback for
    activations other than SiLU, and a decoder layer called with positional arguments, still reach the family's
    own class (not the wrapper's base)."""
    from hf_scatter.models.class_patch import vanilla_class

    vanilla = TINY_BUILDERS["deepseek_v3"](**ODD, hidden_act="gelu")
    patched = hf_scatter.patch_model(copy.deepcopy(vanilla))
    mlp, layer = patched.model.layers[0].mlp, patched.model.layers[1]
    for module in (mlp, layer):
        fused = type(module)
        module.__class__ = type(f"Wrapped{fused.__name__}", (fused,), {})  # what fully_shard does
        assert vanilla_class(type(module)) is fused.__mro__[1]
    x = torch.randn(2, 5, ODD["hidden"])
    rope = vanilla.model.rotary_emb(x, torch.arange(5)[None])
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), vanilla.model.layers[0].mlp(x), rtol=0, atol=0)
        # the attention mask positionally (None: causal attention without padding)
        torch.testing.assert_close(layer(x, None, position_embeddings=rope),
                                   vanilla.model.layers[1](x, None, position_embeddings=rope), rtol=1e-5, atol=1e-5)


def test_gpt_oss_norms_round_once_after_the_weight_in_bf16(device, monkeypatch):
    """GptOssRMSNorm rounds once, after its weight; the Llama-style norms of the other families round before it.
    In fp32 (the suite above) the two are one computation, and with weights of one they agree in bf16 too. So
    here: bf16, random norm weights, bf16 and float32 (how GPT-OSS checkpoints load their norms), and the
    kernels' torch path (HF's own ops): the patched model must feed its first attention and experts, and its
    final norm return, vanilla's bits. (RoPE stays vanilla: on a GPU the fused one is Liger's, other bits.)"""
    monkeypatch.setenv("HF_SCATTER_KERNELS", "torch")
    vanilla = TINY_BUILDERS["gpt_oss"](**ODD).to(device=device, dtype=torch.bfloat16)
    vanilla.set_experts_implementation("eager")
    with torch.no_grad():
        for layer in vanilla.model.layers:
            layer.input_layernorm.weight.normal_()
            layer.post_attention_layernorm.float().weight.normal_()
        vanilla.model.norm.weight.normal_()
    patched = hf_scatter.patch_model(copy.deepcopy(vanilla), rope=False)
    report = hf_scatter.patch_report(patched)
    assert report["model.norm"] == report["model.layers.0"] == report["model.layers.0.input_layernorm"] \
        == "fused_add_norm"
    inputs = {}
    for name, model in (("vanilla", vanilla), ("patched", patched)):
        layer = model.model.layers[0]
        layer.self_attn.register_forward_pre_hook(
            lambda m, args, kwargs, name=name: inputs.__setitem__((name, "attention"), kwargs["hidden_states"]),
            with_kwargs=True)
        layer.mlp.register_forward_pre_hook(lambda m, args, name=name: inputs.__setitem__((name, "mlp"), args[0]))
        model(_ids(device))
    for where in ("attention", "mlp"):
        got, want = inputs["patched", where], inputs["vanilla", where]
        assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want), where
    h = torch.randn(2, 5, ODD["hidden"], device=device, dtype=torch.bfloat16)
    got, want = patched.model.norm(h), vanilla.model.norm(h)
    assert got.dtype == want.dtype and torch.equal(got, want)


class _LinearSavingItsWeight(torch.autograd.Function):
    """``F.linear`` as DeepSpeed's ZeRO-3 runs it: the weight itself saved for backward, never a view of it."""

    @staticmethod
    def forward(ctx, x, weight, bias=None):
        ctx.save_for_backward(x, weight, bias)
        y = x.matmul(weight.t())
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        rows = dy.reshape(-1, dy.shape[-1])
        return (dy.matmul(weight), rows.t().matmul(x.reshape(-1, x.shape[-1])),
                None if bias is None else rows.sum(0))


@pytest.mark.kernel_bodies("reference")
@pytest.mark.parametrize("family", ["mixtral", "dbrx", "gpt_oss", "deepseek_v3"])
def test_nothing_saved_for_backward_holds_a_view_of_a_parameter(family, monkeypatch):
    """ZeRO-3 frees each gathered parameter after forward by giving it new, empty data: a tensor saved for
    backward that is a view of a parameter (a transposed or reshaped expert weight) keeps the whole gathered
    weight alive until backward instead (Mixtral, 4 layers on 4 H100s: 11 GiB more per GPU). With F.linear
    as ZeRO-3 runs it, no saved tensor of a patched model's training step may alias a parameter's memory
    without being that parameter (the experts save the parameter and rebuild their view in backward)."""
    import torch.nn.functional as F

    monkeypatch.setattr(F, "linear", lambda x, w, b=None: _LinearSavingItsWeight.apply(x, w, b))
    _, patched = vanilla_and_patched(family, "cpu")
    params = {}
    for name, p in patched.named_parameters():
        params.setdefault(p.untyped_storage().data_ptr(), []).append((name, p))
    views = []

    def pack(t):
        views.extend(f"{name}: saved {tuple(t.shape)} of {tuple(p.shape)}" for name, p in
                     params.get(t.untyped_storage().data_ptr(), ()) if t.numel() and t is not p)
        return t

    ids = _ids("cpu")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = patched(input_ids=ids, labels=ids).loss
    loss.backward()
    assert not views, "\n".join(views)
    assert all(p.grad is not None for p in patched.parameters() if p.requires_grad)
