"""simdnorm.torch's large outputs on blocks of 2 MB pages (cpp/runtime/huge_blocks.cpp,
simdnorm/torch/_routes.py _new_like): where they sit, their values and strides, the blocks' reuse
and bound, their return from other threads and after fork()."""
import gc
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'simdnorm[torch]')")
import simdnorm  # noqa: E402
import simdnorm.torch as st  # noqa: E402
from simdnorm import _core  # noqa: E402

HUGE = 2 << 20
BIG = (8, 256, 768)  # 2^20 + 2^19 elements: a route's output takes a block
SMALL = (4, 64, 768)


def _on_block(t) -> bool:
    return t.data_ptr() % HUGE == 0


@pytest.fixture(autouse=True)
def _empty_cache():
    gc.collect()  # (an earlier test's tensors in reference cycles: their blocks back now, not mid-test)
    st.empty_cache()
    yield
    st.empty_cache()


def _layer(x):
    m = st.LayerNorm(x.shape[-1], dtype=x.dtype)
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
        m.bias.uniform_(-0.5, 0.5)
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_a_large_output_sits_on_a_block_with_torchs_strides_and_simdnorms_bits(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(BIG, generator=g) * 3 + 1).to(dtype)
    m = _layer(x)
    with torch.no_grad():
        y = m(x)
    assert _on_block(y)
    assert y.dtype == dtype and y.shape == x.shape and y.stride() == torch.empty_like(x).stride()
    # the plain function on the same tensors, into torch's own empty_like: the same bits
    ref = torch.empty_like(x)
    simdnorm.layer_norm(x, m.weight.detach(), m.bias.detach(), axis=-1, epsilon=m.eps, out=ref)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[y.element_size()]
    assert torch.equal(y.view(bits), ref.view(bits))


@pytest.mark.parametrize("shape,channels_last", [(BIG, False), ((4, 64, 64, 64), True), (SMALL, False)],
                         ids=["rows", "channels-last", "small"])
def test_the_cpp_kernels_outputs_sit_on_blocks(shape, channels_last):
    # a planned torch.ops call's repeat runs in the C++ kernel (no Python): its large dense output
    # takes a block too where torch has torch_from_blob (2.11 and later), a small one torch's allocator
    g = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=g) * 2 + 1
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        c = shape[1]
        params = (torch.rand(c, generator=g) - 0.5, torch.rand(c, generator=g) + 0.5, torch.rand(c, generator=g),
                  torch.rand(c, generator=g))
        call = lambda: torch.ops.simdnorm.batch_normalization(x, *params)  # noqa: E731
    else:
        w, b = torch.rand(shape[-1], generator=g) + 0.5, torch.rand(shape[-1], generator=g)
        call = lambda: torch.ops.simdnorm.layer_norm(x, w, b)[0]  # noqa: E731
    first = call()  # (plans the call)
    computed = _core.torch_kernel_calls()
    y = call()
    assert _core.torch_kernel_calls() == computed + 1, "not computed by the C++ kernel"
    assert y.stride() == torch.empty_like(x).stride()
    large = x.numel() >= _core.huge_block_min_elements
    from_blob = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 11)
    assert _on_block(y) == (large and from_blob), (x.numel(), y.data_ptr() % HUGE)
    assert torch.equal(y.view(torch.int32), first.view(torch.int32))
    if large and from_blob:
        kept = _core.huge_cache_bytes()
        ptr = y.data_ptr()
        del y
        assert _core.huge_cache_bytes() > kept, "the block did not come back when its tensor died"
        assert call().data_ptr() == ptr


def test_channels_last_training_and_its_gradient_sit_on_blocks():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 64, 48, 48, generator=g).contiguous(memory_format=torch.channels_last).requires_grad_()
    bn = st.BatchNorm2d(64)
    twin = torch.nn.BatchNorm2d(64)
    y = bn(x)
    assert _on_block(y) and y.stride() == x.stride()
    dy = torch.randn(y.shape, generator=g).contiguous(memory_format=torch.channels_last)
    (gx,) = torch.autograd.grad(y, (x,), dy)
    assert _on_block(gx) and gx.stride() == x.stride()
    xr = x.detach().clone().requires_grad_()
    yr = twin(xr)
    (gr,) = torch.autograd.grad(yr, (xr,), dy)
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gr, rtol=1e-4, atol=1e-5)


