"""Instruction mix of block_gemm's consumer K loop, from SASS compiled on the CPU (no GPU needed).

Compiles a block_gemm_kernel variant for sm_90a with TileLang and nvcc (as tests/unit/test_kernels_compile.py
does), disassembles the cubin with nvdisasm and prints, per loop that issues wgmma (QGMMA/HGMMA), the
instruction count by opcode and the order of the matmuls, waits and promotions; plus ptxas's register and
spill report. The consumer loop's count divided by the K blocks per stage (block_gemm.K_TILE / 32) is the
issue cost of one 32-wide K block per thread. nvdisasm is not part of the CUDA toolkit's nvcc package:
`pip install --target DIR nvidia-cuda-nvdisasm` and pass --nvdisasm DIR/nvidia/cu13/bin/nvdisasm.

Usage:  python bench/gemm_sass.py [--fp4] [--tile 128,128,256] [--stages 4] [--kw '{"depth": 3}'] --nvdisasm PATH
"""

import argparse
import collections
import itertools
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

N, K = 4096, 7168
INSTR = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^\s*\.(L_x_\d+):")


def cubin(fp4: bool, tile: tuple[int, int, int], stages: int, kw: dict, out: Path) -> str:
    """Compile the variant to out/kernel.cubin; -> ptxas's resource report."""
    import tilelang

    from dsv41_convert.kernels.block_gemm import block_gemm_kernel as jit

    args = (N, K, 32, 32, 1 if fp4 else 32, fp4, True, True, stages, tile)
    src = tilelang.compile(
        jit.get_tir(*args, **kw), target={"kind": "cuda", "arch": "sm_90a"}, pass_configs=jit.pass_configs
    )
    return nvcc_cubin(src.get_kernel_source(), out)


def nvcc_cubin(source: str, out: Path) -> str:
    """TileLang's CUDA source -> out/kernel.cubin for sm_90a (nvcc, TileLang's headers); -> ptxas's report
    lines (resources, spills, performance advisories such as C7514)."""
    import tilelang

    (out / "kernel.cu").write_text(source)
    root = Path(tilelang.__file__).parent
    cmd = ["nvcc", "--cubin", "-O3", "-arch=sm_90a", "-std=c++20", f"-I{root / 'src'}"]
    cmd += [f"-I{root / '3rdparty' / 'cutlass' / 'include'}", "-Xptxas", "-v", "-o", str(out / "kernel.cubin")]
    done = subprocess.run([*cmd, str(out / "kernel.cu")], capture_output=True, text=True, check=True)
    return "\n".join(line for line in done.stderr.splitlines() if "ptxas info" in line or "spill" in line)


def loops(sass: str):
    """-> [(start, end, [instruction text])] for each backward branch whose body issues wgmma and no TMA load
    (the consumers' K loop, not a span that reaches into the producer's code)."""
    lines = sass.splitlines()
    labels, pending, ins = {}, [], []
    for line in lines:
        if m := LABEL.match(line):
            pending.append(m.group(1))
        elif m := INSTR.match(line):
            addr = int(m.group(1), 16)
            labels.update((name, addr) for name in pending)
            pending = []
            ins.append((addr, m.group(2)))
    found = []
    for addr, text in ins:
        m = re.search(r"BRA `\((\.L_x_\d+)\)", text)
        start = labels.get(m.group(1)[1:]) if m else None
        if start is not None and start < addr:
            body = [t for a, t in ins if start <= a <= addr]
            if any("GMMA" in t for t in body) and not any("UTMALDG" in t for t in body):  # consumer, not producer
                found.append((start, addr, body))
    return found


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp4", action="store_true")
    parser.add_argument("--tile", default="128,128,256")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--kw", default="{}", help="block_gemm_kernel keywords as JSON")
    parser.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
    args = parser.parse_args()
    if not args.nvdisasm:
        raise SystemExit("gemm_sass: nvdisasm not found; pass --nvdisasm PATH (see the module docstring)")
    tile = tuple(int(x) for x in args.tile.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        print(cubin(args.fp4, tile, args.stages, json.loads(args.kw), out))
        sass = subprocess.run(
            [args.nvdisasm, "-c", str(out / "kernel.cubin")], capture_output=True, text=True, check=True
        )
    for start, end, body in loops(sass.stdout):
        mix = collections.Counter(opcode(t) for t in body)
        print(f"loop {start:#x}-{end:#x}: {len(body)} instructions: {dict(mix.most_common(12))}")
        order = [opcode(t) for t in body if re.search(r"GMMA|DEPBAR|FFMA|SYNCS", t)]
        runs = [f"{len(list(group))} {op}" for op, group in itertools.groupby(order)]
        print("  order: " + ", ".join(runs))


if __name__ == "__main__":
    main()
