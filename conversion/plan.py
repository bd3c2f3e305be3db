"""The conversion plan: every output tensor, where each of its pieces comes from, and which shard it goes
to. Building it reads only config.json and the safetensors headers, and checks the whole input (keys,
shapes, expert count, truncated files) before anything is written."""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import stat
import tempfile
from dataclasses import dataclass, field

import torch

from .layout import (CONFIG_KEY, EXPERT_COUNT_KEYS, FORMAT_VERSION, Correspondence, correspondences, detect_scheme,
                     expert_index, scheme_name)
from .quantized import BLOCK, QUANT_METHOD, with_scales
from .safetensors_io import ConversionError, TensorInfo, TensorSpec, read_header

TO_SCATTER, TO_HF = "hf-scatter", "hf"
INDEX_NAME = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
# What --overwrite may replace besides config.json, the weights and the files the plan copies: what
# save_pretrained writes for a causal LM and its tokenizer, and the model card and license of a hub download.
_CHECKPOINT_FILES = frozenset({
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
    "README.md", "LICENSE", "LICENSE.txt", "NOTICE", "USE_POLICY.md", ".gitattributes"})
_SHARD_NAME = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Piece:
    """``count`` elements of ``source`` from element ``src_offset`` land at ``dst_offset`` of the output."""

    source: TensorInfo
    src_offset: int
    dst_offset: int
    count: int


@dataclass
class OutputTensor:
    spec: TensorSpec
    pieces: list[Piece]


@dataclass
class Plan:
    src: str
    dst: str
    to: str
    model_type: str
    scheme: str  # the HF side's naming
    dtype: torch.dtype | None
    config: dict  # config.json to write
    shards: dict[str, list[OutputTensor]]  # file name -> tensors in write order
    copies: list[str]  # other files of SRC copied as they are
    skipped: list[str] = field(default_factory=list)  # weight files of other formats, not copied
    replaces: tuple[int, int] | None = None  # device and inode of the DST that --overwrite may replace

    @property
    def total_bytes(self) -> int:
        return sum(t.spec.nbytes for tensors in self.shards.values() for t in tensors)

    def describe(self) -> str:
        """Human-readable plan for ``--dry-run``."""
        n = sum(len(t) for t in self.shards.values())
        hf = f"HF ({self.scheme})"
        direction = f"{hf} -> hf-scatter" if self.to == TO_SCATTER else f"hf-scatter -> {hf}"
        cast = f", cast to {str(self.dtype).removeprefix('torch.')}" if self.dtype else ""
        lines = [f"convert {self.src} -> {self.dst}", f"  {self.model_type}, {direction}{cast}",
                 f"  {n} tensors, {format_size(self.total_bytes)} in {len(self.shards)} shard(s)"]
        for name, tensors in self.shards.items():
            lines.append(f"  {name}: {len(tensors)} tensors, {format_size(sum(t.spec.nbytes for t in tensors))}")
            for t in tensors:
                sources = sorted({p.source.name for p in t.pieces})
                origin = sources[0] if len(sources) == 1 else f"{len(sources)} tensors: {sources[0]} ..."
                lines.append(f"    {t.spec.name} {list(t.spec.shape)} {str(t.spec.dtype).removeprefix('torch.')}"
                             f" <- {origin}")
        if self.copies:
            lines.append(f"  copy: {', '.join(self.copies)}")
        if self.skipped:
            lines.append(f"  not copied (other weight formats): {', '.join(self.skipped)}")
        return "\n".join(lines)


def format_size(nbytes: int) -> str:
    """Decimal units, as checkpoint shard sizes are written ("5.0 GB")."""
    from tqdm import tqdm

    return tqdm.format_sizeof(nbytes, "B", 1000)


