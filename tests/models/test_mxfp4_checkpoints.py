"""GPT-OSS MXFP4 checkpoints load as shipped: the experts keep the checkpoint's bytes (no bf16 copy), generate
the tokens transformers' own (dequantizing) load generates, train what is around them, and save back as
shipped; transformers' own path stays one argument away."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Mxfp4Config

import hf_scatter
from shipped_cases import assert_adapter_trains, assert_generates_like, assert_trains_like, training_case
from hf_scatter.models.mxfp4_experts import Mxfp4GptOssExperts, save_mxfp4_checkpoint
from hf_scatter.tiny import tiny_decoder

pytestmark = pytest.mark.kernel_bodies("reference")  # the kernels' MXFP4 arithmetic: tests/kernels/test_mxfp4.py


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mxfp4") / "gpt-oss"
    model = tiny_decoder("gpt_oss", seed=3)
    with torch.no_grad():  # trained-looking biases, so the experts' bias path counts
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.normal_(std=0.05)
    save_mxfp4_checkpoint(model, path)
    return path


def test_experts_keep_the_checkpoints_bytes_and_nothing_is_dequantized(checkpoint):
    model = hf_scatter.from_pretrained(checkpoint, dtype=torch.float32)
    shipped = load_file(checkpoint / "model.safetensors")
    experts = {n: m for n, m in model.named_modules() if isinstance(m, Mxfp4GptOssExperts)}
    assert len(experts) == model.config.num_hidden_layers
    for name, module in experts.items():
        for leaf in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"):
            assert torch.equal(getattr(module, leaf), shipped[f"{name}.{leaf}"]), (name, leaf)
    # no float copy of an expert weight anywhere: every float tensor is one the checkpoint holds as floats
    floats = {k for k, v in model.state_dict().items() if v.is_floating_point()}
    assert floats == {k for k, v in shipped.items() if v.is_floating_point()}
    report = hf_scatter.patch_report(model)
    assert all("MXFP4" in report[name] for name in experts), report


def _transformers_own(checkpoint):
    """transformers' own load of the checkpoint (no hub kernels here: it dequantizes), in float32 throughout
    (5.17 dequantizes the experts to bf16 whatever the dtype asked for; their values are exact in either)."""
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).float()


def test_greedy_tokens_equal_transformers_own_load_in_fp32(checkpoint):
    """transformers dequantizes the same checkpoint: the same values, so the same tokens."""
    stock = _transformers_own(checkpoint)
    assert not any(isinstance(m, Mxfp4GptOssExperts) for m in stock.modules())  # the stock quantizer ran
    ours = hf_scatter.from_pretrained(checkpoint, dtype=torch.float32)
    assert_generates_like(ours, stock)


def test_frozen_mxfp4_experts_pass_gradients_to_what_trains(checkpoint):
    """The experts get no gradient, the layers around them get the gradients of the dequantized model."""
    stock = _transformers_own(checkpoint)
    ours = hf_scatter.from_pretrained(checkpoint, dtype=torch.float32)
    assert_trains_like(ours, stock, lambda layer: layer.self_attn.q_proj.weight)
    assert not any(p.requires_grad for m in ours.modules() if isinstance(m, Mxfp4GptOssExperts)
                   for p in (m.gate_up_proj_blocks, m.down_proj_blocks))


def test_save_pretrained_writes_the_shipped_keys_back(checkpoint, tmp_path):
    model = hf_scatter.from_pretrained(checkpoint, dtype=torch.float32)
    model.save_pretrained(tmp_path / "again")
    shipped, saved = load_file(checkpoint / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert saved.keys() == shipped.keys()
    assert all(torch.equal(saved[k], shipped[k]) for k in shipped if k.endswith(("_blocks", "_scales")))
    again = hf_scatter.from_pretrained(tmp_path / "again", dtype=torch.float32)
    assert any(isinstance(m, Mxfp4GptOssExperts) for m in again.modules())


def test_dequantize_asks_for_transformers_own_path_and_the_table_is_given_back(checkpoint):
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    stock_entry = AUTO_QUANTIZER_MAPPING["mxfp4"]
    bf16 = hf_scatter.from_pretrained(checkpoint, quantization_config=Mxfp4Config(dequantize=True))
    assert not any(isinstance(m, Mxfp4GptOssExperts) for m in bf16.modules())
    assert AUTO_QUANTIZER_MAPPING["mxfp4"] is stock_entry  # from_pretrained's own switch, undone
    hf_scatter.patch_transformers()
    try:
        patched = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        assert any(isinstance(m, Mxfp4GptOssExperts) for m in patched.modules())
    finally:
        hf_scatter.unpatch_transformers()
    assert AUTO_QUANTIZER_MAPPING["mxfp4"] is stock_entry


def test_trainer_trains_a_lora_adapter_around_the_frozen_mxfp4_experts(checkpoint, tmp_path):
    """transformers' Trainer accepts the quantized model with a PEFT adapter (not without one) and trains the
    adapter: its loss falls, the MXFP4 bytes stay the checkpoint's."""
    pytest.importorskip("peft")
    from transformers import Trainer

    model = hf_scatter.from_pretrained(checkpoint, dtype=torch.float32)
    args, rows = training_case(tmp_path)
    with pytest.raises(ValueError, match="adapter"):
        Trainer(model=model, args=args, train_dataset=rows)
    adapted = assert_adapter_trains(model, args, rows, ["q_proj", "v_proj"])
    shipped = load_file(checkpoint / "model.safetensors")
    experts = adapted.base_model.model.model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj_blocks, shipped["model.layers.0.mlp.experts.gate_up_proj_blocks"])


def test_offloading_streams_the_shipped_bytes_and_generates_transformers_own_tokens(checkpoint):
    """Offloaded as loaded: the store holds the checkpoint's MXFP4 bytes (no float copy of an expert), and greedy
    tokens are those of transformers' own dequantizing load."""
    from hf_scatter.offload import Policy

    prompt = torch.tensor([[5, 17, 101, 42, 7, 250, 3], [0, 0, 9, 8, 30, 200, 11]])
    mask = (torch.arange(7) >= torch.tensor([[0], [2]])).long()
    with torch.no_grad():
        want = _transformers_own(checkpoint).generate(prompt, attention_mask=mask, max_new_tokens=8,
                                                      do_sample=False, pad_token_id=0)
    model = hf_scatter.from_pretrained(checkpoint, dtype=torch.float32)
    shipped = sum(t.nbytes for name, t in model.state_dict().items() if ".experts." in name)
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu",
                                   policy=Policy(2, 1, weights_gpu_fraction=0.0), progress=False)
    layout = off.store.layout
    # the experts' columns, and the output projection's bias (added once, after the columns' sum)
    streamed = [e for t in layout.stage_tables for n, e in t.entries.items()
                if n.startswith("streamed.") or n == "post.down_bias"]
    assert {e.dtype for e in streamed} == {torch.uint8, torch.float32}  # blocks and scales; the biases
    assert sum(e.nbytes for e in streamed) == shipped  # every expert byte streams as shipped, nothing more
    assert "| experts' weights | MXFP4, as shipped |" in off.describe()
    assert off.generate(prompt, attention_mask=mask, max_new_tokens=8, progress=False).tolist() == want.tolist()


def test_the_converter_refuses_a_quantized_checkpoint_before_writing(checkpoint, tmp_path, capsys):
    from hf_scatter.cli import main

    assert main(["convert", str(checkpoint), str(tmp_path / "out")]) != 0
    said = capsys.readouterr().err
    assert "quantized (mxfp4)" in said and "never dequantizes" in said
    assert not (tmp_path / "out").exists()
