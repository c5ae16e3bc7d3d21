"""hxfer is a package: python/hxfer/ around the extension hxfer._hxfer, one version from CMake.

What `pip install .` would get wrong is checked here against the package this run imports
(build/python/hxfer/ under `make test`); the install itself is scripts/pip-install-check.sh.
"""

import importlib
import pathlib
import pickle
import re
import shutil
import subprocess

import pytest

import hxfer
from hxfer import _hxfer
from pages import tiny_layout

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE_PACKAGE = ROOT / "python" / "hxfer"
PACKAGE_DIR = pathlib.Path(hxfer.__file__).resolve().parent


def cmake_project_version():
    text = (ROOT / "CMakeLists.txt").read_text()
    return re.search(r"project\(hxfer VERSION ([0-9.]+)", text).group(1)


def test_version_is_the_cmake_project_version():
    assert hxfer.__version__ == cmake_project_version()


def test_wheel_version_is_read_from_the_cmake_project():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    rule = pyproject["tool"]["scikit-build"]["metadata"]["version"]
    assert pyproject["project"]["dynamic"] == ["version"]
    match = re.search(rule["regex"], (ROOT / rule["input"]).read_text())
    assert match and match.group("value") == hxfer.__version__


def test_hxfer_is_a_package_holding_the_extension():
    assert (PACKAGE_DIR / "__init__.py").is_file()
    assert PACKAGE_DIR.name == "hxfer" and list(hxfer.__path__)
    assert pathlib.Path(_hxfer.__file__).resolve().parent == PACKAGE_DIR


def test_every_module_of_the_source_package_is_in_the_imported_one_and_current():
    for source in sorted(SOURCE_PACKAGE.glob("*.py")):
        copy = PACKAGE_DIR / source.name
        assert copy.is_file(), f"{copy} missing: rebuild (cmake --build build --target hxfer_python)"
        assert copy.read_bytes() == source.read_bytes(), f"{copy} is older than {source}: rebuild"


def test_submodules_import():
    """Every pure-Python submodule imports, or (hxfer.vllm without vLLM installed) fails with an
    ImportError that names what it needs; `import hxfer` itself never needs it."""
    imported = []
    for source in sorted(SOURCE_PACKAGE.glob("*.py")):
        if source.stem == "__init__":
            continue
        try:
            importlib.import_module(f"hxfer.{source.stem}")
            imported.append(source.stem)
        except ImportError as e:
            cause = e if isinstance(e, ModuleNotFoundError) else e.__cause__
            if not isinstance(cause, ModuleNotFoundError) or cause.name is None or \
                    cause.name.split(".")[0] == "hxfer":
                raise
            assert cause.name.split(".")[0] in str(e), str(e)
    assert "tensors" in imported


def test_everything_public_of_the_extension_is_hxfers_own():
    public = [name for name in vars(_hxfer) if not name.startswith("_")]
    assert {"Layout", "Memory", "Sender", "Receiver", "Result", "SharedBuffer", "Error",
            "plan_transfer", "API_VERSION"} <= set(public)
    for name in public:
        obj = getattr(hxfer, name)
        assert obj is getattr(_hxfer, name)
        if isinstance(obj, type) or callable(obj):
            assert obj.__module__ == "hxfer", name
    assert repr(hxfer.Layout) == "<class 'hxfer.Layout'>"
    assert hxfer.__doc__ == _hxfer.__doc__


def test_pickles_name_the_package_not_the_extension():
    data = pickle.dumps(tiny_layout("vllm"))
    assert b"_hxfer" not in data
    assert pickle.loads(data) == tiny_layout("vllm")


def test_extension_needs_no_libhxfer_so():
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("no readelf")
    dynamic = subprocess.run([readelf, "-d", _hxfer.__file__], capture_output=True, text=True,
                             check=True).stdout
    assert "NEEDED" in dynamic and "libhxfer" not in dynamic
