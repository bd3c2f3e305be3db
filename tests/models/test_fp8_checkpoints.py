"""Block-scaled FP8 checkpoints (DeepSeek-V3 and Qwen3-FP8 layout) load as shipped: experts and linear layers
keep the checkpoint's bytes (no float copy), generate the tokens transformers' own (dequantizing) load
generates, train what is around them, and save back as shipped; transformers' own path stays one argument
away."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

import hf_scatter
from shipped_cases import assert_adapter_trains, assert_generates_like, assert_trains_like, training_case
from hf_scatter.kernels.fp8_blocks import FP8_DTYPE
from hf_scatter.models.fp8_experts import Fp8BlockLinear, save_fp8_checkpoint
from hf_scatter.tiny import tiny_decoder

pytestmark = pytest.mark.kernel_bodies("reference")  # the kernels' FP8 arithmetic: tests/kernels/test_fp8_blocks.py
# the tiny models' dimensions are multiples of these blocks (releases use 128 x 128 on their own dimensions)
FAMILIES = {"qwen3_moe": (32, 32), "deepseek_v3": (8, 8)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8") / request.param
    save_fp8_checkpoint(tiny_decoder(request.param, seed=3), path, block=FAMILIES[request.param])
    return path


def _fp8_experts(model):
    return {n: m for n, m in model.named_modules() if type(m).__name__ == "FP8Experts"}


def test_weights_keep_the_checkpoints_bytes_and_nothing_is_dequantized(checkpoint):
    model = hf_scatter.from_pretrained(checkpoint, dtype=torch.float32)
    shipped = load_file(checkpoint / "model.safetensors")
    experts = _fp8_experts(model)
    assert len(experts) == sum(k.endswith(".experts.0.down_proj.weight") for k in shipped) > 0
    for name, module in experts.items():
        for e in range(module.num_experts):
            gate_up = torch.cat([shipped[f"{name}.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")])
            assert torch.equal(module.gate_up_proj[e].view(torch.uint8), gate_up.view(torch.uint8))
            assert torch.equal(module.down_proj[e].view(torch.uint8), shipped[f"{name}.{e}.down_proj.weight"].view(
                torch.uint8))
            scales = torch.cat([shipped[f"{name}.{e}.{p}.weight_scale_inv"] for p in ("gate_proj", "up_proj")])
            assert torch.equal(module.gate_up_proj_scale_inv[e], scales)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Fp8BlockLinear)}
    assert linears and all(torch.equal(m.weight.view(torch.uint8), shipped[f"{n}.weight"].view(torch.uint8))
                           for n, m in linears.items())
    # no float copy of a quantized weight anywhere: every float tensor is one the checkpoint holds as floats
    state = model.state_dict()
    assert {k for k, v in state.items() if v.dtype == FP8_DTYPE} and \
        not any(v.dtype == FP8_DTYPE for k, v in shipped.items() if k.removesuffix(".weight") + ".weight" not in state
                and ".experts." not in k)
    floats = {k for k, v in state.items() if v.is_floating_point() and v.dtype != FP8_DTYPE and "scale_inv" not in k}
    assert floats == {k for k, v in shipped.items() if v.is_floating_point() and v.dtype != FP8_DTYPE
                      and "scale_inv" not in k}
    report = hf_scatter.patch_report(model)
    assert all("FP8 block-scaled weights as shipped" in report[name] for name in experts), report
    assert all(report[name].startswith("fp8 block-scaled linear") for name in linears)


def _transformers_own(checkpoint):
    """transformers' own load of the checkpoint, dequantized (what it does without a GPU; with one, its FP8
    modules need a kernel from the hub), in float32 throughout."""
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                quantization_config=FineGrainedFP8Config(dequantize=True))


def test_greedy_tokens_equal_transformers_own_load_in_fp32(checkpoint):
    """transformers dequantizes the same checkpoint: the same values, so the same tokens."""
    stock = _transformers_own(checkpoint)
    assert not _fp8_experts(stock) and not any(p.dtype == FP8_DTYPE for p in stock.parameters())
    ours = hf_scatter.from_pretrained(checkpoint, dtype=torch.float32)
    assert_generates_like(ours, stock)


def test_frozen_fp8_weights_pass_gradients_to_what_trains(checkpoint):
    """The FP8 weights get no gradient; the norms around them get the gradients of the dequantized model."""
    stock = _transformers_own(checkpoint)
    ours = hf_scatter.from_pretrained(checkpoint, dtype=torch.float32)
    assert_trains_like(ours, stock, lambda layer: layer.input_layernorm.weight)
    stored = [p for p in ours.parameters() if p.dtype == FP8_DTYPE]
    assert stored and all(p.grad is None for p in stored)


def test_fp8_weights_load_frozen(checkpoint):
    """An optimizer over ``model.parameters()`` (a full fine-tune) gets no FP8 tensor to step: training stays
    in float, around the frozen checkpoint."""
    model = hf_scatter.from_pretrained(checkpoint, dtype=torch.float32)
    frozen = [n for n, p in model.named_parameters() if p.dtype == FP8_DTYPE or n.endswith("scale_inv")]
    assert frozen and not any(model.get_parameter(n).requires_grad for n in frozen)
    assert any(p.requires_grad for p in model.parameters())  # the norms, routers and embeddings train


def test_save_pretrained_writes_the_shipped_keys_back(checkpoint, tmp_path):
    model = hf_scatter.from_pretrained(checkpoint, dtype=torch.float32)
    model.save_pretrained(tmp_path / "again")
    shipped, saved = load_file(checkpoint / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert saved.keys() == shipped.keys()
    assert all(torch.equal(saved[k].view(torch.uint8), shipped[k].view(torch.uint8)) for k in shipped
               if shipped[k].dtype == FP8_DTYPE)
    again = hf_scatter.from_pretrained(tmp_path / "again", dtype=torch.float32)
    assert _fp8_experts(again)


def test_dequantize_asks_for_transformers_own_path_and_the_table_is_given_back(checkpoint):
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    stock_entry, stock_mxfp4 = AUTO_QUANTIZER_MAPPING["fp8"], AUTO_QUANTIZER_MAPPING["mxfp4"]
    floats = hf_scatter.from_pretrained(checkpoint, dtype=torch.float32,
                                        quantization_config=FineGrainedFP8Config(dequantize=True))
    assert not _fp8_experts(floats) and not any(p.dtype == FP8_DTYPE for p in floats.parameters())
    assert AUTO_QUANTIZER_MAPPING["fp8"] is stock_entry  # from_pretrained's own switch, undone
    hf_scatter.patch_transformers()
    try:
        patched = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        assert _fp8_experts(patched)
    finally:
        hf_scatter.unpatch_transformers()
    assert AUTO_QUANTIZER_MAPPING["fp8"] is stock_entry
    with hf_scatter.load_as_shipped():  # switched on for the process inside a block: the block's exit keeps it
        hf_scatter.patch_transformers()
    try:
        assert AUTO_QUANTIZER_MAPPING["fp8"] is not stock_entry and AUTO_QUANTIZER_MAPPING["mxfp4"] is not stock_mxfp4
    finally:
        hf_scatter.unpatch_transformers()
    assert AUTO_QUANTIZER_MAPPING["fp8"] is stock_entry and AUTO_QUANTIZER_MAPPING["mxfp4"] is stock_mxfp4


def test_trainer_trains_a_lora_adapter_on_fp8_attention(checkpoint, tmp_path):
    """PEFT wraps the FP8 attention projections with a LoRA adapter; the adapter trains (its loss falls) and the
    FP8 bytes stay the checkpoint's."""
    model = hf_scatter.from_pretrained(checkpoint, dtype=torch.float32)
    target = ["q_proj", "v_proj"] if "qwen" in checkpoint.name else ["q_b_proj", "kv_b_proj"]
    adapted = assert_adapter_trains(model, *training_case(tmp_path), target)
    shipped = load_file(checkpoint / "model.safetensors")
    base = adapted.base_model.model.model.layers[-1].self_attn.o_proj
    key = f"model.layers.{len(adapted.base_model.model.model.layers) - 1}.self_attn.o_proj.weight"
    assert torch.equal(base.weight.view(torch.uint8), shipped[key].view(torch.uint8))


