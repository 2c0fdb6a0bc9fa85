"""llama.cpp's `llama-server` and `llama-quantize` built from source outside the repository, and the F16
and F32 copies of CoLLM's model file.

The source is the `vendor/llama.cpp` tree of the `llama-cpp-python` sdist (`pip download --no-binary`),
unpacked under the work directory and built there with CMake and Ninja (`-DGGML_NATIVE=ON`, Release, no
curl, no tests). A step whose output is there already is skipped, so a second run builds nothing. None
of it lands in the repository.

    WORK/dist/llama_cpp_python-VERSION.tar.gz     the sdist
    WORK/src/llama_cpp_python-VERSION/            its unpacked tree
    WORK/build/bin/llama-server, llama-quantize   the binaries
    WORK/models/<stem>.F16.gguf, <stem>.F32.gguf  the copies of the model file
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp is built
DEFAULT_WORK_DIR = Path("/tmp/collm-peer")
TARGETS = ("llama-server", "llama-quantize")
CMAKE_FLAGS = (
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
)
WEIGHT_TYPES = ("F16", "F32")  # the copies `llama-quantize --allow-requantize` writes


@dataclass(frozen=True)
class Layout:
    """Where the sdist, its source, the build and the model copies of one work directory lie."""

    work_dir: Path
    version: str = LLAMA_CPP_PYTHON

    @property
    def dist_dir(self) -> Path:
        return self.work_dir / "dist"

    @property
    def sdist(self) -> Path:
        return self.dist_dir / f"llama_cpp_python-{self.version}.tar.gz"

    @property
    def source(self) -> Path:
        return self.work_dir / "src" / f"llama_cpp_python-{self.version}" / "vendor" / "llama.cpp"

    @property
    def build_dir(self) -> Path:
        return self.work_dir / "build"

    def binary(self, target: str) -> Path:
        return self.build_dir / "bin" / target

    def model_copy(self, model: Path, weight_type: str) -> Path:
        """The `weight_type` copy of `model`: its stem without the quantisation suffix, then the type."""
        stem = model.stem.rsplit(".", 1)[0] if "." in model.stem else model.stem
        return self.work_dir / "models" / f"{stem}.{weight_type}.gguf"


def configure_command(layout: Layout, generator: str) -> list[str]:
    """The CMake configure command of the llama.cpp tree."""
    return [
        "cmake",
        "-B",
        str(layout.build_dir),
        "-S",
        str(layout.source),
        *CMAKE_FLAGS,
        "-G",
        generator,
    ]


def build_command(layout: Layout, jobs: int) -> list[str]:
    """The CMake build command of `TARGETS`."""
    return ["cmake", "--build", str(layout.build_dir), "--target", *TARGETS, "-j", str(jobs)]


def quantize_command(layout: Layout, model: Path, weight_type: str) -> list[str]:
    """`llama-quantize --allow-requantize MODEL COPY TYPE`: the model's weights as `weight_type`."""
    return [
        str(layout.binary("llama-quantize")),
        "--allow-requantize",
        str(model),
        str(layout.model_copy(model, weight_type)),
        weight_type,
    ]


def _run(cmd: Sequence[str], log: Path) -> None:
    """Run `cmd`, its output appended to `log`; RuntimeError with the log's tail when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as f:
        f.write(f"$ {' '.join(cmd)}\n".encode())
        f.flush()
        rc = subprocess.run(list(cmd), stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{cmd[0]} failed (exit {rc}); {log}:\n{tail}")


def _generator() -> str:
    """Ninja when a `ninja` binary is on PATH (`pip install ninja` puts one in the virtualenv), else Unix
    Makefiles."""
    return "Ninja" if shutil.which("ninja") else "Unix Makefiles"


def build(layout: Layout, jobs: int) -> float:
    """Download, unpack and build what is missing of `layout`; the seconds it took (0 when nothing was)."""
    if all(layout.binary(t).is_file() for t in TARGETS):
        return 0.0
    t0 = time.monotonic()
    log = layout.work_dir / "build.log"
    if not layout.sdist.is_file():
        _run(
            [
                sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                f"llama-cpp-python=={layout.version}", "-d", str(layout.dist_dir),
            ],
            log,
        )  # fmt: skip
    if not layout.source.is_dir():
        with tarfile.open(layout.sdist) as tar:
            tar.extractall(layout.work_dir / "src", filter="data")
    _run(configure_command(layout, _generator()), log)
    _run(build_command(layout, jobs), log)
    return time.monotonic() - t0


def model_copies(layout: Layout, model: Path) -> dict[str, Path]:
    """The F16 and F32 copies of `model` (written by `llama-quantize` when missing), by weight type."""
    log = layout.work_dir / "quantize.log"
    out = {}
    for weight_type in WEIGHT_TYPES:
        path = layout.model_copy(model, weight_type)
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            _run(quantize_command(layout, model, weight_type), log)
        out[weight_type] = path
    return out
