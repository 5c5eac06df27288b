"""Package discovery for the one import package ``headstart``, whose source is the repository root
(pyproject.toml maps it: ``package-dir = {"headstart" = "."}``). setuptools' ``find_packages`` finds every
subpackage (a folder with an ``__init__.py``), so a new head's folder is in the wheel without being listed;
the test tree, recipes and docs are not code of the package."""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    """The root's modules are the package's (``__init__.py``, ``train.py``), except this file."""

    def find_package_modules(self, package, package_dir):
        return [m for m in super().find_package_modules(package, package_dir) if m[:2] != ("headstart", "setup")]


setup(packages=["headstart"] + [f"headstart.{name}" for name in find_packages(exclude=["tests", "tests.*"])],
      cmdclass={"build_py": BuildPy})
