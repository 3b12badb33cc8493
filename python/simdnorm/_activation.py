"""Fused activations: ``Activation(name, **params)``, validated once, frozen.

The table below is the single source of the activation set. Its ORDER is the kind index the C++
extension receives (``cpp/include/simdnorm/types.h``, ``enum class ActKind``): do not reorder.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional, Tuple, Union

import numpy as np

__all__ = ["Activation", "ACTIVATIONS"]

_INF = math.inf

# name -> ((param, default), ...) in the order the kernel receives them as (p0, p1).
# DirectML's defaults; linear, parametric_softplus and clip have none in DirectML (simdnorm's: the identity's values).
_TABLE: Tuple[Tuple[str, Tuple[Tuple[str, float], ...]], ...] = (
    ("identity", ()),
    ("linear", (("alpha", 1.0), ("beta", 0.0))),
    ("relu", ()),
    ("leaky_relu", (("alpha", 0.01),)),
    ("thresholded_relu", (("alpha", 1.0),)),
    ("elu", (("alpha", 1.0),)),
    ("celu", (("alpha", 1.0),)),
    ("scaled_elu", (("alpha", 1.67326), ("gamma", 1.0507))),
    ("sigmoid", ()),
    ("hard_sigmoid", (("alpha", 0.2), ("beta", 0.5))),
    ("tanh", ()),
    ("scaled_tanh", (("alpha", 1.0), ("beta", 0.5))),
    ("softplus", (("steepness", 1.0),)),
    ("parametric_softplus", (("alpha", 1.0), ("beta", 1.0))),
    ("softsign", ()),
    ("shrink", (("bias", 0.0), ("threshold", 0.5))),
    ("gelu", ()),
    ("clip", (("min", -_INF), ("max", _INF))),
    ("silu", ()),
    ("hard_swish", ()),
)

_KIND = {name: i for i, (name, _) in enumerate(_TABLE)}
_PARAMS = dict(_TABLE)

#: Every activation name with its parameters and their defaults, in kernel order.
ACTIVATIONS: Mapping[str, Mapping[str, float]] = MappingProxyType(
    {name: MappingProxyType(dict(params)) for name, params in _TABLE}
)

# Range rules beyond "finite": (name, param) -> (predicate, description of the valid range).
_RANGES = {
    ("softplus", "steepness"): (lambda v: v > 0.0, "> 0"),
    ("celu", "alpha"): (lambda v: v != 0.0, "non-zero"),
    ("shrink", "threshold"): (lambda v: v >= 0.0, ">= 0"),
}

# Activations are applied in float32 (the compute type): the kernel rounds each parameter to float32
# for all but float64 data (cpp/kernels/activations.h), so a parameter must be finite there (clip's
# min and max excepted: +-inf is a one-sided clip, and beyond the largest float32 it rounds to +-inf).
_F32_MAX = float(np.finfo(np.float32).max)
# The parameters a formula divides by: non-zero in float32, with a reciprocal finite in float32
# (celu's alpha rounding to 0 gave NaN for every input; softplus's steepness, inf).
_DIVISORS = {
    ("celu", "alpha"): "x / alpha",
    ("softplus", "steepness"): "log1p(exp(steepness * x)) / steepness",
}
# The smallest float32 whose reciprocal is finite in float32 (1 / 2**-128 = 2**128 overflows).
_MIN_DIVISOR = 2.0 ** -128 + 2.0 ** -149


def _check_divisor(key: str, p: str, v: float) -> None:
    formula = _DIVISORS[(key, p)]
    v32 = abs(float(np.float32(v)))
    if v32 >= _MIN_DIVISOR:
        return
    why = "rounds to 0 in float32" if v32 == 0.0 else "has a reciprocal that overflows float32"
    raise ValueError(
        f"activation {key!r}: parameter {p!r} is {v!r}, which {why}; the formula divides by it ({formula}): "
        f"|{p}| in float32 must be at least {_MIN_DIVISOR!r} (1/{p} finite in float32)"
    )


_SHORT_INT = 10 ** 20  # ints up to 20 digits (int64's and uint64's whole range) print in full


def value_text(v: Any) -> str:
    """How a message names a value the caller gave: ``repr(v)``, but an int of more than 20 digits
    by its size ("about 10**5000"): an int past 4300 digits has no str() at all in Python >= 3.11
    (ValueError, which would replace our message), and a long one helps no one. A value whose repr
    fails that way (a Fraction of such ints) is named by its type."""
    if isinstance(v, int) and not -_SHORT_INT < v < _SHORT_INT:
        return f"about {'-' if v < 0 else ''}10**{int(abs(v).bit_length() * 0.30103)}"
    try:
        return repr(v)
    except ValueError:  # a Fraction of ints past the digit limit, say
        return f"a {type(v).__name__} too long to print"


def beyond_float64(v: Any) -> str:
    """How a message names a real number float() refused (OverflowError): 10**400 has 401 digits,
    and an int past 4300 digits has no str() at all (ValueError) in Python >= 3.11."""
    if isinstance(v, int):
        return f"an int of {value_text(v)} (beyond float64's range)"
    return f"a {type(v).__name__} beyond float64's range (about {'-' if v < 0 else ''}1.8e308)"


def _names_list() -> str:
    return ", ".join(name for name, _ in _TABLE)


def _describe(name: str) -> str:
    params = _PARAMS[name]
    if not params:
        return f"{name!r} takes no parameters"
    return f"{name!r} takes " + ", ".join(f"{p}={d!r}" for p, d in params)


@dataclass(frozen=True, init=False, eq=False, repr=False)
class Activation:
    """A fused activation applied after the normalization, in float32 (float64 for float64 data).

    ``Activation("leaky_relu", alpha=0.1)``; parameters not given take DirectML's defaults
    (see :data:`ACTIVATIONS`). Raises ``ValueError`` for unknown names or parameters and
    out-of-range values, listing the valid ones; ``TypeError`` for non-numeric parameters.
    Parameters must be finite in float32 (clip's min and max may be +-inf); one the formula
    divides by (celu's alpha, softplus's steepness) must be non-zero there with a finite reciprocal,
    and scaled_elu's gamma * alpha must be finite there too.
    """

    name: str
    params: Mapping[str, float] = field(default_factory=dict)
    # (kind index, p0, p1): what the C++ extension receives.
    _core: Tuple[int, float, float] = field(default=(0, 0.0, 0.0), compare=False)
    _hash: int = field(default=0, compare=False)

    def __init__(self, name: str, **params: Any) -> None:
        if not isinstance(name, str):
            raise TypeError(
                f"activation: the name must be a str, got {type(name).__name__}; valid names: {_names_list()}"
            )
        key = name.strip().lower().replace("-", "_")
        if key not in _KIND:
            raise ValueError(f"activation: unknown name {name!r}; valid names: {_names_list()}")
        spec = _PARAMS[key]
        valid = {p for p, _ in spec}
        unknown = sorted(set(params) - valid)
        if unknown:
            raise ValueError(
                f"activation {key!r}: unknown parameter(s) {', '.join(map(repr, unknown))}; {_describe(key)}"
            )
        values = {}
        for p, default in spec:
            v = params.get(p, default)
            if isinstance(v, (bool,)) or not isinstance(v, numbers.Real):
                raise TypeError(
                    f"activation {key!r}: parameter {p!r} must be a real number, got {type(v).__name__}"
                )
            try:
                v = float(v)
            except OverflowError:  # an int (or Fraction) past float64
                if key == "clip":  # beyond float32 clip's bounds round to +-inf (as 1e300 does)
                    v = -_INF if v < 0 else _INF
                else:
                    raise ValueError(
                        f"activation {key!r}: parameter {p!r} is {beyond_float64(v)}; activations are "
                        f"applied in float32, so it must be finite there: |{p}| <= {_F32_MAX!r}"
                    ) from None
            if key == "clip":
                if math.isnan(v):
                    raise ValueError(f"activation 'clip': {p} is NaN; min and max must be numbers (±inf allowed)")
            elif not math.isfinite(v):
                raise ValueError(f"activation {key!r}: parameter {p!r} is {v!r}; it must be finite")
            elif abs(v) > _F32_MAX:
                raise ValueError(
                    f"activation {key!r}: parameter {p!r} is {v!r}, beyond float32's largest finite value; "
                    f"activations are applied in float32, so it must be finite there: |{p}| <= {_F32_MAX!r}"
                )
            rule = _RANGES.get((key, p))
            if rule is not None and not rule[0](v):
                raise ValueError(f"activation {key!r}: parameter {p!r} is {v!r}; it must be {rule[1]}")
            if (key, p) in _DIVISORS:
                _check_divisor(key, p, v)
            values[p] = v
        if key == "scaled_elu" and abs(values["gamma"] * values["alpha"]) > _F32_MAX:
            # The kernel folds the two into one factor of exp(x) - 1: past float32 it is inf, and
            # inf * 0 made x = 0 give NaN.
            raise ValueError(
                f"activation 'scaled_elu': gamma * alpha is {values['gamma'] * values['alpha']!r}, beyond float32's "
                f"largest finite value; the formula multiplies by it (gamma * alpha * (exp(x) - 1)), so it must be "
                f"finite in float32: |gamma * alpha| <= {_F32_MAX!r}"
            )
        if key == "clip" and not values["min"] <= values["max"]:
            raise ValueError(
                f"activation 'clip': min={values['min']!r} > max={values['max']!r}; it must be min <= max"
            )
        pv = [values[p] for p, _ in spec] + [0.0, 0.0]
        core = (_KIND[key], pv[0], pv[1])
        setattr_ = object.__setattr__
        setattr_(self, "name", key)
        setattr_(self, "params", MappingProxyType(values))
        setattr_(self, "_core", core)
        setattr_(self, "_hash", hash(core))

    def __repr__(self) -> str:
        args = "".join(f", {p}={v!r}" for p, v in self.params.items())
        return f"Activation({self.name!r}{args})"

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not Activation:
            return NotImplemented
        return self._core == other._core  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (_rebuild, (self.name, dict(self.params)))


def _rebuild(name: str, params: dict) -> Activation:
    return Activation(name, **params)


ActivationLike = Union[None, str, Activation]

_IDENTITY_CORE = (0, 0.0, 0.0)
# Activations by name string, built once (the functional hot path resolves through the plan cache).
_BY_NAME: dict = {}


def resolve(activation: ActivationLike, field_name: str = "activation") -> Optional[Activation]:
    """None, a name or an Activation -> an Activation (None stays None). Raises ValueError/TypeError."""
    if activation is None or activation.__class__ is Activation:
        return activation  # type: ignore[return-value]
    if isinstance(activation, str):
        act = _BY_NAME.get(activation)
        if act is None:
            act = Activation(activation)
            if len(_BY_NAME) < 256:
                _BY_NAME[activation] = act
        return act
    raise TypeError(
        f"{field_name}: expected None, an activation name (str) or simdnorm.Activation, "
        f"got {type(activation).__name__}; valid names: {_names_list()}"
    )


def core_tuple(act: Optional[Activation]) -> Tuple[int, float, float]:
    return _IDENTITY_CORE if act is None else act._core
