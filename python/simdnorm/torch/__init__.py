"""simdnorm for PyTorch (CPU): ``torch.ops.simdnorm.*`` operators and drop-in torch.nn modules.

Importing this module registers the operators (``torch.ops.simdnorm.layer_norm``, ...: one per
function of simdnorm's functional and training API, with ``.out`` overloads, fake kernels for
torch.compile and torch.export, and autograd through simdnorm's backward ops; plus
``update_running_stats_``), and each forward operator's decomposition into torch's own
operators, which torch.onnx's exporter translates. The modules :class:`BatchNorm1d` ...
:class:`InstanceNorm3d` subclass torch.nn's and compute with those operators; :func:`convert`
swaps them into a model in place and :func:`revert` swaps them back. The user guide's page
docs/torch.rst lists the schemas.

Once imported, simdnorm's parallel calls run on the OpenMP threads torch's own ops use (see
:func:`share_threads`), so that the two do not compete for the cores.

PyTorch stays optional: ``import simdnorm`` never imports it; this module needs it, 2.10 or later.
"""
import re as _re

try:
    import torch as _torch  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in an environment without PyTorch
    raise ImportError("simdnorm.torch needs PyTorch: pip install 'simdnorm[torch]'") from e

#: The oldest torch this module runs on: the operators read tensors through DLPack's C exchange API
#: and the C++ kernels call torch's stable C ABI, both of 2.10; CI tests it and the newest.
MIN_TORCH = (2, 10)


def _torch_version(text: str) -> tuple:
    m = _re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


if _torch_version(str(_torch.__version__)) < MIN_TORCH:
    _min = ".".join(map(str, MIN_TORCH))
    raise ImportError(f"simdnorm.torch needs torch {_min} or later; this is torch {_torch.__version__}: pip install "
                      f"'torch>={_min}' (simdnorm's plain functions take numpy arrays without it)")

from ._modules import (  # noqa: E402
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    GroupNorm,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    LayerNorm,
    RMSNorm,
    convert,
    revert,
)
from ._ops import SCHEMAS  # noqa: E402
from ._routes import empty_cache  # noqa: E402
from .._runtime import share_torch_threads as share_threads, share_torch_threads_once  # noqa: E402

share_torch_threads_once()

__all__ = [
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "LayerNorm",
    "GroupNorm",
    "RMSNorm",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "convert",
    "revert",
    "SCHEMAS",
    "share_threads",
    "empty_cache",
]
