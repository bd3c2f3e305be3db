"""Planning offloaded generation: the hardware profile, the model's per-op costs, the hierarchical roofline
model (HRM), the per-policy cost model and the policy search. Prices only: nothing here runs the model."""
