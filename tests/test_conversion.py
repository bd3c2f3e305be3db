"""`hf-scatter convert`: lossless both ways, loads patched with the same logits, streams, and refuses bad
input without leaving a partial destination."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import hf_scatter
from hf_scatter.cli import main as cli_main
from hf_scatter.conversion import CONFIG_KEY, ConversionError, build_plan, convert
from hf_scatter.tiny import tiny_dbrx, tiny_mixtral

SHARD = "60KB"  # tiny models are ~900 kB: every checkpoint here has many shards


def _save_fused(model, path, shards: int = 3) -> None:
    """A Mixtral checkpoint under transformers 5's in-memory names (a raw state_dict dump), sharded."""
    os.makedirs(path)
    model.config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    keys = sorted(state)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: state[k] for k in part}, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _checkpoint(kind: str, path, tokenizer=None, **config):
    """Write a multi-shard tiny checkpoint of ``kind``; returns the model it holds."""
    if kind == "mixtral-fused":
        model = tiny_mixtral(experts=5, top_k=3, hidden=40, intermediate=56, **config)
        _save_fused(model, path)
    else:
        model = (tiny_mixtral if kind == "mixtral" else tiny_dbrx)(**config)
        model.save_pretrained(path, max_shard_size=SHARD)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return model


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _digest(path) -> dict[str, str]:
    return {name: hashlib.sha256(open(os.path.join(path, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(path))}


def _leftovers(parent) -> list[str]:
    return [n for n in os.listdir(parent) if n.startswith(".")]


KINDS = ["mixtral", "mixtral-fused", "dbrx"]


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_bitwise_and_the_layout_is_stacked(kind, tmp_path, tokenizer):
    src, dst, back = tmp_path / "src", tmp_path / "hfs", tmp_path / "back"
    _checkpoint(kind, src, tokenizer)
    before = _digest(src)
    convert(str(src), str(dst), max_shard_size=SHARD, progress=False)
    convert(str(dst), str(back), to="hf", max_shard_size=SHARD, progress=False)
    assert _digest(src) == before, "the source directory changed"

    original, stacked, restored = _tensors(src), _tensors(dst), _tensors(back)
    assert set(restored) == set(original)
    for key, tensor in original.items():
        assert restored[key].dtype == tensor.dtype and torch.equal(restored[key], tensor), key
    assert not any(".experts.0." in k for k in stacked), "per-expert tensors left in the hf-scatter layout"
    assert sum(t.numel() for t in stacked.values()) == sum(t.numel() for t in original.values())
    assert len([n for n in os.listdir(dst) if n.endswith(".safetensors")]) > 1, "max shard size ignored"

    config = json.loads((dst / "config.json").read_text())
    assert config[CONFIG_KEY]["format_version"] == 1
    assert CONFIG_KEY not in json.loads((back / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    assert _leftovers(tmp_path) == []


def _count_expert_stacking(monkeypatch) -> list[str]:
    """Records every per-expert merge/concatenation transformers runs while loading."""
    from transformers import core_model_loading as loading

    calls = []
    for cls in (loading.MergeModulelist, loading.Concatenate):
        original = cls.convert

        def convert(self, *args, _original=original, _name=cls.__name__, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "convert", convert)
    return calls


@pytest.mark.parametrize("kind", KINDS)
def test_converted_checkpoint_loads_patched_with_vanilla_logits_and_no_stacking(kind, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    src, dst = tmp_path / "src", tmp_path / "hfs"
    _checkpoint(kind, src)
    convert(str(src), str(dst), max_shard_size=SHARD, progress=False)
    tokens = torch.randint(3, 300, (2, 11))
    vanilla = AutoModelForCausalLM.from_pretrained(src)
    expected = vanilla(tokens).logits

    stacking = _count_expert_stacking(monkeypatch)
    hf_scatter.patch_transformers()
    try:
        model = AutoModelForCausalLM.from_pretrained(dst)
    finally:
        hf_scatter.unpatch_transformers()
    assert stacking == [], f"loading the converted checkpoint stacked experts: {stacking}"
    assert hf_scatter.patch_report(model), "not patched"
    torch.testing.assert_close(model(tokens).logits, expected, rtol=1e-5, atol=1e-5)

    model = hf_scatter.from_pretrained(dst)
    assert hf_scatter.patch_report(model)
    torch.testing.assert_close(model(tokens).logits, expected, rtol=1e-5, atol=1e-5)
    if kind == "mixtral":  # the probe sees the stacking an HF per-expert checkpoint needs
        AutoModelForCausalLM.from_pretrained(src)
        assert stacking


def test_dtype_cast_verify_and_dry_run(tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "hfs"
    model = _checkpoint("mixtral", src)
    assert cli_main(["convert", str(src), str(dst), "--dtype", "bfloat16", "--dry-run"]) == 0
    plan_text = capsys.readouterr().out
    assert "model.layers.1.mlp.experts.gate_up_proj [4, 192, 64] bfloat16 <- 8 tensors" in plan_text
    assert not dst.exists()

    assert cli_main(["convert", str(src), str(dst), "--dtype", "bfloat16", "--verify", "--no-progress"]) == 0
    assert "verify: max abs logits difference" in capsys.readouterr().out
    stacked = _tensors(dst)
    assert all(t.dtype == torch.bfloat16 for t in stacked.values())
    state = model.state_dict()
    for key, tensor in stacked.items():
        assert torch.equal(tensor, state[key].to(torch.bfloat16)), key
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"


def test_verify_catches_a_wrong_conversion_and_leaves_no_dst(tmp_path, monkeypatch):
    from hf_scatter.conversion import writer

    src, dst = tmp_path / "src", tmp_path / "hfs"
    _checkpoint("mixtral", src)
    assemble = writer._assemble

    def swapped_experts(t, reader):  # gate and up halves exchanged: shapes fine, numbers wrong
        out = assemble(t, reader)
        return out.roll(out.shape[1] // 2, dims=1) if t.spec.name.endswith("gate_up_proj") else out

    monkeypatch.setattr(writer, "_assemble", swapped_experts)
    with pytest.raises(ConversionError, match="verify failed: logits of .* differ"):
        convert(str(src), str(dst), verify=True, progress=False)
    assert not dst.exists() and _leftovers(tmp_path) == []


def test_interrupted_run_leaves_no_partial_dst_and_keeps_an_old_one(tmp_path, monkeypatch):
    from hf_scatter.conversion import writer

    src, dst = tmp_path / "src", tmp_path / "hfs"
    _checkpoint("mixtral", src)
    assemble, calls = writer._assemble, []

    def interrupted(t, reader):
        calls.append(t.spec.name)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return assemble(t, reader)

    monkeypatch.setattr(writer, "_assemble", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(str(src), str(dst), max_shard_size=SHARD, progress=False)
    assert not dst.exists() and _leftovers(tmp_path) == []

    dst.mkdir()
    (dst / "keep.txt").write_text("old")
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        convert(str(src), str(dst), overwrite=True, progress=False)
    assert os.listdir(dst) == ["keep.txt"] and _leftovers(tmp_path) == []

    monkeypatch.setattr(writer, "_assemble", assemble)
    convert(str(src), str(dst), overwrite=True, progress=False)
    assert not (dst / "keep.txt").exists() and (dst / "config.json").exists()


# ------------------------------------------------------------------------------------------ bad input
def _edit_config(src, **changes):
    config = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        if isinstance(value, dict):
            config[key].update(value)
        else:
            config[key] = value
    (src / "config.json").write_text(json.dumps(config))


def _rewrite_shard(src, key: str, new: torch.Tensor | None, new_key: str | None = None) -> str:
    """Replace (or drop, with ``new=None``) tensor ``key`` in its shard, keeping the index consistent;
    ``new_key`` adds ``new`` as an extra tensor instead."""
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"][key]
    with safe_open(str(src / shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if new_key is not None:
        tensors[new_key] = new
        index["weight_map"][new_key] = shard
    elif new is None:
        del tensors[key], index["weight_map"][key]
    else:
        tensors[key] = new
    save_file(tensors, str(src / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    return shard


def _shard_of(src, key: str) -> str:
    return json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][key]


EXPERT = "model.layers.1.block_sparse_moe.experts.2.w3.weight"


def _truncate(src):
    shard = _shard_of(src, EXPERT)
    path = src / shard
    path.write_bytes(path.read_bytes()[:-100])
    return [shard]


def _corrupt_header(src):
    shard = _shard_of(src, EXPERT)
    data = bytearray((src / shard).read_bytes())
    data[8:40] = b"\x00garbage, not a json header!!!!"[:32]
    (src / shard).write_bytes(bytes(data))
    return [shard]


BAD_INPUTS = {
    "unknown architecture": (lambda src: _edit_config(src, model_type="llama") or ["config.json", "'llama'"],
                             "unknown architecture"),
    "missing key": (lambda src: _rewrite_shard(src, EXPERT, None) and [EXPERT], "missing tensor"),
    "extra key": (lambda src: [_rewrite_shard(src, EXPERT, torch.zeros(3), "model.layers.0.extra.weight"),
                               "model.layers.0.extra.weight"], "unexpected tensor"),
    "shape mismatch": (lambda src: [_rewrite_shard(src, EXPERT, torch.zeros(95, 64)), EXPERT, "[95, 64]"],
                       "has shape"),
    "truncated file": (_truncate, "truncated"),
    "corrupt file": (_corrupt_header, "corrupt"),
    "too few experts in config": (lambda src: _edit_config(src, num_local_experts=3) or
                                  [_shard_of(src, "model.layers.0.block_sparse_moe.experts.3.w1.weight"),
                                   "model.layers.0.block_sparse_moe.experts.3.w1.weight"], "expert count mismatch"),
    "too many experts in config": (lambda src: _edit_config(src, num_local_experts=6) or
                                   ["model.layers.0.block_sparse_moe.experts.4.w1.weight"],
                                   "expert count mismatch"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_names_file_and_tensor_exits_nonzero_and_leaves_no_dst(case, tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "hfs"
    _checkpoint("mixtral", src)
    damage, message = BAD_INPUTS[case]
    names = damage(src)
    before = _digest(src)
    capsys.readouterr()
    assert cli_main(["convert", str(src), str(dst), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-scatter convert: error: ") and message in err, err
    for name in names:
        assert name in err, (name, err)
    assert not dst.exists() and _leftovers(tmp_path) == []
    assert _digest(src) == before


@pytest.mark.parametrize("kind,edit", [("dbrx", {"ffn_config": {"moe_num_experts": 3}}),
                                       ("mixtral-fused", {"num_local_experts": 4})])
def test_expert_count_mismatch_in_stacked_checkpoints(kind, edit, tmp_path):
    src = tmp_path / "src"
    _checkpoint(kind, src)
    _edit_config(src, **edit)
    with pytest.raises(ConversionError, match=r"\.safetensors: tensor '.*experts.*' has shape .*expert count"):
        build_plan(str(src), str(tmp_path / "hfs"))


def test_refusals_name_the_fix(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "hfs"
    _checkpoint("dbrx", src)
    dst.mkdir()
    with pytest.raises(ConversionError, match="exists: pass --overwrite"):
        build_plan(str(src), str(dst))
    with pytest.raises(ConversionError, match="outside the source"):
        build_plan(str(src), str(src / "inside"))
    with pytest.raises(ConversionError, match="not an hf-scatter checkpoint"):
        build_plan(str(src), str(tmp_path / "x"), to="hf")
    convert(str(src), str(dst), overwrite=True, progress=False)
    with pytest.raises(ConversionError, match="already in the hf-scatter layout.*--to hf"):
        build_plan(str(dst), str(tmp_path / "x"))
    with pytest.raises(ConversionError, match="max shard size 'lots'"):
        build_plan(str(src), str(tmp_path / "x"), max_shard_size="lots")
    with pytest.raises(ConversionError, match="fused.* does not exist for dbrx"):
        build_plan(str(dst), str(tmp_path / "x"), to="hf", hf_naming="fused")


_MEASURE = """
import json, resource, sys
from hf_scatter.conversion import build_plan, convert
src, dst, shard = sys.argv[1:]
build_plan(src, dst + "-plan", max_shard_size=shard)  # imports and a meta model: not what we measure
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
convert(src, dst, max_shard_size=shard, progress=False)
print(json.dumps({"before_kb": before, "after_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def test_peak_memory_is_bounded_by_shards_not_the_model(tmp_path):
    """A 100 MB model converts with 8 MB shards; its peak resident memory grows by about one shard."""
    src, dst = tmp_path / "src", tmp_path / "hfs"
    shard = 8 * 2**20
    tiny_mixtral(hidden=256, intermediate=512, experts=8, layers=6, vocab=512).save_pretrained(
        src, max_shard_size=shard)
    model_bytes = sum(os.path.getsize(src / n) for n in os.listdir(src) if n.endswith(".safetensors"))
    assert model_bytes > 9 * shard
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(src), str(dst), str(shard)], check=True,
                         capture_output=True, text=True, env=env).stdout
    rss = json.loads(out.splitlines()[-1])
    growth = (rss["after_kb"] - rss["before_kb"]) * 1024
    assert growth < 2 * shard, f"peak RSS grew by {growth / 2**20:.1f} MiB for a {model_bytes / 2**20:.0f} MiB model"
    assert set(_tensors(dst)) == set(tiny_mixtral(hidden=8, intermediate=8, experts=8, layers=6,
                                                  vocab=512).state_dict())
