import json
import math

import pytest
import torch

import kvpolicy
from kvpolicy.calibrate import budget
from kvpolicy.evaluation import (
    FRONTIER_BUDGETS,
    RunResult,
    decode_perplexity,
    frontier_dominance,
    peer_rows,
    peers,
    run,
)
from kvpolicy.evaluation.stored import QUICK_STORED_GROUPS, STORED_BUDGETS, WHOLE_BUDGETS
from kvpolicy.policies import load_spec
from kvpolicy.policies.footprint import CONTEXT
from kvpolicy.zoo.tiny import tiny_model


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


def test_quick_eval_writes_a_report_with_every_ablation(tmp_path, monkeypatch):
    calibrations = []
    calibrate = budget.calibrate
    monkeypatch.setattr(budget, "calibrate",
                        lambda *a, **kw: calibrations.append(1) or calibrate(*a, **kw))
    report = kvpolicy.evaluate(quick=True, peers=False, progress=False, out=tmp_path)
    names = [r.name for r in report.runs]
    assert names[:2] == ["full precision (DynamicCache)", "derived policy"]
    # the fp32 model's DynamicCache holds twice the fp16 bytes
    assert report.runs[0].cache_bytes == 2 * report.runs[0].fp16_bytes
    groups = {r.group for r in report.runs}
    assert {"axes", "rope", "residual", "sinks", "bits", "split"} <= groups
    split = {r.name: r for r in report.runs if r.group == "split"}
    assert sorted(split) == ["keys 2 / values 3", "keys 3 / values 2"]
    assert all(r.avg_bits == 2.5 for r in split.values())  # both halves of 2.5 bits
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
    for png in ("perplexity_vs_bits", "key_channel_magnitude", "error_by_axis_and_metric",
                "frontier"):
        assert (tmp_path / f"{png}.png").stat().st_size > 0
    # Where consumed: measured for the derived axes and their flips, ranked vs perplexity.
    assert "K-channel-pre/V-token" in report.consumed["policies"]
    assert report.consumed["perplexity_order"][0] in report.consumed["policies"]
    assert len(report.consumed["key_channel_absmax"]) == 2  # layers
    rows = report.consumed["per_layer"]["K-channel-pre/V-token"]
    assert [(r["layer"], r["tensor"]) for r in rows][:2] == [(0, "key"), (0, "value")]
    assert "## Where the tensors are consumed" in (tmp_path / "report.md").read_text()
    # Frontier: budget runs allocated from one calibration, within their budgets; one more
    # calibration in the relative currency for the middle budget, one for the stored-bits
    # budgets and one for the whole-cache budgets.
    assert len(calibrations) == 4
    currency = [r for r in report.runs if r.group == "currency"]
    assert [r.name for r in currency] == ["budget 2.5, relative-error currency"]
    assert currency[0].avg_bits <= 2.5 and currency[0].settings["budget"] == 2.5
    assert report.frontier["calibration"]["tokens"] == 512
    assert report.frontier["calibration"]["seconds"] > 0
    budgets = [r for r in report.runs if r.group == "budget"]
    assert [r.name for r in budgets] == ["budget 2.25", "budget 2.5", "budget 3"]
    elems = report.run("2 bits").fp16_bytes_per_token // 2  # 2 layers x 2 heads x (32 + 32)
    assert elems == 256
    for r, b in zip(budgets, FRONTIER_BUDGETS, strict=True):
        assert r.settings["budget"] == b  # allocated, 3.0 included, not uniform widths
        widths = r.settings["key_bits"] + r.settings["value_bits"]
        assert len(widths) == 4 and set(widths) <= {1, 2, 3, 4, 8}
        assert r.avg_bits == sum(widths) / 4 <= b
        # codes + an fp16 scale and zero per group of 16, per the widths allocated, and the
        # same figure measured on the cache the run held
        assert r.bytes_per_token == sum(elems / 4 * (w / 8 + 4 / 16) for w in widths)
        assert r.measured_bytes_per_token == pytest.approx(r.bytes_per_token, rel=1e-9)
        assert r.fp16_bytes_per_token == 2 * elems
    for b in (2, 3, 4):  # the uniform points are the bits ablations, steady state
        assert report.run(f"{b} bits").bytes_per_token == elems * (b / 8 + 4 / 16)
    # Stored-bits budgets: widths and groups (of QUICK_STORED_GROUPS: 80 tokens pack
    # none of 64 or 128) and metadata widths allocated from one calibration; codes + a
    # scale and zero per group within the budget, by the policy's count and on the cache
    # each run held.
    stored = [r for r in report.runs if r.group == "stored"]
    assert [r.name for r in stored] == ["stored budget 2.5", "stored budget 3"]
    assert report.frontier["stored"]["budgets"] == list(STORED_BUDGETS) == [2.5, 3.0]
    assert report.frontier["stored"]["groups"] == list(QUICK_STORED_GROUPS)
    for r, b in zip(stored, STORED_BUDGETS, strict=True):
        assert r.settings["budget"] == b and r.settings["budget_unit"] == "stored"
        widths = r.settings["key_bits"] + r.settings["value_bits"]
        groups = r.settings["key_groups"] + r.settings["value_groups"]
        assert set(groups) <= set(QUICK_STORED_GROUPS) and set(widths) <= {1, 2, 3, 4, 8}
        assert r.avg_bits == sum(widths) / 4
        metas = r.settings["key_meta_bits"] + r.settings["value_meta_bits"]
        assert set(metas) <= {8, 16}  # meta_bits: auto, the default, chooses per tensor
        assert r.avg_stored_bits == pytest.approx(sum(
            w + 2 * m / g for w, g, m in zip(widths, groups, metas, strict=True)) / 4,
            rel=1e-12)
        assert r.avg_stored_bits <= b + 1e-9
        assert r.bytes_per_token == pytest.approx(elems * r.avg_stored_bits / 8, rel=1e-12)
        assert r.measured_bytes_per_token == pytest.approx(r.bytes_per_token, rel=1e-9)
        assert r.measured_bytes_per_token * 8 / elems <= b + 1e-9
        assert r.kl is not None and r.top1_agreement is not None and r.ratio > 0
    assert stored[1].avg_stored_bits > stored[0].avg_stored_bits  # 3 buys more than 2.5
    # Whole-cache budgets (WHOLE_BUDGETS at CONTEXT tokens): 2.0 fits the tiny model's
    # codes beside its sinks, residual and incomplete chunk in full precision, 1.5 does not
    # (a note says so, no row); every kvpolicy run carries its whole-cache bits.
    whole = [r for r in report.runs if r.group == "whole"]
    assert [r.name for r in whole] == ["whole-cache budget 2"]
    assert report.frontier["whole"]["budgets"] == list(WHOLE_BUDGETS) == [2.0, 1.5]
    assert whole[0].settings["budget"] == 2.0
    assert whole[0].settings["defaults"]["budget_context"] == CONTEXT
    assert 0.9 * 2.0 < whole[0].whole_bits <= 2.0 + 1e-9
    assert whole[0].avg_stored_bits < whole[0].whole_bits  # the windows are counted
    assert any(n.startswith("whole-cache budget 1.5: refused (the budget holds")
               for n in report.notes)
    for r in budgets + stored + [derived]:
        assert r.avg_stored_bits < r.whole_bits < r.avg_stored_bits + 0.2
    assert report.runs[0].whole_bits is None  # fp is not on the frontier
    assert set(report.frontier["dominated_by"]) == {r.name for r in budgets + stored + whole}
    budget_json = [r for r in data["runs"] if r["group"] == "budget"]
    assert budget_json[1]["settings"]["value_bits"] == budgets[1].settings["value_bits"]
    assert budget_json[1]["bytes_per_token"] == budgets[1].bytes_per_token
    md = (tmp_path / "report.md").read_text()
    # KL and top-1 agreement with fp on the same steps: 0 and 1 for fp itself, and the
    # quantized runs differ from it.
    fp_row = report.runs[0]
    assert (fp_row.kl, fp_row.top1_agreement) == (0.0, 1.0)
    assert derived.kl > 0 and 0 <= derived.top1_agreement <= 1
    assert all(r.kl is not None and r.top1_agreement is not None for r in report.runs)
    assert data["runs"][1]["kl"] == derived.kl
    # Retrieval: fp, the derived policy, its groups-of-16 ablation, budget 2.5 and the
    # stored-bits budgets (quanto needs peers), each over the second copy after the
    # prefill: 2 passages x (48 - 16). The quick policy writes fp16 metadata in groups of
    # 16 already, so its fp16-metadata ablation is the derived run and scores nothing more.
    # "one width per key" runs apart from the derived policy, which on this model (no
    # tokenizer, no calibration text) keeps one width too.
    assert [r.name for r in report.retrieval] == [
        "full precision (DynamicCache)", "derived policy", "groups of 16 (8-bit metadata)",
        "one width per key", "budget 2.5", "stored budget 2.5", "stored budget 3",
        "whole-cache budget 2"]
    assert report.retrieval_setup == {"passages": 2, "length": 48, "prefix": 16, "steps": 32,
                                      "source": "random"}
    assert all(r.tokens == 64 and 0 <= r.top1 <= 1 for r in report.retrieval)
    assert report.retrieval[0].agreement == 1.0
    assert "## Retrieval: a passage, then the same passage again" in md
    assert data["retrieval"][1]["name"] == "derived policy"
    assert "## Frontier: perplexity vs compression" in md
    mid = budgets[1]
    assert f"| budget 2.5 | {mid.avg_bits:.3f} | {mid.bytes_per_token:.1f} |" in md
    assert "### Widths allocated by budget 2.5" in md
    for r in stored + whole:  # in the frontier table, with its stored bits, KL and top-1
        assert (f"| {r.name} | {r.avg_bits:.3f} | {r.bytes_per_token:.1f} | "
                f"{r.avg_stored_bits:.3f} | {r.whole_bits:.3f} |") in md
        assert f"{r.kl:.3g} | {r.top1_agreement:.3f} |" in md
    assert "One more calibration for the stored-bits budgets" in md
    assert [r["name"] for r in data["runs"] if r["group"] == "stored"] == [r.name for r in stored]
    assert "One more calibration for the whole-cache budgets (at 4,096 tokens)" in md
    assert data["runs"][-1]["whole_bits"] == whole[0].whole_bits
    assert md.count("not dominated") + md.count("dominated by") == 6


