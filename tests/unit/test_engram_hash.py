"""Engram hashing: token map, multipliers, primes and hash ids against plain re-statements."""

from __future__ import annotations

import dataclasses
import os
import unicodedata

import numpy as np
import pytest
import torch
from reference_data import REAL_CONFIG

from dsv41_convert.config import ModelArgs, load_model_args
from dsv41_convert.engram_tokens import compressed_token_map, load_token_map
from dsv41_convert.errors import ConfigError
from dsv41_convert.model.engram_hash import EngramLayout, NgramHashState, hash_multipliers
from dsv41_convert.synth.presets import TINY, hf_config
from dsv41_convert.synth.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TINY.vocab_size)


@pytest.fixture(scope="module")
def args(tokenizer) -> ModelArgs:
    _, size = compressed_token_map(tokenizer)
    return ModelArgs.from_hf_dict(hf_config(TINY, compressed_vocab_size=size)).with_runtime(
        max_batch_size=2, max_seq_len=64
    )


def _plain_key(text: str, raw: str) -> str:
    """The token-map key, restated with unicodedata instead of the tokenizers normalizers."""
    if "\ufffd" in text:
        return raw
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(c for c in s if not unicodedata.combining(c)).lower()
    out, in_ws = [], False
    for c in s:
        if c in " \t\r\n":
            if not in_ws:
                out.append(" ")
            in_ws = True
        else:
            out.append(c)
            in_ws = False
    s = "".join(out)
    s = s if s == " " else s.strip()
    return s or text


def test_token_map_matches_plain_restatement(tokenizer):
    token_map, size = compressed_token_map(tokenizer)
    keys: dict[str, int] = {}
    expected = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        key = _plain_key(tokenizer.decode([i], skip_special_tokens=False), tokenizer.id_to_token(i))
        expected.append(keys.setdefault(key, len(keys)))
    assert token_map == expected
    assert size == len(keys)
    # the map really folds: "Model" and " Model" share an id
    ids = {tokenizer.token_to_id(t) for t in ("Model", "ĠModel") if tokenizer.token_to_id(t) is not None}
    assert len({token_map[i] for i in ids}) == 1 and len(ids) >= 2
    assert size < len(token_map)


def test_token_map_size_mismatch_names_tokenizer_json(tmp_path, tokenizer):
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    _, size = compressed_token_map(tokenizer)
    assert len(load_token_map(path, size)) == TINY.vocab_size
    with pytest.raises(ConfigError, match=r"tokenizer\.json.*engram_compressed_vocab_size is 99092"):
        load_token_map(path, 99092)


def test_a_tokenizer_is_folded_once_per_process_and_file_version(tmp_path, tokenizer, monkeypatch):
    """A verify rank checks its plan's tokenizer.json, then its model reads it: 0.4 s each at the published
    size. The second load is the first's map; a tokenizer.json written again is folded again."""
    import dsv41_convert.engram_tokens as engram_tokens

    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    expected, size = compressed_token_map(tokenizer)
    folds = []
    real = engram_tokens.compressed_token_map
    monkeypatch.setattr(engram_tokens, "compressed_token_map", lambda t: folds.append(1) or real(t))
    assert load_token_map(path, size) == expected and load_token_map(path, size) == expected and len(folds) == 1
    text = path.read_text()
    path.write_text(text + " ")  # another version of the file: same tokens, another size
    assert load_token_map(path, size) == expected and len(folds) == 2
    # rewritten in place with its size and modification time put back (cp -p, rsync -t): its change time moved
    stamp = path.stat()
    path.write_text(text + "\n")
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert load_token_map(path, size) == expected and len(folds) == 3


def test_a_tokenizer_json_is_parsed_once_per_process_and_file_version(tmp_path, tokenizer):
    """verify's prompt bound, its text prompts and the Engram token map each parsed tokenizer.json (0.18 s a
    parse at the published size): one parse now, and another for another version of the file."""
    from dsv41_convert.engram_tokens import read_tokenizer
    from dsv41_convert.verify.prompts import _tokenizer

    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    first = read_tokenizer(path)
    assert _tokenizer(path, "prompts") is first and read_tokenizer(path) is first
    path.write_text(path.read_text() + " ")
    assert read_tokenizer(path) is not first
    assert read_tokenizer(path).get_vocab_size() == first.get_vocab_size()


def test_real_layout_rows_and_primes():
    args = load_model_args(REAL_CONFIG)
    layout = EngramLayout.from_args(args)
    assert layout.table_rows() == args.engram_num_embeddings == (384006168, 384016682)
    flat = [p for layer in layout.primes for row in layer for p in row]
    assert len(flat) == 2 * 3 * 8 and flat == sorted(flat) and flat[0] > 16_000_000 - 1
    assert layout.n_hash_cols == 24


