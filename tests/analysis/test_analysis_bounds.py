"""EP decode bound, MTP speed-up, local decode, training cost, and hardware presets/files."""

import json

import pytest

from dsv3.analysis import bounds
from dsv3.analysis.arch import load_architecture
from dsv3.analysis.hardware import HARDWARE_PRESETS, load_hardware_file, resolve_hardware
from dsv3.analysis.params import count_params
from dsv3.errors import DSV3Error


def test_ep_bound_at_50_gbs_reproduces_the_paper():
    b = bounds.ep_decode_bound(50)
    assert b.comm_time_s * 1e6 == pytest.approx(120.96, rel=1e-12)
    assert b.layer_time_s * 1e6 == pytest.approx(241.92, rel=1e-12)
    assert round(b.tpot_s * 1e3, 2) == 14.76
    assert int(b.tps) == 67


def test_ep_bound_at_900_gbs_reproduces_nvl72():
    b = bounds.ep_decode_bound(900)
    assert b.comm_time_s * 1e6 == pytest.approx(6.72, rel=1e-12)
    assert round(b.tpot_s * 1e3, 2) == 0.82
    assert round(b.tps, -2) == 1200


def test_ep_bound_from_a_model_uses_its_hidden_size_and_experts():
    v3 = load_architecture("deepseek-v3")
    b = bounds.ep_decode_bound_for(v3, 50)
    assert b.comm_time_s == pytest.approx(3 * 32 * 9 * 7168 / 50e9)
    assert b.tpot_s * 1e3 == pytest.approx(15.11, abs=0.01)
    with pytest.raises(DSV3Error, match="no routed experts"):
        bounds.ep_decode_bound_for(load_architecture("qwen2.5-72b"), 50)
    with pytest.raises(DSV3Error, match="positive"):
        bounds.ep_decode_bound(0)


def test_mtp_speedup():
    assert bounds.mtp_speedup(0.8) == pytest.approx(1.8)
    assert bounds.mtp_speedup(0.9) == pytest.approx(1.9)
    assert bounds.mtp_speedup(0.85, step_overhead=1.85 / 1.8 - 1) == pytest.approx(1.8)  # ~2.8% overhead
    assert bounds.mtp_speedup(0.5, depth=2) == pytest.approx(1.75)
    with pytest.raises(DSV3Error):
        bounds.mtp_speedup(1.5)


def test_local_decode_v2_on_ai_soc_is_near_20_and_dense_70b_single_digit():
    v2, dense = load_architecture("deepseek-v2"), load_architecture("qwen2.5-72b")
    m4_pro = HARDWARE_PRESETS["m4-pro"]
    v2_tps = bounds.local_decode(v2, count_params(v2), m4_pro, "4bit", context=0)
    dense_tps = bounds.local_decode(dense, count_params(dense), m4_pro, "4bit", context=0)
    assert 20 <= v2_tps.tps <= 30  # docs/references.md#local-deployment's estimate: ~26 TPS at 273 GB/s
    assert dense_tps.tps < 10
    assert not v2_tps.fits and v2_tps.devices_needed == 2  # 118 GB of 4-bit weights in 64 GB
    assert bounds.local_decode(v2, count_params(v2), HARDWARE_PRESETS["m4-max"], "4bit", context=0).fits


def test_local_decode_reads_the_kv_cache_too():
    v3 = load_architecture("deepseek-v3")
    c, hw = count_params(v3), HARDWARE_PRESETS["h200"]
    short, long = bounds.local_decode(v3, c, hw, context=0), bounds.local_decode(v3, c, hw, context=100_000)
    assert long.bytes_per_token - short.bytes_per_token == pytest.approx(70_272 * 100_000)


def test_training_cost_reproduces_2_664m_gpu_hours():
    h800 = HARDWARE_PRESETS["h800"]
    mfu = bounds.implied_mfu(2.664e6, 14.8e12, 250e9, h800.bf16_tflops)
    assert mfu == pytest.approx(0.3894, abs=0.001)  # ISCA Table 4: causal MFU 38.94%
    cost = bounds.training_cost(14.8e12, 250e9, h800.bf16_tflops, mfu, usd_per_gpu_hour=2.0)
    assert cost.gpu_hours == pytest.approx(2.664e6)
    assert cost.usd == pytest.approx(5.328e6)
    at_table4 = bounds.training_cost(14.8e12, 250e9, h800.bf16_tflops, 0.3894)
    assert at_table4.gpu_hours == pytest.approx(2.664e6, rel=0.003)
    with pytest.raises(DSV3Error, match="MFU"):
        bounds.training_cost(1e12, 1e9, 989, 0)


def test_presets_have_sources_and_unverified_figures_say_so():
    expected = {"h800", "h100", "h200", "b200", "gb200-nvl72", "rtx4090-ddr5-server", "m4-pro", "m4-max",
                "ryzen-ai-max-395", "dgx-spark"}
    assert expected <= set(HARDWARE_PRESETS)
    assert all(h.source for h in HARDWARE_PRESETS.values())
    for name in ("m4-pro", "ryzen-ai-max-395", "dgx-spark"):
        assert "not verified" in HARDWARE_PRESETS[name].source
    assert HARDWARE_PRESETS["gb200-nvl72"].scale_up_gbs == 900 and HARDWARE_PRESETS["h800"].scale_out_gbs == 50


def test_user_hardware_from_yaml_and_json(tmp_path):
    y = tmp_path / "hw.yaml"
    y.write_text("hardware:\n  - name: mybox\n    memory_gb: 256\n    memory_bandwidth_gbs: 400\n"
                 "    bf16_tflops: 100\n    scale_out_gbs: 25\n")
    j = tmp_path / "hw.json"
    j.write_text(json.dumps({"name": "j", "memory_gb": 8, "memory_bandwidth_gbs": 100, "bf16_tflops": 10}))
    devices = resolve_hardware([str(y), "h800", str(j)])
    assert [d.name for d in devices] == ["mybox", "h800", "j"]
    assert devices[0].scale_out_gbs == 25 and devices[0].source == "user file"


@pytest.mark.parametrize("text, message", [
    ("name: x\nmemory_gb: 1\nmemory_bandwidth_gbs: 1\nbf16_tflop: 1\n", "unknown hardware keys"),
    ("name: x\nmemory_gb: 1\nmemory_bandwidth_gbs: 1\n", "lacks"),
    ("name: x\nmemory_gb: -1\nmemory_bandwidth_gbs: 1\nbf16_tflops: 1\n", "non-negative"),
    ("name: [unclosed\n", "cannot be parsed"),
    ("[]\n", "no hardware"),
])
def test_bad_hardware_files_fail_clearly(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(DSV3Error, match=message):
        load_hardware_file(path)


def test_unknown_hardware_name():
    with pytest.raises(DSV3Error, match="unknown hardware"):
        resolve_hardware(["tpu-v9"])
