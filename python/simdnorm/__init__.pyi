"""Type stubs for simdnorm's public API."""
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, List, Literal, Mapping, Optional, Protocol, Sequence, Tuple, Union, overload

import numpy as np
import numpy.typing as npt

__version__: str

_Array = npt.NDArray[Any]
_ArrayLike = Any  # an ndarray, an object with __dlpack__ (taken without a copy), or a (nested) list
_Axes = Union[int, Sequence[int]]
_Stats = Tuple[_Array, Optional[_Array], Optional[_Array]]

class DescriptorError(ValueError): ...
class DescriptorTypeError(DescriptorError, TypeError): ...
class DescriptorAxisError(DescriptorError, IndexError): ...

@dataclass(frozen=True, init=False)  # as at runtime: its fields are read-only
class Activation:
    name: str
    params: Mapping[str, float]
    def __init__(self, name: str, **params: float) -> None: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

ACTIVATIONS: Mapping[str, Mapping[str, float]]
ActivationLike = Union[None, str, Activation]  # also at runtime: simdnorm.ActivationLike

@dataclass(frozen=True, init=False)  # as at runtime: its fields are read-only
class TensorDesc:
    dtype: np.dtype[Any]
    sizes: Tuple[int, ...]
    strides: Optional[Tuple[int, ...]]
    def __init__(self, dtype: npt.DTypeLike, sizes: Sequence[int], strides: Optional[Sequence[int]] = ...) -> None: ...
    @classmethod
    def from_array(cls, array: _Array, *, strides: bool = ...) -> "TensorDesc": ...
    @property
    def ndim(self) -> int: ...
    def byte_strides(self) -> Optional[Tuple[int, ...]]: ...
    def validate(self, name: str = ...) -> None: ...

@dataclass(frozen=True, init=False)  # as at runtime: its fields are read-only
class BatchNormalizationDesc:
    input: TensorDesc
    mean: TensorDesc
    variance: TensorDesc
    scale: Optional[TensorDesc]
    bias: Optional[TensorDesc]
    output: TensorDesc
    epsilon: float
    activation: ActivationLike
    channel_axis: int
    spatial: bool
    def __init__(
        self,
        input: TensorDesc,
        mean: TensorDesc,
        variance: TensorDesc,
        scale: Optional[TensorDesc] = ...,
        bias: Optional[TensorDesc] = ...,
        output: Optional[TensorDesc] = ...,
        *,
        epsilon: float = ...,
        activation: ActivationLike = ...,
        channel_axis: int = ...,
        spatial: bool = ...,
    ) -> None: ...
    def validate(self) -> None: ...

@dataclass(frozen=True, init=False)  # as at runtime: its fields are read-only
class MeanVarianceNormalizationDesc:
    input: TensorDesc
    axes: Union[int, Tuple[int, ...]]
    scale: Optional[TensorDesc]
    bias: Optional[TensorDesc]
    output: TensorDesc
    normalize_mean: bool
    normalize_variance: bool
    epsilon: float
    epsilon_mode: Literal["inside", "outside"]
    activation: ActivationLike
    def __init__(
        self,
        input: TensorDesc,
        axes: _Axes,
        scale: Optional[TensorDesc] = ...,
        bias: Optional[TensorDesc] = ...,
        output: Optional[TensorDesc] = ...,
        *,
        normalize_mean: bool = ...,
        normalize_variance: bool = ...,
        epsilon: float = ...,
        epsilon_mode: Literal["inside", "outside"] = ...,
        activation: ActivationLike = ...,
    ) -> None: ...
    def validate(self) -> None: ...

class _CompiledBatchNormalization(Protocol):
    desc: BatchNormalizationDesc
    def __call__(
        self,
        x: _ArrayLike,
        mean: _ArrayLike,
        variance: _ArrayLike,
        scale: Optional[_ArrayLike] = ...,
        bias: Optional[_ArrayLike] = ...,
        *,
        out: Optional[_Array] = ...,
    ) -> _Array: ...

