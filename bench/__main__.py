"""`python -m simdnorm.bench [options]` (or `python -m bench` from the source tree)."""
import sys

from .cli import main

sys.exit(main(sys.argv[1:]))