def _point(name, group, bytes_per_token, perplexity):
    return RunResult(name, group, perplexity, perplexity / 10, None, None, None, 1.0,
                     bytes_per_token=bytes_per_token, fp16_bytes_per_token=512)


def test_frontier_dominance_needs_both_fewer_bytes_and_lower_perplexity():
    runs = [
        _point("2 bits", "bits", 128.0, 12.0),
        _point("3 bits", "bits", 160.0, 11.0),
        _point("4 bits", "bits", 192.0, 10.0),
        _point("budget 2.5", "budget", 144.0, 11.5),  # 2 bits smaller but worse: not dominated
        _point("budget 3", "budget", 160.0, 11.2),  # 3 bits: same bytes, lower perplexity
        _point("budget 2.25", "budget", 136.0, 12.5),  # 2 bits: smaller and better
        _point("quanto", "peer", 100.0, 9.0),  # peers never dominate
    ]
    assert frontier_dominance(runs) == {
        "budget 2.5": [], "budget 3": ["3 bits"], "budget 2.25": ["2 bits"],
    }


@pytest.mark.parametrize("axes", [(0, 0), (-1, -1)])
def test_quanto_steady_state_bytes_match_what_its_cache_holds(axes):
    model = tiny_model("llama")  # fp32: quanto keeps its scales and shifts in fp32
    per_token = run._elements_per_token(model)
    res = decode_perplexity(
        model, _segments(2, 45), 40, 5, progress=False, batched=True,
        make_cache=lambda: peers.peer_cache(model, "quanto", bits=2, group_size=16,
                                            residual=8, axis_key=axes[0], axis_value=axes[1]),
    )
    held = peers.cache_bytes(res.cache)
    assert held.packed > 0 and held.residual > 0  # quantized tokens and a window
    steady = peer_rows.quanto_bytes_per_token(per_token, 2, 16, model)
    assert steady == per_token * (2 / 8 + 2 * 4 / 16)
    assert peer_rows.quanto_measured_bytes_per_token(held, per_token, model) == steady
    # Over the whole cache at CONTEXT tokens: the body at the steady rate, the 8-token
    # window in fp32, the same count kvpolicy's whole-cache figure makes.
    whole = peer_rows.quanto_whole_bits(steady, per_token, 8, model)
    assert whole == pytest.approx(
        (steady * (CONTEXT - 8) + per_token * 4 * 8) * 8 / (per_token * CONTEXT), rel=1e-12)
    assert steady * 8 / per_token < whole
    assert peer_rows.quanto_whole_bits(None, per_token, 8, model) is None


