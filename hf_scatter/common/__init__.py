"""Small helpers every layer may use: one concept per module, nothing here imports the rest of hf-scatter."""
