"""simdnorm's microbenchmark suite (installed as ``simdnorm.bench``).

``python -m simdnorm bench [--quick] [--threads N] [--filter SUBSTR] [--json FILE] [--plot FILE]``
calls :func:`main`. The named shape lists live in :mod:`.shapes` (shared with the tests).
"""
from .cli import main

__all__ = ["main"]