def test_primes_are_the_successive_primes(args):
    layout = EngramLayout.from_args(args)

    def plain_is_prime(n):
        return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))

    flat = [p for layer in layout.primes for row in layer for p in row]
    expected = [n for n in range(args.engram_vocab_size, 10 * args.engram_vocab_size) if plain_is_prime(n)]
    assert flat == expected[: len(flat)]
    assert layout.table_rows() == args.engram_num_embeddings
    offsets = layout.row_offsets()
    for g, layer in enumerate(layout.primes):
        sizes = [p for row in layer for p in row]
        assert offsets[g] == [sum(sizes[:i]) for i in range(len(sizes))]


def test_multipliers_odd_and_seeded():
    m = hash_multipliers((1, 14), 4, 99092)
    bound = (2**63 - 1) // 99092 // 2
    for row, layer in zip(m.tolist(), (1, 14), strict=True):
        draws = np.random.default_rng(10007 * layer).integers(0, bound, size=4, dtype=np.int64)
        assert row == [int(d) * 2 + 1 for d in draws]
        assert all(v % 2 == 1 and v * 99092 < 2**63 for v in row)


def _plain_hashes(ids, mask, token_map, pad_token, layout, multipliers):
    """Straightforward per-position hashing with Python ints."""
    n = layout.max_ngram_size
    pad = token_map[pad_token]
    out = []
    for b, row in enumerate(ids):
        rows = []
        for t in range(len(row)):
            toks, blocked = [], False
            for k in range(n):
                src = t - k
                if src < 0 or (mask is not None and not mask[b][src]):
                    blocked = True
                toks.append(pad if blocked else token_map[row[src]])
            per_layer = []
            for g in range(len(layout.layer_ids)):
                offset, cols = 0, []
                for size in range(2, n + 1):
                    acc = 0
                    for k in range(size):
                        acc ^= toks[k] * multipliers[g][k]
                    for prime in layout.primes[g][size - 2]:
                        cols.append(acc % prime + offset)
                        offset += prime
                per_layer.append(cols)
            rows.append(per_layer)
        out.append(rows)
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("with_mask", [False, True])
def test_hashes_match_plain_restatement(tokenizer, args, with_mask):
    layout = EngramLayout.from_args(args)
    token_map, _ = compressed_token_map(tokenizer)
    state = NgramHashState(args, layout, tokenizer)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, TINY.vocab_size, (2, 19), generator=gen)
    mask = None
    if with_mask:
        mask = torch.ones(2, 19, dtype=torch.bool)
        mask[0, 4:9] = False  # an image span
        mask[1, 0] = False
    got = state(ids, 0, mask)
    want = _plain_hashes(
        ids.tolist(),
        None if mask is None else mask.tolist(),
        token_map,
        args.engram_pad_id,
        layout,
        state.multipliers.tolist(),
    )
    assert got.shape == (2, 19, len(layout.layer_ids), layout.n_hash_cols)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert (got >= 0).all() and (got < torch.tensor(layout.table_rows()).view(1, 1, -1, 1)).all()


