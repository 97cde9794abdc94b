import json

import pytest

from shardwise.cli import main


def run_cli(capsys, *args):
    code = main(["cost", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_collective_json(capsys):
    code, out, _ = run_cli(capsys, "--collective", "all_reduce", "--bytes", "1GiB", "--ranks", "8",
                           "--hardware", "h100", "--json")
    assert code == 0
    result = json.loads(out)
    assert set(result) == {"time_s", "algorithm", "protocol", "algbw_GBps", "busbw_GBps"}
    assert result["algbw_GBps"] == pytest.approx(2**30 / result["time_s"] / 1e9)
    assert result["busbw_GBps"] == pytest.approx(result["algbw_GBps"] * 2 * 7 / 8)


def test_collective_nodes_slow_it_down(capsys):
    times = []
    for nodes in ("1", "2"):
        _, out, _ = run_cli(capsys, "--collective", "all_gather", "--bytes", "64MiB", "--ranks", "8",
                            "--nodes", nodes, "--json")
        times.append(json.loads(out)["time_s"])
    assert times[0] < times[1]


def test_matmul_json_and_table(capsys):
    code, out, _ = run_cli(capsys, "--matmul", "8192x8192x8192", "--dtype", "bf16", "--json")
    result = json.loads(out)
    assert code == 0 and result["bound"] == "compute" and result["flops"] == 2 * 8192**3
    assert result["bytes"] == 3 * 8192 * 8192 * 2
    code, out, _ = run_cli(capsys, "--matmul", "1x4096x4096", "--hardware", "a100")
    assert code == 0 and "memory" in out and "a100" in out


def test_human_collective_table(capsys):
    code, out, _ = run_cli(capsys, "--collective", "reduce_scatter", "--bytes", "8KiB", "--ranks", "4")
    assert code == 0 and "reduce_scatter" in out and "bus bandwidth" in out


@pytest.mark.parametrize("args, words", [
    (["--collective", "all_reduce", "--hardware", "tpu"], ["h100", "a100", "cpu"]),
    (["--collective", "all_reduce", "--bytes", "1GX"], ["1GX"]),
    (["--collective", "all_reduce", "--bytes=-4"], ["negative"]),
    (["--collective", "all_reduce", "--ranks", "0"], ["ranks"]),
    (["--collective", "gather"], ["all_gather"]),
    (["--matmul", "8x8"], ["MxKxN"]),
    (["--collective", "all_reduce", "--ranks", "16", "--nodes", "1"], ["nodes"]),
])
def test_bad_input_is_one_sentence_exit_2(capsys, args, words):
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    for w in words:
        assert w in err


def test_bad_hardware_file_names_the_field(capsys, tmp_path):
    spec = tmp_path / "gpu.toml"
    spec.write_text('name = "x"\n[peak_flops]\nbf16 = 1e12\nfp16 = 1e12\nfp32 = 1e12\n')
    code, _, err = run_cli(capsys, "--collective", "all_reduce", "--hardware", str(spec))
    assert code == 2 and "mem_bw" in err
