"""Training a patched model: transformers.Trainer side by side with vanilla, and PEFT LoRA on attention
projections and on the fused expert tensors."""

import copy

import pytest
import torch

import hf_scatter
from hf_scatter.tiny import DECODER_FAMILIES
from test_models import MOE_LAYERS, _assert_same_grads, _ids, _rel, patched_experts, vanilla_and_patched


def _recording_trainer(**kwargs):
    """A transformers.Trainer that keeps every step's loss (the logged ones are averaged and rounded)."""
    from transformers import Trainer

    class Recording(Trainer):
        def training_step(self, *args, **kw):
            loss = super().training_step(*args, **kw)
            self.losses.append(loss.item())
            return loss

    trainer = Recording(**kwargs)
    trainer.losses = []
    return trainer


def _train(model, tmp_path, steps, tokens):
    from transformers import TrainingArguments

    # SGD with momentum, not AdamW: AdamW's first steps move every weight by about the learning rate whatever
    # the gradient's size, so rounding noise in near-zero gradients grew into router-probability differences of
    # 2e-5 by step 11, against a Qwen3-MoE routing margin of 2.7e-5 (another summation order flipped a route)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4,
                             optim="sgd", optim_args="momentum=0.9", learning_rate=0.2, warmup_steps=0,
                             weight_decay=0.01, logging_steps=1,
                             save_strategy="no", report_to=[], seed=11, data_seed=11, dataloader_num_workers=0,
                             disable_tqdm=True, use_cpu=not torch.cuda.is_available())
    data = [{"input_ids": row, "labels": row} for row in tokens]
    trainer = _recording_trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return trainer.losses


# transformers 5.17 cannot train DBRX and Granite-MoE with their load-balancing loss (they drop the router
# logits); DeepSeek defines none
AUX_LOSS = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss")


# One family per router and decoder-layer kind (softmax top-k; group-limited sigmoid; top-k of the logits
# without fused norms; top-k of float32 logits with scaled residuals). Qwen2-MoE, OLMoE and DeepSeek-V2 share
# those code paths; every family's single step is checked gradient by gradient in test_models.
TRAINER_FAMILIES = ["mixtral", "dbrx", "qwen3_moe", "deepseek_v3", "gpt_oss", "granitemoe"]


# On the CPU the Trainer runs the kernels' torch reference (12 interpreted steps of Mixtral took 65 s of a 2-core
# machine's suite); the kernels are held to float64 references by their own tests and every family's interpreted
# step gradient by gradient in test_models; on a GPU the Trainer runs them. PEFT's wiring into the kernels keeps
# the interpreter for one family.
INTERPRETED_PEFT_FAMILY = "mixtral"


@pytest.mark.kernel_bodies("reference")
@pytest.mark.parametrize("family", TRAINER_FAMILIES)
def test_trainer_side_by_side_losses_and_final_weights_match(family, device, tmp_path):
    """The Trainer's steps (the fused training loss, the aux loss where the family has one) give vanilla's
    losses, and final weights within what 12 SGD steps make of float rounding."""
    vanilla, patched = vanilla_and_patched(family, device, output_router_logits=family in AUX_LOSS)
    tokens = _ids(torch.device("cpu"), batch=16, length=12, seed=3)
    steps = 12  # three epochs: the reference learns (loss -12%)
    want = _train(vanilla, tmp_path / "vanilla", steps, tokens)
    got = _train(patched, tmp_path / "patched", steps, tokens)
    assert len(got) == len(want) == steps
    assert want[-1] < 0.9 * want[0], "the reference run must actually learn for the comparison to mean something"
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs vanilla {b}"
    final_v, final_p = vanilla.state_dict(), patched.state_dict()
    worst = max(final_v, key=lambda k: _rel(final_p[k], final_v[k]))
    # measured: at most 2.6e-7 (loss) and 8e-7 (weights) over the six families, also under another summation order
    assert _rel(final_p[worst], final_v[worst]) < 1e-5, worst
    assert patched_experts(patched) == MOE_LAYERS


def _lora(family, **extra):
    from peft import LoraConfig

    experts = "block_sparse_moe.experts" if family == "granitemoe" else "mlp.experts"
    targets = {"mixtral": (["q_proj", "v_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
               "dbrx": (["Wqkv"], ["ffn.experts.mlp.w1", "ffn.experts.mlp.v1", "ffn.experts.mlp.w2"])}.get(
        family, (["o_proj"], [f"{experts}.gate_up_proj", f"{experts}.down_proj"]))
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets[0], target_parameters=targets[1], **extra)


@pytest.mark.parametrize("family", ["mixtral", *DECODER_FAMILIES])
def test_peft_lora_on_attention_and_experts_matches_vanilla_peft(family, device, kernel_bodies):
    """LoRA on an attention projection and on the fused 3-D expert tensors (PEFT's target_parameters),
    patched against vanilla PEFT, then merged."""
    kernel_bodies(family == INTERPRETED_PEFT_FAMILY)  # PEFT's wiring is under test here
    from peft import get_peft_model

    base, _ = vanilla_and_patched(family, device)
    cfg = _lora(family, init_lora_weights=False)  # random B: the adapters change the output
    torch.manual_seed(0)
    vanilla = get_peft_model(copy.deepcopy(base), cfg)
    torch.manual_seed(0)
    patched = hf_scatter.patch_model(get_peft_model(copy.deepcopy(base), cfg))
    assert patched_experts(patched) == MOE_LAYERS
    ids = _ids(device)
    want, got = vanilla(ids, labels=ids), patched(ids, labels=ids)
    assert _rel(got.logits, want.logits) < 1e-5
    want.loss.backward()
    got.loss.backward()
    _assert_same_grads(vanilla, patched)
    assert any("experts" in n and "lora_A" in n for n in _assert_lora_grads(patched))
    with torch.no_grad():
        unmerged = patched(ids).logits
        merged = patched.merge_and_unload()
        assert _rel(merged(ids).logits, unmerged) < 1e-5


def _assert_lora_grads(model):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if p.requires_grad)
    return names


@pytest.mark.kernel_bodies("reference")  # 6 steps of PEFT's wiring on DBRX; the interpreted LoRA step is above
def test_peft_lora_on_dbrx_experts_trains_and_merges_into_vanilla(device):
    """transformers' own DBRX cannot run LoRA on its expert tensors (it reads ``mlp.w1`` around PEFT's wrapper);
    the patched one can. The check against vanilla goes through the merge: merged weights in a vanilla model
    must give the patched adapter's outputs."""
    from peft import get_peft_model

    base, _ = vanilla_and_patched("dbrx", device)
    torch.manual_seed(0)
    model = hf_scatter.patch_model(get_peft_model(copy.deepcopy(base), _lora("dbrx")))
    ids = _ids(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
    names = _assert_lora_grads(model)
    assert sum("experts.mlp" in n for n in names) == 12  # (A, B) x (w1, v1, w2) x 2 layers
    assert losses[-1] < losses[0]
    with torch.no_grad():
        unmerged = model(ids).logits
        merged = hf_scatter.unpatch_model(model.merge_and_unload())
        assert hf_scatter.patch_report(merged) == {}
        assert _rel(merged(ids).logits, unmerged) < 1e-5
