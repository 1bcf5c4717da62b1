"""The session protocol's contract (query-and-correct): its types and the ``SessionStore``
Protocol, the in-process store, the strict id formats, the fleet Cacheback table's contract and the
per-request figures (``Stats``). Torch-free."""
