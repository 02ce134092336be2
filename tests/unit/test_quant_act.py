"""Activation quantizers against a numpy reference written from upstream kernel.py's stated numerics."""

import math

import numpy as np
import pytest
import torch
from quant_reference import act_ref, fp4_act_ref

from dsv41_convert.quant import E2M1_VALUES, act_quant, fp4_act_quant, unpack_nibbles

# the independent reference: tests/quant_reference.py (float32 numpy arithmetic, value tables from the bit layouts)


def bf16_activations(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-12, 12, (*shape[:-1], 1), generator=gen))
    x = x.bfloat16()
    x.view(-1)[:32] = 0  # one all-zero group: the floor decides its scale
    x.view(-1)[40] = 1e4  # one group whose values mostly underflow
    return x


# --- act_quant --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block", "fmt", "sdt"),
    [(32, "ue8m0", torch.float8_e8m0fnu), (128, None, torch.float32), (32, None, torch.float32), (128, "ue8m0", None)],
)
def test_act_quant_matches_reference(block, fmt, sdt):
    x = bf16_activations(3, 5, 256, seed=block)
    args = (x, block, fmt) if sdt is None else (x, block, fmt, sdt)
    q, s = act_quant(*args)
    q_ref, s_ref = act_ref(x, block, fmt is not None)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == (sdt or torch.float8_e8m0fnu) and s.shape == (3, 5, 256 // block)
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), q_ref)
    np.testing.assert_array_equal(s.float().numpy(), s_ref)


def test_act_quant_defaults_are_the_models_settings():
    x = bf16_activations(4, 64)
    q, s = act_quant(x)
    q2, s2 = act_quant(x, 32, "ue8m0", torch.float8_e8m0fnu)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(
        s.view(torch.uint8), s2.view(torch.uint8)
    )


def test_act_quant_floor_and_clamp():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    x[1, 0], x[1, 1] = 448.0 * 4, -448.0 * 4  # amax 1792: scale 4, values at +-448
    q, s = act_quant(x)
    assert s.float().tolist() == [[2.0**-22], [4.0]]  # 1e-4 / 448 -> 2**-22
    assert q.float()[1, :2].tolist() == [448.0, -448.0]
    q, s = act_quant(x, 32, None, torch.float32)
    assert s[1].item() == np.float32(1792) * np.float32(1 / 448)


@pytest.mark.parametrize(("block", "fmt"), [(32, "ue8m0"), (128, None)])
def test_act_quant_inplace_writes_dequantized_values_back(block, fmt):
    x = bf16_activations(6, 256, seed=7)
    q, s = act_quant(x.clone(), block, fmt, torch.float32)
    want = (q.float().unflatten(-1, (-1, block)) * s.unsqueeze(-1)).flatten(-2).bfloat16()
    y = x.clone()
    out = act_quant(y, block, fmt, torch.float32, True)
    assert out is y
    assert torch.equal(y, want)


def test_act_quant_inf_saturates_like_upstream():
    x = torch.ones(1, 32, dtype=torch.bfloat16)
    x[0, 3] = math.inf
    q, s = act_quant(x)
    # scale inf (e8m0 NaN); finite / inf = 0; inf / inf = NaN
    assert math.isnan(s.float().item())
    assert q.float()[0, 0].item() == 0.0 and math.isnan(q.float()[0, 3].item())
    assert q.view(torch.uint8)[0, 3].item() == 0x7F  # the positive NaN, on every processor
    x[0, 4] = -1.0
    y = act_quant(x.clone(), inplace=True)
    assert y.isnan().all() and not (y.view(torch.int16) < 0).any()  # 0 * inf: positive NaNs only


def test_act_quant_rejects_ragged_rows():
    with pytest.raises(ValueError, match="not a multiple of block_size 32"):
        act_quant(torch.zeros(2, 48, dtype=torch.bfloat16))


