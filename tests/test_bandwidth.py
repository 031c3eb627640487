"""Bandwidth model (SPEC §10): the formulas, their scaling, validation and the CLI."""
from __future__ import annotations

import json

import pytest

from infra.simulator.bandwidth import BandwidthConfig, bandwidth, ring_factor
from workers.cli import main

PAPER = BandwidthConfig(params=5e9, step_time_s=1.0, utilisation=0.9, sites=2)


def test_paper_setting_by_hand():
    out = bandwidth(PAPER)
    # DP: 5e9 bf16 values over the backward pass stretched to 1/0.9 s minus the 1/3 s forward
    assert out["dp_gbps"] == pytest.approx(5e9 * 16 / (1 / 0.9 - 1 / 3) / 1e9)
    # Decoupled: one of P=100 fragments per step, over a step of 1/0.9 s
    assert out["decoupled_bf16_gbps"] == pytest.approx(5e7 * 16 * 0.9 / 1e9)
    assert out["decoupled_bf16_gbps"] == pytest.approx(4 * out["decoupled_int4_gbps"])
    assert out["dp_gbps"] / out["decoupled_bf16_gbps"] > 100


def test_scaling_with_sites_fragments_overlap_and_utilisation():
    two, eight = bandwidth(PAPER), bandwidth(BandwidthConfig(5e9, 1.0, 0.9, 8))
    for key in two:
        assert eight[key] / two[key] == pytest.approx(ring_factor(8) / ring_factor(2)) == pytest.approx(1.75)
    fewer = bandwidth(BandwidthConfig(5e9, 1.0, 0.9, 2, fragments=50))
    assert fewer["decoupled_int4_gbps"] == pytest.approx(2 * two["decoupled_int4_gbps"])
    assert fewer["dp_gbps"] == two["dp_gbps"]
    # H = 4P: a fragment every 4 steps; tau = 2 < 4 gives it 2 steps, tau >= 4 the full 4
    sparse = [bandwidth(BandwidthConfig(5e9, 1.0, 0.9, 2, fragments=25, sync_every=100, overlap=t))
              for t in (1, 2, 4, 8)]
    rates = [b["decoupled_bf16_gbps"] for b in sparse]
    assert rates[0] == pytest.approx(2 * rates[1]) and rates[1] == pytest.approx(2 * rates[2])
    assert rates[2] == rates[3]
    lax = bandwidth(BandwidthConfig(5e9, 1.0, 0.5, 2))
    assert lax["dp_gbps"] < two["dp_gbps"] and lax["decoupled_int4_gbps"] < two["decoupled_int4_gbps"]


@pytest.mark.parametrize("kw, match", [
    (dict(params=0), "params"), (dict(utilisation=1.5), "utilisation"), (dict(sites=1), "sites"),
    (dict(fragments=100, sync_every=50), "sync_every"), (dict(overlap=0), "overlap"),
])
def test_validation_names_the_bad_value(kw, match):
    base = dict(params=5e9)
    base.update(kw)
    with pytest.raises(ValueError, match=match):
        BandwidthConfig(**base)


def test_cli_json_and_formula(capsys):
    assert main(["bandwidth", "--params", "5e9", "--step-time", "1", "--utilisation", "0.9", "--sites", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"dp_gbps", "decoupled_bf16_gbps", "decoupled_int4_gbps"}
    assert out["dp_gbps"] == pytest.approx(bandwidth(PAPER)["dp_gbps"])
    assert main(["bandwidth", "--params", "5B", "--sites", "8"]) == 0
    text = capsys.readouterr().out
    assert "dp_bps" in text and "decoupled_bps" in text and "Decoupled DiLoCo int4" in text
    assert main(["bandwidth", "--params", "5e9", "--utilisation", "0"]) == 2
    assert "utilisation" in capsys.readouterr().err
