"""kernels.launch: Triton kernels launched through libcuda with the GIL kept.

On the CPU: the specialization key, the launch plan built from a compiled kernel's signature,
and the fallback to Triton's own launch. On a CUDA device (skipped elsewhere): the copy, hash
and check kernels launched directly give Triton's results, and a plan packed wrong is caught.
"""

from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tierstore.kernels import launch
from tierstore.kernels.launch import Launcher, prepare, spec_key


def _fake_tensor_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """spec_key takes only CUDA tensors; on the CPU, let it read CPU ones as if they were."""
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda")))


def test_spec_key_is_at_least_as_fine_as_tritons_specialization(monkeypatch: pytest.MonkeyPatch) -> None:
    base = torch.zeros(64, dtype=torch.uint8)
    _fake_tensor_key(monkeypatch)
    k = spec_key((base, 32), {"B": 4})
    assert k is not None
    assert spec_key((base[1:], 32), {"B": 4}) != k  # the address is no longer 16-byte aligned
    assert spec_key((base.view(torch.int64), 32), {"B": 4}) != k  # another dtype
    assert spec_key((base, 48), {"B": 4}) == k  # same facts: divisible by 16, i32, not 1
    assert spec_key((base, 33), {"B": 4}) != k  # not divisible by 16
    assert spec_key((base, 1), {"B": 4}) != spec_key((base, 3), {"B": 4})  # 1 is a constexpr for Triton
    assert spec_key((base, 2**31 + 16), {"B": 4}) != k  # i64, not i32
    assert spec_key((base, 2**63 + 16), {"B": 4}) != spec_key((base, 2**31 + 16), {"B": 4})  # u64
    assert spec_key((base, True), {"B": 4}) != spec_key((base, 1), {"B": 4})  # a bool is no int here
    assert spec_key((base, 32), {"B": 8}) != k  # constexpr values
    assert spec_key((base, 32.0), {}) is None  # a float: Triton launches it


def test_spec_key_tells_host_tensors_from_device_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    host = spec_key((torch.zeros(4),), {})  # pinned host memory a kernel writes over PCIe
    _fake_tensor_key(monkeypatch)
    assert host is not None and spec_key((torch.zeros(4),), {}) != host


def _kernel(signature: dict[str, Any], **md: Any) -> SimpleNamespace:
    meta = dict(num_ctas=1, launch_cooperative_grid=False, launch_pdl=False, global_scratch_size=0,
                profile_scratch_size=0, num_warps=4, shared=512)
    meta.update(md)
    return SimpleNamespace(metadata=SimpleNamespace(**meta), src=SimpleNamespace(signature=signature), function=77)


def test_prepare_packs_by_the_compiled_signature() -> None:
    sig = {"a_ptr": "*u8", "n": "constexpr", "stride": "i64", "count": "i32", "B": "constexpr"}
    plan = prepare(_kernel(sig), ["a_ptr", "n", "stride", "count", "B"], (torch.zeros(2), 1, 64, 3))
    assert not isinstance(plan, str)
    assert plan.function == 77 and plan.block_x == 128 and plan.shared == 512
    assert plan.positions == [0, 2, 3] and plan.is_pointer == [True, False, False]
    assert plan.on_host == [True, False, False]  # a CPU tensor: its device address per launch
    assert len(plan.holders) == 5  # three parameters, then the global and profile scratch (null)
    assert [type(h) for h in plan.holders[:3]] == [ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32]
    assert all(plan.params[i] == ctypes.addressof(h) for i, h in enumerate(plan.holders))
    assert plan.holders[3].value == 0 and plan.holders[4].value == 0


@pytest.mark.parametrize("sig, md, n_args", [
    ({"a_ptr": "*u8"}, {"global_scratch_size": 16}, 1),
    ({"a_ptr": "*u8"}, {"profile_scratch_size": 8}, 1),
    ({"a_ptr": "*u8"}, {"num_ctas": 2}, 1),
    ({"a_ptr": "*u8"}, {"launch_pdl": True}, 1),
    ({"a_ptr": "*u8"}, {"launch_cooperative_grid": True}, 1),
    ({"a_ptr": "*u8", "x": "fp32"}, {}, 2),  # a float parameter
    ({"a_ptr": "*u8", "x": ("i32", "i32")}, {}, 2),  # a tuple
    ({"a_ptr": "*u8", "x": "i32"}, {}, 1),  # x passed by keyword
])
def test_prepare_leaves_what_it_cannot_launch_exactly_to_triton(sig: dict[str, Any], md: dict[str, Any],
                                                                   n_args: int) -> None:
    assert isinstance(prepare(_kernel(sig, **md), list(sig), (0,) * n_args), str)  # the reason


def test_prepare_refuses_a_triton_without_scratch_fields() -> None:
    k = _kernel({"a_ptr": "*u8"})
    del k.metadata.profile_scratch_size  # an older launch ABI
    assert prepare(k, ["a_ptr"], (0,)) == "profile_scratch_size=absent"


