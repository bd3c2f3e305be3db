"""Only for what pyproject.toml cannot say: ship ``hf_scatter_lm_eval.pth`` at the wheel's top level (the
startup hook that lets the stock ``lm_eval --model hf-scatter`` command find hf-scatter's models)."""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "hf_scatter_lm_eval.pth"


class BuildWithPth(build_py):
    def run(self):
        super().run()
        shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildWithPth})
