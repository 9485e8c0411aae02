"""An import stub for torchvision, for SGLang on a CPU-only test machine.

SGLang imports torchvision at module level for its vision models; the package index's
torchvision wheels are CUDA builds that would replace the CPU torch. Every ``torchvision.*``
module imports as a placeholder whose attributes exist and raise when called, so importing
SGLang works and any real use of torchvision fails loudly.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class _Placeholder:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"torchvision is a stub here: {self._name} is not available")

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _StubFinder())


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(f"torchvision.{name}")