def test_incremental_decode_equals_one_pass(tokenizer, args):
    layout = EngramLayout.from_args(args)
    whole = NgramHashState(args, layout, tokenizer)
    steps = NgramHashState(args, layout, tokenizer)
    ids = torch.randint(0, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[:, 2:4] = False
    ref = whole(ids, 0, mask)
    parts = [steps(ids[:, :6], 0, mask[:, :6])]
    for t in range(6, 12):
        parts.append(steps(ids[:, t : t + 1], t, mask[:, t : t + 1]))
    torch.testing.assert_close(torch.cat(parts, dim=1), ref, atol=0, rtol=0)


def test_pad_before_start_uses_engram_pad_id(tokenizer, args):
    layout = EngramLayout.from_args(args)
    token_map, _ = compressed_token_map(tokenizer)
    state = NgramHashState(args, layout, tokenizer)
    # a sequence that starts with pad tokens hashes like one where look-back ran off the start
    a = state(torch.tensor([[args.engram_pad_id] * 3 + [11]]), 0)[:, -1]
    b = state(torch.tensor([[11]]), 0)[:, -1]
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    other = dataclasses.replace(args, engram_pad_id=5)
    c = NgramHashState(other, layout, tokenizer)(torch.tensor([[11]]), 0)[:, -1]
    assert token_map[5] != token_map[args.engram_pad_id]
    assert not torch.equal(b, c)


# Produced by the upstream reference (engram.py) for the released layout, with the token map
# i -> i % 99092 and position 3 masked; ours must reproduce them exactly.
UPSTREAM_LAYER1_EVERY5TH = [
    [5702652, 90144770, 164143652, 247482304, 322314652],
    [3712101, 92752161, 175442067, 241909229, 325585036],
    [4764445, 87662857, 164965967, 240384907, 335798535],
    [4299726, 88876378, 170979806, 250883315, 331826823],
    [5702652, 90144770, 164143652, 247482304, 322314652],
    [14747278, 92885735, 162378997, 253762704, 328962115],
    [4626109, 85122185, 172629208, 254759863, 328027857],
]
UPSTREAM_LAYER14_EVERY7TH = [
    [14361964, 120604547, 226280582, 349372619],
    [9451401, 117513643, 233102485, 351309825],
    [15838243, 126326313, 228261288, 345675745],
    [6788701, 120694389, 226234010, 350742427],
    [14361964, 120604547, 226280582, 349372619],
    [7250975, 124452582, 236155251, 344844321],
    [10630543, 123278050, 231611794, 344868072],
]
UPSTREAM_MULTIPLIERS = [
    [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    [67716810739261, 51510806800915, 30921347202721, 82619226485591],
]


def test_released_layout_matches_upstream_values():
    args = load_model_args(REAL_CONFIG).with_runtime(max_batch_size=1, max_seq_len=16)
    layout = EngramLayout.from_args(args)
    state = NgramHashState(args, layout, [i % 99092 for i in range(args.vocab_size)])
    assert state.multipliers.tolist() == UPSTREAM_MULTIPLIERS
    ids = torch.tensor([[0, 128000, 5, 99091, 99092, 129279, 77]])
    mask = torch.tensor([[True, True, True, False, True, True, True]])
    got = state(ids, 0, mask)
    assert got[0, :, 0, ::5].tolist() == UPSTREAM_LAYER1_EVERY5TH
    assert got[0, :, 1, ::7].tolist() == UPSTREAM_LAYER14_EVERY7TH


def test_accents_and_case_fold_onto_one_compressed_id():
    """A word tokenizer whose tokens differ only in accents and case: one compressed id for all of them (NFD then
    accents stripped, lowercased), numbered in order of first appearance."""
    from tokenizers import Tokenizer, models

    vocab = {"e": 0, "é": 1, "E": 2, "É": 3, "x": 4, "è": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="x"))
    assert compressed_token_map(tok) == ([0, 0, 0, 0, 1, 0], 2)


def test_a_token_map_list_must_hold_exactly_the_configured_compressed_ids():
    from dsv41_convert.engram_tokens import resolve_token_map

    assert resolve_token_map([0, 1, 2, 1], 3) == [0, 1, 2, 1]
    for short in ([0, 1, 1, 0], []):  # fewer ids than the hash tables are sized for
        with pytest.raises(ConfigError, match=r"engram_compressed_vocab_size is 3"):
            resolve_token_map(short, 3)
    with pytest.raises(ConfigError, match=r"holds 4 compressed ids, engram_compressed_vocab_size is 3"):
        resolve_token_map([0, 1, 2, 3], 3)


def test_bucket_primes_start_at_the_vocab_size_itself_when_it_is_prime():
    """The bucket counts are the primes >= engram_vocab_size (primes_above(vocab - 1)): a vocab size that is
    itself prime is the first bucket. Planted fault it catches: primes_above starting one past its first
    candidate (a prime vocab size skipped, every bucket range and table size shifted)."""
    from itertools import islice

    from dsv41_convert.engram_buckets import bucket_primes, primes_above

    def plain_primes(lo: int, count: int) -> list[int]:
        out, n = [], lo
        while len(out) < count:
            if n > 1 and all(n % d for d in range(2, int(n**0.5) + 1)):
                out.append(n)
            n += 1
        return out

    assert list(islice(primes_above(10), 3)) == [11, 13, 17]
    assert list(islice(primes_above(1), 4)) == [2, 3, 5, 7]
    # vocab 101 (prime): layer 0 gets 101, 103 (n = 2) and 107, 109 (n = 3); layer 1 the next four
    want = plain_primes(101, 8)
    assert want[0] == 101
    assert bucket_primes(2, 3, 2, 101) == ((tuple(want[0:2]), tuple(want[2:4])), (tuple(want[4:6]), tuple(want[6:8])))


def test_the_first_id_past_the_token_map_is_refused(tokenizer, args):
    """An id equal to the token map's length (one past its last entry) is a ConfigError naming the tokenizer,
    like any larger id; the map's last id hashes. Planted fault it catches: the check written `top >
    len(token_map)`, which let that id through to an IndexError in the lookup."""
    state = NgramHashState(args, EngramLayout.from_args(args), tokenizer)
    size = len(state.token_map)
    assert state(torch.tensor([[3, size - 1]]), 0).shape[:2] == (1, 2)
    with pytest.raises(ConfigError, match=rf"token id {size} reached the Engram hash"):
        state(torch.tensor([[3, size]]), 0)
