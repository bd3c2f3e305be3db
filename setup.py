"""Only for what pyproject.toml cannot say: ship ``hf_scatter_lm_eval.pth`` at the top of the install (the
startup hook that lets the stock ``lm_eval --model hf-scatter`` command find hf-scatter's models), in a
wheel and in an editable install (``pip install -e .``, what ``make`` creates) alike."""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "hf_scatter_lm_eval.pth"
PTH_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH)


class BuildWithPth(build_py):
    def run(self):
        super().run()
        shutil.copy(PTH_SOURCE, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


class EditableWithPth(editable_wheel):
    """An editable wheel holds only setuptools' own finder, not build_py's outputs: add the hook beside it.

    ``_install_namespaces`` is the one step that receives the folder the editable wheel is zipped from
    (setuptools 64 and later). The hook's ``.pth`` sorts after setuptools' ``__editable__.*.pth``, so
    the finder that makes ``_hf_scatter_lm_eval`` importable is in place when the hook imports it.
    """

    def _install_namespaces(self, installation_dir, pth_prefix):
        super()._install_namespaces(installation_dir, pth_prefix)
        shutil.copy(PTH_SOURCE, os.path.join(installation_dir, PTH))


setup(cmdclass={"build_py": BuildWithPth, "editable_wheel": EditableWithPth})
