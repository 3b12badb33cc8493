"""The sanitizer run's self-test: prove that the extension really is instrumented and the ASan
runtime really is active, by making simdnorm read and write just past the end of heap buffers.

numpy does not check np.lib.stride_tricks.as_strided against its buffer, so the views below are
legal Python that reaches memory the arrays do not own: the kernels (compiled with
-fsanitize=address) must be stopped by an ASan report. The views are strided on purpose: the
strided kernels move elements with plain (instrumented) loads and stores. ASan does not check the
masked vector loads/stores of the contiguous kernels' heads and tails (AVX2/AVX-512 mask intrinsics
are not instrumented), so an overrun there is not reported as such; the fuzzer's poisoned arena
(tests/test_fuzz.py) is what catches stray writes on those paths, with or without sanitizers. .ci/sanitize.sh runs this script under the
preloaded runtime and FAILS when it exits cleanly (no report means the sanitizer run proves
nothing). Never run it without the sanitizer: it corrupts the heap on purpose.

usage: python asan_canary.py read|write
"""

import sys

import numpy as np
from numpy.lib.stride_tricks import as_strided

import simdnorm


def main(which: str) -> None:
    simdnorm.set_num_threads(1)
    if which == "read":
        # a 16-byte buffer viewed as 3 floats 8 bytes apart: the last one lies at bytes 16..19
        buf = np.ones(4, np.float32)
        x = as_strided(buf, shape=(1, 3), strides=(0, 8))
        simdnorm.batch_normalization(x, np.zeros(3, np.float32), np.ones(3, np.float32), channel_axis=-1)
    elif which == "write":
        # out: 16 bytes of heap viewed as 3 floats 8 bytes apart: the last store lands at bytes 16..19
        x = np.ones((1, 3), np.float32)
        small = np.empty(4, np.float32)
        out = as_strided(small, shape=(1, 3), strides=(24, 8), writeable=True)
        simdnorm.mean_variance_normalization(x, -1, out=out)
    else:
        raise SystemExit(f"unknown canary {which!r}")
    print(f"canary {which}: NOT caught", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "read")
