"""Models: finding, fetching, converting and loading them (``edgespec.models.loading``, which needs
torch), the default model's files, tokenizer identity, the incremental text stream and a
request's images (``images``; these four torch-free; this package imports nothing);
vision-language targets (``vision``, torch)."""
