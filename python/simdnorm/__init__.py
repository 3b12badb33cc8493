"""simdnorm: SIMD batch normalization (inference) and mean-variance normalization for numpy arrays.

Functional API: :func:`batch_normalization`, :func:`mean_variance_normalization` and the
conveniences :func:`layer_norm`, :func:`rms_norm`, :func:`instance_norm`, :func:`group_norm`.
Training: :func:`batch_normalization_training` (batch and running statistics) and the backward of
every op (:func:`batch_normalization_backward`, :func:`mean_variance_normalization_backward`,
:func:`layer_norm_backward`, :func:`rms_norm_backward`, :func:`instance_norm_backward`,
:func:`group_norm_backward`).
Mergeable statistics: :func:`moments` gives a part's :class:`Moments`, merged by
:meth:`Moments.merge` or :func:`merge_moments` (``simdnorm.dask``, imported on its own, runs the
ops on Dask arrays with them).
DirectML-style descriptors: :class:`TensorDesc`, :class:`BatchNormalizationDesc`,
:class:`MeanVarianceNormalizationDesc`, :class:`Activation`, validated by ``desc.validate()`` and
turned into operators by :func:`compile`. Runtime: :func:`set_num_threads`, :func:`get_num_threads`,
:func:`isa`, :func:`available_isas`, :func:`set_isa` (and ``SIMDNORM_NUM_THREADS``, ``SIMDNORM_ISA``).
"""
from . import _core  # noqa: F401  (ml_dtypes is not imported: _descriptors.is_bfloat16)
from ._activation import ACTIVATIONS, Activation, ActivationLike  # noqa: E402
from ._api import (  # noqa: E402
    batch_normalization,
    group_norm,
    instance_norm,
    layer_norm,
    mean_variance_normalization,
    rms_norm,
)
from ._compile import compile  # noqa: E402,A004
from ._moments import Moments, merge_moments, moments  # noqa: E402
from ._training import (  # noqa: E402
    BatchNormalizationGradDesc,
    BatchNormalizationTrainingDesc,
    MeanVarianceNormalizationGradDesc,
    batch_normalization_backward,
    batch_normalization_training,
    group_norm_backward,
    instance_norm_backward,
    layer_norm_backward,
    mean_variance_normalization_backward,
    rms_norm_backward,
)
from ._descriptors import (  # noqa: E402
    BatchNormalizationDesc,
    DescriptorAxisError,
    DescriptorError,
    DescriptorTypeError,
    MeanVarianceNormalizationDesc,
    TensorDesc,
)
from ._runtime import available_isas, get_num_threads, isa, set_isa, set_num_threads  # noqa: E402
from . import _runtime  # noqa: E402

__version__ = _core.__version__

_runtime.init()
del _runtime

__all__ = [
    "__version__",
    # functional API
    "batch_normalization",
    "mean_variance_normalization",
    "layer_norm",
    "rms_norm",
    "instance_norm",
    "group_norm",
    # training
    "batch_normalization_training",
    "batch_normalization_backward",
    "mean_variance_normalization_backward",
    "layer_norm_backward",
    "rms_norm_backward",
    "instance_norm_backward",
    "group_norm_backward",
    # mergeable statistics
    "moments",
    "Moments",
    "merge_moments",
    # descriptors
    "TensorDesc",
    "BatchNormalizationDesc",
    "MeanVarianceNormalizationDesc",
    "BatchNormalizationTrainingDesc",
    "BatchNormalizationGradDesc",
    "MeanVarianceNormalizationGradDesc",
    "Activation",
    "ActivationLike",
    "ACTIVATIONS",
    "DescriptorError",
    "DescriptorTypeError",
    "DescriptorAxisError",
    "compile",
    # runtime
    "set_num_threads",
    "get_num_threads",
    "isa",
    "available_isas",
    "set_isa",
]
