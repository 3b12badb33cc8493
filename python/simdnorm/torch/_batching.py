"""vmap rules of the torch.ops.simdnorm ops: one call over the whole batch, not one per sample.

A vmapped call sees each sample's tensors; the rule moves the batch dim to the front of every
tensor and calls the op once on tensors of one more dim, with the op's dims shifted past it:
the normalized axes (layer, RMS, MVN), the channel axis (batch norm). A batched parameter (an
ensemble's own weights) becomes a same-rank parameter with the batch dim in front, which every
op takes; a parameter whose gradient is asked of a backward op is made so too (each sample's
gradient is its own sum). Instance and group norm run as MVN over each sample's (n, c) or
(n, group) elements, the channels split into (groups, channels per group) as a view. Batch norm
training and its backward take same-rank parameters with the batch dim in front, which give the
statistics that shape: each sample's own.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

_ops = torch.ops.simdnorm


def _front(t: Optional[torch.Tensor], d: Optional[int], b: int) -> Optional[torch.Tensor]:
    """t with the batch dim in front: moved there, or expanded (an unbatched tensor, no copy)."""
    if t is None:
        return None
    return t.movedim(d, 0) if d is not None else t.expand(b, *t.shape)


def _shift(axis: int) -> int:
    """A sample's dim as a dim of the batched tensor (negative dims count from the end: the same)."""
    return axis + 1 if axis >= 0 else axis


def _trailing(p: Optional[torch.Tensor], d: Optional[int], b: int, nd: int, want_own: bool = False
              ) -> Optional[torch.Tensor]:
    """A parameter broadcast from the trailing dims (layer, RMS, MVN) for a batched input of nd dims:
    unbatched as it is, unless want_own (its gradient per sample); else (B, 1, ..., *p)."""
    if p is None or (d is None and not want_own):
        return p
    p = _front(p, d, b)
    return p.reshape(b, *([1] * (nd - p.dim())), *p.shape[1:])


def _channel(p: Optional[torch.Tensor], d: Optional[int], b: int, nd: int, ca: int, want_own: bool = False
             ) -> Optional[torch.Tensor]:
    """A batch norm parameter (1-D of the channels, or same-rank) for a batched input of nd dims
    whose channels are at ca: unbatched 1-D as it is (but for 1-D samples, nd 2, whose parameters are
    same-rank: a (1,) one broadcasts); else same-rank with the batch dim in front."""
    if p is None:
        return None
    if d is None and not want_own:
        return p if p.dim() == 1 and nd > 2 else p.unsqueeze(0)
    p = _front(p, d, b)
    if p.dim() == nd:
        return p
    shape = [b] + [1] * (nd - 1)
    shape[ca % nd] = p.shape[1]
    return p.reshape(shape)


def _sample_shape(p: Optional[torch.Tensor], d: Optional[int]) -> Optional[Tuple[int, ...]]:
    """A sample's shape of p (the rules see the tensors with their batch dim at d)."""
    if p is None:
        return None
    return tuple(p.shape) if d is None else tuple(n for i, n in enumerate(p.shape) if i != d % p.dim())


def _sample_grad(g: torch.Tensor, shape: Optional[Tuple[int, ...]]) -> Tuple[torch.Tensor, Optional[int]]:
    """A parameter's gradient from a batched backward call (shaped like the batched parameter), as
    (each sample's gradient of the parameter's sample shape, in front; out dim); an empty one (not
    asked for) unbatched."""
    if shape is None or g.numel() == 0 and 0 not in shape:
        return g, None
    return g.reshape(g.shape[0], *shape), 0


def _out_dims(results: Sequence[torch.Tensor]) -> Tuple[Optional[int], ...]:
    return tuple(None if r.dim() == 1 and r.numel() == 0 else 0 for r in results)  # (an empty: not computed)


def _wants(flag: Optional[bool], p: Optional[torch.Tensor]) -> bool:
    return p is not None and (flag is None or bool(flag))


# ----------------------------------------------------------------------------------------------------
# layer, RMS and MVN: the normalized axes shifted past the batch dim

def _layer_norm(info, in_dims, input, scale=None, bias=None, *, axis=-1, **kw):
    b, (dx, ds, db) = info.batch_size, (list(in_dims) + [None, None])[:3]
    x = _front(input, dx, b)
    r = _ops.layer_norm(x, _trailing(scale, ds, b, x.dim()), _trailing(bias, db, b, x.dim()), axis=_shift(axis), **kw)
    return r, (0, 0, 0)