class _CompiledMeanVarianceNormalization(Protocol):
    desc: MeanVarianceNormalizationDesc
    @overload
    def __call__(
        self,
        x: _ArrayLike,
        scale: Optional[_ArrayLike] = ...,
        bias: Optional[_ArrayLike] = ...,
        *,
        out: Optional[_Array] = ...,
        return_stats: Literal[False] = ...,
    ) -> _Array: ...
    @overload
    def __call__(
        self,
        x: _ArrayLike,
        scale: Optional[_ArrayLike] = ...,
        bias: Optional[_ArrayLike] = ...,
        *,
        out: Optional[_Array] = ...,
        return_stats: Literal[True],
    ) -> _Stats: ...

@overload
def compile(desc: BatchNormalizationDesc) -> _CompiledBatchNormalization: ...
@overload
def compile(desc: MeanVarianceNormalizationDesc) -> _CompiledMeanVarianceNormalization: ...
@overload
def compile(
    desc: Union[BatchNormalizationTrainingDesc, BatchNormalizationGradDesc, MeanVarianceNormalizationGradDesc],
) -> Any: ...

class BatchNormalizationTrainingDesc:
    input: TensorDesc
    scale: Optional[TensorDesc]
    bias: Optional[TensorDesc]
    fused_add: Optional[TensorDesc]
    epsilon: float
    activation: ActivationLike
    channel_axis: int
    def __init__(
        self, input: TensorDesc, scale: Optional[TensorDesc] = ..., bias: Optional[TensorDesc] = ...,
        fused_add: Optional[TensorDesc] = ..., *, epsilon: float = ..., activation: ActivationLike = ...,
        channel_axis: int = ...,
    ) -> None: ...
    def validate(self) -> None: ...

class BatchNormalizationGradDesc:
    input: TensorDesc
    mean: TensorDesc
    variance: TensorDesc
    scale: Optional[TensorDesc]
    bias: Optional[TensorDesc]
    fused_add: Optional[TensorDesc]
    epsilon: float
    channel_axis: int
    training: bool
    activation: ActivationLike
    grad_input: bool
    grad_scale: Optional[bool]
    grad_bias: Optional[bool]
    def __init__(
        self, input: TensorDesc, mean: TensorDesc, variance: TensorDesc, scale: Optional[TensorDesc] = ...,
        bias: Optional[TensorDesc] = ..., fused_add: Optional[TensorDesc] = ..., *, epsilon: float = ...,
        channel_axis: int = ..., training: bool = ..., activation: ActivationLike = ..., grad_input: bool = ...,
        grad_scale: Optional[bool] = ..., grad_bias: Optional[bool] = ...,
    ) -> None: ...
    def validate(self) -> None: ...

class MeanVarianceNormalizationGradDesc:
    input: TensorDesc
    axes: Union[int, Tuple[int, ...]]
    mean: Optional[TensorDesc]
    inv_std: Optional[TensorDesc]
    scale: Optional[TensorDesc]
    bias: Optional[TensorDesc]
    normalize_mean: bool
    normalize_variance: bool
    epsilon: float
    epsilon_mode: Literal["inside", "outside"]
    activation: ActivationLike
    grad_input: bool
    grad_scale: Optional[bool]
    grad_bias: Optional[bool]
    def __init__(
        self, input: TensorDesc, axes: _Axes, mean: Optional[TensorDesc], inv_std: Optional[TensorDesc],
        scale: Optional[TensorDesc] = ..., bias: Optional[TensorDesc] = ..., *, normalize_mean: bool = ...,
        normalize_variance: bool = ..., epsilon: float = ..., epsilon_mode: Literal["inside", "outside"] = ...,
        activation: ActivationLike = ..., grad_input: bool = ..., grad_scale: Optional[bool] = ...,
        grad_bias: Optional[bool] = ...,
    ) -> None: ...
    def validate(self) -> None: ...

