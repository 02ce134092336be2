"""verify.provenance.config_differences: the fields by which CONVERTED's config is another model than the one a
reference ran."""

from dsv41_convert.verify.provenance import config_differences


def test_a_field_on_one_side_only_is_a_difference():
    ran = {"n_layers": 4, "norm_eps": 1e-6, "expert_dtype": "fp4", "dtype": "fp8"}
    assert config_differences(ran, ran | {"expert_dtype": "fp8", "dtype": "bf16"}) == []  # format fields
    assert config_differences(ran, ran | {"norm_eps": 1e-5}) == ["norm_eps 1e-06 -> 1e-05"]
    assert config_differences(ran, ran | {"swiglu_limit": 7.0}) == ["swiglu_limit None -> 7.0"]
    assert config_differences(ran | {"swiglu_limit": 7.0}, ran) == ["swiglu_limit 7.0 -> None"]
    assert config_differences({"window_size": (1, 2)}, {"window_size": [1, 2]}) == []  # as recorded in JSON