def test_the_converter_keeps_fp8_as_shipped_both_ways(checkpoint, tmp_path, capsys):
    """Per-expert FP8 weights and their scales are stacked into the fused experts (scales moving with their blocks
    of rows), never dequantized: --verify passes, the converted model reads FP8 experts and generates the
    original's tokens, and converting back gives the original tensors bit for bit. --dtype is refused."""
    from hf_scatter.cli import main

    fused, back = tmp_path / "fused", tmp_path / "back"
    assert main(["convert", str(checkpoint), str(fused), "--verify", "--no-progress"]) == 0, capsys.readouterr().err
    stacked = load_file(fused / "model.safetensors")
    experts = [k for k in stacked if ".experts." in k and not k.endswith("_scale_inv")]
    assert experts and all(stacked[k].dtype == FP8_DTYPE and stacked[f"{k}_scale_inv"].dim() == 3 for k in experts)
    model = hf_scatter.from_pretrained(fused, dtype=torch.float32)
    assert _fp8_experts(model) and "as shipped" in " ".join(hf_scatter.patch_report(model).values())
    prompt = torch.tensor([[5, 17, 101, 42, 7]])
    want = hf_scatter.from_pretrained(checkpoint, dtype=torch.float32).generate(prompt, max_new_tokens=6,
                                                                                do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), want)
    assert main(["convert", str(fused), str(back), "--to", "hf", "--no-progress"]) == 0, capsys.readouterr().err
    shipped, again = load_file(checkpoint / "model.safetensors"), load_file(back / "model.safetensors")
    assert shipped.keys() == again.keys()
    assert all(torch.equal(shipped[k].view(torch.uint8), again[k].view(torch.uint8)) for k in shipped)
    assert main(["convert", str(checkpoint), str(tmp_path / "cast"), "--dtype", "bfloat16"]) != 0
    said = capsys.readouterr().err
    assert "would cast FP8 weights" in said and "leave --dtype out" in said
    assert not (tmp_path / "cast").exists()


