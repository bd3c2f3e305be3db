"""Fine-tune a patched MoE model with transformers' Trainer on several processes: FSDP2, DeepSpeed ZeRO-3, or
transformers' expert parallelism. One process per GPU:

    torchrun --nproc_per_node 8 examples/trainer_distributed.py --engine fsdp2 --model PATH --text train.txt

The rule for every engine: patch the plain model, then let the engine shard it (docs/distributed.md).
``--cpu`` runs the same recipe on CPU processes (gloo; DeepSpeed's CPU accelerator), as the tests do.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("fsdp2", "zero3", "ep"), required=True)
    parser.add_argument("--model", required=True, help="a local checkpoint directory (or a hub name)")
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--text", help="a text file, one training example per line (needs the model's tokenizer)")
    data.add_argument("--random-rows", type=int, help="this many rows of random token ids (a smoke test)")
    parser.add_argument("--length", type=int, default=512, help="tokens per row (longer lines are cut)")
    parser.add_argument("--batch", type=int, default=1, help="rows per process and step")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--optim", default="adamw_torch",
                        help="the optimizer, by its TrainingArguments name (adamw_torch_fused, adafactor, sgd, ...)")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPUs)")
    parser.add_argument("--out", default="trained", help="where the final vanilla checkpoint is written")
    parser.add_argument("--cpu", action="store_true", help="CPU processes with gloo (tests, no GPU)")
    return parser.parse_args(argv)


def check_launch(engine: str) -> None:
    """Fail before loading anything when the script was not started by torchrun: every engine needs its ranks."""
    if "LOCAL_RANK" not in os.environ:
        sys.exit(f"trainer_distributed.py: --engine {engine} needs one process per GPU; start it with "
                 "`torchrun --nproc_per_node N examples/trainer_distributed.py ...`.")


def zero3_config() -> dict:
    """ZeRO-3; "auto" lets Trainer fill in what TrainingArguments already says (batch, clipping, precision)."""
    return {"zero_optimization": {"stage": 3, "overlap_comm": True,
                                  # one consolidated 16-bit state dict at save: a vanilla checkpoint
                                  "stage3_gather_16bit_weights_on_model_save": True},
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}


def fsdp2_arguments() -> dict:
    """FSDP2 through accelerate: every decoder layer (the model's ``_no_split_modules``) and the root sharded."""
    return {"fsdp": "full_shard auto_wrap",
            "fsdp_config": {"version": 2, "reshard_after_forward": True, "state_dict_type": "FULL_STATE_DICT"}}


def load_model(args: argparse.Namespace, world: int):
    import torch
    from transformers import AutoModelForCausalLM

    import hf_scatter

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if args.engine == "ep":
        # transformers shards the experts at load time; the scattermoe backend must be in place by then.
        import dataclasses

        from transformers.distributed import DistributedConfig

        if "ep_size" not in {f.name for f in dataclasses.fields(DistributedConfig)}:
            sys.exit("--engine ep needs a transformers release with DistributedConfig(ep_size=...) (5.2x); "
                     "earlier releases shard experts only on the tensor-parallel group (docs/distributed.md).")
        hf_scatter.patch_transformers()
        try:
            model = AutoModelForCausalLM.from_pretrained(
                args.model, dtype=dtype, distributed_config=DistributedConfig(ep_size=world, fsdp_size=world))
        finally:
            hf_scatter.unpatch_transformers()  # the classes as before; the loaded model stays patched
    else:
        # Under ZeRO-3 (the DeepSpeed config is known to TrainingArguments by now) this loads each parameter
        # already partitioned; patching a partitioned model is fine, the kernels see gathered parameters.
        model = hf_scatter.patch_model(AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype))
    model.config.use_cache = False  # no KV cache in training steps
    return model


def dataset(args: argparse.Namespace, vocab_size: int):
    """(rows, collator): random equal-length rows, or the text file's lines padded per batch (labels -100)."""
    import torch
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq

    if args.random_rows:
        ids = torch.randint(3, vocab_size, (args.random_rows, args.length), generator=torch.Generator().manual_seed(0))
        return [{"input_ids": row, "labels": row} for row in ids], None
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with open(args.text, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    if not lines:
        sys.exit(f"trainer_distributed.py: {args.text} has no non-empty line to train on.")
    rows = []
    for line in lines:
        ids = tokenizer(line, truncation=True, max_length=args.length)["input_ids"]
        rows.append({"input_ids": ids, "labels": list(ids)})
    return rows, DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_launch(args.engine)
    if args.cpu:
        os.environ["DS_ACCELERATOR"] = "cpu"
        if args.engine == "zero3":
            import deepspeed.ops

            # DeepSpeed's shared-memory all-reduce for CPU processes is compiled at start-up: gloo does it.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    from transformers import Trainer, TrainingArguments

    engine = {"fsdp2": fsdp2_arguments(), "zero3": {"deepspeed": zero3_config()}, "ep": {}}[args.engine]
    training = TrainingArguments(args.out, per_device_train_batch_size=args.batch, max_steps=args.max_steps,
                                 learning_rate=args.lr, optim=args.optim, bf16=args.bf16, use_cpu=args.cpu,
                                 logging_steps=1, save_strategy="no", report_to=[], **engine)
    model = load_model(args, int(os.environ["WORLD_SIZE"]))
    rows, collate = dataset(args, model.config.vocab_size)
    trainer = Trainer(model=model, args=training, train_dataset=rows, data_collator=collate)
    trainer.train()
    trainer.save_model(args.out)  # a vanilla checkpoint: the same parameter names as the unpatched model
    import torch.distributed as dist

    if dist.is_initialized():  # no rank tears its group down while rank 0 still writes the checkpoint
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