# --- fp4_act_quant ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block", "sdt"),
    [(32, torch.float8_e8m0fnu), (16, torch.float8_e4m3fn), (16, torch.float8_e8m0fnu), (32, torch.float8_e4m3fn)],
)
def test_fp4_act_quant_matches_reference(block, sdt):
    x = bf16_activations(4, 3, 128, seed=block + 1)
    packed, s = fp4_act_quant(x, block, False, sdt)
    codes_ref, s_ref = fp4_act_ref(x, block, sdt == torch.float8_e4m3fn)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (4, 3, 64)
    assert s.dtype == sdt and s.shape == (4, 3, 128 // block)
    np.testing.assert_array_equal(unpack_nibbles(packed).numpy(), codes_ref)
    np.testing.assert_array_equal(s.float().numpy(), s_ref)


def test_fp4_act_quant_default_scale_dtype_follows_block():
    x = bf16_activations(2, 64, seed=3)
    assert fp4_act_quant(x, 32)[1].dtype == torch.float8_e8m0fnu
    assert fp4_act_quant(x, 16)[1].dtype == torch.float8_e4m3fn
    a = fp4_act_quant(x.clone(), 16, True)
    b = fp4_act_quant(x.clone(), 16, True, scale_dtype=torch.float8_e4m3fn)
    assert torch.equal(a, b)


@pytest.mark.parametrize(("block", "sdt"), [(32, torch.float8_e8m0fnu), (16, torch.float8_e4m3fn)])
def test_fp4_act_quant_inplace_writes_dequantized_values_back(block, sdt):
    x = bf16_activations(5, 128, seed=11)
    packed, s = fp4_act_quant(x.clone(), block, False, sdt)
    vals = E2M1_VALUES[unpack_nibbles(packed).long()]
    want = (vals.unflatten(-1, (-1, block)) * s.float().unsqueeze(-1)).flatten(-2).bfloat16()
    y = x.clone()
    assert fp4_act_quant(y, block, True, sdt) is y
    assert torch.equal(y, want)


def test_fp4_act_quant_floors():
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert fp4_act_quant(x, 32)[1].float().tolist() == [[2.0**-126, 2.0**-126]]
    assert fp4_act_quant(x, 16)[1].float().tolist() == [[2.0**-9] * 4]


def test_fp4_act_quant_e4m3_scale_is_rounded_amax_over_6():
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    x[0, 0] = 7.0  # 7/6 = 1.1667 -> e4m3 1.125; 7 / 1.125 = 6.22 clamps to 6
    packed, s = fp4_act_quant(x, 16)
    assert s.float().item() == 1.125
    assert unpack_nibbles(packed)[0, 0].item() == 7


def test_fp4_act_quant_rejects_unknown_scale_dtype():
    with pytest.raises(ValueError, match="scale_dtype"):
        fp4_act_quant(torch.zeros(1, 32, dtype=torch.bfloat16), 32, False, torch.float32)


def test_act_quant_nan_stays_in_its_group():
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    x[0, 40] = math.nan
    q, s = act_quant(x)
    assert s.float()[0, 0].item() == 2.0**-8 and math.isnan(s.float()[0, 1].item())
    assert not q.float()[0, :32].isnan().any() and q.float()[0, 32:].isnan().all()


# --- planted faults that the tests above let through (mutation audit) --------------------------------


def test_fp4_act_quant_e4m3_scale_is_the_quotient_amax_over_6_rounded():
    """scale = e4m3(amax / 6) (SPEC §4): amax one float32 ulp below 6 * 1.1875 (e4m3's midpoint between 1.125
    and 1.25) has a quotient just below the midpoint, so 1.125; amax * f32(1/6) lands on the midpoint
    itself and ties to 1.25. Float32 activations only: a bf16 amax never lies this close to 6 * midpoint."""
    amax = np.nextafter(np.float32(7.125), np.float32(0))
    assert amax / 6 < 1.1875  # the quotient, exactly: below the midpoint
    x = torch.zeros(2, 16)
    x[0, 3] = float(amax)
    x[1, 5] = -float(amax)
    _, s = fp4_act_quant(x, 16, False, torch.float8_e4m3fn)
    assert s.float()[:, 0].tolist() == [1.125, 1.125]


@pytest.mark.parametrize("block", [8, 32, 64, 128])
def test_fp4_act_quant_default_scale_dtype_is_e8m0_unless_block_16(block):
    """None means e4m3 scales for block 16 (the compressed KV latent) and e8m0 for every other block."""
    x = bf16_activations(2, 128, seed=block)
    _, s = fp4_act_quant(x, block)
    assert s.dtype == torch.float8_e8m0fnu
    np.testing.assert_array_equal(s.float().numpy(), fp4_act_ref(x, block, False)[1])
