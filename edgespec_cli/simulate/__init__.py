"""``edgespec simulate``: a whole fleet on one machine (real verifier, cache and drafters; each
device's compute speed and network link emulated)."""
