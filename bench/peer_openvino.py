"""OpenVINO (CPU plugin): a model built from openvino opset ops, compiled with f32 inference
precision (its default on CPUs with bf16 support is bf16) and INFERENCE_NUM_THREADS, run on
shared-memory tensors with one reused infer request. The layer types of the executed graph are shown.
The training cases are n/a: OpenVINO is an inference runtime (BatchNormInference only: no batch
statistics, running statistics or backward ops).
"""
from __future__ import annotations

import numpy as np

from .cases import CaseData, NotAvailable
from .impl_base import LazyPeerImpl, Prepared, prepared_out  # noqa: F401


def _import():
    import openvino as ov
    try:
        import openvino.opset13 as ops
    except ImportError:  # older layouts
        from openvino.runtime import opset13 as ops  # type: ignore[no-redef]
    return ov, ops


_HIDDEN_LAYERS = {"Input", "Output", "Const", "Parameter", "Result", "Constant"}


def exec_layer_types(compiled) -> list[str]:
    """Layer types of the graph the CPU plugin executes (without inputs, outputs, constants)."""
    out = []
    for node in compiled.get_runtime_model().get_ordered_ops():
        rt = node.get_rt_info()
        lt = rt["layerType"].astype(str) if "layerType" in rt else node.get_type_name()
        if lt not in _HIDDEN_LAYERS:
            out.append(lt)
    return out


def exec_layer_precisions(compiled) -> list[tuple[str, str]]:
    """(layer type, runtime precision) of each executed layer (without inputs, outputs, constants);
    the precision "" where the plugin does not say."""
    out = []
    for node in compiled.get_runtime_model().get_ordered_ops():
        rt = node.get_rt_info()
        lt = rt["layerType"].astype(str) if "layerType" in rt else node.get_type_name()
        if lt not in _HIDDEN_LAYERS:
            prec = rt["runtimePrecision"].astype(str) if "runtimePrecision" in rt else ""
            out.append((lt, prec.lower()))
    return out