def test_off_switch_and_cpu_go_through_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    launch.enabled.cache_clear()
    with monkeypatch.context() as env:
        env.setenv("TIERSTORE_TRITON_LAUNCH", "0")
        assert not launch.enabled()
    launch.enabled.cache_clear()  # decided again without the switch
    if launch.enabled():
        pytest.skip("the fallback part needs a machine without CUDA")
    calls: list[tuple[Any, ...]] = []

    class FakeJit:
        arg_names = ["x"]

        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            return lambda *a, **kw: calls.append((grid, a, kw))

    launcher = Launcher(FakeJit())
    launcher.launch((3,), torch.zeros(2), B=1)  # no CUDA here (or the switch): Triton's launch
    launcher.launch((3,), torch.zeros(2), B=1)
    assert [(grid, kw) for grid, _, kw in calls] == [((3,), {"B": 1})] * 2
    assert launcher.counts() == {"direct": 0, "via_triton": 2}


def test_launch_hooks_send_launches_through_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.6 keeps its launch hooks as chains of calls (empty: none set), older ones as None."""
    from triton import knobs

    chain = SimpleNamespace(calls=[])
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", chain, raising=False)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None, raising=False)
    assert not launch._hooks_set()
    chain.calls.append(print)  # a profiler hooked in
    assert launch._hooks_set()
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", print, raising=False)
    assert launch._hooks_set()


# --- on a CUDA device ---------------------------------------------------------------------------

def _direct(name: str) -> int:
    from tierstore.kernels import checksum, triton_kernels

    table = {"copy": triton_kernels._COPY_LAUNCH, **{k: v for k, v in checksum._LAUNCH.items()}}
    return table[name].counts()["direct"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton)")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 is set")
@pytest.mark.gpu
def test_direct_launches_match_tritons_and_a_wrong_pointer_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernel_cases import AttentionCase

    from tierstore.format.checksums import section_checksums
    from tierstore.kernels import GroupCopier
    from tierstore.kernels.checksum import SectionHasher, check_and_mask

    assert launch.enabled(), "libcuda and a known Triton launch ABI are expected on the device"
    assert not launch._hooks_set()
    case = AttentionCase("bfloat16", heads=4, head_size=64, tokens=8, n_pages=12)
    views, ids = case.build("LBHNC", 8, "cuda")
    copier = GroupCopier(views, case.layout, 1, [1, 1], backend="triton")
    ref = GroupCopier(views, case.layout, 1, [1, 1], backend="torch")
    hasher = SectionHasher(case.layout, "cuda")
    before = {k: _direct(k) for k in ("copy", "hash_long", "hash_short", "check_mask")}
    n, n_sec = 5, len(case.layout.sections)
    for rnd in range(4):  # the first rounds compile through Triton, the later ones launch directly
        pick = ids[torch.randperm(ids.shape[0])[:n]].cuda()
        pages = torch.full((n, case.layout.nbytes), 0xA5 ^ rnd, dtype=torch.uint8, device="cuda")
        want = torch.full_like(pages, 0x5A)
        copier.gather(pick, pages)
        ref.gather(pick, want)
        assert torch.equal(pages, want)
        host_out = rnd % 2 == 1  # results written over PCIe into pinned host memory, as PageTransfer does
        out = torch.empty((n, n_sec), dtype=torch.int64, pin_memory=True) if host_out else None
        sums = hasher.hash(pages, out=out)
        torch.cuda.synchronize()
        host = pages.cpu().numpy()
        expect = [[v - 2**64 if v >= 2**63 else v for v in section_checksums(case.layout, host[i].tobytes())]
                  for i in range(n)]
        assert sums.cpu().tolist() == expect
        meta = torch.tensor([[*row, 0] for row in expect], dtype=torch.int64, device="cuda")
        meta[2, 0] ^= 1  # page 2 expects another sum: its ids become -1
        ids_out = torch.empty((n, 1), dtype=torch.int64, device="cuda")
        ok = torch.zeros(n, dtype=torch.uint8, pin_memory=host_out, device="cpu" if host_out else "cuda")
        check_and_mask(sums.cuda(), meta, 0, pick, ids_out, ok)
        torch.cuda.synchronize()
        assert ok.cpu().tolist() == [1, 1, 0, 1, 1]
        assert ids_out[2].item() == -1 and ids_out[0].item() == pick[0].item()
    torch.cuda.synchronize()
    after = {k: _direct(k) for k in before}
    assert after["copy"] > before["copy"] and after["check_mask"] > before["check_mask"]
    assert after["hash_long"] + after["hash_short"] > before["hash_long"] + before["hash_short"]
    assert not launch.refusals(), launch.refusals()

    # The negative control: direct launches that get the next page's address where the pages
    # start hash pages 1-4 instead of 0-3, and the comparison says so.
    head = pages[:4]
    assert hasher.hash(head).cpu().tolist() == expect[:4]  # this shape's kernel is prepared
    real = Launcher._launch_direct

    def shifted(drv: Any, plan: Any, grid: tuple[int, ...], args: tuple[Any, ...], device: int) -> None:
        if isinstance(args[0], torch.Tensor) and args[0].data_ptr() == head.data_ptr():
            args = (pages[1:5], *args[1:])
        real(drv, plan, grid, args, device)

    monkeypatch.setattr(Launcher, "_launch_direct", staticmethod(shifted))
    assert hasher.hash(head).cpu().tolist() == expect[1:5] != expect[:4]
    monkeypatch.undo()
    assert hasher.hash(head).cpu().tolist() == expect[:4]
    # Pageable host memory, which the GPU cannot write, is refused as Triton refuses it.
    with pytest.raises(ValueError, match="not pinned"):
        hasher.hash(pages, out=torch.empty((n, n_sec), dtype=torch.int64))
