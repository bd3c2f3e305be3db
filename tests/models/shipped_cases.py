"""What the checkpoints-as-shipped tests (MXFP4, FP8) compare against transformers' own dequantizing load."""

import torch

# Both models compute with the same values in float32, in different orders (grouped products against
# transformers' per-expert loop): what differs is float32 rounding over sums of ~100 products, ~1e-6 relative
# per layer; one decoded value wrong moves the result by about 1e-2.
FP32_REL = 1e-5


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def assert_generates_like(ours, stock) -> None:
    """The same logits (within float32 rounding) and the same greedy tokens as transformers' own load."""
    prompt = torch.tensor([[5, 17, 101, 42, 7, 250, 3]])
    with torch.no_grad():
        assert rel_err(ours(prompt).logits, stock(prompt).logits) < FP32_REL
        want = stock.generate(prompt, max_new_tokens=8, do_sample=False)
        got = ours.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)


def assert_trains_like(ours, stock, trainable) -> None:
    """With only ``trainable(layer)`` of each decoder layer training, its gradients equal those of transformers'
    own load (the quantized weights frozen between them)."""
    ids = torch.tensor([[9, 8, 30, 200, 11, 6]])
    for model in (stock, ours):
        model.requires_grad_(False)
        for layer in model.model.layers:
            trainable(layer).requires_grad_(True)
        model(ids, labels=ids).loss.backward()
    for a, b in zip(ours.model.layers, stock.model.layers):
        assert rel_err(trainable(a).grad, trainable(b).grad) < FP32_REL


def training_case(tmp_path) -> tuple:
    """The ``Trainer`` arguments and rows the adapter tests train with: six steps on the CPU, no checkpoints."""
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=2, learning_rate=3e-2,
                             save_strategy="no", report_to=[], logging_steps=1, disable_tqdm=True, use_cpu=True)
    rows = [{"input_ids": torch.arange(i, i + 10) % 300 + 1, "labels": torch.arange(i, i + 10) % 300 + 1}
            for i in range(4)]
    return args, rows


def assert_adapter_trains(model, args, rows, target_modules: list[str]):
    """A PEFT LoRA adapter on ``target_modules`` trains under ``Trainer``: its loss falls. Returns the adapted
    model."""
    import pytest

    peft = pytest.importorskip("peft")
    from transformers import Trainer

    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=target_modules))
    trainer = Trainer(model=adapted, args=args, train_dataset=rows)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses[-1] < losses[0], losses
    return adapted
