"""kernels.bench's MLA decode rows (a GPU bench): the rows' code runs on a CPU with
the kernel interpreted at tiny dimensions, and a CPU run leaves them out."""

from kernels import bench


def test_it_prints_a_torch_and_a_kernel_row_per_latent_dtype(capsys):
    table = bench.Table("cpu")

    bench.bench_mla_decode(table, "cpu", 2, 40, 1, (64, 16, 4), kernel_impl="triton")

    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [
        (op, dtype)
        for dtype in bench.MLA_KV_DTYPES
        for op in ("mla_torch", "mla_decode")
    ]
    assert all(r[-1] == "1.00" for r in rows if r[0] == "mla_torch")
    assert all(float(r[-3]) > 0 for r in rows)  # ms


def test_it_leaves_the_mla_rows_to_cuda(capsys):
    bench.main(["--mla-only", "--device", "cpu"])

    out = capsys.readouterr().out
    assert "run on CUDA only" in out and "mla_decode" not in out
