"""ONNX Runtime (CPU execution provider): a one-node ONNX model built in memory, run with io binding
onto preallocated numpy arrays.

The optimized graph ORT actually runs is inspected once per case: if ORT inserted casts to float32
because it lacks a kernel for the dtype, the case is n/a (we do not time a cast); if ORT expanded the
op into several nodes (an ONNX function body), the table says so. A case with a fused activation
gets the activation's nodes after the norm (:data:`ONNX_ACTIVATION`); the note says what ORT ran
for them.

Training: forward-training batch norm is BatchNormalization-15 with training_mode=1 (Y and the
updated running statistics as outputs, ONNX's momentum convention), which ORT's CPU inference
session runs. Backward cases are n/a: ONNX defines no gradient operators, and ORT's own
(com.microsoft *Grad) kernels are registered only in its training builds; the reason shown is what
this build says when asked for one.
"""
from __future__ import annotations

import os
import tempfile
from typing import Optional

import numpy as np

from .cases import CaseData, NotAvailable
from .impl_base import LazyPeerImpl, Prepared, prepared_out  # noqa: F401
from .shapes import MOMENTUM, RUNNING_MEAN_INIT, RUNNING_VAR_INIT

OPSET = 23  # RMSNormalization-23; BatchNormalization-15, LayerNormalization-17, GroupNormalization-21
ONNX_OP = {
    "batch_norm": "BatchNormalization",
    "instance_norm": "InstanceNormalization",
    "group_norm": "GroupNormalization",
    "mvn": "MeanVarianceNormalization",
    "layer_norm": "LayerNormalization",
    "rms_norm": "RMSNormalization",
    "batch_norm_training": "BatchNormalization",  # training_mode=1
}


# Each fused activation as the ONNX nodes (op type, inputs, outputs) that follow the norm, whose
# output is then NORM_OUT; the last writes Y. SiLU as Sigmoid and Mul: ORT fuses the pair into its
# com.microsoft QuickGelu kernel (alpha 1: x * sigmoid(x)), while ONNX's own Swish (opset 24) runs
# in ORT 1.32 as its function body, Mul, Sigmoid, Mul, unfused.
NORM_OUT = "N"
ONNX_ACTIVATION = {
    "relu": (("Relu", [NORM_OUT], ["Y"]),),
    "silu": (("Sigmoid", [NORM_OUT], ["sigmoid_N"]), ("Mul", [NORM_OUT, "sigmoid_N"], ["Y"])),
}


def _import():
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    return onnx, ort, helper, numpy_helper, TensorProto


# ORT's training-build gradient kernels of the backward cases' ops (none for group, instance, MVN)
ORT_GRAD_OP = {
    "batch_norm_backward": "BatchNormalizationGrad",
    "layer_norm_backward": "LayerNormalizationGrad",
    "rms_norm_backward": "SimplifiedLayerNormalizationGrad",
}


def _elem_type(TensorProto, dtype_name: str) -> int:
    return {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16,
            "bfloat16": TensorProto.BFLOAT16, "float64": TensorProto.DOUBLE}[dtype_name]


