"""The synthetic-checkpoint catalogue and presets against the published checkpoint's metadata."""

from __future__ import annotations

import gzip
import itertools
import json

import pytest
from reference_data import REFERENCE as REF

from dsv41_convert.config import ModelArgs
from dsv41_convert.convert.catalogue import Fmt, catalogue, file_tensors
from dsv41_convert.engram_buckets import engram_table_rows, is_prime
from dsv41_convert.errors import PlanError
from dsv41_convert.synth.presets import MEDIUM, PRESETS, TINY, hf_config
from dsv41_convert.synth.write import plan_shards


def _published_catalog() -> dict[str, tuple[str, list[int]]]:
    out = {}
    for row in json.loads((REF / "v41-flash.tensor-catalog.json").read_text()):
        for combo in itertools.product(*row["axes"]):
            name = row["pattern"]
            for value in combo:
                name = name.replace("{}", str(value), 1)
            out[name] = (row["dtype"], row["shape"])
    return out


def _files(args: ModelArgs, quantized: bool) -> dict[str, tuple[str, list[int]]]:
    return {t.name: (t.dtype, list(t.shape)) for p in catalogue(args) for t in file_tensors(p, quantized)}


def _args(preset=TINY, **kw) -> ModelArgs:
    return ModelArgs.from_hf_dict(hf_config(preset, compressed_vocab_size=100, **kw))


@pytest.fixture(scope="module")
def real_shards():
    """The shard plan of the published config (96,085 tensors; built once, it takes seconds)."""
    real = ModelArgs.from_hf_dict(json.loads((REF / "v41-flash.config.json").read_text()))
    return plan_shards(real, quantized=True)


def test_catalogue_of_the_real_config_is_the_published_catalog(real_shards):
    mine = {t.name: (t.dtype, list(t.shape)) for s in real_shards for t in s.tensors}
    published = _published_catalog()
    assert len(published) == 96085
    assert sorted(set(published) - set(mine)) == []
    assert sorted(set(mine) - set(published)) == []
    assert {k: v for k, v in mine.items() if published[k] != v} == {}


def test_engram_rows_reproduce_the_published_config():
    text = json.loads((REF / "v41-flash.config.json").read_text())["text_config"]
    rows = engram_table_rows(2, text["engram_max_ngram_size"], text["engram_n_heads"], text["engram_vocab_size"])
    assert rows == tuple(text["engram_num_embeddings"]) == (384006168, 384016682)


def test_is_prime_matches_trial_division():
    trial = [n for n in range(2, 3000) if all(n % d for d in range(2, int(n**0.5) + 1))]
    assert [n for n in range(3000) if is_prime(n)] == trial
    assert is_prime(16000057) and not is_prime(16000057 * 3)


