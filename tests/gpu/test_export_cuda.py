"""`export --device cuda` writes the same bytes as the CPU path, for every format, from a published and
from a bf16 make-tiny source (the quantizing, dequantizing and casting actions all run on the kernels)."""

from pathlib import Path

import pytest

from dsv41_convert.convert.export import build_export_plan, export
from dsv41_convert.convert.export_rules import FORMATS
from dsv41_convert.synth.presets import TINY
from dsv41_convert.synth.write import write_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("export-cuda")
    for kind in ("fp8", "bf16"):
        write_checkpoint(base / kind, TINY, seed=5, quantized=kind == "fp8")
    return {kind: base / kind for kind in ("fp8", "bf16")}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_cuda_export_is_byte_identical_to_cpu(sources, tmp_path, kind, fmt):
    ep = build_export_plan(sources[kind], fmt)
    export(ep, tmp_path / "cpu", device="cpu")
    export(ep, tmp_path / "cuda", device="cuda")
    names = sorted(p.name for p in (tmp_path / "cpu").glob("model-*.safetensors"))
    assert names
    for name in [*names, "config.json", "model.safetensors.index.json"]:
        assert (tmp_path / "cpu" / name).read_bytes() == (tmp_path / "cuda" / name).read_bytes(), name
