"""edgespec: speculative decoding across an edge fleet."""
