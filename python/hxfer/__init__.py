# The hxfer package: the compiled extension hxfer._hxfer (python/hxfer_module.cc), re-exported
# whole, and the pure-Python submodules next to this file (`import hxfer.vllm`).
#
# The extension's classes and functions are renamed into this package (hxfer.Layout, not
# hxfer._hxfer.Layout), so reprs, help() and pickles name them as `import hxfer` shows them.

from hxfer import _hxfer
from hxfer._hxfer import *  # noqa: F401,F403  Layout, Memory, Sender, Receiver, Error, ...
from hxfer._hxfer import __version__  # the CMake project's version: see pyproject.toml

__doc__ = _hxfer.__doc__

for _obj in vars(_hxfer).values():
    if getattr(_obj, "__module__", None) == _hxfer.__name__:
        _obj.__module__ = __name__
del _obj
