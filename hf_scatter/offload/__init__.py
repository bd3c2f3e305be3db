"""Offloaded generation of MoE models larger than GPU memory (MoE-Lightning): HRM performance model and
policy search, CGOPipe.

Planning (no GPU needed)::

    from hf_scatter.offload import Workload, load_profile, search_policy
    policy = search_policy("mixtral-8x7b", load_profile("h100-host-anchors"), Workload(512, 64), "16GiB")
    print(policy.to_markdown()); print(policy.explain())

``predict(policy, model, profile, workload)`` and ``decode_layer_time(policy, model, profile, context)``
evaluate any policy, so measured runs can be checked against the model.

Running (CGOPipe)::

    import hf_scatter
    offloaded = hf_scatter.offload_model(model, gpu_memory="16GiB")     # also hf_scatter.offload.offload_model
    out = offloaded.generate(input_ids, attention_mask=mask, max_new_tokens=128)

Over several GPUs of one host, one process each under torchrun:
``hf_scatter.offload_model(model, gpu_memory="16GiB", group=dist.group.WORLD)`` (tensor parallelism: each GPU
keeps and streams its share of every layer).
"""

from ..common.units import format_bytes, parse_bytes
from ..common.shapes import BUILTIN_MODELS
from .families.registry import offloaded_model_types
from .families.spec import ModelSpec
from .measure import measure_profile
from .plan.cost_model import CostOptions, LayerTime, OpTime, Prediction, decode_layer_time, predict, prefill_layer_time
from .plan.hrm import HierarchicalRoofline, ProfileError, Roofs, TurningPoints, turning_points
from .plan.known_profiles import KNOWN_PROFILES, load_profile
from .plan.policy import PlanError, Policy, Workload
from .plan.profile import GPU_SPECS, HardwareProfile, default_profile_path
from .plan.roofline_plot import operating_points, plot_roofline
from .plan.search import search_policy
from .runtime.batching import Batch, MicroBatch, plan_batches
from .runtime.offloaded import GenerationResult, OffloadedModel, RequestTiming, offload_model

offload = offload_model  # the name this function had (``from hf_scatter.offload import offload``)

__all__ = [
    "BUILTIN_MODELS", "CostOptions", "GPU_SPECS", "HardwareProfile", "HierarchicalRoofline", "KNOWN_PROFILES",
    "LayerTime", "ModelSpec", "OpTime", "PlanError", "Policy", "Prediction", "ProfileError", "Roofs",
    "TurningPoints", "Workload", "decode_layer_time", "default_profile_path", "format_bytes", "load_profile",
    "measure_profile", "offloaded_model_types", "operating_points", "parse_bytes", "plot_roofline", "predict",
    "prefill_layer_time",
    "search_policy", "turning_points",
    "Batch", "GenerationResult", "MicroBatch", "OffloadedModel", "RequestTiming", "offload", "offload_model",
    "plan_batches",
]
