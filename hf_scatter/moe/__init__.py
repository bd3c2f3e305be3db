"""ScatterMoE building blocks: routing, the ParallelLinear layer, the SMoE GLU MLP and Mixture-of-Attention."""

from .attention import MixtureOfAttention
from .mlp import GLUMLP, expert_mlp, glu_experts
from .parallel_linear import parallel_linear
from .routing import flatten_sort_count

__all__ = ["GLUMLP", "MixtureOfAttention", "expert_mlp", "flatten_sort_count", "glu_experts", "parallel_linear"]
