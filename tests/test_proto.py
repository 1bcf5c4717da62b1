"""The committed generated code is exactly what grpcio-tools makes from proto/."""

from edgespec.wire.protogen import ROOT, generate


def test_regenerating_gives_the_committed_files(tmp_path):
    fresh = generate(tmp_path)
    assert [f.name for f in fresh] == ["edgespec_pb2.py", "edgespec_pb2.pyi",
                                      "edgespec_pb2_grpc.py"]
    for f in fresh:
        committed = ROOT / "edgespec" / "v1" / f.name
        assert committed.read_bytes() == f.read_bytes(), f"{f.name} is stale: run " \
                                                          "python -m edgespec.wire.protogen"


def test_messages_carry_numbers_not_pickles():
    from edgespec.v1 import edgespec_pb2 as pb

    chunk = pb.DraftChunk(session_id="s", epoch=1, start=2, tokens=[3, 4], idle=True)
    again = pb.DraftChunk.FromString(chunk.SerializeToString())
    assert again == chunk and b"pickle" not in chunk.SerializeToString()


def test_an_old_drafters_q_field_is_skipped_not_refused():
    """Field 5 (a sampled draft's q', removed and reserved) from a drafter built before the
    removal parses: the chunk's other fields are intact and the old field is dropped."""
    from edgespec.v1 import edgespec_pb2 as pb

    assert "q" not in pb.DraftChunk.DESCRIPTOR.fields_by_name
    # an old SparseQ {ids: [3], probs: [1.0]}: field 1 packed int32, field 2 packed float
    old_q = bytes([0x0A, 0x01, 0x03, 0x12, 0x04]) + b"\x00\x00\x80\x3f"
    field5 = bytes([(5 << 3) | 2, len(old_q)]) + old_q
    chunk = pb.DraftChunk(session_id="s", epoch=1, start=2, tokens=[3])
    parsed = pb.DraftChunk.FromString(chunk.SerializeToString() + field5 + field5)
    assert parsed.session_id == "s" and list(parsed.tokens) == [3] and parsed.start == 2
    parsed.DiscardUnknownFields()
    assert parsed == chunk
