"""GPT-OSS MXFP4 checkpoints load as shipped: the experts keep the checkpoint's bytes (no bf16 copy), generate
the tokens transformers' own (dequantizing) load generates, train what is around them, and save back as
shipped; transformers' own path stays one argument away."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Mxfp4Config

import hf_scatter
from hf_scatter.models.mxfp4_experts import Mxfp4GptOssExperts, save_mxfp4_checkpoint
from hf_scatter.tiny import tiny_decoder

pytestmark = pytest.mark.kernel_bodies("reference")  # the kernels' MXFP4 arithmetic: tests/kernels/test_mxfp4.py
# Both models compute with the same values in float32, in different orders (grouped products against
# transformers' per-expert loop): what differs is float32 rounding over sums of ~100 products, ~1e-6 relative
# per layer; one decoded value wrong moves the result by about 1e-2.
FP32_REL = 1e-5


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


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
    prompt = torch.tensor([[5, 17, 101, 42, 7, 250, 3]])
    with torch.no_grad():
        assert _rel_err(ours(prompt).logits, stock(prompt).logits) < FP32_REL
        want = stock.generate(prompt, max_new_tokens=8, do_sample=False)
        got = ours.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)


def test_frozen_mxfp4_experts_pass_gradients_to_what_trains(checkpoint):
    """The experts get no gradient, the layers around them get the gradients of the dequantized model."""
    stock = _transformers_own(checkpoint)
    ours = hf_scatter.from_pretrained(checkpoint, dtype=torch.float32)
    ids = torch.tensor([[9, 8, 30, 200, 11, 6]])
    for model in (stock, ours):
        model.requires_grad_(False)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.requires_grad_(True)
        model(ids, labels=ids).loss.backward()
    for a, b in zip(ours.model.layers, stock.model.layers):
        assert _rel_err(a.self_attn.q_proj.weight.grad, b.self_attn.q_proj.weight.grad) < FP32_REL
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
    peft = pytest.importorskip("peft")
    from transformers import Trainer, TrainingArguments

    model = hf_scatter.from_pretrained(checkpoint, dtype=torch.float32)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=2, learning_rate=3e-2,
                             save_strategy="no", report_to=[], logging_steps=1, disable_tqdm=True, use_cpu=True)
    rows = [{"input_ids": torch.arange(i, i + 10) % 300 + 1, "labels": torch.arange(i, i + 10) % 300 + 1}
            for i in range(4)]
    with pytest.raises(ValueError, match="adapter"):
        Trainer(model=model, args=args, train_dataset=rows)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainer = Trainer(model=adapted, args=args, train_dataset=rows)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses[-1] < losses[0], losses
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
