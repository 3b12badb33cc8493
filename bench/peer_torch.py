"""PyTorch CPU: torch.nn.functional on zero-copy views of the case's numpy arrays.

Training cases: forward-training batch norm is F.batch_norm(training=True) with running statistics,
its weight and bias requiring grad (as nn.BatchNorm2d's parameters do: each call records its autograd
node, saving its statistics for the backward). A backward case builds the forward graph once, before
the timing (F.batch_norm(training=True) / layer_norm / group_norm / instance_norm / rms_norm on x,
weight and bias that require grad), and times torch.autograd.grad of that output with respect to
(x, weight, bias) given grad_output (retain_graph=True, so each call runs the same backward graph):
the backward kernels and autograd's engine, what loss.backward() costs for this layer, against
simdnorm's backward call given the statistics its forward returned.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import replace

import numpy as np

from .cases import CaseData, NotAvailable
from .impl_base import LazyPeerImpl, Prepared
from .shapes import MOMENTUM, RUNNING_MEAN_INIT, RUNNING_VAR_INIT, forward_op
from .timing import run_reps


def _import_torch():
    import torch
    import torch.nn.functional as F
    return torch, F


def to_torch(torch, a: np.ndarray):
    """A tensor sharing the array's memory and strides (bfloat16 through a uint16 view)."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def to_numpy(torch, t, like: np.ndarray) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(like.dtype)
    return t.numpy()


def _then_activation(F, name: str, norm):
    """The norm, then F.relu / F.silu on its output: the unfused pair a torch model runs. In place
    (inplace=True, as torchvision's ResNet writes nn.ReLU): the norm's output is a fresh tensor, so
    torch is not charged a second output allocation that its users avoid."""
    act = getattr(F, name)

    def norm_then_activation():
        return act(norm(), inplace=True)

    return norm_then_activation


