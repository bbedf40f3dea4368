"""Decode attention on a GPU: the fused Triton kernel over a 2-bit packed cache vs SDPA.

Policy timed (the kvpolicy-2 layout): keys 2-bit per-channel, stored before RoPE and
rotated in the kernel (rotate_half), values 2-bit per-token, G=32, fp16 scales; one
decode query per sequence. Baseline: ``torch.nn.functional.scaled_dot_product_attention``
over an fp16 cache of post-RoPE keys (``enable_gqa=True``). Both are timed with
``triton.testing.do_bench`` (median, launch overhead included) and with
``triton.testing.do_bench_cudagraph`` (graph replays: kernel time without the Python
launch cost, which dominates short contexts). Before timing, every row
checks the kernel against :func:`kvpolicy.kernels.reference.packed_attention_partial`
on batch row 0 (fp16 dots vs the fp32 reference).

GB/s counts the packed bytes (codes, scales, zeros of K and V) a call must read, against
the 4.8 TB/s of an H200; the rotary tables and positions are not counted.

Run from the repository root: ``PYTHONPATH=. python bench/gpu_attention.py``. Without
CUDA it says so and exits 0. Prints one table; runs in a few minutes on one H200.
"""

from __future__ import annotations

import math
import sys
import time

import torch

H200_BYTES_PER_S = 4.8e12
CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)
# (name, query heads, kv heads, head_dim, rope theta)
MODELS = (("SmolLM2-135M", 9, 3, 64, 1e5), ("Llama-3-8B", 32, 8, 128, 5e5))
BATCHES = (1, 8)
G = 32
DEVICE = "cuda"
ATOL = RTOL = 2e-2  # fp16 queries and tensor-core dots against an fp32 reference


def _rope(theta: float, d: int, positions: int, dtype: torch.dtype, device: str):
    from kvpolicy.kernels.layout import RotarySpec

    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=device).float() / d))
    ang = torch.arange(positions, device=device).float()[:, None] * inv[None, :]
    ang = torch.cat((ang, ang), dim=-1)
    return RotarySpec("rotate_half", d, ang.cos().to(dtype), ang.sin().to(dtype))


def _packed_bytes(*packs) -> int:
    return sum(t.numel() * t.element_size() for p in packs for t in p)


