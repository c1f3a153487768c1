"""The compression bench's quality rows on the demo model: the candidate as the
engine runs it in the reference's arithmetic against the bars, and as information
the same candidate and the parent run in bf16 arithmetic."""

import torch
from safetensors.torch import save_file

from gpuagent.benches import DEMO_MODEL_DIR
from gpuagent.benches import compress as bench
from gpuagent.benches.compress import bf16_floor_rows, quality_rows
from gpuagent.compress.recipes import weight_scheme
from gpuagent.evaluate.evalsets import TEXT_SLICES
from gpuagent.evaluate.inprocess import EngineModel
from gpuagent.evaluate.regression import Settings
from kernels import int4_cpu
from tests.gpuagent.conftest import DEMO_MODEL

SETTINGS = Settings(slices=TEXT_SLICES, max_items=1, continuation_tokens=2)


def test_the_candidate_is_judged_and_its_bf16_arithmetic_is_information(
    compressed_demo,
):
    reference = EngineModel(DEMO_MODEL, "bf16", max_tokens=1024)

    rows = quality_rows(
        "w8a16 rtn", compressed_demo["w8a16"], reference, SETTINGS, True
    )

    judged = [r for r in rows if "bf16 arithmetic" not in r.name]
    in_bf16 = [r for r in rows if "bf16 arithmetic" in r.name]
    assert len(judged) == len(in_bf16) == 2 * (len(TEXT_SLICES) + 1)  # + overall
    assert all(r.ok is not None and r.target for r in judged)
    assert all(r.ok is None and not r.target for r in in_bf16)
    # bf16 arithmetic (torch's CPU kernels, bf16 everywhere else) costs more
    judged_kld = [float(r.value) for r in judged if "KLD" in r.name]
    in_bf16_kld = [float(r.value) for r in in_bf16 if "KLD" in r.name]
    assert in_bf16_kld[-1] > judged_kld[-1], (judged_kld, in_bf16_kld)


def test_the_parent_in_bf16_weights_and_arithmetic_moves_the_logits_as_information():
    reference = EngineModel(DEMO_MODEL, "bf16", max_tokens=1024)

    rows = bf16_floor_rows(DEMO_MODEL, reference, SETTINGS)

    assert rows and all(r.ok is None for r in rows)
    klds = {
        label: [
            float(r.value)
            for r in rows
            if r.name.startswith(label + ":") and "KLD" in r.name
        ]
        for label in ("parent's weights in bf16", "parent in bf16 arithmetic")
    }
    for label, values in klds.items():
        assert len(values) == len(TEXT_SLICES) + 1, label  # + overall
        assert all(k > 0 for k in values), (label, values)  # bf16 is not free
    # rounding the stored weights once costs less than rounding every activation
    weights, arithmetic = klds.values()
    assert weights[-1] < arithmetic[-1], klds


def test_every_bench_recipe_is_one_compress_applies():
    labels = [label for label, _ in bench.RECIPES]
    assert len(set(labels)) == len(labels)
    for label, options in bench.RECIPES:
        scheme = weight_scheme({"kv_cache_dtype": "bf16", **options})
        assert scheme is not None, label
        assert label.split()[0].split("-g")[0] == scheme.name.split("-g")[0], label


def test_the_lossless_table_covers_the_demo_model_and_the_model_dir(tmp_path):
    folder = tmp_path / "other-model"
    folder.mkdir()
    weight = torch.randn(96, 80).to(torch.bfloat16)
    save_file({"layer.weight": weight}, folder / "model.safetensors")

    table, _ = bench.lossless_table(folder, quick=True)
    only_demo, _ = bench.lossless_table(DEMO_MODEL_DIR, quick=True)

    def models(text):
        return [line.split()[0] for line in text.splitlines()[2:-1]]

    assert models(table) == ["demo_model", "other-model"]
    assert models(only_demo) == ["demo_model"]


def test_decode_rows_time_each_format_and_the_int4_folder_without_its_kernel(
    compressed_demo, monkeypatch
):
    folders = {
        "w8a16 rtn": compressed_demo["w8a16"],
        "w4a16-g128 rtn": compressed_demo["w4a16-g128"],
    }
    fused_calls = []
    # the kernel's two entries: per call, and over weights prepared at load (the
    # engine's)
    for entry in ("int4_matmul", "int4_matmul_prepared"):
        kernel = getattr(int4_cpu, entry)
        monkeypatch.setattr(
            int4_cpu,
            entry,
            lambda *a, kernel=kernel: fused_calls.append(1) or kernel(*a),
        )
    runs = []  # (kernel on?, fused calls made) per timed generation
    timer = bench.engine_bench.time_engine

    def timed(*args, **kwargs):
        before = len(fused_calls)
        result = timer(*args, **kwargs)
        runs.append((int4_cpu.AVAILABLE, len(fused_calls) - before))
        return result

    monkeypatch.setattr(bench.engine_bench, "time_engine", timed)

    rows = bench.decode_rows(DEMO_MODEL, folders, max_tokens=4, repeats=1)

    labels = [r.name.split(": ", 1)[1] for r in rows]
    assert labels == [
        "parent",
        "w8a16 rtn",
        "w4a16-g128 rtn",
        "w4a16-g128 rtn, torch reference",
    ]
    assert all(r.ok is None and float(r.value.split()[0]) > 0 for r in rows)
    assert rows[0].value.endswith(" 1.00x")
    assert int4_cpu.AVAILABLE  # switched back on
    # two rounds of four runs: the int4 folder's kernel ran, and only there
    assert len(runs) == 8
    assert [calls > 0 for _, calls in runs] == [False, False, True, False] * 2
    assert [on for on, _ in runs] == [True, True, True, False] * 2