def _rms_norm(info, in_dims, input, scale=None, *, axis=-1, **kw):
    b, (dx, ds) = info.batch_size, (list(in_dims) + [None])[:2]
    x = _front(input, dx, b)
    r = _ops.rms_norm(x, _trailing(scale, ds, b, x.dim()), axis=_shift(axis), **kw)
    return r, (0, 0)


def _mean_variance_normalization(info, in_dims, input, axes, scale=None, bias=None, **kw):
    b, (dx, _, ds, db) = info.batch_size, (list(in_dims) + [None, None])[:4]
    x = _front(input, dx, b)
    r = _ops.mean_variance_normalization(x, [_shift(a) for a in axes], _trailing(scale, ds, b, x.dim()),
                                         _trailing(bias, db, b, x.dim()), **kw)
    return r, _out_dims(r)


def _batch_normalization(info, in_dims, input, mean, variance, scale=None, bias=None, *, channel_axis=1, **kw):
    b = info.batch_size
    dims = (list(in_dims) + [None, None])[:5]
    x = _front(input, dims[0], b)
    ca = 1 if x.dim() == 2 else _shift(channel_axis)  # (a 1-D sample: its channels are its elements)
    m, v, s, bb = (_channel(p, d, b, x.dim(), ca) for p, d in zip((mean, variance, scale, bias), dims[1:]))
    return _ops.batch_normalization(x, m, v, s, bb, channel_axis=ca, **kw), 0


def _same_rank(params: Sequence[Tuple[Optional[torch.Tensor], Optional[int]]], b: int, nd: int, ca: int,
               x: torch.Tensor) -> Tuple[List[Optional[torch.Tensor]], List[int]]:
    """Batch norm parameters as one same-rank shape with the batch dim in front (each expanded to
    the joint shape, no copy), and that shape: same-rank parameters shape the statistics of batch
    norm training and its backward, so each sample's are its own. Absent ones stay None."""
    placed = [_channel(p, d, b, nd, ca, True) for p, d in params]
    shapes = [t.shape for t in placed if t is not None]
    if not shapes:
        shapes = [[b] + [1] * (nd - 1)]
        shapes[0][ca % nd] = x.shape[ca % nd]
    joint = list(torch.broadcast_shapes(*shapes))
    return [None if t is None else t.expand(joint) for t in placed], joint


def _sample_stats_shape(params: Sequence[Tuple[Optional[torch.Tensor], Optional[int]]], c: int, sample_nd: int
                        ) -> Tuple[int, ...]:
    """The shape batch norm training gives a sample's statistics: a same-rank parameter's, else (C,)."""
    for p, d in params:
        shape = _sample_shape(p, d)
        if shape is not None and len(shape) == sample_nd:
            return shape
    return (c,)


def _summed_to(g: torch.Tensor, placed_shape: Sequence[int], sample: Tuple[int, ...]) -> torch.Tensor:
    """A joint-shaped gradient summed over the dims along which the parameter broadcast, per sample."""
    dims = [i for i, (n, k) in enumerate(zip(placed_shape, g.shape)) if n == 1 and k != 1]
    return (g.sum(dims, keepdim=True) if dims else g).reshape(g.shape[0], *sample)


def _batch_normalization_training(info, in_dims, input, scale=None, bias=None, fused_add=None, *,
                                  channel_axis=1, **kw):
    b = info.batch_size
    dx, ds, db, df = (list(in_dims) + [None, None, None])[:4]
    x = _front(input, dx, b)
    nd = x.dim()
    if nd == 2 and scale is None and bias is None:  # (a 1-D sample needs a same-rank parameter: its error)
        return _per_sample(_ops.batch_normalization_training.default, info, in_dims,
                           (input, scale, bias, fused_add), dict(channel_axis=channel_axis, **kw))
    ca = 1 if nd == 2 else _shift(channel_axis)
    (s, bb), joint = _same_rank(((scale, ds), (bias, db)), b, nd, ca, x)
    if s is None and bb is None:  # (ones of the joint shape say the statistics are each sample's)
        s = x.new_ones(joint)
    y, m, v = _ops.batch_normalization_training(x, s, bb, _trailing(fused_add, df, b, nd), channel_axis=ca, **kw)
    stats = _sample_stats_shape(((scale, ds), (bias, db)), x.shape[ca % nd], nd - 1)
    return (y, m.reshape(b, *stats), v.reshape(b, *stats)), (0, 0, 0)


