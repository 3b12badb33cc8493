"""Named benchmark cases, shared by the benchmark suite and the tests.

Pure data and tiny helpers: no numpy, no peers. A :class:`Case` names one op on one shape, element
type and memory layout; the suite times every implementation on exactly that, and the tests import
the same lists (``from simdnorm.bench.shapes import CASES, RESNET50_BN_SHAPES, ...``).

Layouts:
- ``"nchw"``: a C-contiguous array of the logical shape (N, C, H, W), channel_axis=1 (also the 2-D
  (N, C) batch norm cases: :data:`BATCH_NORM_1D_CASES`).
- ``"nhwc"``: channels-last, i.e. the view ``np.empty((N, H, W, C)).transpose(0, 3, 1, 2)``: the
  same logical shape (N, C, H, W), channel_axis=1, with the channels innermost in memory.
- ``"contig"``: a C-contiguous array (the sequence cases, e.g. (batch, tokens, hidden)).

Fused activations: a forward case may name an ``activation`` ("relu", "silu") applied to its op's
output, as simdnorm fuses it (``simdnorm.group_norm(x, 32, g, b, activation="silu")``) and the
peers run it after the norm; those cases are named ``<short>+<activation>/...``
(:data:`ACTIVATION_CASES`).

Training ops (SPEC §9): ``batch_norm_training`` (batch statistics, running statistics updated) and the
backward ops ``<op>_backward`` (grad_input, grad_scale and grad_bias of the forward op from
grad_output, given the statistics its forward returned). Their cases are listed after the others
(:data:`TRAINING_CASES`), named ``bn-train/...`` and ``<short>-bwd/...``; backward ops through their
forward's activation (:data:`ACTIVATION_BACKWARD_CASES`), ``<short>-bwd+<activation>/...``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import prod
from typing import Iterable, Optional, Sequence

# ResNet-50's batch-norm layers at batch 8 (oneDNN benchdnn's resnet_50 bnorm list, mb=8).
RESNET50_BN_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (8, 64, 112, 112),
    (8, 256, 56, 56),
    (8, 64, 56, 56),
    (8, 512, 28, 28),
    (8, 128, 28, 28),
    (8, 1024, 14, 14),
    (8, 256, 14, 14),
    (8, 2048, 7, 7),
    (8, 512, 7, 7),
)
# Instance norm, group norm (32 groups) and MVN over (0, 2, 3): a ResNet stage's planes, and its
# last stage's 7x7 ones (runs of 49 elements: every plane's head and tail a partial vector).
SPATIAL_NORM_SHAPES: tuple[tuple[int, int, int, int], ...] = ((8, 256, 56, 56), (8, 512, 7, 7))
# Layer norm and RMS norm over the last axis: (batch, tokens, hidden). Hidden 768 and 1024 (BERT),
# and 4096 (LLaMA-7B), whose rows with their scale and bias outgrow the L1; and rows of 64, a head's
# queries or keys normalized on their own (QK-norm: 8 sequences x 12 heads, head_dim 64), where the
# cost of each row's ends and statistics, not the memory, sets the pace.
SEQUENCE_NORM_SHAPES: tuple[tuple[int, int, int], ...] = ((8, 512, 768), (32, 128, 1024), (4, 512, 4096),
                                                          (96, 512, 64))
# BatchNorm1d over an MLP's features, (batch, features): thousands of channels of a few samples
# each, where the work per channel (folding the statistics and parameters, the coefficients, the
# parameters' sums), not the memory, sets the pace. Float32 inference (after the tiny cases), and
# forward-training and backward (in TRAINING_CASES); tagged "bn1d".
BATCH_NORM_1D_SHAPE: tuple[int, int] = (8, 4096)
# Per-call overhead: a tiny batch norm, called functionally and through simdnorm.compile(desc).
TINY_SHAPE: tuple[int, int, int, int] = (1, 16, 8, 8)
# float64 (float64 data with float64 statistics), one case of each kind of loop: layer norm
# rows (the sequence shape of BERT), an NCHW batch norm (the largest ResNet-50 layer) and instance
# norm over (2, 3). Tagged "float64"; not in --quick.
FLOAT64_CASES: tuple[tuple[str, tuple[int, ...], str], ...] = (
    ("layer_norm", SEQUENCE_NORM_SHAPES[0], "contig"),
    ("batch_norm", RESNET50_BN_SHAPES[0], "nchw"),
    ("instance_norm", SPATIAL_NORM_SHAPES[0], "nchw"),
)
# Stable Diffusion's UNet (SD 1.x at 512x512): 64x64 latents, batch 2 (classifier-free guidance's
# conditioned and unconditioned halves), its first blocks' 320 channels.
SD_UNET_GROUP_NORM_SHAPE: tuple[int, int, int, int] = (2, 320, 64, 64)
# A norm with the activation models run right after it, fused into the one call (op, shape, layout,
# dtype, activation): ResNet-50's conv-bn-relu (batch norm with given statistics, its first stage's
# shape) and the UNet's GroupNorm(32) + SiLU, in float32 and in bfloat16. Named "<short>+<activation>/...".
ACTIVATION_CASES: tuple[tuple[str, tuple[int, ...], str, str, str], ...] = (
    ("batch_norm", RESNET50_BN_SHAPES[1], "nchw", "float32", "relu"),
    ("group_norm", SD_UNET_GROUP_NORM_SHAPE, "nchw", "float32", "silu"),
    ("group_norm", SD_UNET_GROUP_NORM_SHAPE, "nchw", "bfloat16", "silu"),
)

# Training ops: (op, shape, layout, dtype). The shapes and dtypes of the speed goals of the training
# issue: forward-training batch norm (NCHW); the backward of batch norm (NCHW and channels-last), of
# layer norm (float32 and bfloat16), RMS norm, group norm (32 groups), instance norm and MVN over
# (0, 2, 3), all float32 unless said, and group norm's of channels-last data (diffusion models'
# UNets train so); then batch norm and group norm on 7x7 planes, and batch norm training on
# 14x14 planes (ResNet-50's third stage: runs of 196 elements, eight to a channel); last, batch
# norm's backward with given statistics (training=False: a frozen batch norm while fine-tuning),
# NCHW and channels-last; then BatchNorm1d's (N, C) forward-training and backward. Tagged
# "training" (the backward ones also "backward").
TRAINING_CASES: tuple[tuple[str, tuple[int, ...], str, str], ...] = (
    ("batch_norm_training", RESNET50_BN_SHAPES[1], "nchw", "float32"),
    ("batch_norm_training", RESNET50_BN_SHAPES[1], "nhwc", "float32"),
    ("batch_norm_backward", RESNET50_BN_SHAPES[1], "nchw", "float32"),
    ("batch_norm_backward", RESNET50_BN_SHAPES[1], "nhwc", "float32"),
    ("layer_norm_backward", SEQUENCE_NORM_SHAPES[0], "contig", "float32"),
    ("layer_norm_backward", SEQUENCE_NORM_SHAPES[0], "contig", "bfloat16"),
    ("rms_norm_backward", SEQUENCE_NORM_SHAPES[0], "contig", "float32"),
    ("group_norm_backward", SPATIAL_NORM_SHAPES[0], "nchw", "float32"),
    ("group_norm_backward", SPATIAL_NORM_SHAPES[0], "nhwc", "float32"),
    ("instance_norm_backward", SPATIAL_NORM_SHAPES[0], "nchw", "float32"),
    ("mvn_backward", SPATIAL_NORM_SHAPES[0], "nchw", "float32"),
    ("batch_norm_training", RESNET50_BN_SHAPES[-1], "nchw", "float32"),
    ("batch_norm_backward", RESNET50_BN_SHAPES[-1], "nchw", "float32"),
    ("group_norm_backward", SPATIAL_NORM_SHAPES[1], "nchw", "float32"),
    ("batch_norm_training", RESNET50_BN_SHAPES[5], "nchw", "float32"),
    ("batch_norm_eval_backward", RESNET50_BN_SHAPES[1], "nchw", "float32"),
    ("batch_norm_eval_backward", RESNET50_BN_SHAPES[1], "nhwc", "float32"),
    ("batch_norm_training", BATCH_NORM_1D_SHAPE, "nchw", "float32"),
    ("batch_norm_backward", BATCH_NORM_1D_SHAPE, "nchw", "float32"),
)
# Backward ops through the activation their forward fused (op, shape, layout, dtype, activation), as
# training runs them: ResNet-50's batch norm + relu (batch statistics), the UNet's GroupNorm(32) +
# SiLU in float32 and bfloat16. Named "<short>-bwd+<activation>/...", tagged "training", "backward"
# and "activation".
ACTIVATION_BACKWARD_CASES: tuple[tuple[str, tuple[int, ...], str, str, str], ...] = (
    ("batch_norm_backward", RESNET50_BN_SHAPES[1], "nchw", "float32", "relu"),
    ("group_norm_backward", SD_UNET_GROUP_NORM_SHAPE, "nchw", "float32", "silu"),
    ("group_norm_backward", SD_UNET_GROUP_NORM_SHAPE, "nchw", "bfloat16", "silu"),
)
# PyTorch's running-statistics momentum (ONNX's is 1 - this: 0.9) and torch.nn's initial running
# statistics, for the forward-training case.
MOMENTUM = 0.1
RUNNING_MEAN_INIT = 0.0
RUNNING_VAR_INIT = 1.0

BN_DTYPES = ("float32", "float16", "bfloat16")
BN_LAYOUTS = ("nchw", "nhwc")
SPATIAL_DTYPES = ("float32", "float16")
SEQUENCE_DTYPES = ("float32", "float16", "bfloat16")  # bfloat16: the transformers' other 16-bit type
GROUP_NORM_GROUPS = 32
MVN_AXES = (0, 2, 3)
EPSILON = 1e-5

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
DTYPE_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64"}

# What each op is, in words (shown by --list and stored in the JSON).
OP_DESCRIPTIONS = {
    "batch_norm": "y = scale*(x-mean)/sqrt(var+eps)+bias, per-channel (C,) float32 parameters "
                  "(float64 for float64 data)",
    "instance_norm": "per (n, c) over (2, 3), eps inside sqrt, (C,) scale and bias",
    "group_norm": "per (n, group) over the group's channels and (2, 3), (C,) scale and bias",
    "mvn": "mean/variance over axes, y = (x-mean)/sqrt(var+eps), no scale or bias",
    "layer_norm": "over the last axis, (D,) scale and bias",
    "rms_norm": "y = scale*x/sqrt(mean(x^2)+eps) over the last axis, (D,) scale",
    "batch_norm_training": "batch norm with the batch's mean and population variance over (0, 2, 3), "
                           "(C,) float32 scale and bias; returns them and updates (C,) running "
                           "statistics (PyTorch's momentum 0.1 and unbiased variance)",
    "batch_norm_backward": "grad_input, grad_scale, grad_bias of training-mode batch norm given "
                           "grad_output and the forward's mean and variance",
    "batch_norm_eval_backward": "grad_input, grad_scale, grad_bias of batch norm with given statistics "
                                "(training=False: frozen running statistics) given grad_output",
    "instance_norm_backward": "grad_input, grad_scale, grad_bias of instance norm given grad_output "
                              "and the forward's mean and inv_std",
    "group_norm_backward": "grad_input, grad_scale, grad_bias of group norm given grad_output and "
                           "the forward's mean and inv_std",
    "mvn_backward": "grad_input of MVN over axes given grad_output and the forward's mean and inv_std",
    "layer_norm_backward": "grad_input, grad_scale, grad_bias of layer norm given grad_output and "
                           "the forward's mean and inv_std",
    "rms_norm_backward": "grad_input, grad_scale of RMS norm given grad_output and the forward's inv_rms",
}
# The activations a case may fuse after its op, in words (the float64 reference: bench/cases.py).
ACTIVATION_DESCRIPTIONS = {
    "relu": "max(y, 0)",
    "silu": "y / (1 + exp(-y))",
}
TRAINING_OPS = frozenset(op for op in OP_DESCRIPTIONS if op == "batch_norm_training" or op.endswith("_backward"))
BACKWARD_OPS = frozenset(op for op in OP_DESCRIPTIONS if op.endswith("_backward"))


def forward_op(op: str) -> str:
    """The forward op a backward op differentiates ("layer_norm" for "layer_norm_backward"; batch norm
    in training mode for "batch_norm_backward", with its given statistics for
    "batch_norm_eval_backward"); the op itself otherwise."""
    if op == "batch_norm_eval_backward":
        return "batch_norm"
    return op[: -len("_backward")] if op.endswith("_backward") else op


@dataclass(frozen=True)
class Case:
    """One benchmark case: an op on one logical shape, dtype and memory layout."""

    name: str
    op: str  # one of OP_DESCRIPTIONS
    shape: tuple[int, ...]  # logical shape (channels at axis 1 for 4-D cases)
    dtype: str  # "float32" | "float16" | "bfloat16" | "float64"
    layout: str = "nchw"  # "nchw" | "nhwc" | "contig"
    axes: tuple[int, ...] = ()  # reduced axes (normalized-over dims) for the MVN-type ops
    groups: int = 0  # group_norm only
    compiled: bool = False  # simdnorm runs it through simdnorm.compile(desc)
    epsilon: float = EPSILON
    # one of ACTIVATION_DESCRIPTIONS, applied to the op's output (a backward op's forward's: its
    # gradient taken through it)
    activation: Optional[str] = None
    tags: frozenset[str] = field(default_factory=frozenset)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the input tensor."""
        return self.numel * ITEMSIZE[self.dtype]

    @property
    def bytes_moved(self) -> int:
        """Bytes the op must move at least: the input read once + the output written once; for a
        backward op, x and grad_output read once + grad_input written once."""
        return bytes_moved(self.shape, self.dtype, self.op)

    @property
    def is_training(self) -> bool:
        """A training op (forward-training batch norm or a backward op)."""
        return self.op in TRAINING_OPS

    @property
    def is_backward(self) -> bool:
        return self.op in BACKWARD_OPS

    @property
    def channels(self) -> int:
        return self.shape[1] if len(self.shape) >= 2 else self.shape[0]

    @property
    def param_len(self) -> int:
        """Length of the 1-D parameters (scale, bias, mean, var), 0 if the op takes none."""
        op = forward_op(self.op)
        if op in ("batch_norm", "batch_norm_training", "instance_norm", "group_norm"):
            return self.shape[1]
        if op in ("layer_norm", "rms_norm"):
            return self.shape[-1]
        return 0

    @property
    def params(self) -> tuple[str, ...]:
        """Names of the 1-D parameter arrays the op takes, in call order."""
        return {
            "batch_norm": ("mean", "var", "scale", "bias"),
            "instance_norm": ("scale", "bias"),
            "group_norm": ("scale", "bias"),
            "mvn": (),
            "layer_norm": ("scale", "bias"),
            "rms_norm": ("scale",),
            # batch statistics, not given ones: scale and bias only
            "batch_norm_training": ("scale", "bias"),
            "batch_norm_backward": ("scale", "bias"),
            "batch_norm_eval_backward": ("mean", "var", "scale", "bias"),
            "instance_norm_backward": ("scale", "bias"),
            "group_norm_backward": ("scale", "bias"),
            "mvn_backward": (),
            "layer_norm_backward": ("scale", "bias"),
            "rms_norm_backward": ("scale",),
        }[self.op]

    @property
    def grad_params(self) -> tuple[str, ...]:
        """The parameters a backward op returns the gradient of (given statistics are constants)."""
        return tuple(k for k in self.params if k not in ("mean", "var"))

    def describe(self) -> str:
        extra = []
        if self.axes and self.op in ("mvn", "mvn_backward"):
            extra.append(f"axes={self.axes}")
        if self.groups:
            extra.append(f"groups={self.groups}")
        if self.activation:
            extra.append(f"{'through' if self.is_backward else 'then'} {self.activation}")
        if self.compiled:
            extra.append("simdnorm via compile(desc)")
        tail = f" [{', '.join(extra)}]" if extra else ""
        return f"{self.op} {shape_str(self.shape)} {self.dtype} {self.layout}{tail}"

    def scaled(self, shape: Sequence[int]) -> "Case":
        """The same op, dtype and layout on another (smaller) shape, for fast tests."""
        shape = tuple(int(s) for s in shape)
        if len(shape) != len(self.shape):
            raise ValueError(f"scaled shape {shape} must have {len(self.shape)} dims")
        name = make_name(self.op, shape, self.dtype, self.layout, self.groups, self.compiled,
                         tiny="tiny" in self.tags, activation=self.activation)
        return replace(self, name=name, shape=shape)


