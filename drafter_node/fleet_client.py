"""The drafter's side of the fleet-wide Cacheback table: pulls it from the draft cache over gRPC
(``DraftCache.FleetTable``), on a channel of its own, for a drafter's background ``FleetSync``.
Recording is the verifier's job (it teaches the table committed tokens), so ``record`` does
nothing here."""

from __future__ import annotations

from edgespec.protocol.fleet_table import MAX_ORDER, FleetEntry, FleetPull
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire.convert import auth_metadata
from edgespec.wire.channels import make_channel


class RemoteFleetTable:
    def __init__(self, cache: str, token: str | None = None, tls_ca: str | None = None,
                 tls: bool = False, tls_cert: str | None = None, tls_key: str | None = None,
                 timeout_s: float = 5.0, vocab_size: int = 1 << 31):
        self._channel = make_channel(cache, tls_ca, tls, client_cert=tls_cert,
                                     client_key=tls_key)
        self._stub = pb_grpc.DraftCacheStub(self._channel)
        self._metadata = auth_metadata(token)
        self.timeout_s = timeout_s
        self.vocab_size = vocab_size

    def record(self, tokens: list[int], start: int = 0) -> None:
        """The verifier records; a drafter's claims never reach the fleet table."""

    def pull(self, since: int, limit: int = 2048) -> FleetPull:
        reply = self._stub.FleetTable(pb.FleetTableRequest(since=since, limit=limit),
                                      metadata=self._metadata, timeout=self.timeout_s)
        entries = [FleetEntry(tuple(e.leader), tuple(e.followers)) for e in reply.entries
                   if 1 <= len(e.leader) <= MAX_ORDER and e.followers
                   and all(0 <= t < self.vocab_size for t in (*e.leader, *e.followers))]
        return FleetPull(entries, reply.version, reply.more)

    def close(self) -> None:
        self._channel.close()

