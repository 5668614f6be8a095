"""The few-rows CPU matmul: agrees with torch, and is bitwise independent of the row count."""
import pytest
import torch
import torch.nn.functional as F

from quickdraft import kernels

needs_kernel = pytest.mark.skipif(kernels.kernel_status().startswith(("no C", "CPU capability")),
                                  reason="no C compiler or no AVX2 on this machine")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [64, 70])  # 70: a tail that is not a multiple of the 8 SIMD lanes
def test_matches_torch_and_is_batch_invariant(dtype, K):
    assert kernels.kernel_status().startswith("built"), kernels.kernel_status()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, K, generator=g).to(dtype)
    b = torch.randn(300, generator=g)
    x = torch.randn(kernels.MAX_ROWS, K, generator=g).to(dtype)
    y = kernels.skinny_linear(x, w, b)
    ref = F.linear(x.float(), w.float(), b).to(dtype)
    assert y.dtype == dtype and y.shape == (kernels.MAX_ROWS, 300)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.float(), ref.float(), atol=tol * K ** 0.5, rtol=tol)
    rows = torch.cat([kernels.skinny_linear(x[i:i + 1], w, b) for i in range(x.shape[0])])
    assert torch.equal(rows, y)  # same reduction order whatever M is
    assert torch.equal(kernels.skinny_linear(x[:5].view(5, 1, K), w, b).view(5, -1), y[:5])


def test_usable_only_for_few_rows_of_supported_weights():
    w = torch.zeros(8, 16)
    if kernels.kernel_status().startswith("built"):
        assert kernels.usable(torch.zeros(2, 3, 16), w)
    assert not kernels.usable(torch.zeros(kernels.MAX_ROWS + 1, 16), w)
    assert not kernels.usable(torch.zeros(1, 16), w.t())            # not contiguous
    assert not kernels.usable(torch.zeros(1, 16), w.to(torch.int32))
