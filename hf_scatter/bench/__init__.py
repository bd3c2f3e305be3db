"""Benchmarks behind `hf-scatter bench ...`: every peer measured in the same process, JSON + Markdown out."""
