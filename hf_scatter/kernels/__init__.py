"""Triton kernels, each with a pure-torch reference path in the same module.

Kernel modules are imported on first use, not here, so that callers can still switch on the Triton
interpreter (``TRITON_INTERPRET=1``) after ``import hf_scatter``.
"""
