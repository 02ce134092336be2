"""An export that computes nothing through torch runs without importing it: a copy (published -> fp8-fp4:
every tensor copied byte for byte) and published -> fp8 (the experts' fp4 -> fp8 cast is numpy on bytes,
quant/cast_bytes.py). torch's import is 1.5 s of a worker's start on the dev box, 3-5 s on the 16-core
host. An export that computes through torch (bf16) does import it (the check below can tell; one worker,
so that the work runs in the process it looks at). Planted faults it catches: a module-level `import
torch` back in convert/execute.py, write.py, stream.py or quant/__init__.py, or write.py importing
transform for numpy outputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CODE = (
    "import sys; from dsv41_convert.cli import main; sys.argv = ['dsv41-convert', *sys.argv[1:], '--workers', '1', "
    "'--json']\ntry:\n    main()\nexcept SystemExit as e:\n"
    "    assert not e.code, e.code\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
)


@pytest.fixture(scope="module")
def pub(tmp_path_factory) -> Path:
    from dsv41_convert.synth.presets import PRESETS
    from dsv41_convert.synth.write import write_checkpoint

    out = tmp_path_factory.mktemp("pub") / "pub"
    write_checkpoint(out, PRESETS["tiny"], seed=3, quantized=True, vision=False)
    return out


@pytest.mark.parametrize(("fmt", "want"), [("fp8-fp4", "NO-TORCH"), ("fp8", "NO-TORCH"), ("bf16", "TORCH")])
def test_export_without_torch_work_does_not_import_torch(pub, tmp_path, fmt, want):
    out = tmp_path / "out"
    args = ["export", str(pub), str(out), "--format", fmt]
    proc = subprocess.run([sys.executable, "-c", CODE, *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == want, proc.stdout[-2000:]
    if fmt == "fp8-fp4":  # the copy is still every published tensor, byte for byte
        for shard in sorted(pub.glob("model-*.safetensors")):
            assert (out / shard.name).read_bytes() == shard.read_bytes(), shard.name


@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_shard_on_the_cpu_does_not_import_torch(pub, tmp_path, expert_dtype):
    """`shard` of the published layout computes wo_a (e4m3 x e8m0 -> bf16) and, with fp8 experts, the cast:
    both numpy on bytes, so no torch. (Their bytes: the shard tests against tests/reference_convert.py.)"""
    out = tmp_path / "out"
    args = ["shard", str(pub), str(out), "--tp", "2", "--expert-dtype", expert_dtype]
    proc = subprocess.run([sys.executable, "-c", CODE, *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "NO-TORCH", proc.stdout[-2000:]