def _batch_normalization_backward(info, in_dims, grad_output, input, mean, variance, scale=None, bias=None,
                                  fused_add=None, *, channel_axis=1, grad_scale=None, grad_bias=None, **kw):
    b = info.batch_size
    dims = (list(in_dims) + [None, None, None])[:7]
    go, x = _front(grad_output, dims[0], b), _front(input, dims[1], b)
    nd = x.dim()
    ca = 1 if nd == 2 else _shift(channel_axis)
    params = list(zip((mean, variance, scale, bias), dims[2:6]))
    (m, v, s, bb), joint = _same_rank(params, b, nd, ca, x)
    ws, wb = _wants(grad_scale, scale), _wants(grad_bias, bias)
    if s is None:  # (ones: a same-rank parameter shapes the statistics; no gradient of theirs)
        s, grad_scale = x.new_ones(joint), False
    fa = None if fused_add is None else _trailing(fused_add, dims[6], b, nd, True)
    gi, gs, gb, gf = _ops.batch_normalization_backward(go, x, m, v, s, bb, fa, channel_axis=ca, grad_scale=grad_scale,
                                                       grad_bias=grad_bias, **kw)
    results, out = [gi], [None if gi.dim() == 1 and gi.numel() == 0 else 0]
    for g, wanted, (p, d) in ((gs, ws, params[2]), (gb, wb, params[3])):
        if wanted:
            results.append(_summed_to(g, _channel(p, d, b, nd, ca, True).shape, _sample_shape(p, d)))
            out.append(0)
        else:
            results.append(g)
            out.append(None)
    if fa is None:
        results.append(gf)
        out.append(None)
    else:
        results.append(gf.reshape(b, *_sample_shape(fused_add, dims[6])))
        out.append(0)
    return tuple(results), tuple(out)


# ----------------------------------------------------------------------------------------------------
# instance and group norm as MVN over each sample's (n, c) / (n, group) elements

