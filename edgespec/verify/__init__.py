"""Verification: the one step that decides, for every session of a batch, how many draft tokens
the target accepts and which token it adds (chains and trees, greedy and keyed sampling, exact or
the opt-in lossy loose rule), and the position-keyed noise that makes sampled verification exact."""
