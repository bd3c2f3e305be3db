"""What offloading knows of each model family: its shapes and per-op costs for the planner (``spec.py``), and
how its decoder layer splits for the runtime (``adapter.py``), one module per family behind ``registry.py``."""
