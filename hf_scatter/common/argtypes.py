"""Command-line value types: each parses one kind of option and says in one line what is wrong with a bad
value (argparse names the option), so every command rejects bad input before it starts working."""

from __future__ import annotations

import argparse
import math
import re

from .units import parse_bytes

__all__ = ["byte_size", "eval_limit", "int_at_least", "non_negative_float", "positive_int", "positive_ints",
           "prompt_lengths", "torch_device"]


def int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)


def positive_ints(text: str) -> list[int]:
    """Comma-separated whole numbers >= 1, e.g. 1,4,16."""
    values = []
    for part in (p.strip() for p in text.split(",")):
        try:
            values.append(positive_int(part))
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (give whole numbers separated by commas, e.g. 1,4,16)") from None
    return values


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def eval_limit(text: str) -> int | float:
    """lm-eval's --limit: a document count (>= 1) or a share of each task (0 < fraction < 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if 0 < value < 1:
        return value
    if value >= 1 and value == int(value):
        return int(value)
    raise argparse.ArgumentTypeError(f"must be a document count >= 1 or a fraction between 0 and 1, got {text!r}")


# A number without a unit is bytes, and no memory budget or shard size is under a mebibyte: "--gpu-memory 16" means
# 16GiB, which read as 16 bytes drew "too small for the model" from the planner (and a shard per tensor from convert).
_SMALLEST_BARE_NUMBER = 2**20
_BARE_NUMBER = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*", re.IGNORECASE)


def byte_size(text: str) -> str:
    """Checked here, kept as written: the callers parse it again and print it in their reports."""
    try:
        value = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    bare = _BARE_NUMBER.fullmatch(text)
    if bare and value < _SMALLEST_BARE_NUMBER:
        number, note = bare.group(1), "(a number without a unit counts bytes)"
        if value < 2**10:
            raise argparse.ArgumentTypeError(f"{number} bytes: did you mean {number}GiB? {note}")
        raise argparse.ArgumentTypeError(f"{number} bytes is less than 1 MiB: write the unit, e.g. 16GiB or 500MB "
                                         f"{note}")
    return text


def prompt_lengths(text: str) -> list[float]:
    lengths = []
    for part in (p.strip() for p in text.split(",")):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a length: give a number of tokens, or several "
                                             f"separated by commas (e.g. 512 or 128,512,2048)") from None
        if not (math.isfinite(value) and value >= 1):
            raise argparse.ArgumentTypeError(f"prompt lengths must be at least 1 token, got {part!r}")
        lengths.append(value)
    return lengths


def torch_device(text: str) -> str:
    """cpu, cuda or cuda:N that exists on this machine."""
    import torch

    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu, cuda or cuda:N")
    if text.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(text.partition(":")[2] or 0)
        if index >= count:
            raise argparse.ArgumentTypeError(f"{text}: this machine has {count or 'no'} CUDA GPU(s)"
                                             + ("; use --device cpu" if not count else ""))
    return text