def test_offloading_streams_the_shipped_fp8_bytes_and_generates_transformers_own_tokens(checkpoint):
    """Offloaded as loaded: the experts' FP8 bytes and scales stream as shipped (part of every expert's columns
    resident, in whole blocks), the dense FP8 layers (Qwen3's attention; DeepSeek's latent attention, shared
    experts and first dense layer) decoded into float, and greedy tokens (every expert streamed, and only the
    routed ones) are those of transformers' own dequantizing load."""
    from hf_scatter.offload import Policy

    model = hf_scatter.from_pretrained(checkpoint, dtype=torch.float32)
    prompt = torch.tensor([[5, 17, 101, 42, 7, 250, 3], [0, 0, 9, 8, 30, 200, 11]])
    mask = (torch.arange(7) >= torch.tensor([[0], [2]])).long()
    with torch.no_grad():
        want = _transformers_own(checkpoint).generate(prompt, attention_mask=mask, max_new_tokens=8,
                                                      do_sample=False, pad_token_id=0)
    shipped = sum(t.nbytes for name, t in model.state_dict().items() if ".experts." in name)
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu", progress=False,
                                   policy=Policy(2, 1, weights_gpu_fraction=0.8))
    layout = off.store.layout
    block = FAMILIES[checkpoint.name][0]
    split = [s.columns for s, layer in zip(layout.splits, model.model.layers) if hasattr(layer.mlp, "experts")]
    assert split and all(c < 96 and c % block == 0 for c in split)  # part of every expert resident, whole blocks
    experts = [e for t in (*layout.stage_tables, *layout.resident_tables) for n, e in t.entries.items()
               if n.startswith(("resident.", "streamed."))]  # the experts' column parts
    assert {e.dtype for e in experts} == {FP8_DTYPE, torch.float32}  # bytes and scales
    assert sum(e.nbytes for e in experts) == shipped  # every expert byte as shipped, nothing more
    assert "| experts' weights | FP8, as shipped |" in off.describe()
    for mode in ("all", "routed"):
        off.expert_streaming = mode
        assert off.generate(prompt, attention_mask=mask, max_new_tokens=8, progress=False).tolist() == want.tolist()
