"""The committed generated code is exactly what grpcio-tools makes from proto/."""

from edgespec.protogen import ROOT, generate


def test_regenerating_gives_the_committed_files(tmp_path):
    fresh = generate(tmp_path)
    assert [f.name for f in fresh] == ["edgespec_pb2.py", "edgespec_pb2.pyi",
                                      "edgespec_pb2_grpc.py"]
    for f in fresh:
        committed = ROOT / "edgespec" / "v1" / f.name
        assert committed.read_bytes() == f.read_bytes(), f"{f.name} is stale: run " \
                                                          "python -m edgespec.protogen"


def test_messages_carry_numbers_not_pickles():
    from edgespec.v1 import edgespec_pb2 as pb

    chunk = pb.DraftChunk(session_id="s", epoch=1, start=2, tokens=[3, 4],
                          q=[pb.SparseQ(ids=[3], probs=[1.0])] * 2)
    again = pb.DraftChunk.FromString(chunk.SerializeToString())
    assert again == chunk and b"pickle" not in chunk.SerializeToString()
