"""The benchmark script runs end to end on a tiny folder and cleans up after
itself (its numbers are not asserted: benchmarks are not timed tests)."""

from gpuagent.benches.integrity import main


def test_it_prints_the_table_and_removes_its_folder(tmp_path, capsys):
    assert (
        main(
            [
                "--size-gb",
                "0.004",
                "--repeats",
                "1",
                "--dir",
                str(tmp_path),
                "--no-engine",
                "--hostile-mb",
                "2",
            ]
        )
        == 0
    )

    out = capsys.readouterr().out
    for row in (
        "model_signing verify sha256",
        "ours verify sha256",
        "ours verify blake3 (cold)",
        "ours vs model_signing, sha256:",
        "re-verify quick (digest cache)",
        "re-verify full / quick:",
        "gate, 2 MB header",
        "gate / safetensors library, header:",
        "verify, sparse 128 GiB planted",
    ):
        assert row in out
    assert list(tmp_path.iterdir()) == []
