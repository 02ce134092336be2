"""Work that computes nothing through torch runs without importing it: every export of the published layout
(the copy to fp8-fp4; fp8, whose fp4 -> fp8 cast is numpy on bytes, quant/cast_bytes.py; bf16, whose
decoders are too, quant/fp8_bytes.py and fp4_bytes.py) and `shard` of it (wo_a). torch's import is 1.5 s
of a worker's start on the dev box, 3-5 s on the 16-core host. Quantizing a bf16 source does import it
(the check below can tell; one worker, so that the work runs in the process it looks at). Planted faults it
catches: a module-level `import torch` back in convert/execute.py, write.py, stream.py or quant/__init__.py,
or write.py importing transform for numpy outputs."""

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


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> Path:
    from dsv41_convert.synth.presets import PRESETS
    from dsv41_convert.synth.write import write_checkpoint

    out = tmp_path_factory.mktemp("bf16") / "bf16"
    write_checkpoint(out, PRESETS["tiny"], seed=3, quantized=False, vision=False)
    return out


@pytest.mark.parametrize(
    ("source", "fmt", "want"),
    [("pub", "fp8-fp4", "NO-TORCH"), ("pub", "fp8", "NO-TORCH"), ("pub", "bf16", "NO-TORCH"), ("bf16", "fp8", "TORCH")],
)
def test_export_without_torch_work_does_not_import_torch(request, pub, tmp_path, source, fmt, want):
    out = tmp_path / "out"
    src = request.getfixturevalue(source)
    args = ["export", str(src), str(out), "--format", fmt]
    proc = subprocess.run([sys.executable, "-c", CODE, *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == want, proc.stdout[-2000:]
    if (source, fmt) == ("pub", "fp8-fp4"):  # the copy is still every published tensor, byte for byte
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
