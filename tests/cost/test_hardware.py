import dataclasses

import pytest
import torch

from shardwise.cost.hardware import Hardware, builtin_names, get_hardware
from shardwise.cost.units import format_bytes, parse_bytes
from shardwise.errors import UserError

GOOD_SPEC = """
name = "mygpu"
[peak_flops]
bf16 = 100e12
fp16 = 100e12
fp32 = 10e12
[memory]
mem_bw = 1e12
mem_capacity = 40e9
mem_eff = 0.5
[compute]
compute_eff = 0.5
launch_s = 5e-6
[network]
gpus_per_node = 4
intra_bw = 100e9
intra_eff = 0.8
intra_latency_s = 3e-6
inter_bw = 25e9
inter_eff = 0.8
inter_latency_s = 6e-6
nvls = false
"""


def test_builtin_specs_load_and_are_hashable():
    assert set(builtin_names()) >= {"h100", "h200", "a100", "b200", "cpu"}
    for name in ("h100", "H200", "a100", "b200", "cpu"):
        hw = get_hardware(name)
        assert hw.name == name.lower()
        assert {"bf16", "fp16", "fp32"} <= set(hw.peak_flops)
        assert hash(hw) == hash(get_hardware(name))
    assert get_hardware("h100").peak_flops["bf16"] == 989e12  # figures.md
    assert get_hardware("h200").mem_bw > get_hardware("h100").mem_bw
    assert get_hardware("h100").nvls and not get_hardware("a100").nvls


def test_h100_96gb_is_torchtitans_part():
    """figures.md: torchtitan's H100s have 96 GB of HBM2e at 2.4 TB/s, a 500 W limit (a lower
    sustained GEMM rate than the 700 W SXM part), 8 per host, 400 Gb/s RDMA per GPU."""
    hw, sxm = get_hardware("h100-96gb"), get_hardware("h100")
    assert (hw.mem_capacity, hw.mem_bw, hw.gpus_per_node, hw.inter_bw) == (96e9, 2.4e12, 8, 50e9)
    assert hw.compute_eff < sxm.compute_eff and hw.mem_bw < sxm.mem_bw


def test_times_follow_the_spec():
    hw = get_hardware("h100")
    assert hw.memory_time(3.35e12 * 0.9) == pytest.approx(1.0)
    assert hw.flops_time(989e12 * hw.compute_eff, torch.bfloat16) == pytest.approx(1.0)
    assert hw.flops_time(10**12, "fp32") > hw.flops_time(10**12, "bf16")
    # integer and fp64 work fall back to the fp32 rate
    assert hw.flops_time(10**12, torch.int64) == hw.flops_time(10**12, torch.float32)
    with pytest.raises(UserError, match="dtype"):
        hw.flops_time(1, "int3")


def test_user_file(tmp_path):
    path = tmp_path / "mygpu.toml"
    path.write_text(GOOD_SPEC)
    hw = get_hardware(str(path))
    assert isinstance(hw, Hardware) and hw.name == "mygpu" and hw.gpus_per_node == 4
    assert get_hardware(hw) is hw


def test_attention_runs_at_its_own_efficiency_where_a_spec_gives_one(tmp_path):
    path = tmp_path / "mygpu.toml"
    path.write_text(GOOD_SPEC)
    assert get_hardware(str(path)).attention_slowdown(torch.bfloat16) == 1.0  # none given: a GEMM's rate
    path.write_text(GOOD_SPEC.replace("compute_eff = 0.5", "compute_eff = 0.5\nattention_eff = 0.2"))
    hw = get_hardware(str(path))
    assert hw.attention_slowdown(torch.bfloat16) == hw.attention_slowdown(torch.float16) == pytest.approx(2.5)
    assert hw.attention_slowdown(torch.float32) == 1.0  # no flash attention in fp32
    assert get_hardware("h100").attention_slowdown(torch.bfloat16) > 1  # FA2 measured on a lent H100


@pytest.mark.parametrize("edit, field", [
    (lambda s: s.replace("mem_bw = 1e12\n", ""), "mem_bw"),
    (lambda s: s.replace("launch_s = 5e-6", "launch_s = 0"), "launch_s"),
    (lambda s: s.replace("inter_bw = 25e9", "inter_bw = -1"), "inter_bw"),
    (lambda s: s.replace("fp16 = 100e12\n", ""), "peak_flops.fp16"),
    (lambda s: s.replace("gpus_per_node = 4", "gpus_per_node = 0"), "gpus_per_node"),
    (lambda s: s.replace("compute_eff = 0.5", "compute_eff = 1.5"), "compute_eff"),
    (lambda s: s.replace("compute_eff = 0.5", "compute_eff = 0.5\nattention_eff = 2"), "attention_eff"),
    (lambda s: s.replace("compute_eff = 0.5", "compute_eff = 0.5\nattention_eff = 0"), "attention_eff"),
    (lambda s: s.replace("nvls = false", "nvls = true"), "nvls_bw"),
])
def test_bad_user_file_names_the_field(tmp_path, edit, field):
    path = tmp_path / "bad.toml"
    path.write_text(edit(GOOD_SPEC))
    with pytest.raises(UserError, match=field.replace(".", r"\.")):
        get_hardware(str(path))


def test_unknown_name_and_missing_file(tmp_path):
    with pytest.raises(UserError, match="h100, h100-96gb, h200") as e:
        get_hardware("tpu-v5")
    assert "a100" in str(e.value) and "cpu" in str(e.value)
    with pytest.raises(UserError, match="does not exist"):
        get_hardware(str(tmp_path / "nope.toml"))
    broken = tmp_path / "broken.toml"
    broken.write_text("name = ")
    with pytest.raises(UserError, match="not valid TOML"):
        get_hardware(str(broken))


def test_overrides_change_the_hash():
    hw = get_hardware("h100")
    slower = dataclasses.replace(hw, inter_bw=hw.inter_bw / 2)
    assert slower != hw and hash(slower) != hash(hw)


@pytest.mark.parametrize("text, n", [("512", 512), ("8KiB", 8192), ("1GiB", 2**30), ("1GB", 10**9),
                                     ("1.5MB", 1_500_000), ("0", 0), (" 2 MiB ", 2 * 2**20), ("4k", 4096)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["1GX", "GiB", "", "-1", "1.5", "1e9", "12 34"])
def test_parse_bytes_rejects(text):
    with pytest.raises(UserError):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(2**30) == "1 GiB" and format_bytes(512) == "512 B"