def test_a_dead_outputs_block_serves_the_next_output_of_its_size():
    x = torch.randn(BIG)
    m = _layer(x)
    with torch.no_grad():
        y = m(x)
        first = y.data_ptr()
        nbytes = y.numel() * y.element_size()
        assert _core.huge_cache_bytes() == 0
        del y
        assert _core.huge_cache_bytes() == -(-nbytes // HUGE) * HUGE
        y = m(x)
    assert y.data_ptr() == first and _core.huge_cache_bytes() == 0
    del y
    assert st.empty_cache() == -(-nbytes // HUGE) * HUGE and _core.huge_cache_bytes() == 0


def test_small_outputs_and_views_stay_torchs():
    x = torch.randn(SMALL)
    m = _layer(x)
    with torch.no_grad():
        y = m(x)
    del y
    assert _core.huge_cache_bytes() == 0
    # a large input with gaps between its elements: torch.empty_like's layout, torch's memory
    wide = torch.randn(8, 256, 1536)[..., ::2]
    with torch.no_grad():
        y = m.__class__(768)(wide)
    assert y.is_contiguous()
    del y
    assert _core.huge_cache_bytes() == 0


def test_blocks_come_back_from_other_threads():
    xs = [torch.randn(BIG) for _ in range(4)]
    m = _layer(xs[0])
    with torch.no_grad():
        ys = [m(x) for x in xs]
    assert all(_on_block(y) for y in ys)
    nbytes = -(-ys[0].numel() * ys[0].element_size() // HUGE) * HUGE
    barrier = threading.Barrier(len(ys))

    def drop(i):
        barrier.wait()
        ys[i] = None

    threads = [threading.Thread(target=drop, args=(i,)) for i in range(len(ys))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _core.huge_cache_bytes() == len(xs) * nbytes


def test_an_unused_capsule_gives_its_block_back():
    cap = _core.huge_block_capsule([1 << 20], None, 2, 32)
    assert _core.huge_cache_bytes() == 0
    del cap
    assert _core.huge_cache_bytes() == 4 << 20
    with pytest.raises(ValueError, match="densely"):
        _core.huge_block_capsule([4, 4], [8, 1], 2, 32)


def test_a_blocks_tensor_resizes_within_its_size_only():
    x = torch.randn(BIG)
    with torch.no_grad():
        y = _layer(x)(x)
    y.resize_(100)  # (smaller: the same storage)
    with pytest.raises(RuntimeError, match="not resizable"):
        y.resize_(x.numel() * 2)


def test_the_kept_blocks_are_bounded():
    script = textwrap.dedent("""
        import torch, simdnorm.torch as st
        from simdnorm import _core
        assert _core.huge_cache_limit() == 16 << 20
        m = st.LayerNorm(768)
        xs = [torch.randn(8, 256, 768) for _ in range(3)]  # 6 MB each, 6 MB blocks
        with torch.no_grad():
            ys = [m(x) for x in xs]
        first, last = ys[0].data_ptr(), ys[2].data_ptr()
        for i in range(3):  # (freed first to last)
            ys[i] = None
        print(_core.huge_cache_bytes())
        with torch.no_grad():
            again = [m(x) for x in xs[:2]]  # (the two latest blocks kept, the first one unmapped)
        print(sorted(y.data_ptr() == last for y in again), first in [y.data_ptr() for y in again])
    """)
    env = dict(os.environ, SIMDNORM_TORCH_CACHE_MB="16")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    kept, reused = r.stdout.strip().splitlines()[-2:]
    assert int(kept) == 12 << 20  # two of the three kept: a third would pass 16 MB
    assert reused == "[False, True] False"


@pytest.mark.parametrize("setting, mb, warns", [
    ("64", 64, False), ("0", 0, False), ("", 1024, False),
    ("-1", 1024, True), ("+64", 1024, True), (" 64", 1024, True), ("64MB", 1024, True), ("1e3", 1024, True),
    ("17592186044416", 1024, True),  # (2^44 MB: wrapped to a bound of 0 bytes)
    ("99999999999999999999", 1024, True),  # (past unsigned long long: strtoull's saturation)
])
def test_a_cache_bound_not_in_whole_megabytes_is_the_default_with_a_warning(setting, mb, warns):
    """strtoull read "-1" as 2^64 - 1 megabytes (no bound: 1.7 GB kept where 1 GB was meant),
    2^44 as 0 (no cache), "64MB" as the default, all unsaid."""
    script = "import simdnorm.torch; from simdnorm import _core; print(_core.huge_cache_limit() >> 20)"
    env = dict(os.environ, SIMDNORM_TORCH_CACHE_MB=setting)
    r = subprocess.run([sys.executable, "-W", "always::RuntimeWarning", "-c", script], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.strip().splitlines()[-1]) == mb
    said = f"SIMDNORM_TORCH_CACHE_MB={setting!r} is not a whole number of megabytes" in r.stderr
    assert said == warns, r.stderr


def _child_layer_norm(queue):
    # (numpy's work, not torch's: torch's parallel ops hang in a child forked after they ran, OpenMP's)
    x = torch.from_numpy(np.random.default_rng(3).standard_normal(BIG, dtype=np.float32))
    with torch.no_grad():
        y = st.LayerNorm(768)(x)
    ok = y.data_ptr() % HUGE == 0 and bool(np.isfinite(y.numpy()).all())
    del y
    queue.put((ok, _core.huge_cache_bytes()))


def test_a_forked_child_takes_and_gives_blocks():
    x = torch.randn(BIG)
    with torch.no_grad():
        y = _layer(x)(x)
    del y  # (the parent's cache holds a block at the fork)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    p = ctx.Process(target=_child_layer_norm, args=(queue,))
    p.start()
    ok, cached = queue.get(timeout=120)
    p.join(timeout=120)
    assert p.exitcode == 0 and ok and cached > 0