def batch_normalization(
    x: _ArrayLike,
    mean: _ArrayLike,
    variance: _ArrayLike,
    scale: Optional[_ArrayLike] = ...,
    bias: Optional[_ArrayLike] = ...,
    *,
    epsilon: float = ...,
    activation: ActivationLike = ...,
    channel_axis: int = ...,
    out: Optional[_Array] = ...,
) -> _Array: ...
@overload
def mean_variance_normalization(
    x: _ArrayLike,
    axes: _Axes,
    scale: Optional[_ArrayLike] = ...,
    bias: Optional[_ArrayLike] = ...,
    *,
    normalize_mean: bool = ...,
    normalize_variance: bool = ...,
    epsilon: float = ...,
    epsilon_mode: Literal["inside", "outside"] = ...,
    activation: ActivationLike = ...,
    out: Optional[_Array] = ...,
    return_stats: Literal[False] = ...,
) -> _Array: ...
@overload
def mean_variance_normalization(
    x: _ArrayLike,
    axes: _Axes,
    scale: Optional[_ArrayLike] = ...,
    bias: Optional[_ArrayLike] = ...,
    *,
    normalize_mean: bool = ...,
    normalize_variance: bool = ...,
    epsilon: float = ...,
    epsilon_mode: Literal["inside", "outside"] = ...,
    activation: ActivationLike = ...,
    out: Optional[_Array] = ...,
    return_stats: Literal[True],
) -> _Stats: ...
@overload
def layer_norm(
    x: _ArrayLike, scale: Optional[_ArrayLike] = ..., bias: Optional[_ArrayLike] = ..., *, axis: int = ...,
    epsilon: float = ..., activation: ActivationLike = ..., out: Optional[_Array] = ...,
    return_stats: Literal[False] = ...,
) -> _Array: ...
@overload
def layer_norm(
    x: _ArrayLike, scale: Optional[_ArrayLike] = ..., bias: Optional[_ArrayLike] = ..., *, axis: int = ...,
    epsilon: float = ..., activation: ActivationLike = ..., out: Optional[_Array] = ..., return_stats: Literal[True],
) -> Tuple[_Array, _Array, _Array]: ...
@overload
def rms_norm(
    x: _ArrayLike, scale: Optional[_ArrayLike] = ..., *, axis: int = ..., epsilon: float = ...,
    activation: ActivationLike = ..., out: Optional[_Array] = ..., return_stats: Literal[False] = ...,
) -> _Array: ...
@overload
def rms_norm(
    x: _ArrayLike, scale: Optional[_ArrayLike] = ..., *, axis: int = ..., epsilon: float = ...,
    activation: ActivationLike = ..., out: Optional[_Array] = ..., return_stats: Literal[True],
) -> Tuple[_Array, None, _Array]: ...
@overload
def instance_norm(
    x: _ArrayLike, scale: Optional[_ArrayLike] = ..., bias: Optional[_ArrayLike] = ..., *, epsilon: float = ...,
    channel_axis: int = ..., activation: ActivationLike = ..., out: Optional[_Array] = ...,
    return_stats: Literal[False] = ...,
) -> _Array: ...
@overload
def instance_norm(
    x: _ArrayLike, scale: Optional[_ArrayLike] = ..., bias: Optional[_ArrayLike] = ..., *, epsilon: float = ...,
    channel_axis: int = ..., activation: ActivationLike = ..., out: Optional[_Array] = ..., return_stats: Literal[True],
) -> Tuple[_Array, _Array, _Array]: ...
@overload
def group_norm(
    x: _ArrayLike, num_groups: int, scale: Optional[_ArrayLike] = ..., bias: Optional[_ArrayLike] = ..., *,
    epsilon: float = ..., channel_axis: int = ..., activation: ActivationLike = ..., out: Optional[_Array] = ...,
    return_stats: Literal[False] = ...,
) -> _Array: ...
@overload
def group_norm(
    x: _ArrayLike, num_groups: int, scale: Optional[_ArrayLike] = ..., bias: Optional[_ArrayLike] = ..., *,
    epsilon: float = ..., channel_axis: int = ..., activation: ActivationLike = ..., out: Optional[_Array] = ...,
    return_stats: Literal[True],
) -> Tuple[_Array, _Array, _Array]: ...