def shape_str(shape: Iterable[int]) -> str:
    return "x".join(str(int(s)) for s in shape)


def bytes_moved(shape: Sequence[int], dtype: str, op: str = "") -> int:
    """Input read once + output written once: 2 * nbytes of the input; a backward op reads x and
    grad_output and writes grad_input: 3 * nbytes (the statistics and parameters are not counted)."""
    return (3 if op in BACKWARD_OPS else 2) * prod(shape) * ITEMSIZE[dtype]


def make_name(op: str, shape, dtype: str, layout: str, groups: int = 0, compiled: bool = False,
              tiny: bool = False, activation: Optional[str] = None) -> str:
    d = DTYPE_SHORT[dtype]
    s = shape_str(shape)
    if tiny:
        return f"tiny/bn{'-compiled' if compiled else ''}/{s}/{d}"
    if op == "batch_norm_training":
        return f"bn-train/{s}/{layout}/{d}"
    fwd = forward_op(op)
    short = {
        "batch_norm": "bn",
        "instance_norm": "instance",
        "group_norm": f"group{groups}",
        "mvn": "mvn023",
        "layer_norm": "layer",
        "rms_norm": "rms",
    }[fwd]
    if op != fwd:
        short += "-bwd-eval" if op == "batch_norm_eval_backward" else "-bwd"
    if activation:
        short += f"+{activation}"
    if fwd == "batch_norm" or layout == "nhwc":  # (the other ops' cases are NCHW but for this one)
        return f"{short}/{s}/{layout}/{d}"
    return f"{short}/{s}/{d}"


