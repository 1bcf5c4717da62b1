"""The draft cache: session state in Redis (``store``) behind a gRPC service (``service``)."""
