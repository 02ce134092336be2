"""safetensors headers: our parser against bad files, our writer against safetensors' own bytes."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load, save, save_file

from dsv41_convert.errors import HeaderError
from dsv41_convert.store.safetensors_header import build_header, read_header, sort_metadata

TORCH_TO_ST = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int8: "I8",
    torch.float4_e2m1fn_x2: "F4",
}


def _entries(sd):
    out = []
    for name, t in sd.items():
        shape = tuple(t.shape)
        if t.dtype == torch.float4_e2m1fn_x2:
            shape = (*shape[:-1], shape[-1] * 2)
        out.append((name, TORCH_TO_ST[t.dtype], shape))
    return out


def _sample():
    return {
        "layers.0.attn.wq_b.weight": torch.zeros(64, 32, dtype=torch.float8_e4m3fn),
        "layers.0.attn.wq_b.scale": torch.ones(2, 1, dtype=torch.float8_e8m0fnu),
        "layers.0.attn.attn_sink": torch.arange(8, dtype=torch.float32),
        "embed.weight": torch.ones(4, 16, dtype=torch.bfloat16),
        "layers.0.ffn.experts.0.w1.weight": torch.zeros(4, 8, dtype=torch.int8).view(torch.float4_e2m1fn_x2),
        "layers.0.ffn.experts.0.w1.scale": torch.ones(4, 1, dtype=torch.float8_e8m0fnu),
        "scalar": torch.tensor(1.0),
    }


def test_build_header_is_byte_identical_to_save_file():
    sd = _sample()
    blob = save(sd)
    header, spans = build_header(_entries(sd))
    assert blob[: len(header)] == header  # golden: safetensors' serializer
    assert spans[-1][2] == len(blob)


def test_build_header_keeps_the_given_order_when_asked(tmp_path):
    sd = _sample()
    entries = _entries(sd)[::-1]
    header, spans = build_header(entries, sort=False)
    assert [name for name, _, _ in spans] == [name for name, _, _ in entries]
    text = header[8:].decode().rstrip(" ")
    assert list(json.loads(text)) == [name for name, _, _ in entries]  # the JSON's order too
    raw = {n: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for n, t in sd.items()}
    path = tmp_path / "kept.safetensors"
    path.write_bytes(header + b"".join(raw[n] for n, _, _ in spans))
    h = read_header(path)  # a valid file: the data tiles the area in the header's order
    blob = path.read_bytes()
    assert [n for n in h.tensors] == [n for n, _, _ in entries]
    assert all(blob[e.begin : e.end] == raw[n] for n, e in h.tensors.items())
    sorted_header, _ = build_header(entries)
    assert sorted_header == build_header(_entries(sd))[0] != header  # sorted: the input order does not matter


def test_read_header_roundtrip(tmp_path):
    sd = _sample()
    save_file(sd, tmp_path / "a.safetensors")
    h = read_header(tmp_path / "a.safetensors")
    assert set(h.tensors) == set(sd)
    blob = (tmp_path / "a.safetensors").read_bytes()
    for name, t in sd.items():
        info = h.tensors[name]
        assert blob[info.begin : info.end] == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _write(path, header: dict | bytes, data: bytes = b"", length: int | None = None):
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "length", "match"),
    [
        (b"{not json", b"", None, "not valid JSON"),
        (b"[" * 1500 + b"]" * 1500, b"", None, "not valid JSON"),  # a RecursionError, a traceback before
        (b'{"t": "\xff"}', b"", None, "not valid JSON"),
        (
            {"t": {"dtype": "F4", "shape": [1023], "data_offsets": [0, 512]}},
            b"\0" * 512,
            None,
            r"tensor t: F4 \[1023\] is not a whole number of bytes",
        ),
        (
            {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 4,
            None,
            r"tensor t ends at byte.*truncated",
        ),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, None, "needs 8"),
        ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, None, "gap of 4 bytes"),
        (
            {
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
            },
            b"\0" * 4,
            None,
            r"tensor b starts at data offset 8, which is past the end of the \d+-byte file .*truncated",
        ),
        ({"t": {"dtype": "XX", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "unknown dtype"),
        ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8, None, "4 bytes after"),
        (b"{}", b"", 10**9, "exceeds"),
        (b"{}", b"", 4096, "runs past the end"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
            },
            b"\0" * 8,
            None,
            "overlaps",
        ),
        # accepted before (an audit), though safetensors itself refuses such a file
        ({"__metadata__": {"format": 3}}, b"", None, r"__metadata__ must be an object of strings, found \{"),
        ({"__metadata__": [1, 2]}, b"", None, r"__metadata__ must be an object of strings, found \[1, 2\]"),
        ({"__metadata__": False}, b"", None, r"__metadata__ must be an object of strings, found false"),  # a review
        ({"__metadata__": ""}, b"", None, r"__metadata__ must be an object of strings, found \"\""),
        # a tensor named twice, at the same bytes as another dtype: json (and safetensors) kept the last (an audit)
        (
            b'{"t": {"dtype": "I8", "shape": [4], "data_offsets": [0, 4]}, '
            b'"t": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}',
            b"\0" * 4,
            None,
            "header gives tensor 't' twice",
        ),
        (
            b'{"t": {"dtype": "F32", "dtype": "I32", "shape": [1], "data_offsets": [0, 4]}}',
            b"\0" * 4,
            None,
            "header gives 'dtype' of tensor 't' twice",
        ),
    ],
)
def test_bad_headers_name_file_and_tensor(tmp_path, header, data, length, match):
    path = _write(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(HeaderError, match=match) as err:
        read_header(path)
    assert "bad.safetensors" in str(err.value)


@pytest.mark.parametrize(
    ("dim", "readable"),
    [(2**64 - 1, True), (2**64, False), (10**400, False)],
    ids=["u64 max", "u64 max + 1", "10**400"],
)
def test_a_zero_size_tensor_takes_only_dimensions_safetensors_reads(tmp_path, dim, readable):
    """A dimension past 2**64 - 1 of a zero-size tensor (its other dimension 0: no bytes to disagree with) was
    accepted, so `download --verify-only` passed a header that safetensors' own reader refuses. Whether
    safetensors reads it is asked of safetensors itself here."""
    from safetensors import SafetensorError, safe_open

    path = _write(tmp_path / "z.safetensors", {"t": {"dtype": "F32", "shape": [0, dim], "data_offsets": [0, 0]}})
    try:
        with safe_open(str(path), "numpy") as f:
            assert list(f.keys()) == ["t"]
        theirs = True
    except SafetensorError:
        theirs = False
    assert theirs == readable
    if readable:
        assert read_header(path).tensors["t"].shape == (0, dim)
    else:
        with pytest.raises(HeaderError, match=r"z\.safetensors: tensor t: shape has a dimension past 2\*\*64 - 1"):
            read_header(path)


def test_short_file(tmp_path):
    (tmp_path / "s.safetensors").write_bytes(b"abc")
    with pytest.raises(HeaderError, match="too short"):
        read_header(tmp_path / "s.safetensors")


@pytest.mark.parametrize(
    "metadata", [None, {"z": "1", "format": "f", "ä": "ü", "a": '["x"]', "m": "", "q": 'a"b\\c\n\x01'}]
)
def test_sorting_metadata_keeps_tensors_and_values(tmp_path, metadata):
    g = torch.Generator().manual_seed(3)
    tensors = {"w": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g).bfloat16()}
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    before = path.read_bytes()
    sort_metadata(path)
    after = path.read_bytes()
    n = struct.unpack("<Q", after[:8])[0]
    header = json.loads(after[8 : 8 + n])
    assert len(after) == len(before) and after[8 + n :] == before[8 + n :]
    assert list(header.get("__metadata__", {})) == sorted(metadata or {})
    assert header.get("__metadata__") == metadata
    back = load(after)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    sort_metadata(path)
    assert path.read_bytes() == after


def test_sorted_metadata_gives_one_file_from_many_processes(tmp_path):
    """safetensors itself orders the metadata by a per-process hash: three processes, three files."""
    script = (
        "import sys, shutil, torch; from safetensors.torch import save_file;"
        "from dsv41_convert.store.safetensors_header import sort_metadata;"
        "save_file({'t': torch.arange(4.0)}, sys.argv[1], metadata={k: str(i) for i, k in enumerate('abcdefgh')});"
        "shutil.copy(sys.argv[1], sys.argv[2]); sort_metadata(sys.argv[2])"
    )
    for i in range(3):
        subprocess.run([sys.executable, "-c", script, tmp_path / f"raw{i}", tmp_path / f"sorted{i}"], check=True)
    raw = {(tmp_path / f"raw{i}").read_bytes() for i in range(3)}
    assert len(raw) > 1  # what the sort is for; 3 equal of 8! orders would be chance
    assert len({(tmp_path / f"sorted{i}").read_bytes() for i in range(3)}) == 1


@pytest.mark.parametrize(
    ("name", "advice"),
    [
        ("model1-mp2.safetensors", r"truncated rank file\? `shard \.\.\. --resume` writes again"),
        ("model-00003-of-00046.safetensors", r"truncated shard\? download it again"),
    ],
)
def test_a_truncated_file_is_told_what_makes_it_whole(tmp_path, name, advice):
    """A rank file cut short was told to be downloaded again (it is written by shard, not downloaded)."""
    path = tmp_path / name
    save_file({"t": torch.zeros(64, dtype=torch.bfloat16)}, path)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(HeaderError, match=rf"{name}: tensor t ends at byte \d+ but .*; {advice}"):
        read_header(path)


def test_null_metadata_is_none(tmp_path):
    """`"__metadata__": null` opens in safetensors: no metadata, not a corrupt file (a review)."""
    t = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    path = _write(tmp_path / "null.safetensors", {"__metadata__": None, "t": t}, b"\0" * 4, None)
    assert list(read_header(path).tensors) == ["t"]
