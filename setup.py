"""One build step on top of pyproject.toml: the shipped steering vectors (the top-level
``vectors/`` folder, where they are made and reviewed) go into the wheel as package data,
``steerserve/vectors/``, so that a non-editable install serves them (steerserve.artifacts'
default_vectors_dir looks there first). An editable install reads ``vectors/`` in place."""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

VECTORS = Path(__file__).resolve().parent / "vectors"


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False) or not VECTORS.is_dir():
            return
        out = Path(self.build_lib) / "steerserve" / "vectors"
        for src in sorted(VECTORS.rglob("*")):
            if src.is_file() and "__pycache__" not in src.parts:
                dest = out / src.relative_to(VECTORS)
                self.mkpath(str(dest.parent))
                self.copy_file(str(src), str(dest))


setup(cmdclass={"build_py": BuildPy})
