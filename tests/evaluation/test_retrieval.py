import math

import pytest
import torch

import kvpolicy
from kvpolicy.cli import build_parser
from kvpolicy.errors import KVPolicyError
from kvpolicy.evaluation import (
    NextTokenReference,
    decode_perplexity,
    peer_rows,
    retrieval_task,
    run,
    score_retrieval,
)
from kvpolicy.zoo.tiny import tiny_model

_SMALL = {"defaults": {"bits": 2, "group_size": 16, "residual": 16, "sinks": 2}}


def _ids(n, length, seed=0):
    return torch.randint(3, 128, (n, length), generator=torch.Generator().manual_seed(seed))


def test_retrieval_task_scores_exactly_the_second_copy_after_the_prefill():
    passages = _ids(2, 40)
    task = retrieval_task(passages, prefix=5)
    assert torch.equal(task.ids, torch.cat([passages, passages], dim=1))
    assert (task.context, task.steps) == (45, 35)
    assert torch.equal(task.scored(), passages[:, 5:])
    # the prefill rounded up to whole quantization groups: 40 + 5 -> 48
    rounded = retrieval_task(passages, prefix=5, multiple=16)
    assert (rounded.prefix, rounded.context, rounded.steps) == (8, 48, 32)
    assert torch.equal(rounded.scored(), passages[:, 8:])
    with pytest.raises(ValueError, match="nothing to score"):
        retrieval_task(passages, prefix=40)


def test_retrieval_scores_the_second_copy_as_a_full_forward_does():
    model = tiny_model("llama")
    task = retrieval_task(_ids(2, 30), prefix=6)
    got = score_retrieval(model, task, "fp", progress=False)
    with torch.no_grad():  # logits at position t predict token t + 1
        logits = model(task.ids).logits[:, task.context - 1 : task.context + task.steps - 1]
    assert got.tokens == 2 * 24
    hits = (logits.argmax(-1) == task.scored()).float().mean().item()
    assert got.top1 == pytest.approx(hits)
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), task.scored().reshape(-1))
    assert got.perplexity == pytest.approx(math.exp(nll.item()), rel=1e-4)


def test_a_run_against_its_own_record_has_kl_zero_and_full_agreement():
    model = tiny_model("llama")
    segs = _ids(2, 56)
    ref = NextTokenReference()
    first = decode_perplexity(model, segs, 40, 16, progress=False, batched=True,
                              reference=ref, record=True)
    again = decode_perplexity(model, segs, 40, 16, progress=False, batched=True, reference=ref)
    assert (first.kl, first.agreement) == (0.0, 1.0)
    assert (again.kl, again.agreement) == (0.0, 1.0)
    assert ref.log_probs.shape == (2, 16, 128) and ref.log_probs.dtype == torch.float16
    q = kvpolicy.compile_model(tiny_model("llama"), policy=_SMALL)
    two = decode_perplexity(q, segs, 40, 16, progress=False, batched=True, reference=ref)
    assert two.cache.layers[0].packed.n_packed > 0
    assert two.kl > 0
    assert 0 <= two.agreement <= 1
    with pytest.raises(ValueError, match="same segments, context and steps"):
        decode_perplexity(model, segs, 40, 8, progress=False, reference=ref)
    with pytest.raises(ValueError, match="already recorded"):
        decode_perplexity(model, segs, 40, 16, progress=False, reference=ref, record=True)


def test_kl_is_that_of_the_reference_against_the_run_per_scored_token():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    segs = _ids(2, 30)
    ref = NextTokenReference()
    decode_perplexity(a, segs, 20, 10, progress=False, reference=ref, record=True)
    got = decode_perplexity(b, segs, 20, 10, progress=False, reference=ref)
    with torch.no_grad():
        lp_a = torch.log_softmax(a(segs).logits[:, 19:29], -1)
        lp_b = torch.log_softmax(b(segs).logits[:, 19:29], -1)
    want = (lp_a.exp() * (lp_a - lp_b)).sum(-1).mean().item()
    assert got.kl == pytest.approx(want, rel=1e-2)
    agree = (lp_a.argmax(-1) == lp_b.argmax(-1)).float().mean().item()
    assert got.agreement == pytest.approx(agree)


def test_argmax_only_reference_gives_agreement_without_kl():
    model = tiny_model("llama")
    ref = NextTokenReference(log_probs=False)
    res = decode_perplexity(model, _ids(1, 30), 20, 10, progress=False, reference=ref,
                            record=True)
    assert ref.log_probs is None and res.kl is None and res.agreement == 1.0


def test_quanto_peer_runs_carry_kl_and_a_retrieval_row():
    pytest.importorskip("optimum.quanto")
    load = lambda: tiny_model("llama")  # noqa: E731
    segs = _ids(2, 80)
    ref, retrieval_ref = NextTokenReference(), NextTokenReference(log_probs=False)
    fp = decode_perplexity(load(), segs, 64, 16, progress=False, batched=True, reference=ref,
                           record=True)
    task = retrieval_task(_ids(2, 48, seed=2), multiple=16)
    score_retrieval(load(), task, "fp", reference=retrieval_ref, record=True, progress=False)
    per_token = run._elements_per_token(load())
    rows, retrieved = peer_rows.peer_runs(load, segs, 64, 16, fp.perplexity, _SMALL,
                                          per_token, False, [], ref, task, retrieval_ref)
    assert [r.name for r in rows][0] == "quanto default axes (0, 0)"
    assert all(r.kl > 0 and 0 <= r.top1_agreement <= 1 for r in rows)
    assert all(r.avg_stored_bits < r.whole_bits for r in rows)  # its window counted too
    (name, row), = retrieved.items()
    assert name == rows[1].name and row.tokens == 2 * task.steps
    assert row.agreement is not None


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"context": 250, "steps": 16}, "250 \\+ 16 = 266 tokens exceed the 256 positions"),
    ({"context": 64, "steps": 16, "retrieval": 200}, "retrieval=200.*--retrieval 128 or less"),
    ({"context": 64, "steps": 16, "retrieval": 20}, "--retrieval 20: .*nothing to score"),
])
def test_eval_refuses_lengths_past_the_models_positions(kwargs, match):
    with pytest.raises(KVPolicyError, match=match):
        kvpolicy.evaluate("tiny-llama", peers=False, progress=False, **kwargs)


def test_eval_refuses_a_context_quantos_per_channel_axes_cannot_group_before_any_run():
    # 2 KV heads x 60 tokens = 120 rows, not a multiple of the 16-element groups
    with pytest.raises(KVPolicyError, match="context=60.*--no-peers"):
        kvpolicy.evaluate("tiny-llama", policy=_SMALL, context=60, steps=16, progress=False)


def test_eval_flags_for_long_context_and_retrieval():
    parser = build_parser()
    args = parser.parse_args(["eval", "--context", "4096", "--steps", "512", "--retrieval", "0"])
    assert (args.context, args.steps, args.retrieval) == (4096, 512, 0)
    assert parser.parse_args(["eval"]).retrieval is None  # evaluate() picks the default