def _row(model, b, t, rope, gen):
    """Build one shape, check it, time it; returns the printed fields."""
    import torch.nn.functional as F
    from triton.testing import do_bench, do_bench_cudagraph

    from kvpolicy.kernels import reference as ref
    from kvpolicy.kernels import triton_attention as ta
    from kvpolicy.kernels import triton_quant as tq
    from kvpolicy.kernels.layout import QuantSpec

    name, hq, hkv, d, _ = model
    dev, dt = DEVICE, torch.float16
    k_spec = QuantSpec(bits=2, group_size=G, axis="channel")
    v_spec = QuantSpec(bits=2, group_size=G, axis="token")
    q = torch.randn(b, hq, 1, d, device=dev, dtype=dt, generator=gen)
    k = torch.randn(b, hkv, t, d, device=dev, dtype=dt, generator=gen)
    k[..., :4] *= 8.0  # a few outlier channels, as real keys have
    v = torch.randn(b, hkv, t, d, device=dev, dtype=dt, generator=gen)
    kp, vp = tq.quantize(k, k_spec), tq.quantize(v, v_spec)
    pos = torch.arange(t, device=dev).expand(b, t)
    scale = 1.0 / math.sqrt(d)

    def fused():
        return ta.packed_attention_partial(
            q, kp, vp, k_spec, v_spec, scale=scale, rope=rope, k_positions=pos,
            check_positions=False,
        )

    row = dict(model=name, b=b, t=t, packed=_packed_bytes(kp, vp), status="ok")
    out, lse = fused()
    kp0 = type(kp)(*(x[:1] for x in kp))
    vp0 = type(vp)(*(x[:1] for x in vp))
    want, want_lse = ref.packed_attention_partial(
        q[:1], kp0, vp0, k_spec, v_spec, scale=scale, rope=rope, k_positions=pos[:1]
    )
    row["err"] = (out[:1] - want).abs().max().item()
    ok = torch.allclose(out[:1], want, atol=ATOL, rtol=RTOL) and torch.allclose(
        lse[:1], want_lse, atol=ATOL, rtol=RTOL
    )
    del want, want_lse, kp0, vp0
    if not ok:
        row["status"] = "FAIL"
        return row

    # Baseline: an fp16 cache of (already rotated) keys and values.
    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    sdpa()
    row["sdpa"] = do_bench(sdpa, warmup=25, rep=100, return_mode="median")
    row["ours"] = do_bench(fused, warmup=25, rep=100, return_mode="median")
    # CUDA-graph replays remove the Python launch cost of both sides.
    try:
        row["sdpa_g"] = do_bench_cudagraph(sdpa, rep=50, return_mode="median")
        row["ours_g"] = do_bench_cudagraph(fused, rep=50, return_mode="median")
    except Exception as e:  # noqa: BLE001  (report and keep the eager figures)
        row["status"] = f"ok (no graph: {type(e).__name__})"
    return row


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench/gpu_attention.py: no CUDA device here; this benchmark needs a GPU "
              "(the Triton kernels are tested on CPU by tests/kernels). Nothing to do.")
        return 0
    start = time.time()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    dev_name = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    rows = []
    for model in MODELS:
        rope = _rope(model[4], model[3], max(CONTEXTS), torch.float16, DEVICE)
        for b in BATCHES:
            for t in CONTEXTS:
                try:
                    rows.append(_row(model, b, t, rope, gen))
                except Exception as e:  # noqa: BLE001  (one bad row must not lose the table)
                    first = (str(e).splitlines() or [""])[0][:60]
                    rows.append(dict(model=model[0], b=b, t=t,
                                     status=f"ERROR {type(e).__name__}: {first}"))
                torch.cuda.empty_cache()

    import triton

    print(f"Decode attention, 2-bit K per-channel pre-RoPE (rotate_half) + 2-bit V per-token, "
          f"G={G}, fp16 | {dev_name} | torch {torch.__version__}, triton {triton.__version__}")
    head = (f"{'model':<13} {'B':>2} {'T':>7} {'sdpa_us':>8} {'triton_us':>9} {'speedup':>7} "
            f"{'sdpa_graph':>10} {'triton_graph':>12} {'speedup':>7} {'packed_MB':>9} "
            f"{'GB/s':>6} {'%4.8TB/s':>8} {'max_err':>8}  check")
    print(head)
    print("-" * len(head))

    def us(row, key, width):
        return f"{row[key] * 1e3:>{width}.1f}" if key in row else f"{'-':>{width}}"

    def ratio(row, a, b):
        return f"{row[a] / row[b]:>6.2f}x" if a in row and b in row else f"{'-':>7}"

    for r in rows:
        best = r.get("ours_g", r.get("ours"))
        gbs = r["packed"] / (best * 1e-3) / 1e9 if best else None
        print(f"{r['model']:<13} {r['b']:>2} {r['t']:>7} {us(r, 'sdpa', 8)} {us(r, 'ours', 9)} "
              f"{ratio(r, 'sdpa', 'ours')} {us(r, 'sdpa_g', 10)} {us(r, 'ours_g', 12)} "
              f"{ratio(r, 'sdpa_g', 'ours_g')} "
              + (f"{r['packed'] / 1e6:>9.1f} " if "packed" in r else f"{'-':>9} ")
              + (f"{gbs:>6.0f} {100 * gbs * 1e9 / H200_BYTES_PER_S:>7.1f}% " if gbs
                 else f"{'-':>6} {'-':>8} ")
              + (f"{r['err']:>8.1e}" if "err" in r else f"{'-':>8}")
              + f"  {r['status']}")
    print(f"(total {time.time() - start:.0f} s; us = median of triton.testing.do_bench "
          f"(eager, launch overhead included) and do_bench_cudagraph (graph); the fused call "
          f"includes the split merge; GB/s = packed bytes / best fused time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
