"""The target runner: a forward pass over many sessions' KV slots at once, with batch-invariant
linear layers and attention (a row's bits do not depend on what else is in the call), the static
KV cache, the start-up probes of which dtypes this machine serves exactly, and the CPU thread
policy. Import the modules themselves (``edgespec.runner.target_runner``); this package imports
nothing, so ``edgespec.runner.threads`` stays torch-free."""
