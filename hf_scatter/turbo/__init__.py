"""Variable-length BERT runtime (TurboTransformers' runtime and serving ideas): unpadded encoder, memory
planner, batch scheduler."""
