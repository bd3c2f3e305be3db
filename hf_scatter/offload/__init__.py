"""Offloaded generation of MoE models larger than GPU memory (MoE-Lightning): HRM performance model and
policy search, CGOPipe."""