# training: batch statistics and gradients
_Grads = Tuple[Optional[_Array], Optional[_Array], Optional[_Array]]
def batch_normalization_training(
    x: _ArrayLike, scale: Optional[_ArrayLike] = ..., bias: Optional[_ArrayLike] = ..., *, epsilon: float = ...,
    channel_axis: int = ..., fused_add: Optional[_ArrayLike] = ..., activation: ActivationLike = ...,
    running_mean: Optional[_Array] = ..., running_var: Optional[_Array] = ...,
    momentum: Union[float, Literal["cumulative"], None] = ..., momentum_convention: Literal["pytorch", "onnx"] = ...,
    num_batches_tracked: Optional[int] = ..., out: Optional[_Array] = ...,
) -> Tuple[_Array, _Array, _Array]: ...
def batch_normalization_backward(
    grad_output: _ArrayLike, x: _ArrayLike, mean: _ArrayLike, variance: _ArrayLike,
    scale: Optional[_ArrayLike] = ..., bias: Optional[_ArrayLike] = ..., *, epsilon: float = ...,
    channel_axis: int = ..., training: bool = ..., fused_add: Optional[_ArrayLike] = ...,
    activation: ActivationLike = ..., grad_input: bool = ..., grad_scale: Optional[bool] = ...,
    grad_bias: Optional[bool] = ..., out: Optional[_Array] = ...,
) -> Tuple[Optional[_Array], ...]: ...
def mean_variance_normalization_backward(
    grad_output: _ArrayLike, x: _ArrayLike, axes: Union[int, Sequence[int]], mean: Optional[_ArrayLike],
    inv_std: Optional[_ArrayLike], scale: Optional[_ArrayLike] = ..., bias: Optional[_ArrayLike] = ..., *,
    normalize_mean: bool = ..., normalize_variance: bool = ..., epsilon: float = ..., epsilon_mode: str = ...,
    activation: ActivationLike = ..., grad_input: bool = ..., grad_scale: Optional[bool] = ...,
    grad_bias: Optional[bool] = ..., out: Optional[_Array] = ...,
) -> _Grads: ...
def layer_norm_backward(
    grad_output: _ArrayLike, x: _ArrayLike, mean: _ArrayLike, inv_std: _ArrayLike,
    scale: Optional[_ArrayLike] = ..., bias: Optional[_ArrayLike] = ..., *, axis: int = ..., epsilon: float = ...,
    activation: ActivationLike = ..., grad_input: bool = ..., grad_scale: Optional[bool] = ...,
    grad_bias: Optional[bool] = ..., out: Optional[_Array] = ...,
) -> _Grads: ...
def rms_norm_backward(
    grad_output: _ArrayLike, x: _ArrayLike, inv_rms: _ArrayLike, scale: Optional[_ArrayLike] = ..., *,
    axis: int = ..., epsilon: float = ..., activation: ActivationLike = ..., grad_input: bool = ...,
    grad_scale: Optional[bool] = ..., grad_bias: Optional[bool] = ..., out: Optional[_Array] = ...,
) -> _Grads: ...
def instance_norm_backward(
    grad_output: _ArrayLike, x: _ArrayLike, mean: _ArrayLike, inv_std: _ArrayLike,
    scale: Optional[_ArrayLike] = ..., bias: Optional[_ArrayLike] = ..., *, channel_axis: int = ...,
    epsilon: float = ..., activation: ActivationLike = ..., grad_input: bool = ..., grad_scale: Optional[bool] = ...,
    grad_bias: Optional[bool] = ..., out: Optional[_Array] = ...,
) -> _Grads: ...
def group_norm_backward(
    grad_output: _ArrayLike, x: _ArrayLike, num_groups: int, mean: _ArrayLike, inv_std: _ArrayLike,
    scale: Optional[_ArrayLike] = ..., bias: Optional[_ArrayLike] = ..., *, channel_axis: int = ...,
    epsilon: float = ..., activation: ActivationLike = ..., grad_input: bool = ..., grad_scale: Optional[bool] = ...,
    grad_bias: Optional[bool] = ..., out: Optional[_Array] = ...,
) -> _Grads: ...

# mergeable statistics
class Moments:
    count: _Array
    mean: _Array
    m2: _Array
    def __init__(self, count: npt.ArrayLike, mean: npt.ArrayLike, m2: npt.ArrayLike) -> None: ...
    @property
    def shape(self) -> Tuple[int, ...]: ...
    def __iter__(self) -> Iterator[_Array]: ...
    def merge(self, other: Moments) -> Moments: ...
    def variance(self, ddof: float = ...) -> _Array: ...
    def inv_std(self, epsilon: float = ..., epsilon_mode: Literal["inside", "outside"] = ...) -> _Array: ...

def moments(x: _ArrayLike, axes: _Axes) -> Moments: ...
def merge_moments(parts: Iterable[Moments]) -> Moments: ...

def set_num_threads(n: int) -> int: ...
def get_num_threads() -> int: ...
def isa() -> str: ...
def available_isas() -> List[str]: ...
def set_isa(name: str) -> str: ...

__all__: List[str]
