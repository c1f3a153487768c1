import pytest
from pydantic import ValidationError

from gpuagent.protocol import JobResult, Recipe, VerifyResult


@pytest.mark.parametrize("weights", ["bf16", "fp16", "int8", "int4-g32", "int4-g128"])
def test_it_accepts_known_weight_formats(weights):
    assert Recipe(weights=weights, kv_cache_dtype="int8").weights == weights


@pytest.mark.parametrize(
    ("weights", "kv"), [("int4", "int8"), ("int4-g100", "int8"), ("int8", "int3")]
)
def test_it_refuses_unknown_formats(weights, kv):
    with pytest.raises(ValidationError):
        Recipe(weights=weights, kv_cache_dtype=kv)


@pytest.mark.parametrize("weights", ["w8a16", "int8", "w4a16-g64", "int4-g128"])
def test_it_takes_an_int8_head_beside_int_weights(weights):
    recipe = Recipe(weights=weights, kv_cache_dtype="int8", head="int8")

    assert recipe.head == "int8"
    assert recipe.model_dump(exclude_defaults=True)["head"] == "int8"
    # left out, the stored recipe (and its registration digest) is as before
    assert "head" not in Recipe(weights=weights, kv_cache_dtype="int8").model_dump(
        exclude_defaults=True
    )


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"head": "int4"}, "unknown head format 'int4'; expected one of int8"),
        ({"head": "Q8_0"}, "unknown head format 'Q8_0'"),
        ({"head": 8}, "valid string"),
        ({"weights": "bf16", "head": "int8"}, "needs quantized weights"),
        ({"weights": "fp16", "head": "int8"}, "needs quantized weights"),
        ({"weights": "fp8", "head": "int8"}, "for int weight formats"),
        ({"quantize_lm_head": True, "head": "int8"}, "give one"),
    ],
)
def test_it_refuses_a_head_it_cannot_write_naming_the_option(options, says):
    with pytest.raises(ValidationError) as refused:
        Recipe.model_validate(
            {"weights": "w4a16-g128", "kv_cache_dtype": "int8"} | options
        )

    [error] = refused.value.errors()
    assert error["loc"] == ("head",)
    assert says in error["msg"]


def test_it_refuses_extra_fields():
    with pytest.raises(ValidationError):
        VerifyResult(ok=True, manifest_digest="sha256:00", surprise=1)


def test_it_round_trips_a_job_result_through_json():
    result = JobResult(job_id=1, kind="verify", ok=False, error="changed: a.bin")

    assert JobResult.model_validate_json(result.model_dump_json()) == result


def test_it_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, gpuagent.protocol; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)

    assert out.stdout.strip() == "False", out.stderr


def _slice(**overrides):
    values = dict(
        name="english",
        num_tokens=10,
        mean_kld=0.001,
        p99_kld=0.01,
        max_kld=0.02,
        same_top1=0.99,
        ppl_candidate=10.1,
        ppl_reference=10.0,
        ppl_ratio=1.01,
        num_continuations=4,
        exact_match=0.75,
        flips=1,
    )
    return {**values, **overrides}


def test_it_refuses_a_same_top1_rate_above_one():
    from gpuagent.protocol import SliceQuality

    assert SliceQuality(**_slice()).same_top1 == 0.99
    with pytest.raises(ValidationError):
        SliceQuality(**_slice(same_top1=1.5))


def test_it_round_trips_a_quality_report_through_json():
    from gpuagent.protocol import QualityReport

    report = QualityReport(
        candidate="c", reference="r", method="in_process", seed=0, slices=[_slice()]
    )

    assert QualityReport.model_validate_json(report.model_dump_json()) == report


def test_it_round_trips_a_deploy_spec_and_refuses_a_bad_port_range():
    from gpuagent.protocol import BackendSpec, DeploySpec

    spec = DeploySpec(
        manifest_digest="sha256:00",
        recipe=Recipe(weights="int4-g128", kv_cache_dtype="fp8"),
        backend=BackendSpec(kind="external", preset="vllm", tensor_parallel_size=4),
    )

    assert DeploySpec.model_validate_json(spec.model_dump_json()) == spec
    # engine-only settings stay unset (None) through JSON, so an external backend
    # can tell they were not asked for
    assert (
        DeploySpec.model_validate_json(spec.model_dump_json()).backend.threads is None
    )
    with pytest.raises(ValidationError, match="port_range"):
        DeploySpec(manifest_digest="sha256:00", recipe=spec.recipe, port_range=(9, 8))
    with pytest.raises(ValidationError):
        BackendSpec(kind="kubernetes")