def _channel_split(nd: int, channel_axis: int, groups: Optional[int], c: int) -> Tuple[int, List[int], List[int]]:
    """For a sample of nd dims: (its channel dim, the batched view's shape changes, the MVN axes)
    where the batched view splits the channel dim into (groups, c // groups) when groups is given."""
    ca = channel_axis % nd
    spatial = [d for d in range(1, nd) if d != ca]  # (dim 0: the sample's own batch)
    if groups is None:
        return ca, [], [d + 1 for d in spatial]
    # in the split view, dims after ca move one on; ca + 1 holds the channels of a group
    axes = [ca + 2] + [d + 1 + (d > ca) for d in spatial]
    return ca, [groups, c // groups], axes


def _group_view(t: torch.Tensor, ca: int, split: List[int]) -> torch.Tensor:
    return t.unflatten(ca + 1, split) if split else t


def _group_param(p: Optional[torch.Tensor], d: Optional[int], b: int, nd: int, ca: int, split: List[int],
                 want_own: bool = False) -> Optional[torch.Tensor]:
    """A (C,) parameter as the MVN's: same-rank with the split view, the channels at ca + 1 (split)."""
    if p is None:
        return None
    own = d is not None or want_own
    p = _front(p, d, b) if own else p.unsqueeze(0)
    shape = [p.shape[0]] + [1] * nd
    shape[ca + 1] = p.shape[1]
    return _group_view(p.reshape(shape), ca, split)


def _stats_of_groups(t: torch.Tensor, b: int, n: int, groups: Optional[int]) -> torch.Tensor:
    """MVN's kept-dims statistics as the op returns them: instance norm's kept dims as they are,
    group norm's (B, N, groups)."""
    return t if groups is None else t.reshape(b, n, groups)


def _grouped(info, in_dims, input, groups, scale, bias, channel_axis, kw):
    b = info.batch_size
    dx, ds, db = in_dims
    x = _front(input, dx, b)
    nd, n = x.dim() - 1, x.shape[1]  # (a sample's dims; its own batch)
    ca, split, axes = _channel_split(nd, channel_axis, groups, x.shape[1 + channel_axis % nd])
    y, mean, inv = _ops.mean_variance_normalization(_group_view(x, ca, split), axes,
                                                    _group_param(scale, ds, b, nd, ca, split),
                                                    _group_param(bias, db, b, nd, ca, split), **kw)
    y = y.flatten(ca + 1, ca + 2) if split else y
    return (y, _stats_of_groups(mean, b, n, groups), _stats_of_groups(inv, b, n, groups)), (0, 0, 0)


def _instance_norm(info, in_dims, input, scale=None, bias=None, *, epsilon=1e-05, channel_axis=1, **kw):
    dims = (list(in_dims) + [None, None])[:3]
    return _grouped(info, dims, input, None, scale, bias, channel_axis, dict(epsilon=epsilon, **kw))


def _group_norm(info, in_dims, input, num_groups, scale=None, bias=None, *, epsilon=1e-05, channel_axis=1, **kw):
    dims = (list(in_dims) + [None, None, None])
    return _grouped(info, (dims[0], dims[2], dims[3]), input, num_groups, scale, bias, channel_axis,
                    dict(epsilon=epsilon, **kw))


# ----------------------------------------------------------------------------------------------------
# backward ops: the same shapes; a parameter whose gradient is asked for made per sample

def _layer_norm_backward(info, in_dims, grad_output, input, mean, inv_std, scale=None, bias=None, *, axis=-1,
                         grad_scale=None, grad_bias=None, **kw):
    b = info.batch_size
    dims = (list(in_dims) + [None, None])[:6]
    go, x, m, s = (_front(t, d, b) for t, d in zip((grad_output, input, mean, inv_std), dims))
    ws, wb = _wants(grad_scale, scale), _wants(grad_bias, bias)
    sc = _trailing(scale, dims[4], b, x.dim(), ws)
    bi = _trailing(bias, dims[5], b, x.dim(), wb)
    gi, gs, gb = _ops.layer_norm_backward(go, x, m, s, sc, bi, axis=_shift(axis), grad_scale=grad_scale,
                                          grad_bias=grad_bias, **kw)
    return _backward_results(gi, ((gs, _sample_shape(scale, dims[4]) if ws else None),
                                  (gb, _sample_shape(bias, dims[5]) if wb else None)))


def _rms_norm_backward(info, in_dims, grad_output, input, inv_rms, scale=None, *, axis=-1, grad_scale=None, **kw):
    b = info.batch_size
    dims = (list(in_dims) + [None])[:4]
    go, x, s = (_front(t, d, b) for t, d in zip((grad_output, input, inv_rms), dims))
    ws = _wants(grad_scale, scale)
    gi, gs = _ops.rms_norm_backward(go, x, s, _trailing(scale, dims[3], b, x.dim(), ws), axis=_shift(axis),
                                    grad_scale=grad_scale, **kw)
    return _backward_results(gi, ((gs, _sample_shape(scale, dims[3]) if ws else None),))


def _mean_variance_normalization_backward(info, in_dims, grad_output, input, axes, mean, inv_std, scale=None,
                                          bias=None, *, grad_scale=None, grad_bias=None, **kw):
    b = info.batch_size
    dims = (list(in_dims) + [None, None])[:7]
    go, x, m, s = (_front(t, d, b) for t, d in zip((grad_output, input, mean, inv_std), dims[:2] + dims[3:5]))
    ws, wb = _wants(grad_scale, scale), _wants(grad_bias, bias)
    gi, gs, gb = _ops.mean_variance_normalization_backward(
        go, x, [_shift(a) for a in axes], m, s, _trailing(scale, dims[5], b, x.dim(), ws),
        _trailing(bias, dims[6], b, x.dim(), wb), grad_scale=grad_scale, grad_bias=grad_bias, **kw)
    return _backward_results(gi, ((gs, _sample_shape(scale, dims[5]) if ws else None),
                                  (gb, _sample_shape(bias, dims[6]) if wb else None)))


def _grouped_backward(info, in_dims, grad_output, input, groups, mean, inv_std, scale, bias, channel_axis,
                      grad_scale, grad_bias, kw):
    b = info.batch_size
    dgo, dx, dm, ds, dsc, dbi = in_dims
    x = _front(input, dx, b)
    nd = x.dim() - 1
    ca, split, axes = _channel_split(nd, channel_axis, groups, x.shape[1 + channel_axis % nd])
    go = _group_view(_front(grad_output, dgo, b), ca, split)
    x = _group_view(x, ca, split)
    m, s = _front(mean, dm, b), _front(inv_std, ds, b)
    if groups is not None:  # (B, N, groups) -> MVN's kept dims of the split view
        kept = [1 if i in axes else k for i, k in enumerate(x.shape)]
        m, s = m.reshape(kept), s.reshape(kept)
    ws, wb = _wants(grad_scale, scale), _wants(grad_bias, bias)
    gi, gs, gb = _ops.mean_variance_normalization_backward(
        go, x, axes, m, s, _group_param(scale, dsc, b, nd, ca, split, ws),
        _group_param(bias, dbi, b, nd, ca, split, wb), grad_scale=grad_scale, grad_bias=grad_bias, **kw)
    gi = gi.flatten(ca + 1, ca + 2) if split and gi.dim() > 1 else gi  # (a 1-D empty one: not asked for)
    return _backward_results(gi, ((gs, _sample_shape(scale, dsc) if ws else None),
                                  (gb, _sample_shape(bias, dbi) if wb else None)))


def _instance_norm_backward(info, in_dims, grad_output, input, mean, inv_std, scale=None, bias=None, *,
                            channel_axis=1, grad_scale=None, grad_bias=None, **kw):
    dims = (list(in_dims) + [None, None])[:6]
    return _grouped_backward(info, dims, grad_output, input, None, mean, inv_std, scale, bias, channel_axis,
                             grad_scale, grad_bias, kw)


def _group_norm_backward(info, in_dims, grad_output, input, num_groups, mean, inv_std, scale=None, bias=None, *,
                         channel_axis=1, grad_scale=None, grad_bias=None, **kw):
    dims = (list(in_dims) + [None, None])[:7]
    return _grouped_backward(info, dims[:2] + dims[3:], grad_output, input, num_groups, mean, inv_std, scale, bias,
                             channel_axis, grad_scale, grad_bias, kw)


def _backward_results(gi: torch.Tensor, params: Sequence[Tuple[torch.Tensor, Optional[Tuple[int, ...]]]]) -> tuple:
    """(grad_input, the parameters' gradients...) and their out dims."""
    results, dims = [gi], [None if gi.dim() == 1 and gi.numel() == 0 else 0]
    for g, shape in params:
        g, d = _sample_grad(g, shape)
        results.append(g)
        dims.append(d)
    return tuple(results), tuple(dims)


def _update_running_stats_(info, in_dims, running_mean, running_var, mean, variance, num_batches_tracked=None,
                           **kw):
    """Each member's running statistics from its own batch's (an ensemble's stacked buffers, as
    torch.func.stack_module_state makes them): the op once per member, in place in its slice."""
    dims = (list(in_dims) + [None])[:5]
    buffers = [(n, d) for n, d in zip(("running_mean", "running_var", "num_batches_tracked"), dims[:2] + dims[4:])
               if not (n == "num_batches_tracked" and num_batches_tracked is None)]
    unbatched = [n for n, d in buffers if d is None]
    if unbatched:
        raise RuntimeError(f"vmap: simdnorm::update_running_stats_ would write every member's statistics into "
                           f"the same {', '.join(unbatched)}, which is not batched: batch the buffers too "
                           "(torch.func.stack_module_state stacks a module's buffers), or update outside vmap")
    args = (running_mean, running_var, mean, variance, num_batches_tracked)
    for i in range(info.batch_size):
        _ops.update_running_stats_(*[a if d is None or a is None else a.select(d, i) for a, d in zip(args, dims)],
                                   **kw)
    return None, None


RULES = {
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "mean_variance_normalization": _mean_variance_normalization,
    "batch_normalization": _batch_normalization,
    "batch_normalization_training": _batch_normalization_training,
    "batch_normalization_backward": _batch_normalization_backward,
    "instance_norm": _instance_norm,
    "group_norm": _group_norm,
    "layer_norm_backward": _layer_norm_backward,
    "rms_norm_backward": _rms_norm_backward,
    "mean_variance_normalization_backward": _mean_variance_normalization_backward,
    "instance_norm_backward": _instance_norm_backward,
    "group_norm_backward": _group_norm_backward,
    "update_running_stats_": _update_running_stats_,
}


_MAX_DIMS = 8  # (simdnorm's tensors)


def _per_sample(op: Any, info: Any, in_dims: Sequence[Any], args: Sequence[Any], kwargs: dict) -> tuple:
    """The op once per sample, stacked (torch's fallback does the same)."""
    rows = [op(*[a.select(d, i) if isinstance(d, int) else a for a, d in zip(args, in_dims)], **kwargs)
            for i in range(info.batch_size)]
    if isinstance(rows[0], tuple):
        return tuple(torch.stack(r) for r in zip(*rows)), (0,) * len(rows[0])
    return torch.stack(rows), 0


def _guarded(name: str, rule: Any) -> Any:
    """The rule, or per-sample calls where the batched tensors would pass simdnorm's 8 dims (a
    sample of 8 dims; of 7 for group norm, whose rule splits the channels too)."""
    op = getattr(_ops, name).default
    extra = 2 if name.startswith("group_norm") else 1
    at = 1 if name.endswith("_backward") else 0  # (the input's place among the arguments)

    if name == "update_running_stats_":  # (per member already)
        return rule

    def run(info, in_dims, *args, **kwargs):
        x, d = args[at], in_dims[at]
        if x.dim() - (d is not None) + extra > _MAX_DIMS:
            return _per_sample(op, info, in_dims, args, kwargs)
        return rule(info, in_dims, *args, **kwargs)

    return run


def register(lib: Any) -> None:
    for name, rule in RULES.items():
        torch.library.register_vmap(f"simdnorm::{name}", _guarded(name, rule), lib=lib)
