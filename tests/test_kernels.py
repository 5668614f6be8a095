"""kernels.linear over float weights: the C path equals the torch path, for every prologue and weight dtype, and is
bitwise independent of the number of rows (what makes verification match decoding)."""
import pytest
import torch

from quickdraft import kernels

# The kernel must be built wherever the tests run (CI included): these tests fail, not skip, if not.
built = kernels.kernel_info().isa is not None


# the gated prologues: the gate's activation for each (GELU in its tanh and erf forms)
GATED = {"swiglu": "silu", "geglu_tanh": "gelu_tanh", "geglu_erf": "gelu"}
PROLOGUES = ["none", "rmsnorm", *GATED]


def _case(dtype, K, prologue, bias, residual, M=kernels.MAX_ROWS, N=300):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g).to(dtype)
    args = dict(bias=torch.randn(N, generator=g) if bias else None,
                residual=torch.randn(M, N, generator=g) if residual else None,
                norm=(torch.rand(K, generator=g) + 0.5, 1e-5) if prologue == "rmsnorm" else None,
                swiglu=GATED.get(prologue, False))
    x = torch.randn(M, 2 * K if prologue in GATED else K, generator=g) * 2
    return x, w, args


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [64, 70])  # 70: a tail that is not a multiple of the 8 SIMD lanes
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_kernel_equals_torch_path(dtype, K, prologue):
    x, w, args = _case(dtype, K, prologue, bias=True, residual=True)
    assert kernels.usable(x, w)
    y = kernels.linear(x, w, **args)
    # Both paths compute in float32 from the stored (possibly rounded) weights.
    ref = kernels._linear_torch(x, w, args["bias"], args["norm"], args["swiglu"], args["residual"])
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert torch.allclose(y, ref, atol=1e-4, rtol=1e-4), (y - ref).abs().max()


@pytest.mark.parametrize("prologue", PROLOGUES)
def test_kernel_is_batch_invariant(prologue):
    x, w, args = _case(torch.float32, 70, prologue, bias=True, residual=True)
    full = kernels.linear(x, w, **args)
    for i in range(0, x.shape[0], 7):  # rows alone and in odd groups give bitwise the same values
        part = dict(args, residual=args["residual"][i:i + 3])
        assert torch.equal(kernels.linear(x[i:i + 3], w, **part), full[i:i + 3])


def test_kernel_only_for_few_float32_rows_of_contiguous_weights():
    w = torch.zeros(8, 16)
    assert built and kernels.usable(torch.zeros(2, 3, 16), w)
    assert not kernels.usable(torch.zeros(kernels.MAX_ROWS + 1, 16), w)
    assert not kernels.usable(torch.zeros(1, 16), w.t())              # not contiguous
    assert not kernels.usable(torch.zeros(1, 16), w.to(torch.int32))  # unsupported weight dtype
    assert not kernels.usable(torch.zeros(1, 16, dtype=torch.float64), w)


def test_torch_path_matches_plain_torch_ops():
    x, w, args = _case(torch.float32, 64, "rmsnorm", bias=True, residual=True, M=kernels.MAX_ROWS + 1)
    assert not kernels.usable(x, w)
    g, eps = args["norm"]
    h = g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    expected = args["residual"] + h @ w.T + args["bias"]
    assert torch.allclose(kernels.linear(x, w, **args), expected, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 151936), (5, 1003), (9, 64), (2, 3, 17), (7,)])
def test_argmax_equals_torch(shape):
    assert built
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g)
    assert torch.equal(kernels.argmax(x), x.argmax(-1))


def test_argmax_first_of_ties_nan_and_minus_inf():
    x = torch.zeros(6, 20)
    x[0, [3, 11, 19]] = 5.0          # ties: the first
    x[1, 17] = float("nan")          # a NaN wins, as in torch
    x[1, 2] = 9.0
    x[2] = float("-inf")             # nothing but -inf: index 0
    x[3, [9, 18]] = float("nan")     # the first NaN, past the 8-wide body, in the tail
    x[4, 19] = 1.0                   # the maximum in the tail
    x[5, 0] = 1.0
    assert kernels.argmax(x).tolist() == x.argmax(-1).tolist() == [3, 17, 0, 9, 19, 0]


@pytest.mark.parametrize("k", [1, 8, 32])
@pytest.mark.parametrize("shape", [(1, 151936), (9, 49152), (5, 1003), (2, 3, 40), (33,)])
def test_topk_equals_torch_on_distinct_values(shape, k):
    assert built
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    x[..., -1] = 10.0  # the largest in the 8-wide body's tail
    assert torch.equal(kernels.topk_indices(x, k), x.topk(k, dim=-1).indices)


def test_topk_ties_lower_index_first_nan_never_taken():
    x = torch.zeros(3, 20)
    x[0, [13, 2, 19]] = 5.0                          # ties above the rest: by index
    x[0, 7] = 6.0
    x[1, [4, 9]] = float("nan")                      # NaNs skipped; among the zeros, the first ones
    x[1, 12] = 1.0
    x[2] = -torch.arange(20.0)                       # descending from the start: the first k
    assert kernels.topk_indices(x, 4).tolist() == [[7, 2, 13, 19], [12, 0, 1, 2], [0, 1, 2, 3]]
    few = torch.full((1, 20), float("nan"))
    few[0, 5] = 1.0                                  # fewer than k values that are not NaN: torch's answer
    assert torch.equal(kernels.topk_indices(few, 3), few.topk(3, dim=-1).indices)


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("active", "active")])
def test_openmp_waits_passively_unless_told(given, expected):
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run([sys.executable, "-c", "import quickdraft, os; print(os.environ['OMP_WAIT_POLICY'])"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == expected
