"""``python -m simdnorm info`` | ``python -m simdnorm bench [args]`` | ``python -m simdnorm accuracy [args]``."""
from __future__ import annotations

import sys
from typing import List, Optional

USAGE = """usage: python -m simdnorm {info,bench,accuracy} [args]

  info             print the version, the active and available instruction sets and the thread count
  bench [args]     run the microbenchmark suite (python -m simdnorm bench --help)
  accuracy [args]  output and statistics errors against float64, PyTorch's next to them
                   (python -m simdnorm accuracy --help)
"""


def info() -> int:
    import platform

    import ml_dtypes
    import numpy as np

    import simdnorm

    print(f"simdnorm {simdnorm.__version__}")
    print(f"isa: {simdnorm.isa()}")
    print(f"available isas: {', '.join(simdnorm.available_isas())}")
    print(f"threads: {simdnorm.get_num_threads()}")
    print(f"built isas: {simdnorm._core.built_isas.replace(',', ', ')} (SIMDNORM_ISAS={simdnorm._core.isas_setting})")
    print(f"python {platform.python_version()}, numpy {np.__version__}, ml_dtypes {ml_dtypes.__version__}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    try:
        return _dispatch(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # (Ctrl-C in a long run: a line and the shell's status, no traceback)
        sys.stderr.write("interrupted\n")
        return 130


def _dispatch(args: List[str]) -> int:
    if not args:  # a usage error, as argparse reports one: on stderr, exit 2
        sys.stderr.write(USAGE)
        return 2
    if args[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0
    cmd, rest = args[0], args[1:]
    if cmd == "info":
        if rest:
            sys.stderr.write(f"info takes no arguments, got {' '.join(rest)}\n" + USAGE)
            return 2
        return info()
    if cmd == "bench":
        from simdnorm.bench import main as bench_main

        return bench_main(rest)
    if cmd == "accuracy":
        from simdnorm.bench.accuracy import main as accuracy_main

        return accuracy_main(rest)
    sys.stderr.write(f"unknown command {cmd!r}\n" + USAGE)
    return 2


if __name__ == "__main__":
    sys.exit(main())
