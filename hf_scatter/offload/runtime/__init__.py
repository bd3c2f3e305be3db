"""Running offloaded generation: the weight store and its paging, CGOPipe, CPU attention, batching, sampling,
stopping and the trace. It follows a plan from :mod:`hf_scatter.offload.plan` and never plans itself."""
