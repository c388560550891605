"""Only what pyproject.toml cannot say: a wheel carries the C++ kernel sources.

They live in the top-level ``kernels/`` folder (data, not a Python package); a built wheel
gets a copy as ``asyncengine/_kernels/``, where ``asyncengine.executor.kernels.build`` looks
first. An editable install reads ``kernels/`` in the checkout instead.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

KERNELS = Path(__file__).parent / "kernels"


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dest = Path(self.build_lib) / "asyncengine" / "_kernels"
        self.mkpath(str(dest))
        for src in sorted(KERNELS.iterdir()):
            if src.suffix in (".cpp", ".h") or src.name == "README.md":
                self.copy_file(str(src), str(dest / src.name))


setup(cmdclass={"build_py": BuildPyWithKernels})