class OpenVinoImpl(LazyPeerImpl):
    name = "openvino"
    footnote = ("openvino: opset model, CPU plugin, INFERENCE_PRECISION_HINT=f32, shared-memory "
                "tensors, one reused infer request; 'exec:' lists the layers it ran; n/a on float64 "
                "(the CPU plugin computes f64 models in f32); +relu/+silu: a Relu/Swish op after the "
                "norm, for the plugin to fuse as it can")
    requires = "openvino"

    def __init__(self) -> None:
        super().__init__()
        self._core = None

    def _import(self):
        mods = _import()
        self._core = mods[0].Core()
        return mods

    def _version(self, mods) -> str:
        return mods[0].__version__.split("-")[0]

    def config(self) -> dict:
        return {
            "INFERENCE_PRECISION_HINT": "f32",
            "INFERENCE_NUM_THREADS": int(self.threads),
            "PERFORMANCE_HINT": "LATENCY",
            "NUM_STREAMS": 1,
        }

    def build_model(self, data: CaseData):
        ov, ops = self._load()
        case = data.case
        if case.is_training:
            raise NotAvailable("no training ops: OpenVINO's opsets are inference only "
                               + ("(no backward ops)" if case.is_backward
                                  else "(BatchNormInference: no batch or running statistics)"))
        et = {"float32": ov.Type.f32, "float16": ov.Type.f16, "bfloat16": ov.Type.bf16,
              "float64": ov.Type.f64}[case.dtype]
        base_shape = list(data.base.shape)
        x = ops.parameter(base_shape, et, name="X")
        eps = float(case.epsilon)
        note = ""

        def c(arr, shape=None):  # a constant in the input's element type (values are exact)
            a = np.asarray(arr, dtype=np.float32)
            if shape is not None:
                a = a.reshape(shape)
            return ops.constant(a, dtype=et)

        p = data.params
        nd = len(case.shape)
        cshape = (1, -1) + (1,) * (nd - 2)
        if case.op == "batch_norm" and case.layout == "nchw":
            y = ops.batch_norm_inference(x, c(p["scale"]), c(p["bias"]), c(p["mean"]), c(p["var"]), eps)
        elif case.op == "batch_norm":
            # BatchNormInference is channels-first: on the NHWC data the same op is x * A + B per
            # channel (what OpenVINO decomposes BatchNormInference into; the constants fold).
            a = ops.divide(c(p["scale"]), ops.sqrt(ops.add(c(p["var"]), c(eps))))
            b = ops.subtract(c(p["bias"]), ops.multiply(c(p["mean"]), a))
            y = ops.add(ops.multiply(x, a), b)
            note = "expanded: Multiply+Add over NHWC (BatchNormInference is channels-first)"
        elif case.op == "instance_norm":
            m = ops.mvn(x, ops.constant(np.array([2, 3], np.int64)), True, eps, "inside_sqrt")
            y = ops.add(ops.multiply(m, c(p["scale"], cshape)), c(p["bias"], cshape))
        elif case.op == "group_norm":
            y = ops.group_normalization(x, c(p["scale"]), c(p["bias"]), case.groups, eps)
        elif case.op == "mvn":
            y = ops.mvn(x, ops.constant(np.array(case.axes, np.int64)), True, eps, "inside_sqrt")
        elif case.op == "layer_norm":
            m = ops.mvn(x, ops.constant(np.array([-1], np.int64)), True, eps, "inside_sqrt")
            y = ops.add(ops.multiply(m, c(p["scale"])), c(p["bias"]))
        elif case.op == "rms_norm":
            # the decomposition OpenVINO's RMSFusion pass matches:
            # x * 1/Sqrt(ReduceMean(x^2, -1) + eps) * gamma
            sq = ops.power(x, c(2.0))
            ms = ops.reduce_mean(sq, ops.constant(np.array([-1], np.int64)), True)
            r = ops.divide(c(1.0), ops.sqrt(ops.add(ms, c(eps))))
            y = ops.multiply(ops.multiply(x, r), c(p["scale"]))
        else:
            raise NotAvailable(f"unknown op {case.op}")
        if case.activation == "relu":
            y = ops.relu(y)
        elif case.activation == "silu":  # OpenVINO's Swish: x * sigmoid(beta * x), beta 1
            y = ops.swish(y, c(1.0))  # beta in the input's type (its default is an f32 constant)
        elif case.activation:
            raise NotAvailable(f"no OpenVINO op for activation {case.activation!r}")
        model = ov.Model([y], [x], "bench")
        return model, note

    def _tensor(self, ov, arr: np.ndarray):
        if arr.dtype.name == "bfloat16":
            return ov.Tensor(arr.view(np.uint16), ov.Shape(list(arr.shape)), ov.Type.bf16)
        return ov.Tensor(arr, shared_memory=True)

    def prepare(self, data: CaseData) -> Prepared:
        ov, ops = self._load()
        case = data.case
        model, note = self.build_model(data)
        try:
            compiled = self._core.compile_model(model, "CPU", self.config())
        except Exception as e:  # noqa: BLE001
            raise NotAvailable(f"OpenVINO compile failed: {str(e).splitlines()[0][:120]}") from None
        layers = exec_layer_types(compiled)
        if case.dtype == "float64":
            # The CPU plugin has no f64 kernels: it converts f64 to f32 on the way in, computes in
            # f32 and converts back (measured: 3e-7 off on layer norm, the tolerance is 1e-10),
            # whatever INFERENCE_PRECISION_HINT says. Timed, that would be a float32 op.
            f32 = [lt for lt, prec in exec_layer_precisions(compiled)
                   if lt not in ("Convert",) and prec not in ("f64", "")]
            if f32:
                raise NotAvailable(f"OpenVINO CPU has no f64 kernels: it converts float64 to f32 "
                                   f"and computes in f32 ({','.join(dict.fromkeys(f32))} in f32; "
                                   f"exec: {','.join(layers)})")
        converts = [t for t in layers if t in ("Convert",)]
        if converts:
            raise NotAvailable(f"OpenVINO CPU converts {case.dtype} to f32 in a separate pass "
                               f"(exec: {','.join(layers)})")
        x = data.base
        out = data.new_output()
        y = out.transpose(0, 2, 3, 1) if case.layout == "nhwc" else out
        assert x.flags.c_contiguous and y.flags.c_contiguous
        req = compiled.create_infer_request()
        req.set_input_tensor(self._tensor(ov, x))
        req.set_output_tensor(self._tensor(ov, y))
        infer = req.infer

        def fn() -> None:
            infer()

        fn._keep = (compiled, req, x, y)  # type: ignore[attr-defined]
        ex = "exec: " + ",".join(dict.fromkeys(layers))
        note = f"{note}; {ex}" if note else ex
        return prepared_out(fn, out, note)
