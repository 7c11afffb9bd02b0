"""Make the media corpus importable as ``media_corpus`` under ``--import-mode=importlib``.

Other suites that reuse the corpus can do the same, or list this folder in pytest's ``pythonpath``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
