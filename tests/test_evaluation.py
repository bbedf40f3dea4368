import math

import torch

import kvpolicy
from kvpolicy.evaluation import decode_perplexity
from kvpolicy.testing import tiny_model


def _segments(n=3, length=40):
    return torch.randint(3, 128, (n, length), generator=torch.Generator().manual_seed(0))


def test_decode_perplexity_matches_a_full_forward_at_full_precision():
    model = tiny_model("llama")
    segs = _segments()
    got = decode_perplexity(model, segs, 24, 16, progress=False)
    with torch.no_grad():
        logits = model(segs).logits[:, 23:39]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), segs[:, 24:40].reshape(-1), reduction="sum"
    )
    assert got.tokens == 48
    assert math.isclose(got.perplexity, math.exp(nll.item() / 48), rel_tol=1e-4)


def test_batched_equals_one_segment_at_a_time_through_a_compiled_cache():
    model = kvpolicy.compile_model(
        tiny_model("qwen2"), policy={"defaults": {"bits": 2, "group_size": 16, "residual": 8,
                                                  "sinks": 2}}
    )
    segs = _segments()
    a = decode_perplexity(model, segs, 24, 16, progress=False)
    b = decode_perplexity(model, segs, 24, 16, progress=False, batched=True)
    assert a.cache.layers[0].packed.n_packed > 0
    assert math.isclose(a.perplexity, b.perplexity, rel_tol=1e-4)


def test_quick_eval_writes_a_report_with_every_ablation(tmp_path):
    import json

    report = kvpolicy.evaluate(quick=True, peers=False, progress=False, out=tmp_path)
    names = [r.name for r in report.runs]
    assert names[:2] == ["full precision (DynamicCache)", "derived policy"]
    # the fp32 model's DynamicCache holds twice the fp16 bytes
    assert report.runs[0].cache_bytes == 2 * report.runs[0].fp16_bytes
    groups = {r.group for r in report.runs}
    assert {"axes", "rope", "residual", "sinks", "bits"} <= groups
    assert len([r for r in report.runs if r.group == "axes"]) == 3
    # The quick policy packs groups: 2-bit runs really are quantized, and the byte counts
    # move the way the settings say (a random tiny model says nothing about quality).
    derived = report.run("derived policy")
    assert derived.cache_bytes < derived.fp16_bytes
    assert report.run("residual 0").cache_bytes < derived.cache_bytes
    assert report.run("2 bits").cache_bytes < report.run("3 bits").cache_bytes
    assert report.run("3 bits").cache_bytes < report.run("4 bits").cache_bytes
    assert report.run("2 bits").perplexity == derived.perplexity  # same settings, reused
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["runs"][1]["name"] == "derived policy"
    assert "| derived policy |" in (tmp_path / "report.md").read_text()
    for png in ("perplexity_vs_bits", "key_channel_magnitude", "error_by_axis_and_metric"):
        assert (tmp_path / f"{png}.png").stat().st_size > 0
    # Where consumed: measured for the derived axes and their flips, ranked vs perplexity.
    assert "K-channel-pre/V-token" in report.consumed["policies"]
    assert report.consumed["perplexity_order"][0] in report.consumed["policies"]
    assert len(report.consumed["key_channel_absmax"]) == 2  # layers
    rows = report.consumed["per_layer"]["K-channel-pre/V-token"]
    assert [(r["layer"], r["tensor"]) for r in rows][:2] == [(0, "key"), (0, "value")]
    assert "## Where the tensors are consumed" in (tmp_path / "report.md").read_text()