class OnnxRuntimeImpl(LazyPeerImpl):
    name = "onnxruntime"
    footnote = ("onnxruntime: in-memory ONNX model (parameters as initializers), CPU EP, io binding "
                "onto preallocated numpy arrays; +relu: a Relu node after the norm, +silu: Sigmoid "
                "and Mul, which ORT fuses into com.microsoft QuickGelu (the note says what ran)")
    requires = "onnxruntime/onnx"

    def _import(self):
        mods = _import()
        mods[1].set_default_logger_severity(3)
        return mods

    def _version(self, mods) -> str:
        onnx, ort, *_ = mods
        return f"{ort.__version__} (onnx {onnx.__version__})"

    def _grad_kernel_missing(self, op: str) -> Optional[str]:
        """ORT's own words when asked for a session with com.microsoft.`op` (None if it builds one)."""
        onnx, ort, helper, numpy_helper, TensorProto = self._load()
        node = helper.make_node(op, ["dY", "X"], ["dX"], domain="com.microsoft")
        vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("dY", "X", "dX")]
        graph = helper.make_graph([node], "probe", vi[:2], vi[2:])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                        helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 10
        try:
            ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            if "not a registered" in msg:
                return msg[msg.find("com.microsoft:"):][:100]
        return None

    def _backward_unavailable(self, case) -> str:
        grad = ORT_GRAD_OP.get(case.op)
        why = "no backward op (ONNX defines no gradient operators"
        if grad is None:
            return why + ")"
        missing = self._grad_kernel_missing(grad)
        if missing:
            return f"{why}; ORT's own are in its training builds only: here {missing})"
        return f"{why}; this ORT registers com.microsoft.{grad}, a training build's, not timed here)"

    # ---------------------------------------------------------------------------------- model
    def build_model(self, data: CaseData):
        """(onnx ModelProto, note, name of the op that must survive as one node or None)."""
        onnx, ort, helper, numpy_helper, TensorProto = self._load()
        case = data.case
        et = _elem_type(TensorProto, case.dtype)
        base_shape = list(data.base.shape)  # memory order: NHWC for the channels-last layout
        X = helper.make_tensor_value_info("X", et, base_shape)
        Y = helper.make_tensor_value_info("Y", et, base_shape)
        eps = float(case.epsilon)
        # parameters in the input's dtype (ONNX ties scale/bias to T), except BatchNormalization,
        # which takes float32 ones with a float16 input (T1/T2 since opset 15); with a float64
        # input float64 ones (ORT's double BatchNormalization kernel takes no float32 parameters)
        pdt = {"float32": np.float32, "float16": np.float16, "bfloat16": data.x.dtype,
               "float64": np.float64}[case.dtype]
        bn_pdt = np.float64 if case.dtype == "float64" else np.float32
        if case.is_backward:
            raise NotAvailable(self._backward_unavailable(case))
        inits = []
        nodes = []
        note = ""
        op = ONNX_OP[case.op]
        keep: Optional[str] = op

        def init(name, arr):
            arr = np.ascontiguousarray(arr)
            if arr.dtype.name == "bfloat16":
                t = helper.make_tensor(name, TensorProto.BFLOAT16, arr.shape,
                                       arr.astype(np.float32).ravel().tolist())
                inits.append(t)
            else:
                inits.append(numpy_helper.from_array(arr, name))
            return name

        def const(name, value, dtype=None):
            return init(name, np.asarray(value, dtype=dtype or pdt))

        outputs = [Y]
        if case.op == "batch_norm_training":
            if case.layout != "nchw":
                raise NotAvailable("ONNX BatchNormalization is channels-first (a training-mode "
                                   "expansion over NHWC would not be the op)")
            # the running statistics in: constants (torch.nn's initial values), as each step's
            # are to the kernel; out: ONNX's r = momentum * r + (1 - momentum) * batch
            names = [init(k, data.params[k].astype(bn_pdt)) for k in ("scale", "bias")]
            c = case.param_len
            names.append(init("running_mean", np.full(c, RUNNING_MEAN_INIT, bn_pdt)))
            names.append(init("running_var", np.full(c, RUNNING_VAR_INIT, bn_pdt)))
            outputs += [helper.make_tensor_value_info(k, _elem_type(TensorProto, np.dtype(bn_pdt).name), [c])
                        for k in ("running_mean_out", "running_var_out")]
            nodes.append(helper.make_node("BatchNormalization", ["X"] + names,
                                          ["Y", "running_mean_out", "running_var_out"], epsilon=eps,
                                          momentum=1.0 - MOMENTUM, training_mode=1))
            note = "training_mode=1 (ONNX running variance: the population one)"
            keep = "BatchNormalization"
        elif case.op == "batch_norm" and case.layout == "nchw":
            names = [init(k, data.params[k].astype(bn_pdt)) for k in ("scale", "bias", "mean", "var")]
            nodes.append(helper.make_node("BatchNormalization", ["X"] + names, ["Y"], epsilon=eps))
        elif case.op == "batch_norm":
            # ONNX BatchNormalization is channels-first only: the same op on the NHWC data is
            # y = x * A + B with A = scale / sqrt(var + eps), B = bias - mean * A per channel
            # (computed in-graph from the parameters; ORT folds it once, as its BN kernel would).
            for k in ("scale", "bias", "mean", "var"):
                init(k, data.params[k].astype(pdt))
            const("eps", eps)
            nodes += [
                helper.make_node("Add", ["var", "eps"], ["ve"]),
                helper.make_node("Sqrt", ["ve"], ["sd"]),
                helper.make_node("Div", ["scale", "sd"], ["A"]),
                helper.make_node("Mul", ["mean", "A"], ["mA"]),
                helper.make_node("Sub", ["bias", "mA"], ["B"]),
                helper.make_node("Mul", ["X", "A"], ["XA"]),
                helper.make_node("Add", ["XA", "B"], ["Y"]),
            ]
            note = "expanded: Mul+Add over NHWC (ONNX BatchNormalization is channels-first)"
            keep = None
        elif case.op == "instance_norm":
            init("scale", data.params["scale"].astype(pdt))
            init("bias", data.params["bias"].astype(pdt))
            nodes.append(helper.make_node(op, ["X", "scale", "bias"], ["Y"], epsilon=eps))
        elif case.op == "group_norm":
            init("scale", data.params["scale"].astype(pdt))
            init("bias", data.params["bias"].astype(pdt))
            nodes.append(helper.make_node(op, ["X", "scale", "bias"], ["Y"], epsilon=eps,
                                          num_groups=case.groups, stash_type=1))
        elif case.op == "mvn":
            # ONNX MeanVarianceNormalization fixes epsilon = 1e-9 *outside* the sqrt; this case is
            # eps inside, so it runs as the op's own function body with the epsilon moved inside.
            const("axes", list(case.axes), np.int64)
            const("eps", eps)
            nodes += [
                helper.make_node("ReduceMean", ["X", "axes"], ["m"], keepdims=1),
                helper.make_node("Sub", ["X", "m"], ["d"]),
                helper.make_node("Mul", ["d", "d"], ["d2"]),
                helper.make_node("ReduceMean", ["d2", "axes"], ["v"], keepdims=1),
                helper.make_node("Add", ["v", "eps"], ["ve"]),
                helper.make_node("Sqrt", ["ve"], ["sd"]),
                helper.make_node("Div", ["d", "sd"], ["Y"]),
            ]
            note = "expanded (ONNX MVN has epsilon=1e-9 outside the sqrt, not settable)"
            keep = None
        elif case.op == "layer_norm":
            init("scale", data.params["scale"].astype(pdt))
            init("bias", data.params["bias"].astype(pdt))
            nodes.append(helper.make_node(op, ["X", "scale", "bias"], ["Y"], axis=-1, epsilon=eps,
                                          stash_type=1))
        elif case.op == "rms_norm":
            init("scale", data.params["scale"].astype(pdt))
            nodes.append(helper.make_node(op, ["X", "scale"], ["Y"], axis=-1, epsilon=eps,
                                          stash_type=1))
        else:
            raise NotAvailable(f"unknown op {case.op}")
        if case.activation:  # the norm writes NORM_OUT, the activation's nodes Y
            assert list(nodes[-1].output) == ["Y"]
            nodes[-1].output[0] = NORM_OUT
            nodes += [helper.make_node(t, i, o) for t, i, o in ONNX_ACTIVATION[case.activation]]
        graph = helper.make_graph(nodes, "bench", [X], outputs, initializer=inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 10
        return model, note, keep

    @staticmethod
    def _ops_built(case, keep: Optional[str]) -> str:
        """What the model runs, in words: the norm op (or "these ops"), then its activation's nodes."""
        norm = ONNX_OP[case.op] if keep else "these ops"
        if not case.activation:
            return norm
        return "+".join([norm] + [t for t, _, _ in ONNX_ACTIVATION[case.activation]])

    @staticmethod
    def _split_activation(case, ran_nodes) -> tuple[list[str], Optional[str]]:
        """(op types of the nodes ORT runs for the norm, a note on the activation's or None): the
        activation's nodes are those after the one that writes NORM_OUT."""
        op_types = [n.op_type for n in ran_nodes]
        if not case.activation:
            return op_types, None
        ends = [i for i, n in enumerate(ran_nodes) if NORM_OUT in n.output]
        if not ends:  # ORT merged the norm's last node with the activation's
            return op_types, f"ORT fused the norm and {case.activation}: ran {'+'.join(op_types)}"
        norm, act = op_types[:ends[0] + 1], op_types[ends[0] + 1:]
        built = [t for t, _, _ in ONNX_ACTIVATION[case.activation]]
        act_note = f"then {'+'.join(act)}" + ("" if act == built else f" (built as {'+'.join(built)})")
        return norm, act_note

    def prepare(self, data: CaseData) -> Prepared:
        onnx, ort, *_ = self._load()
        case = data.case
        model, note, keep = self.build_model(data)
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        fd, opt_path = tempfile.mkstemp(suffix=".onnx", prefix="simdnorm-bench-")
        os.close(fd)
        so.optimized_model_filepath = opt_path
        try:
            try:
                sess = ort.InferenceSession(model.SerializeToString(), so,
                                            providers=["CPUExecutionProvider"])
            except Exception as e:  # noqa: BLE001 - e.g. NOT_IMPLEMENTED for the dtype
                msg = str(e).split(":")[-1].strip() or type(e).__name__
                if "NOT_IMPLEMENTED" in str(e):  # no CPU kernel registered for this op and type
                    raise NotAvailable(f"ORT CPU has no {case.dtype} kernel for "
                                       f"{self._ops_built(case, keep)} "
                                       f"(NOT_IMPLEMENTED: {msg[:100]})") from None
                raise NotAvailable(f"ORT: {msg[:120]}") from None
            ran = onnx.load(opt_path)
        finally:
            try:
                os.unlink(opt_path)
            except OSError:
                pass
        ran_nodes = list(ran.graph.node)
        inserted = [n for n in ran_nodes if n.op_type == "Cast" and "InsertedPrecisionFreeCast" in n.name]
        if inserted:
            raise NotAvailable(f"ORT CPU has no {case.dtype} kernel for "
                               f"{self._ops_built(case, keep)} (it inserts casts to float32)")
        op_types, act_note = self._split_activation(case, ran_nodes)
        if keep is not None and op_types != [keep]:
            note = f"ORT expands {keep} into {len(op_types)} nodes (no kernel)"
        if act_note:
            note = f"{note}; {act_note}" if note else act_note
        if case.dtype == "float64" and keep is not None:
            # ONNX attributes are float32: epsilon 1e-5 is 9.99999975e-06 (~1e-12 off the
            # reference, within the float64 tolerance; against that epsilon ~1e-15)
            eps32 = float(np.float32(case.epsilon))
            if eps32 != case.epsilon:
                note = (note + "; " if note else "") + f"epsilon attribute is float32 ({eps32:.9g})"
        x = data.base
        out = data.new_output()
        y = out.transpose(0, 2, 3, 1) if case.layout == "nhwc" else out
        assert x.flags.c_contiguous and y.flags.c_contiguous
        io = sess.io_binding()
        extra = {}  # the other outputs (training: the running statistics), preallocated too
        for o in sess.get_outputs()[1:]:
            extra[o.name] = np.full(o.shape, np.nan, np.float64 if o.type == "tensor(double)" else np.float32)
            io.bind_output(o.name, "cpu", 0, extra[o.name].dtype, list(o.shape), extra[o.name].ctypes.data)
        if x.dtype.name == "bfloat16":  # numpy has no bfloat16: bind the bytes with the ONNX type
            TensorProto = self._load()[4]
            for bind, name, arr in ((io.bind_ortvalue_input, "X", x), (io.bind_ortvalue_output, "Y", y)):
                bind(name, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arr.view(np.uint16),
                                                                           TensorProto.BFLOAT16))
        else:
            io.bind_input("X", "cpu", 0, x.dtype, list(x.shape), x.ctypes.data)
            io.bind_output("Y", "cpu", 0, y.dtype, list(y.shape), y.ctypes.data)
        run = sess.run_with_iobinding

        def fn() -> None:
            run(io)

        # keep the arrays alive with the binding
        fn._keep = (sess, io, x, y, extra)  # type: ignore[attr-defined]
        if not extra:
            return prepared_out(fn, out, note)

        def run_training() -> dict:
            fn()
            return {"out": out, "running_mean": extra["running_mean_out"],
                    "running_var_onnx": extra["running_var_out"]}

        return Prepared(fn, run_training, note, out=out)
