"""gRPC on the wire: conversions to and from the generated messages (``edgespec.v1``), token trees
in their wire form, per-method stream limits, request parsing, telling a wrong address from a slow
server, and the code generator of ``edgespec/v1``. Torch-free."""
