"""python -m turnip.bench.repeatability: the same compiled step run twice from the compiled weights,
compared step by step, bitwise (bench/repeatability.py)."""

import json

import torch


def test_the_cpu_backend_repeats_bitwise_over_two_virtual_devices(tmp_path):
    from turnip.bench import repeatability

    out = tmp_path / "rep.json"
    assert repeatability.main(["--tiny", "--model", "gpt1.3b", "--device", "cpu", "--devices", "2", "--budget", "0.5",
                               "--steps", "2", "--runs", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [row["step"] for row in doc["steps"]] == [1, 2]
    for row in doc["steps"]:
        assert row["same"] and row["weights_differ"] == 0 and row["weights"] > 0
        assert len(row["losses"]) == 2 and row["losses"][0] == row["losses"][1]


def test_a_weight_that_differs_is_named_and_one_flipped_bit_is_seen():
    from turnip.bench.repeatability import compared, fingerprint

    x = torch.randn(1000)
    y = x.clone()
    y.view(torch.int32)[123] ^= 1  # the last bit of one value's mantissa
    assert fingerprint(x) != fingerprint(y) and fingerprint(x) == fingerprint(x.clone())
    half = x.to(torch.bfloat16)
    assert fingerprint(half) == fingerprint(half.clone())  # the 16-bit view

    def step(k, loss, weights):
        return {"step": k, "loss": loss, "weights": weights}

    a = [step(1, 2.0, {"w0": fingerprint(x), "w1": (1, 1.0)}), step(2, 1.5, {"w0": (5, 5.0), "w1": (1, 1.0)})]
    b = [step(1, 2.0, {"w0": fingerprint(x), "w1": (1, 1.0)}), step(2, 1.5, {"w0": (6, 5.0), "w1": (1, 1.0)})]
    first, second = compared([a, b])
    assert first["same"] and not second["same"]
    assert (second["weights_differ"], second["first_differ"]) == (1, ["w0"])


def test_eager_runs_the_same_way_for_its_own_spread(tmp_path):
    """--eager: eager PyTorch run twice from fresh copies of the model, compared as turnip's runs are; on the
    CPU eager repeats bitwise, and the weights compared are the model's."""
    from turnip.bench import repeatability

    out = tmp_path / "eager.json"
    assert repeatability.main(["--tiny", "--model", "gpt1.3b", "--device", "cpu", "--eager", "--steps", "2",
                               "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["system"] == "eager" and [row["step"] for row in doc["steps"]] == [1, 2]
    for row in doc["steps"]:
        assert row["same"] and row["weights"] > 0 and row["losses"][0] == row["losses"][1]
    assert doc["steps"][0]["losses"][0] != doc["steps"][1]["losses"][0]  # the weights moved between steps