class TorchImpl(LazyPeerImpl):
    name = "torch"
    footnote = ("torch: torch.nn.functional on zero-copy views; allocates its output (no out= in F.*); "
                "bn-train: F.batch_norm(training=True) with running statistics; "
                "+relu/+silu: the F.* op, then F.relu/F.silu(inplace=True) on its output (unfused, "
                "as torch models run them); *-bwd: "
                "torch.autograd.grad(y, (x, weight, bias), grad_output, retain_graph=True) of the "
                "F.* forward graph built before the timing (bn-bwd-eval: F.batch_norm(training=False) "
                "with the given statistics; *-bwd+relu/+silu: F.relu/F.silu(y) in the graph); its outputs are fresh each call, and "
                "whether their pages fault depends on the C heap's state, so its samples can be "
                "bimodal (bn-bwd NHWC here: 5.7 ms, or ~23 ms with 6272 page faults): see min..max")
    requires = "torch"

    def _import(self):
        return _import_torch()

    def _version(self, mods) -> str:
        return mods[0].__version__

    def set_threads(self, n: int) -> None:
        self.threads = n
        try:
            torch, _ = self._load()
        except NotAvailable:
            return
        torch.set_num_threads(n)

    @staticmethod
    def _forward(torch, F, case, xt, p):
        """(the forward op as a callable, note) on the tensor xt and parameters p."""
        eps = case.epsilon
        partial = functools.partial
        note = ""
        if case.op == "batch_norm":
            if case.layout == "nhwc":
                assert xt.is_contiguous(memory_format=torch.channels_last)
                note = "channels_last"
            fn = partial(F.batch_norm, xt, p["mean"], p["var"], p["scale"], p["bias"], False, 0.0, eps)
        elif case.op == "batch_norm_training":
            raise AssertionError("built by _build")
        elif case.op == "instance_norm":
            fn = partial(F.instance_norm, xt, None, None, p["scale"], p["bias"], True, 0.0, eps)
        elif case.op == "group_norm":
            fn = partial(F.group_norm, xt, case.groups, p["scale"], p["bias"], eps)
        elif case.op == "mvn":
            if tuple(case.axes) != (0, 2, 3):
                raise NotAvailable(f"no torch op normalizes over axes {case.axes}")
            # batch norm in training mode normalizes with the batch statistics over (0, 2, 3)
            # and the biased variance: exactly MVN over (0, 2, 3), eps inside the sqrt.
            fn = partial(F.batch_norm, xt, None, None, None, None, True, 0.0, eps)
            note = "F.batch_norm(training=True)"
        elif case.op == "layer_norm":
            fn = partial(F.layer_norm, xt, (xt.shape[-1],), p["scale"], p["bias"], eps)
        elif case.op == "rms_norm":
            if not hasattr(F, "rms_norm"):
                raise NotAvailable(f"torch {torch.__version__} has no F.rms_norm")
            fn = partial(F.rms_norm, xt, (xt.shape[-1],), p["scale"], eps)
        else:
            raise NotAvailable(f"unknown op {case.op}")
        return fn, note

    @classmethod
    def _build(cls, torch, F, data, xt, p):
        """(timed callable, run_once, note) for the case on the tensor xt and parameters p."""
        case = data.case
        x = data.x
        if case.op == "batch_norm_training":
            rm = torch.empty(case.param_len, dtype=p["scale"].dtype)
            rv = torch.empty_like(rm)
            w = p["scale"].clone().requires_grad_()
            b = p["bias"].clone().requires_grad_()
            fn = functools.partial(F.batch_norm, xt, rm, rv, w, b, True, MOMENTUM, case.epsilon)

            def run_training():
                rm.fill_(RUNNING_MEAN_INIT)
                rv.fill_(RUNNING_VAR_INIT)
                y = fn()
                return {"out": to_numpy(torch, y, x), "running_mean": rm.numpy().copy(),
                        "running_var": rv.numpy().copy()}

            note = "channels_last" if case.layout == "nhwc" else ""
            return fn, run_training, note
        if case.is_backward:
            xg = xt.detach().requires_grad_()  # a leaf sharing x's memory
            wrt = [xg] + [p[k].clone().requires_grad_() for k in case.grad_params]
            pg = dict(zip(case.grad_params, wrt[1:]))
            if case.op == "batch_norm_backward":  # training mode: the batch's statistics
                if case.layout == "nhwc":
                    assert xg.is_contiguous(memory_format=torch.channels_last)
                fwd = functools.partial(F.batch_norm, xg, None, None, pg["scale"], pg["bias"], True,
                                        0.0, case.epsilon)
                note = "channels_last" if case.layout == "nhwc" else ""
            elif case.op == "batch_norm_eval_backward":  # eval mode: the given statistics
                fwd = functools.partial(F.batch_norm, xg, p["mean"], p["var"], pg["scale"], pg["bias"], False,
                                        0.0, case.epsilon)
                note = "channels_last" if case.layout == "nhwc" else ""
            else:
                fwd, note = cls._forward(torch, F, replace(case, op=forward_op(case.op)), xg, pg)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                y = fwd()  # the graph: built once, outside the timing
                if case.activation:  # -bwd+<activation>: the gradient through it too
                    y = getattr(F, case.activation)(y)
            dyt = to_torch(torch, data.dy)
            fn = functools.partial(torch.autograd.grad, y, wrt, dyt, retain_graph=True)
            names = ("grad_input",) + tuple(f"grad_{k}" for k in case.grad_params)

            def run_backward():
                return {k: to_numpy(torch, g, x) for k, g in zip(names, fn())}

            return fn, run_backward, note
        fn, note = cls._forward(torch, F, case, xt, p)
        if case.activation:
            fn = _then_activation(F, case.activation, fn)

        def run_forward():
            return to_numpy(torch, fn(), x)

        return fn, run_forward, note

    def prepare(self, data: CaseData) -> Prepared:
        torch, F = self._load()
        case = data.case
        x = data.x
        xt = to_torch(torch, x)
        # Parameters: float32 (torch's mixed-precision path, as under autocast) or the input's
        # dtype; the values are exact in both, so both are the same op. For a float16/bfloat16
        # input the faster of the two (3 calls each, during setup) is verified and timed; the
        # note says which. For a float64 input only float64 ones: what a float64 user passes
        # (torch's float64 kernels take no float32 parameters).
        if case.dtype == "float64":
            variants = [("float64", {k: torch.from_numpy(v) for k, v in data.user_params().items()})]
        else:
            variants = [("float32", {k: torch.from_numpy(v) for k, v in data.params.items()})]
        if case.dtype in ("float16", "bfloat16") and data.params:
            tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[case.dtype]
            variants.append((case.dtype, {k: torch.from_numpy(v).to(tdt) for k, v in data.params.items()}))
        built = []
        for pname, p in variants:
            fn, run, note = self._build(torch, F, data, xt, p)
            built.append((pname, fn, run, note))
        if len(built) == 1 or not data.params:
            _, fn, run, note = built[0]
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                timed = []
                for pname, f, r, n in built:
                    f()
                    t = min(run_reps(f, 1) for _ in range(3))
                    timed.append((t, pname, f, r, n))
            t, pname, fn, run, note = min(timed, key=lambda e: e[0])
            note = (note + "; " if note else "") + f"{pname} params"

        def run_once():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return run()

        return Prepared(fn, run_once, note)
