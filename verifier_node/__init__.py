"""The batching verifier: scheduler and gRPC service."""
