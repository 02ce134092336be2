"""The full-size hollow layout (`make-tiny --preset full --sparse`: 510 GB apparent) without --stream-layers
on a host with less RAM: refused naming the weights' need, the host's memory and the way out (exit 2), before
any model is built; it was an allocator's traceback (98,305,579,008 bytes for an Engram table)."""

from __future__ import annotations

import pytest
from cli_run import run_cli
from hollow_ranks import write_hollow_ranks

from dsv41_convert.store.machine import physical_memory

pytestmark = [
    pytest.mark.slow,  # ~15 s: the layout's 96,085 tensors are planned three times
    pytest.mark.skipif(physical_memory() > 500 * 2**30, reason="this host holds the whole model"),
]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    from dsv41_convert.synth.hollow import write_hollow

    out = tmp_path_factory.mktemp("full") / "v41"
    write_hollow(out)
    return out


def test_reference_logits_of_the_full_model_is_refused(full, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(full), str(tmp_path / "ref.safetensors"))
    assert code == 2, err
    assert "Traceback" not in err and "can't allocate" not in err, err
    assert "the model's weights need" in err and "physical memory" in err and "--stream-layers" in err, err


def test_verify_of_its_rank_files_is_refused(full, tmp_path, monkeypatch, capsys):
    conv = tmp_path / "conv"
    write_hollow_ranks(full, conv, 8)
    code, _, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference", str(full))
    assert code == 2, err
    assert "Traceback" not in err and "the model's weights need" in err and "8 ranks on this host" in err, err
