"""Only what pyproject.toml cannot say: a wheel carries the C++ kernel sources and the web
UI's files.

They live in the top-level ``kernels/`` and ``http/`` folders (data, not Python packages); a
built wheel gets copies as ``asyncengine/_kernels/`` and ``asyncengine/_http/``, where
``asyncengine.executor.kernels.build`` and ``asyncengine.entrypoints.http.web`` look first.
An editable install reads the folders in the checkout instead.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

KERNELS = Path(__file__).parent / "kernels"
WEB = Path(__file__).parent / "http"


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
        web = Path(self.build_lib) / "asyncengine" / "_http"
        for src in sorted(WEB.rglob("*")):
            if src.is_file():
                target = web / src.relative_to(WEB)
                self.mkpath(str(target.parent))
                self.copy_file(str(src), str(target))


setup(cmdclass={"build_py": BuildPyWithKernels})
