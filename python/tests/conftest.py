"""pytest setup for hxfer's Python tests: `import hxfer` is the module under build/python.

Run from the repository root: PYTHONPATH=build/python /usr/bin/python3 -m pytest -q python/tests
"""

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# The tests import their helpers (pages.py) and, when PYTHONPATH was not given, the module
# from the build tree.
sys.path.insert(0, str(HERE))
_built = ROOT / "build" / "python"
if _built.is_dir() and str(_built) not in sys.path:
    sys.path.append(str(_built))
