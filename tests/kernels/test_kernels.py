"""Copy kernels on every target: (device, backend) = cpu/torch, cpu/triton (interpreted),
cuda/triton (compiled), cuda/torch; each target runs the same shared cases (kernel_cases.py).

Triton runs interpreted only where no CUDA device exists (TRITON_INTERPRET must be set
before tierstore.kernels.triton_kernels is imported); on a GPU host the cpu/triton cases are
skipped and the cuda ones run compiled. GPU-only tests (real-sized pages, the transfer path)
live in tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "tierstore.kernels.triton_kernels" in sys.modules:  # imported earlier, maybe not interpreted
        importlib.reload(sys.modules["tierstore.kernels.triton_kernels"])

from kernel_cases import (  # noqa: E402
    AttentionCase,
    bits,
    check_attention_canonical,
    check_attention_round_trip,
    check_mamba,
    check_mla,
    check_page_list,
    gather_pages,
)

from tierstore.errors import ConfigError  # noqa: E402
from tierstore.kernels import GroupCopier  # noqa: E402
from tierstore.kernels.views import make_attention_caches  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ON_CUDA = torch.cuda.is_available()
try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

_NO_INTERPRETER = pytest.mark.skipif(
    not (HAVE_TRITON and INTERPRETED), reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (set where there is no GPU)")
_NO_CUDA = pytest.mark.skipif(
    not ON_CUDA or INTERPRETED, reason="needs a CUDA device and TRITON_INTERPRET unset (compiled Triton)")
TARGETS = [
    pytest.param("cpu", "torch", id="cpu-torch"),
    pytest.param("cpu", "triton", id="cpu-triton", marks=_NO_INTERPRETER),
    pytest.param("cuda", "triton", id="cuda-triton", marks=[pytest.mark.gpu, _NO_CUDA]),
    pytest.param("cuda", "torch", id="cuda-torch", marks=[pytest.mark.gpu, _NO_CUDA]),
]


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
def test_attention_pages_identical_across_layouts_and_block_sizes(dtype_name: str, device: str, backend: str) -> None:
    check_attention_canonical(dtype_name, device, backend)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float8_e4m3fn", "float32"])
def test_attention_round_trip_into_other_layout(dtype_name: str, device: str, backend: str) -> None:
    check_attention_round_trip(dtype_name, device, backend)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_mamba_conv_orientation_normalized_and_padding_skipped(device: str, backend: str) -> None:
    check_mamba(device, backend)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_mla_latent_pages(device: str, backend: str) -> None:
    check_mla(device, backend)


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_separate_page_buffers(device: str, backend: str) -> None:
    check_page_list(device, backend)


def test_auto_backend_is_torch_on_cpu() -> None:
    case = AttentionCase("bfloat16")
    views, ids = case.build("LBHNC", 8, "cpu")
    assert GroupCopier(views, case.layout, 1, [1, 1]).backend == "torch"


def test_rejects_views_that_do_not_fit_the_layout() -> None:
    case = AttentionCase("bfloat16")
    _, views = make_attention_caches("LBHNC", 2, 4, 2, 4, 8, torch.bfloat16)
    with pytest.raises(ConfigError, match="joined on dim 1"):
        GroupCopier(views, case.layout, 1, [1, 1], backend="torch")  # 1 block of 4 tokens != 8
    with pytest.raises(ConfigError, match="one source view"):
        GroupCopier(views[:1], case.layout, 2, [1, 1], backend="torch")
    with pytest.raises(ConfigError, match="dtype"):
        GroupCopier([v.view(torch.float16) for v in views], case.layout, 2, [1, 1], backend="torch")
    with pytest.raises(ConfigError, match="backend"):
        GroupCopier(views, case.layout, 2, [1, 1], backend="cuda")
    copier = GroupCopier(views, case.layout, 2, [1, 1], backend="torch")
    with pytest.raises(ValueError, match="block_ids"):
        copier.gather(torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, case.layout.nbytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="pages"):
        copier.gather(torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 5, dtype=torch.uint8))


@pytest.mark.skipif(not (HAVE_TRITON and INTERPRETED), reason="needs Triton (interpreted on CPU)")
def test_triton_plan_words_and_alignment_hints() -> None:
    """Rows that are 16-byte aligned get 8-byte words and 16-byte hints; odd ones do not."""
    from tierstore.kernels.triton_kernels import TritonCopier

    case = AttentionCase("bfloat16")  # rows of 2 x 8 bf16 = 32 bytes
    views, ids = case.build("LBNHC", 4, "cpu")
    (launch,) = TritonCopier(views, case.layout, 2, [1, 1]).describe()
    assert (launch["word"], launch["vec"], launch["row_dims"]) == (8, 2, 2)
    # a latent of 12 bf16 (24-byte rows) padded to 16 elements: 8-byte words, no 16-byte hints
    from kernel_cases import MLACase

    mla = MLACase()
    mviews, _ = mla.build(2, "cpu", padded_c=16)
    (mlaunch,) = TritonCopier(mviews, mla.layout, 4, [0, 0]).describe()
    assert (mlaunch["word"], mlaunch["vec"]) == (8, 1)
    # bf16 conv state stored transposed (SD): one element per row, 2-byte words
    from kernel_cases import MambaCase

    mamba = MambaCase()
    sviews, _, _ = mamba.build("SD", "cpu")
    plan = TritonCopier(sviews, mamba.layout, 1, [None] * len(sviews)).describe()
    assert sorted((p["word"], p["cols"]) for p in plan) == [(2, 1), (8, 16)]  # conv; 128-byte temporal


@pytest.mark.parametrize(("device", "backend"), TARGETS)
def test_scatter_skips_negative_block_ids(device: str, backend: str) -> None:
    """A page whose block ids are masked (-1: it failed verification) writes nothing."""
    if device == "cuda" and backend == "torch":
        pytest.skip("the torch path does not inspect CUDA block ids (a host sync); masking is Triton's")
    case = AttentionCase("bfloat16", n_pages=3, seed=5)
    views, ids = case.build("LBNHC", 4, device)
    pages = gather_pages(case.copier(views, 2, "torch"), ids, case.layout.nbytes, device).to(device)
    _, views2 = make_attention_caches("LBNHC", case.layers, int(ids.max()) + 4, case.heads, 4, case.head_size,
                                      case.dtype, device)
    for v in views2:
        bits(v).fill_(0x3C)  # poison: must survive where nothing is written
    masked = ids.clone()
    masked[1] = -1
    case.copier(views2, 2, backend).scatter(pages, masked.to(device))
    for v, v2 in zip(views, views2, strict=True):
        for p in range(case.n_pages):
            got, want = bits(v2[ids[p].to(device)]), bits(v[ids[p].to(device)])
            if p == 1:
                assert bool((got == 0x3C).all()), "a masked page was written"
            else:
                assert torch.equal(got, want)
