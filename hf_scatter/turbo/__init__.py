"""Variable-length BERT runtime (TurboTransformers' runtime and serving ideas, done the way they pay off
today): packed execution with variable-length attention, a sequence-length-aware memory planner, CUDA
graphs per length bucket, and a DP batch scheduler for serving.

``hf_scatter.patch_model(bert)`` routes a BERT's inference calls through it; ``Encoder`` serves lists of
requests; see docs/bert.md.
"""

from .encoder import Encoder
from .packing import PackedBatch, pack_padded, pack_sequences
from .planner import MemoryPlanner, UsageRecord, plan_records, record_usage
from .runtime import UnpaddedRuntime
from ..common.partition import dp_schedule
from .scheduler import BatchScheduler, CostTable

__all__ = ["BatchScheduler", "CostTable", "Encoder", "MemoryPlanner", "PackedBatch", "UnpaddedRuntime",
           "UsageRecord", "dp_schedule", "pack_padded", "pack_sequences", "plan_records", "record_usage"]