def parse_size(size: int | str) -> int:
    """``--max-shard-size``: bytes, or e.g. '5GB' (powers of ten) / '4GiB' (powers of two)."""
    from hf_scatter.common.units import parse_bytes

    try:
        return parse_bytes(size, "max shard size")
    except ValueError as e:
        raise ConversionError(str(e)) from None


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ConversionError(f"dtype {name!r} is not supported: use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _natural(key: str) -> list:
    """Sort key that puts layer 10 after layer 9, so each layer's tensors sit together in one shard."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def read_tensors(src: str) -> tuple[dict[str, TensorInfo], list[str]]:
    """Every tensor of the checkpoint directory ``src`` (single file or sharded with an index), and the
    weight files read."""
    index_path = os.path.join(src, INDEX_NAME)
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConversionError(f"{index_path}: not a valid safetensors index ({e!r})") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
        weight_map = None
    if not files:
        others = [f for f in os.listdir(src) if f.endswith(_WEIGHT_SUFFIXES)]
        hint = (f" (found {', '.join(others)}: load it with transformers and save_pretrained it as safetensors "
                f"first)") if others else ""
        raise ConversionError(f"{src}: no safetensors weights{hint}")
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        path = os.path.join(src, name)
        if not os.path.isfile(path):
            raise ConversionError(f"{index_path} lists {name}, which does not exist")
        for key, info in read_header(path).items():
            if weight_map is not None and weight_map.get(key) != name:
                raise ConversionError(f"{path}: tensor {key!r} is not mapped to this file by {INDEX_NAME}")
            if key in tensors:
                raise ConversionError(f"{path}: tensor {key!r} is also in {tensors[key].path}")
            tensors[key] = info
    if weight_map is not None:
        for key, name in weight_map.items():
            if key not in tensors:
                raise ConversionError(f"{os.path.join(src, name)}: tensor {key!r} is listed in {INDEX_NAME} but "
                                      f"missing from the file")
    return tensors, files


def _expert_count(config: dict) -> tuple[str, int | None]:
    """config.json's expert count and the name the family gives it."""
    for key in EXPERT_COUNT_KEYS:
        if config.get(key) is not None:
            return key, config[key]
    return "ffn_config.moe_num_experts", (config.get("ffn_config") or {}).get("moe_num_experts")


def _check_expert_count(tensors: dict[str, TensorInfo], config: dict) -> None:
    """Per-expert checkpoints: the experts on disk are exactly 0..E-1 of config.json."""
    per_expert = sorted((k for k in tensors if expert_index(k) is not None), key=_natural)
    name, num_experts = _expert_count(config)
    if not per_expert or num_experts is None:
        return
    found = max(expert_index(k) for k in per_expert) + 1
    if found > num_experts:
        info = tensors[next(k for k in per_expert if expert_index(k) >= num_experts)]
        raise ConversionError(f"{info.path}: tensor {info.name!r} is expert {expert_index(info.name)}, but "
                              f"config.json says {name}={num_experts} (expert count mismatch)")
    if found < num_experts:
        example = re.sub(r"experts\.\d+\.", f"experts.{found}.", per_expert[0])
        raise ConversionError(f"expert count mismatch: config.json says {name}={num_experts}, the "
                              f"weight files hold experts 0..{found - 1} (no tensor {example!r})")


def _check_inputs(tensors: dict[str, TensorInfo], expected: dict[str, tuple[int, ...]], optional: set[str],
                  config: dict, src: str) -> None:
    _check_expert_count(tensors, config)
    num_experts = _expert_count(config)[1]
    # expert tensors first: with a wrong expert count, theirs is the error that explains the others
    for key, info in sorted(tensors.items(), key=lambda item: "experts" not in item[0]):
        if key not in expected:
            raise ConversionError(f"{info.path}: unexpected tensor {key!r}: not part of a {config['model_type']} "
                                  f"checkpoint with this config.json")
        if info.shape != expected[key]:
            hint = (f"; config.json says {num_experts} experts (expert count mismatch?)"
                    if "experts" in key else "")
            raise ConversionError(f"{info.path}: tensor {key!r} has shape {list(info.shape)}, config.json implies "
                                  f"{list(expected[key])}{hint}")
    missing = sorted((k for k in expected if k not in tensors and k not in optional), key=_natural)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConversionError(f"{src}: missing tensor {missing[0]!r}{more}: no weight file has it")


def _outputs(corr: Correspondence, to: str, tensors: dict[str, TensorInfo],
             dtype: torch.dtype | None) -> list[OutputTensor]:
    out_shapes = corr.scatter_shapes if to == TO_SCATTER else corr.hf_shapes
    pieces: dict[str, list[Piece]] = {}
    for link in corr.links:
        src_key, src_off, dst_key, dst_off = ((link.hf_key, link.hf_offset, link.scatter_key, link.scatter_offset)
                                              if to == TO_SCATTER else
                                              (link.scatter_key, link.scatter_offset, link.hf_key, link.hf_offset))
        if src_key in tensors:
            pieces.setdefault(dst_key, []).append(Piece(tensors[src_key], src_off, dst_off, link.count))
    outputs = []
    for key in sorted(pieces, key=_natural):
        source_dtypes = {p.source.dtype for p in pieces[key]}
        if len(source_dtypes) > 1:
            names = sorted(p.source.name for p in pieces[key])
            raise ConversionError(f"tensors {names[0]!r} ... of {key!r} have mixed dtypes "
                                  f"{sorted(map(str, source_dtypes))}: pass --dtype to choose one")
        (src_dtype,) = source_dtypes
        out_dtype = dtype if dtype is not None and src_dtype.is_floating_point else src_dtype
        outputs.append(OutputTensor(TensorSpec(key, out_dtype, out_shapes[key]), pieces[key]))
    return outputs


def _shard(outputs: list[OutputTensor], max_bytes: int) -> dict[str, list[OutputTensor]]:
    groups: list[list[OutputTensor]] = [[]]
    size = 0
    for t in outputs:
        if groups[-1] and size + t.spec.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.spec.nbytes
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": g for i, g in enumerate(groups)}


def _check_paths(src: str, dst: str) -> None:
    if not os.path.isdir(src):
        raise ConversionError(f"{src}: not a checkpoint directory")
    real_src, real_dst = os.path.realpath(src), os.path.realpath(dst)
    if real_dst == real_src or real_dst.startswith(real_src + os.sep) or real_src.startswith(real_dst + os.sep):
        raise ConversionError(f"{dst}: the destination must be outside the source directory {src} (and not "
                              f"contain it): the source is never modified")


def _listing(names: list[str], shown: int = 5) -> str:
    more = f" (and {len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def not_a_checkpoint(dst: str, copies: list[str]) -> list[str]:
    """Why the existing directory ``dst`` is not a checkpoint that --overwrite may replace (empty when it is)."""
    entries = sorted(os.listdir(dst))
    if not entries:
        return []  # nothing in it to lose
    listed = set()  # the shards an index names, whatever their names (but only safetensors files)
    try:
        with open(os.path.join(dst, INDEX_NAME)) as f:
            listed = {n for n in json.load(f)["weight_map"].values() if str(n).endswith(".safetensors")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    allowed = {"config.json", INDEX_NAME, *_CHECKPOINT_FILES, *copies, *listed}
    unexpected, weights = [], False
    for name in entries:
        mode = os.lstat(os.path.join(dst, name)).st_mode
        if not stat.S_ISREG(mode):
            unexpected.append(name + "/" if stat.S_ISDIR(mode) else name)
        elif _SHARD_NAME.match(name) or name in listed:
            weights = True
        elif name not in allowed:
            unexpected.append(name)
    problems = []
    if "config.json" not in entries:
        problems.append("no config.json" + ("" if unexpected else f" (it holds {_listing(entries)})"))
    elif not weights:
        try:
            with open(os.path.join(dst, "config.json")) as f:
                marked = CONFIG_KEY in json.load(f)
        except (OSError, ValueError, TypeError):
            marked = False
        if not marked:
            problems.append("no safetensors weights")
    if unexpected:
        what = "entry" if len(unexpected) == 1 else "entries"
        problems.append(f"{len(unexpected)} {what} a checkpoint does not hold: {_listing(unexpected)}")
    return problems


def check_folder(dst: str) -> None:
    """DST's folder exists or can be created, and can be written: said before any work (``--dry-run`` too),
    not found as a failed write at the end. Tried by making a directory there, as the converter will: mode
    bits do not tell for root or a read-only mount."""
    folder = existing = os.path.dirname(os.path.abspath(dst))
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConversionError(f"{existing}: {os.strerror(errno.ENOTDIR)}: cannot create {dst} in it; "
                              f"choose another DST")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.probe-", dir=existing))
    except OSError as e:
        where = folder if existing == folder else f"{existing} (to create {folder})"
        raise ConversionError(f"{where}: {os.strerror(e.errno)}: cannot write {dst} there; choose another "
                              f"DST") from None


def _check_destination(dst: str, overwrite: bool, copies: list[str]) -> tuple[int, int] | None:
    """--overwrite never deletes what the converter did not write: it replaces only a checkpoint directory.

    Returns that directory's device and inode, taken before its contents are checked: the writer replaces it
    only if what is at DST in the end is still this directory, and still a checkpoint."""
    if not os.path.lexists(dst):
        return None
    st = os.lstat(dst)
    fix = "remove it yourself or choose another DST"
    if os.path.islink(dst):
        raise ConversionError(f"{dst} is a symbolic link (to {os.readlink(dst)}): the converter writes a directory "
                              f"and replaces only a checkpoint directory, never a link; {fix}")
    if not os.path.isdir(dst):
        raise ConversionError(f"{dst} is a file: the converter writes a directory and replaces only a checkpoint "
                              f"directory; {fix}")
    problems = not_a_checkpoint(dst, copies)
    if problems:
        raise ConversionError(f"{dst} is not a checkpoint directory, which is all --overwrite replaces: "
                              f"{'; '.join(problems)}. Move what you want to keep out of {dst}, or choose "
                              f"another DST")
    if not overwrite:
        raise ConversionError(f"{dst} exists: pass --overwrite to replace it")
    return st.st_dev, st.st_ino


@functools.lru_cache(maxsize=None)
def supported_model_types() -> tuple[str, ...]:
    """The MoE causal-LM families ``patch_model`` runs (the registry's): the hf-scatter layout is a layout of
    experts, so a family whose configs name no expert count (BERT) has nothing to convert."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import hf_scatter

    return tuple(t for t in hf_scatter.supported_model_types() if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                 and _expert_count(AutoConfig.for_model(t).get_text_config().to_dict())[1] is not None)


def build_plan(src: str, dst: str, to: str = TO_SCATTER, dtype: str | torch.dtype | None = None,
               max_shard_size: int | str = "5GB", hf_naming: str | None = None, overwrite: bool = False) -> Plan:
    from transformers import AutoConfig

    from hf_scatter import __version__

    _check_paths(src, dst)
    check_folder(dst)
    copies, skipped = [], []
    for name in sorted(os.listdir(src)):
        if name in ("config.json", INDEX_NAME) or not os.path.isfile(os.path.join(src, name)):
            continue
        (skipped if name.endswith(_WEIGHT_SUFFIXES) else copies).append(name)
    skipped = [n for n in skipped if not n.endswith(".safetensors")]
    replaces = _check_destination(dst, overwrite, copies)
    dtype, max_bytes = parse_dtype(dtype), parse_size(max_shard_size)
    config_path = os.path.join(src, "config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ConversionError(f"{config_path}: missing (a checkpoint directory needs its config.json)") from None
    except json.JSONDecodeError as e:
        raise ConversionError(f"{config_path}: not valid JSON ({e})") from None
    model_type = config.get("model_type")
    if model_type not in supported_model_types():
        raise ConversionError(f"{config_path}: unknown architecture model_type={model_type!r} "
                              f"(architectures={config.get('architectures')}); hf-scatter convert supports "
                              f"{', '.join(supported_model_types())}")
    quantization = config.get("quantization_config") or {}
    quantized = quantization.get("quant_method")
    if quantized and quantized != QUANT_METHOD:  # before any tensor is read
        raise ConversionError(f"{config_path}: the weights are quantized ({quantized}); hf-scatter convert keeps "
                              f"block-scaled FP8 as shipped and never dequantizes. A {quantized} checkpoint loads as "
                              f"it ships (GPT-OSS's MXFP4 experts are fused already: hf_scatter.from_pretrained keeps "
                              f"them MXFP4); to convert a float copy, load it dequantized and save_pretrained it first")
    if quantized and dtype is not None:
        raise ConversionError(f"{config_path}: --dtype {str(dtype).removeprefix('torch.')} would cast FP8 weights "
                              f"(quant_method {quantized!r}), which hf-scatter convert keeps as shipped: leave "
                              f"--dtype out")
    marker = config.get(CONFIG_KEY)
    tensors, _ = read_tensors(src)
    if to == TO_SCATTER and marker is not None:
        raise ConversionError(f"{config_path}: already in the hf-scatter layout (format {marker}); use "
                              f"--to hf to convert it back")
    if to == TO_SCATTER and hf_naming is not None:
        raise ConversionError("--hf-naming applies to --to hf only: the source naming is read from its keys")
    if to == TO_HF and marker is None:
        raise ConversionError(f"{config_path}: not an hf-scatter checkpoint (no {CONFIG_KEY!r} entry); "
                              f"it is already an HF checkpoint")
    if to not in (TO_SCATTER, TO_HF):
        raise ConversionError(f"unknown target {to!r}: use {TO_SCATTER!r} or {TO_HF!r}")
    out_config = {k: v for k, v in config.items() if k != CONFIG_KEY}
    try:
        found = correspondences(AutoConfig.for_model(**out_config))
    except ValueError as e:  # a config transformers rejects, or a mapping the converter cannot express
        raise ConversionError(f"{config_path}: {e}") from None
    if to == TO_SCATTER:
        scheme = detect_scheme(found, set(tensors))
    else:
        scheme = scheme_name(hf_naming or marker.get("hf_naming") or next(iter(found)))
        if scheme not in found:
            raise ConversionError(f"--hf-naming {scheme!r} does not exist for {model_type}: use "
                                  f"{' or '.join(found)}")

    corr = found[scheme]
    if quantized:  # each FP8 weight's scales move with its rows
        corr = with_scales(corr, to == TO_SCATTER, tensors, tuple(quantization.get("weight_block_size") or BLOCK))
    expected = corr.hf_shapes if to == TO_SCATTER else corr.scatter_shapes
    _check_inputs(tensors, expected, corr.optional, config, src)
    if to == TO_SCATTER:
        out_config[CONFIG_KEY] = {"format_version": FORMAT_VERSION, "hf_naming": scheme,
                                  "converted_by": f"hf-scatter {__version__}"}
    if dtype is not None:
        dtype_key = "torch_dtype" if "torch_dtype" in out_config else "dtype"
        out_config[dtype_key] = str(dtype).removeprefix("torch.")
    return Plan(src=src, dst=dst, to=to, model_type=model_type, scheme=scheme, dtype=dtype, config=out_config,
                shards=_shard(_outputs(corr, to, tensors, dtype), max_bytes), copies=copies, skipped=skipped,
                replaces=replaces)