def test_text_file_needs_a_model_with_a_tokenizer(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("some text")
    with pytest.raises(kvpolicy.KVPolicyError, match="--text needs a model with a tokenizer"):
        run.evaluate("tiny-llama", text_file=path)
    with pytest.raises(kvpolicy.KVPolicyError, match="--text needs a model with a tokenizer"):
        run.evaluate(quick=True, text_file=path)


def test_retrieval_passages_are_counted_apart_from_the_segments():
    _, segs, _, passages = run._loader("tiny-llama", 1, 64, 16, 48, passages=3)
    assert segs.shape == (1, 80) and passages.shape == (3, 48)
    _, _, _, default = run._loader("tiny-llama", 2, 64, 16, 48)
    assert default.shape == (2, 48)  # as many as the segments
    assert torch.equal(default, passages[:2])  # the same seeded passages, more of them
    with pytest.raises(kvpolicy.KVPolicyError, match="passages=0: give at least 1"):
        run.evaluate("tiny-llama", passages=0)


def test_the_metadata_ablation_is_the_derived_run_where_metadata_is_already_fp16():
    assert run._same_as({"defaults": {"bits": 2, "group_size": 16, "meta_bits": 16}},
                        {"defaults": {"bits": 2, "group_size": 16}})
    assert not run._same_as({"defaults": {"bits": 2, "meta_bits": 16}}, {"defaults": {"bits": 2}})
    assert run._same_as({"defaults": {"bits": 4, "meta_bits": 16}}, {"defaults": {"bits": 4}})


def test_the_rotation_ablations_know_the_two_bit_default_rotates_values():
    # bits=2 rotates its values where meta_bits auto becomes 8: a written "none" is an
    # ablation and "hadamard" the derived run; at 4 bits the other way round.
    two, four = {"defaults": {"bits": 2}}, {"defaults": {"bits": 4}}
    assert run._same_as({"defaults": {"bits": 2, "rotation": "hadamard"}}, two)
    assert not run._same_as({"defaults": {"bits": 2, "rotation": "none"}}, two)
    assert run._same_as({"defaults": {"bits": 4, "rotation": "none"}}, four)
    assert not run._same_as({"defaults": {"bits": 4, "rotation": "hadamard"}}, four)
    names = [name for name, _, _ in run.ablations(2)]
    assert "groups of 16 (8-bit metadata)" in names
    assert "groups of 16 (8-bit metadata)" not in [name for name, _, _ in run.ablations(4)]
    assert "groups of 16 (8-bit metadata)" not in [name for name, _, _ in run.ablations(2.5)]


def test_the_policy_under_test_keeps_what_nobody_wrote_unwritten():
    # bits=2 without a policy: kvpolicy's group stays unwritten, so the derived run stores
    # 8-bit metadata, keys in groups of 12 and values in groups of 32, rotated, as
    # compile_model(bits=2) does; a preset's own values are written out.
    assert run._spec_dict(None, 2) == {"defaults": {"bits": 2}, "overrides": []}
    tensors = kvpolicy.derive_policy(tiny_model("llama"), policy=run._spec_dict(None, 2),
                                     progress=False).tensors
    assert {(t.tensor.value, t.group_size, t.meta_bits, t.rotation) for t in tensors} == {
        ("key", 12, 8, "none"), ("value", 32, 8, "hadamard")}
    kivi = run._spec_dict("kivi-2", 2)
    assert kivi["defaults"]["meta_bits"] == 16 and "group_size" not in kivi["defaults"]
    tensors = kvpolicy.derive_policy(tiny_model("llama"), policy=kivi, progress=False).tensors
    assert {(t.group_size, t.meta_bits) for t in tensors} == {(32, 16)}
    assert run._spec_dict({"defaults": {"group_size": 32}}, 2)["defaults"]["group_size"] == 32



def test_a_stored_bits_policy_under_test_loads_again():
    """``kvpolicy eval --policy`` with a stored-bits budget: the document the ablations
    extend writes no width beside the budget (bits and stored_bits exclude each other)."""
    whole = {"stored_bits": 2.0, "budget_context": 4096, "residual": "auto"}
    got = run._spec_dict({"defaults": whole}, 2)
    assert got["defaults"] == whole
    assert load_spec(got).budget == 2.0
    # the uniform-width rows replace the budget with their width
    assert run._merge(got, {"defaults": {"bits": 3}}) == {"defaults": {"bits": 3},
                                                          "overrides": []}


def test_no_ablations_keeps_the_frontier_and_drops_the_rest(tmp_path, capsys):
    """``kvpolicy eval --quick --no-ablations``: the derived policy, the uniform widths and
    the whole-cache budgets, without the other ablations or the code-bit budgets."""
    from kvpolicy import cli

    code = cli.main(["eval", "--quick", "--no-peers", "--no-ablations", "--retrieval", "0",
                     "--stored-bits", "--whole-cache", "4.0", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "report.json").read_text())
    groups = {r["group"] for r in data["runs"]}
    assert groups == {"headline", "bits", "whole"}
    assert [r["name"] for r in data["runs"] if r["group"] == "bits"] == [
        "2 bits", "3 bits", "4 bits"]
    assert any("skipped (--no-ablations)" in n for n in data["notes"])
    assert (tmp_path / "frontier.png").stat().st_size > 0
    assert "whole-cache budget 4" in capsys.readouterr().out
