"""Generated gRPC code for the edgespec.v1 wire contract (see proto/)."""