def _build_cases() -> tuple[Case, ...]:
    out: list[Case] = []
    quick_bn = {(8, 512, 28, 28)}
    for shape in RESNET50_BN_SHAPES:
        for layout in BN_LAYOUTS:
            for dtype in BN_DTYPES:
                tags = {"bn", layout, dtype}
                if shape in quick_bn and (dtype == "float32" or (layout, dtype) == ("nchw", "float16")):
                    tags.add("quick")
                out.append(Case(make_name("batch_norm", shape, dtype, layout), "batch_norm", shape,
                                dtype, layout, axes=(0, 2, 3), tags=frozenset(tags)))
    for shape in SPATIAL_NORM_SHAPES:
        for dtype in SPATIAL_DTYPES:
            q = {"quick"} if dtype == "float32" else set()
            out.append(Case(make_name("instance_norm", shape, dtype, "nchw"), "instance_norm", shape,
                            dtype, "nchw", axes=(2, 3), tags=frozenset({"spatial", dtype} | q)))
            out.append(Case(make_name("group_norm", shape, dtype, "nchw", GROUP_NORM_GROUPS),
                            "group_norm", shape, dtype, "nchw", axes=(2, 3),
                            groups=GROUP_NORM_GROUPS, tags=frozenset({"spatial", dtype} | q)))
            out.append(Case(make_name("mvn", shape, dtype, "nchw"), "mvn", shape, dtype, "nchw",
                            axes=MVN_AXES, tags=frozenset({"spatial", dtype} | q)))
    for shape in SEQUENCE_NORM_SHAPES:
        for dtype in SEQUENCE_DTYPES:
            q = {"quick"} if shape == SEQUENCE_NORM_SHAPES[0] else set()
            for op in ("layer_norm", "rms_norm"):
                out.append(Case(make_name(op, shape, dtype, "contig"), op, shape, dtype, "contig",
                                axes=(len(shape) - 1,), tags=frozenset({"sequence", dtype} | q)))
    for compiled in (False, True):
        out.append(Case(make_name("batch_norm", TINY_SHAPE, "float32", "nchw", compiled=compiled,
                                  tiny=True),
                        "batch_norm", TINY_SHAPE, "float32", "nchw", axes=(0, 2, 3),
                        compiled=compiled, tags=frozenset({"tiny", "quick", "float32"})))
    out.append(Case(make_name("batch_norm", BATCH_NORM_1D_SHAPE, "float32", "nchw"), "batch_norm",
                    BATCH_NORM_1D_SHAPE, "float32", "nchw", axes=(0,), tags=frozenset({"bn", "nchw", "bn1d", "float32"})))
    for op, shape, layout in FLOAT64_CASES:  # tagged as the float32 cases of their kind are
        if op == "batch_norm":
            axes, tags = (0, 2, 3), {"bn", layout}
        elif op == "instance_norm":
            axes, tags = (2, 3), {"spatial"}
        else:  # layer_norm
            axes, tags = (len(shape) - 1,), {"sequence"}
        out.append(Case(make_name(op, shape, "float64", layout), op, shape, "float64", layout,
                        axes=axes, tags=frozenset(tags | {"float64"})))
    for op, shape, layout, dtype, activation in ACTIVATION_CASES:
        if op == "batch_norm":
            axes, groups, tags = (0, 2, 3), 0, {"bn", layout}
        else:  # group_norm
            axes, groups, tags = (2, 3), GROUP_NORM_GROUPS, {"spatial"}
        tags |= {dtype, "activation"}
        # --quick gets one: the UNet's float32 SiLU, whose exp per element costs more than ReLU's max
        if (op, dtype) == ("group_norm", "float32"):
            tags.add("quick")
        out.append(Case(make_name(op, shape, dtype, layout, groups, activation=activation), op, shape,
                        dtype, layout, axes=axes, groups=groups, activation=activation,
                        tags=frozenset(tags)))
    for op, shape, layout, dtype, activation in (*((*c, None) for c in TRAINING_CASES), *ACTIVATION_BACKWARD_CASES):
        fwd = forward_op(op)
        groups = GROUP_NORM_GROUPS if fwd == "group_norm" else 0
        if fwd in ("batch_norm", "batch_norm_training", "mvn"):
            axes = (0, *range(2, len(shape)))
        elif fwd in ("instance_norm", "group_norm"):
            axes = (2, 3)
        else:  # layer_norm, rms_norm
            axes = (len(shape) - 1,)
        tags = {"training", dtype} | ({"backward"} if op in BACKWARD_OPS else set())
        if len(shape) == 2:
            tags.add("bn1d")
        if activation:
            tags.add("activation")
        elif (op, dtype) == ("layer_norm_backward", "float32"):
            tags.add("quick")
        out.append(Case(make_name(op, shape, dtype, layout, groups, activation=activation), op, shape, dtype,
                        layout, axes=axes, groups=groups, activation=activation, tags=frozenset(tags)))
    names = [c.name for c in out]
    assert len(names) == len(set(names)), "case names must be unique"
    return tuple(out)


CASES: tuple[Case, ...] = _build_cases()
CASES_BY_NAME: dict[str, Case] = {c.name: c for c in CASES}


def select(quick: bool = False, filters: Sequence[str] = ()) -> list[Case]:
    """Cases to run: the quick subset or all, then those whose name contains any filter substring."""
    cases = [c for c in CASES if (not quick or "quick" in c.tags)]
    if filters:
        cases = [c for c in cases if any(f in c.name for f in filters)]
    return cases


def get_case(name: str) -> Case:
    return CASES_BY_NAME[name]
