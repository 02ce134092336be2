"""Every TileLang kernel factory still lowers and compiles for Hopper, without a GPU.

TileLang builds CUDA kernels on a machine with nvcc and no GPU when given an explicit target; this
catches a kernel that no longer lowers (a TileLang upgrade, an edit) on CPU-only CI. sm_90a is the
H100/H200 target TileLang picks on those GPUs (wgmma and register reallocation need the 'a').
Skipped where tilelang or nvcc is missing.
"""

import importlib.util
import shutil

import pytest

pytestmark = pytest.mark.slow

if importlib.util.find_spec("tilelang") is None or shutil.which("nvcc") is None:
    pytest.skip("needs tilelang and nvcc", allow_module_level=True)

TARGET = {"kind": "cuda", "arch": "sm_90a"}

# (module, factory, compile-time arguments): one representative configuration per factory
CASES = [
    ("fp8_quant", "fp8_quant_kernel", (200, 32, 32, "bfloat16", True)),
    ("act_quant", "act_quant_kernel", (1024, 32, "bfloat16", True, True, False)),
    ("fp4_act_quant", "fp4_act_quant_kernel", (200, 32, "bfloat16", False, False)),
    ("fp8_dequant", "fp8_dequant_kernel", (1024, 128, 128, False, "bfloat16")),
    ("fp4_dequant", "fp4_dequant_kernel", (1024, 32, "bfloat16")),
    ("fp4_to_fp8", "fp4_to_fp8_kernel", (1024,)),
    ("hc_split_sinkhorn", "hc_split_sinkhorn_kernel", (4, 20, 1e-6)),
    ("fp8_gemm", "fp8_gemm_kernel", (512, 1024, 32, True)),
    ("fp4_gemm", "fp4_gemm_kernel", (256, 1024, 32, True)),
    ("sparse_attn", "sparse_attn_kernel", (16, 512, 200, 0.044)),
]


@pytest.fixture(scope="module", autouse=True)
def no_kernel_cache():
    import tilelang

    tilelang.disable_cache()  # compile for real, every run
    yield
    tilelang.enable_cache()


@pytest.mark.parametrize("module,factory,args", CASES, ids=[c[0] for c in CASES])
def test_kernel_compiles_for_sm90(module, factory, args):
    import tilelang

    jit = getattr(importlib.import_module(f"dsv41_convert.kernels.{module}"), factory)
    kernel = tilelang.compile(jit.get_tir(*args), target=TARGET, pass_configs=jit.pass_configs)
    source = kernel.get_kernel_source()
    assert "__global__" in source
    if module.endswith("gemm"):
        assert "wgmma" in source, "the gemm should run on Hopper's wgmma"
