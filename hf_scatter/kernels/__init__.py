"""Triton kernels, each with a pure-torch reference path in the same module (see backend.py for which runs)."""
