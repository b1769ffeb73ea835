"""The no-op CUDA of tests/cuda_guard/guard.cpp, compiled once per torch and source into a cache folder.

    so = build()                       # the shared library's path (compiled on first use: a few seconds)
    env = dict(os.environ, **preload(so))  # a subprocess whose torch has it

It must be in the process before `import torch` (torch reads CUDA's hooks while it initialises), so it
is preloaded into a subprocess: never loaded into the pytest process, nor by tpbench. It is compiled
with g++ directly, with torch.utils.cpp_extension's include and library paths: cpp_extension.load would
load the library into the building process, which has imported torch already.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.utils import cpp_extension

SOURCE = Path(__file__).with_name("guard.cpp")


def cache_dir() -> Path:
    """TPBENCH_CACHE_DIR, else $XDG_CACHE_HOME/tpbench (~/.cache/tpbench)."""
    if os.environ.get("TPBENCH_CACHE_DIR"):
        return Path(os.environ["TPBENCH_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tpbench"


def _command(source: Path, out: Path) -> list[str]:
    lib = cpp_extension.TORCH_LIB_PATH
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    return [os.environ.get("CXX", "g++"), "-shared", "-fPIC", "-std=c++17", "-O1",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(source), f"-L{lib}", "-lc10", "-ltorch_cpu",
            f"-Wl,-rpath,{lib}", "-o", str(out)]  # fmt: skip


def build(folder: Path | None = None) -> Path:
    """The library for this torch and this source: from the cache, or compiled into it (atomically, so
    that concurrent test runs never load a half-written file)."""
    folder = folder or cache_dir()
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(_command(SOURCE, Path())).encode()).hexdigest()
    so = folder / f"cuda_guard-torch{torch.__version__}-{key[:12]}.so"
    if so.exists():
        return so
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        part = Path(tmp) / so.name
        proc = subprocess.run(_command(SOURCE, part), capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE} failed:\n{proc.stderr[-4000:]}")
        part.replace(so)
    return so


def preload(so: Path) -> dict[str, str]:
    """The environment that loads `so` into a subprocess before anything else."""
    before = os.environ.get("LD_PRELOAD")
    return {"LD_PRELOAD": f"{so}:{before}" if before else str(so)}
