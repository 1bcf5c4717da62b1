"""Models: finding, fetching, converting and loading them (``edgespec.models.loading``, which needs
torch), the default model's files, tokenizer identity and the incremental text stream (these three
torch-free; this package imports nothing)."""
