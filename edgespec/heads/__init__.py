"""Trained draft heads: small networks over the target's own features that draft inside the
verifier (``proposer``), made by ``edgespec distill`` from the target's responses
(``dataset``, ``harvest``, ``training``) and stored as head folders (``manifest``)."""