def test_published_shard_grouping_for_the_real_config(real_shards):
    index = json.loads(gzip.open(REF / "v41-flash.model.safetensors.index.RECONSTRUCTED.json.gz").read())
    assert {t.name: s.file for s in real_shards for t in s.tensors} == index["weight_map"]
    assert sum(s.nbytes for s in real_shards) == index["metadata"]["total_size"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_config_loads_and_has_every_block_type(name):
    a = _args(PRESETS[name])
    r = a.compress_ratios
    assert a.n_mtp_layers == 3 and r[a.n_layers :] == (0, 0, 0)
    assert a.dspark_target_layer_ids == tuple(range(a.n_layers - 3, a.n_layers))
    window_only = [i for i in range(a.n_layers) if r[i] == 0]
    kv2 = [i for i in a.kv_source_layers if r[i] == 2]
    consumers2 = [i for i in range(a.n_layers) if r[i] == 2 and i not in a.kv_source_layers]
    c = a.candidate_source_layer
    consumers1 = [i for i in range(a.n_layers) if r[i] == 1 and i not in a.index_source_layers]
    assert window_only and kv2 and consumers2 and consumers1
    assert r[c] == 1 and c in a.kv_source_layers and c in a.index_source_layers
    assert any(i > c for i in a.index_source_layers if i not in a.kv_source_layers)
    assert len(a.engram_layer_ids) == 2 and any(i in a.kv_source_layers for i in a.engram_layer_ids)
    assert a.hc_mult == 4 and a.n_shared_experts == 1
    assert max(a.image_token_id, a.dspark_noise_token_id) < a.vocab_size


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_preset_splits_divide_for_tp(name, tp):
    """Every split of upstream convert.py divides, and fp8 splits keep whole 32-blocks."""
    a = _args(PRESETS[name])
    assert a.n_routed_experts % tp == 0 and a.dspark_n_routed_experts % tp == 0
    assert a.o_groups % tp == 0 and a.n_heads % tp == 0 and a.index_n_heads % tp == 0
    dim0 = (".wq_b.weight", ".wo_a.weight", ".attn_sink", ".weights_proj.weight", "markov_head.embed.weight")
    for tname, (dtype, shape) in _files(a, quantized=True).items():
        if tname in ("embed.weight", "head.weight") or tname.endswith((*dim0, "markov_head.head.weight")):
            assert shape[0] % tp == 0, tname
            if dtype == "F8_E4M3":
                assert (shape[0] // tp) % 32 == 0, tname
        if tname.endswith("wo_b.weight"):
            assert shape[1] % tp == 0 and (shape[1] // tp) % 32 == 0, tname


def test_tiny_window_and_topk_fit_a_short_prompt():
    a = _args()
    prompt = 64
    assert a.window_size < prompt // 2
    assert a.index_topk < prompt // 2  # ratio-2 compressed positions of a 64-token prompt
    assert a.candidate_topk_blocks * a.candidate_block_size >= a.index_topk
    assert a.candidate_topk_blocks * a.candidate_block_size < prompt
    assert a.original_seq_len <= prompt


def test_medium_keeps_the_real_hidden_sizes():
    a = _args(MEDIUM)
    assert (a.dim, a.n_heads, a.head_dim, a.q_lora_rank, a.o_lora_rank, a.rope_head_dim) == (
        5120,
        64,
        512,
        1280,
        1024,
        64,
    )
    assert (a.index_n_heads, a.index_head_dim, a.moe_inter_dim, a.engram_head_dim) == (32, 128, 2304, 256)


def test_bf16_layout_has_no_scales_and_full_width_experts():
    a = _args()
    fp8, bf16 = _files(a, quantized=True), _files(a, quantized=False)
    assert not [n for n in bf16 if n.endswith(".scale")]
    assert set(bf16) == {n for n in fp8 if not n.endswith(".scale")}
    for name, (dtype, shape) in bf16.items():
        if fp8[name][0] == "F32":
            assert dtype == "F32", name
        else:
            assert dtype == "BF16", name
        if fp8[name][0] == "I8":
            assert shape == [fp8[name][1][0], 2 * fp8[name][1][1]], name
        else:
            assert shape == fp8[name][1], name
    assert "quantization_config" not in hf_config(TINY, compressed_vocab_size=1, quantized=False)
    assert _args(quantized=False).dtype == "bf16"


def test_no_vision_drops_vision_tensors_and_vl_biases():
    names = set(_files(_args(vision=False), quantized=True))
    assert not [n for n in names if n.startswith(("vision.", "aligner.", "image_")) or n.endswith("bias_vl")]
    assert "layers.0.ffn.gate.bias" in names


@pytest.mark.parametrize("k", [1, 4, 6])
def test_layer_shards(k):
    a = _args()
    shards = plan_shards(a, True, k)
    assert len(shards) == k + 8  # vision, embed, K layers, head, 3 mtp, 2 engram
    assert shards[0].file == f"model-00001-of-{len(shards):05d}.safetensors"
    layer_files = shards[2 : 2 + k]
    seen = [{t.name.split(".")[1] for t in s.tensors} for s in layer_files]
    assert sorted(int(i) for s in seen for i in s) == list(range(a.n_layers))


def test_layer_shards_out_of_range():
    with pytest.raises(PlanError, match="--shards 7"):
        plan_shards(_args(), True, 7)


def test_quantized_linear_weights_are_drawn_jittered():
    """Every fp8 and fp4 linear weight (routed experts included) is drawn with jitter, so its blocks get different
    scale exponents as a real checkpoint's do; unjittered experts had one scale a tensor, and every test on
    make-tiny's experts checked only that one exponent."""
    quantized = [p for p in catalogue(_args()) if p.fmt in (Fmt.FP8, Fmt.FP4)]
    assert any(".ffn.experts." in p.name for p in quantized)
    assert all(p.init.jitter for p in quantized), [p.name for p in quantized if not p.init.jitter][:3]
