"""verify.arithmetic: the line that says what picked a run's CPU kernels, compared between reference-logits and
verify (verdict.exact_blockers), must be the same in every process of the same host and differ where they do."""

from __future__ import annotations

import io
import platform

import pytest
import torch

from dsv41_convert.verify import arithmetic as arithmetic_module
from dsv41_convert.verify.arithmetic import arithmetic

CPUINFO = (
    "processor\t: 0\nmodel name\t: a test CPU\n"
    "flags\t\t: fpu sse2 pni avx512vl amx_tile avx2 f16c avx512_bf16 fma avx avx512f avx512bw avx512_vnni ht\n"
)
FLOAT_FLAGS = "amx_tile avx avx2 avx512_bf16 avx512_vnni avx512bw avx512f avx512vl f16c fma"  # sorted by hand


@pytest.fixture
def this_cpu(monkeypatch):
    """/proc/cpuinfo as CPUINFO says it, and no variable capping the kernels."""
    real_open = open

    def fake_open(path, *args, **kwargs):
        return io.StringIO(CPUINFO) if path == "/proc/cpuinfo" else real_open(path, *args, **kwargs)

    monkeypatch.setattr(arithmetic_module, "open", fake_open, raising=False)
    for name in arithmetic_module._CAPS:
        monkeypatch.delenv(name, raising=False)
    arithmetic_module._cpu_flags.cache_clear()
    yield
    arithmetic_module._cpu_flags.cache_clear()


def test_the_float_instruction_sets_are_listed_sorted_and_no_others(this_cpu):
    """Only the sets that change the float kernels, in sorted order: in a set's order (which string hashing
    randomises per process) a reference and a verify on one host recorded different lines, and verify stopped
    expecting bit equality; flags that pick no kernel (fpu, sse2, ht) would make hosts differ for nothing."""
    machine = f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}"
    assert arithmetic("cpu") == f"{machine}; {FLOAT_FLAGS}"


def test_a_variable_capping_the_kernels_is_recorded(this_cpu, monkeypatch):
    """MKL_ENABLE_INSTRUCTIONS=AVX2 alone made a correct conversion's exact checks differ (an audit,
    2026-12-05): the line must name it, so that a run under it does not expect a reference's bits."""
    plain = arithmetic("cpu")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert arithmetic("cpu") == f"{plain}; MKL_ENABLE_INSTRUCTIONS=AVX2"
