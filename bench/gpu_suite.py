"""The GPU suite: one script, one table, for a single short run on one GPU (an H200).

Why one script: GPU time comes in one short loan, so every measurement the project needs from
a GPU is here, ordered by importance, under a deadline, with every failure reported in its
row instead of ending the run. Without CUDA it says so and exits 0; ``--device cpu --tiny``
runs the same row functions at toy shapes so that the code paths are exercised without a GPU
(tests/test_gpu_suite.py does that). Nothing in the output is estimated: every figure is
measured in the run, or the cell says it was not.

Sections (the rows at 32K tokens and batch 8 run first: kernel, then the three caches; then
the other kernel rows, the 16-bit check, the kernel captures, the other model rows by cost,
and last the capture of a whole decode step):

``kernel``: one decode step of attention, Llama-3-8B shapes (32 query heads on 8 KV heads,
    head_dim 128), random fp16 K/V (four outlier key channels), one query token, at 4K / 32K /
    128K tokens, batch 1 and 8:
    - ``SDPA fp16``: ``F.scaled_dot_product_attention`` over fp16 post-RoPE K/V with
      ``enable_gqa=True``, the flash backend pinned (``sdpa_kernel(FLASH_ATTENTION)``; if flash
      refuses, the row names what ran instead);
    - ``kvpolicy attend``: a ``PackedKVLayer`` with compile_model(bits=2)'s defaults (keys
      per channel in groups of 12 tokens with per-channel widths averaging 2 bits, values
      2-bit per token in groups of 32 channels, 8-bit scales and zeros, residual 128, sinks
      4: the specs ``derive_policy`` gives the suite's model with 512 random token ids as
      calibration text, printed in the header), pre-RoPE keys with
      a rotate_half table in the table dtype a compiled model's cache hands its layers (the
      model's fp16 for Triton, fp32 for the torch backend), timed through
      ``layer.attend(q)``: the whole step as a compiled model runs it, Python included;
    - ``kvpolicy decode_attention``: the backend's ``decode_attention`` alone, on the same
      segments (sinks + residual in fp16, the packed groups, their positions), without the
      layer's Python around it.
``model``: a random-weight transformers ``LlamaForCausalLM`` with those attention shapes
    (hidden 4096, 4 layers, vocabulary 1024, MLP 1024: small so that attention and the cache
    dominate), fp16, at 32K and 128K tokens, batch 1 and 8: transformers' ``DynamicCache``
    (fp16), ``kvpolicy.compile_model(model, bits=2)``, and transformers' ``QuantizedCache``
    (quanto, 2 bits, G=32, R=128, built by ``kvpolicy.evaluation.peers.peer_cache``). A prefill
    of T tokens (timed apart, printed), warm-up steps, then timed decode steps, every run fed
    the same tokens so that their logits compare. One more row compiles at 16 bits, which
    must match ``DynamicCache`` to fp16 rounding (the exactness check of the compiled path).
    The model is compiled once per width and reused; the first row that needs it pays for
    the compile. compile_model's prefill attends in fp32 (``runtime.attend``), so its prefill
    time and peak are not those of an fp16 flash prefill; the decode-phase peak is the
    cache's figure.
``graph``: CUDA-graph capture of SDPA and of ``layer.attend`` (replay time: the kernels without
    Python), and an attempt to capture one decode step of the compiled model, reported as
    captured or with the error it raised. ``n/a (no CUDA)`` on CPU.

Columns:

- ``time``: kernel rows: microseconds per call, the median of ``--reps`` calls after
  ``--warmup`` (CUDA events; each call is enqueued without a sync, so a step bound by Python
  shows its Python time). Model rows: milliseconds per decode step, the mean over the timed
  steps (chunk packing and quanto's re-quantization fall inside them, as they do in use).
- ``throughput``: kernel rows: GB/s on the bytes the call must read; kvpolicy: codes, scales,
  zeros, the fp16 sinks and residual, the positions and the rotary rows of the held tokens
  (counted once, though every head reads them); SDPA: its fp16 K and V. Model rows:
  decode tokens/s (batch x timed steps / their time).
- ``% peak``: that GB/s as a share of the bandwidth measured in the same run by a large
  device-to-device copy (read + write bytes / time). The header also prints the nominal
  figure where the device name is known; the share uses the measured one.
- ``vs baseline``: kernel rows: the speed-up over SDPA at the same shape (SDPA time / this
  time). Model rows: decode tokens/s over DynamicCache's at the same shape. Graph rows: the
  speed-up over the eager call.
- ``memory``: kernel rows: the bytes counted above. Model rows: peak
  ``torch.cuda.max_memory_allocated`` over prefill + decode (reset before each run) and over
  the decode steps alone (reset after the prefill), weights of every resident model included
  (the same for every run), and the bytes the cache holds at the end.
- ``saved``: model rows: (DynamicCache's peak - this peak) / DynamicCache's KV bytes, for the
  decode-phase peak and the whole run's: the share of the fp16 cache that the run saves.
- ``error``: kernel rows: max |out - reference| on batch rows 0 and B-1, the reference being
  the same K/V packed by the torch backend, dequantized, rotated and attended in fp32 by
  ``kvpolicy.kernels.reference``; a row fails above ``ATOL``. SDPA: its own error against
  fp32 attention over its fp16 K/V. Model rows: max |logit difference| against the
  DynamicCache run on the same tokens, at the first decoded token (the prefill's logits)
  and over every decode step, and how often the top-1 tokens agree.
- ``status``: ok / FAIL / OOM (with the message) / ERROR / skipped (time budget), and the
  first call's time (autotune and compile) or the prefill's.

Time: ``--budget-s`` (default 450 s) is a deadline checked before each group of rows; a group
whose scaling guess (from the rows already measured; only used to decide) does not fit is
printed as skipped. A watchdog stops a group that runs 25 s past the deadline. Out of memory
in a row is printed in that row, the memory is freed and the suite goes on. Exit status 1
when a row failed its check or raised something other than out-of-memory, else 0.

Run from the repository root::

    PYTHONPATH=. python bench/gpu_suite.py                      # the suite (needs CUDA)
    PYTHONPATH=. python bench/gpu_suite.py --device cpu --tiny  # code paths on CPU
    PYTHONPATH=. python bench/gpu_suite.py --tiny               # a quick smoke run on the GPU
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import math
import os
import platform
import shlex
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

NO_CUDA = "no CUDA device: the GPU suite measures nothing on this machine"
ATOL = 2e-2  # kvpolicy vs the fp32 reference over the same packed cache (fp16 output)
EXACT_ATOL = 5e-2  # |logit| difference allowed to the 16-bit compile (fp16 rounding, 4 layers)
GRACE_S = 25.0  # the watchdog fires this long after the deadline
MODEL_KINDS = ("fp", "kvpolicy", "quanto")
SECTIONS = ("kernel", "model", "graph")
# Bandwidth of the device's memory as its maker states it, by a part of the device name.
# Printed beside the measured copy bandwidth, never used for the share.
NOMINAL_BYTES_PER_S = (
    ("H200", 4.8e12, "NVIDIA H200 (HBM3e)"),
    ("H100 NVL", 3.9e12, "NVIDIA H100 NVL"),
    ("H100 PCIe", 2.0e12, "NVIDIA H100 PCIe"),
    ("H100", 3.35e12, "NVIDIA H100 SXM5"),
    ("A100-SXM4-80GB", 2.039e12, "NVIDIA A100 SXM4 80GB"),
    ("A100-SXM4-40GB", 1.555e12, "NVIDIA A100 SXM4 40GB"),
)


# ---------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shapes:
    """Every size the suite uses; ``FULL`` for the GPU, ``TINY`` to exercise the code paths."""

    q_heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    kernel_lengths: tuple[int, ...]
    batches: tuple[int, ...]
    model_lengths: tuple[int, ...]
    important_length: int  # rows at this length and the largest batch run first
    layers: int
    vocab: int
    intermediate: int
    check_length: int  # the 16-bit exactness row
    check_batch: int
    graph_length: int
    graph_batch: int
    step_graph_length: int
    reps: int
    warmup: int
    decode_warmup: int
    decode_steps: int
    copy_bytes: int
    reserve_s: float  # time kept for a group no earlier row lets the suite scale from

    @property
    def hidden(self) -> int:
        return self.q_heads * self.head_dim


FULL = Shapes(
    q_heads=32, kv_heads=8, head_dim=128, rope_theta=5e5,
    kernel_lengths=(4096, 32768, 131072), batches=(1, 8), model_lengths=(32768, 131072),
    important_length=32768, layers=4, vocab=1024, intermediate=1024,
    check_length=4096, check_batch=8, graph_length=32768, graph_batch=8, step_graph_length=4096,
    # 8 warm-up steps cover the first chunk packing after a prefill of T = 0 mod 32 (at
    # step 4) and its autotune; 128 timed steps span four packings and one re-quantization
    # of quanto's 128-token residual.
    reps=100, warmup=10, decode_warmup=8, decode_steps=128,
    copy_bytes=2 << 30, reserve_s=20.0,
)
TINY = Shapes(
    q_heads=4, kv_heads=2, head_dim=64, rope_theta=5e5,
    kernel_lengths=(256, 512), batches=(1, 2), model_lengths=(256, 512), important_length=512,
    layers=2, vocab=128, intermediate=256,
    check_length=256, check_batch=2, graph_length=512, graph_batch=2, step_graph_length=256,
    reps=3, warmup=1, decode_warmup=1, decode_steps=3,
    copy_bytes=16 << 20, reserve_s=0.0,
)


# ---------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the table: the measured values, formatted by :func:`table`."""

    section: str
    tokens: int
    batch: int
    method: str
    status: str = "ok"
    values: dict[str, Any] = field(default_factory=dict)
    cells: dict[str, str] = field(default_factory=dict)  # preformatted cells (override)

    @property
    def failed(self) -> bool:
        return self.status.startswith(("FAIL", "ERROR"))


class SuiteTimeout(Exception):
    """Raised by the watchdog when a group runs past the deadline and its grace."""


@dataclass
class Item:
    """A group of rows run together (they share their inputs), with its time guess."""

    section: str
    tokens: int
    batch: int
    methods: tuple[str, ...]
    run: Callable[[Callable[[Row], None]], None]
    estimate_s: Callable[[], float | None]  # None: no earlier row to scale from


def _short(e: BaseException, limit: int = 160) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}" if text else type(e).__name__


def is_oom(e: BaseException) -> bool:
    """Out of device (or host) memory, as torch reports it."""
    if isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def free_memory(device: torch.device) -> None:
    """Drop what a finished or failed row left behind, so the next row starts clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_items(items: list[Item], deadline: float, device: torch.device, rows: list[Row],
              clock: Callable[[], float] = time.monotonic) -> None:
    """Run each group unless it does not fit before ``deadline``; every planned method
    gets a row in ``rows`` (measured, skipped, OOM or error), in plan order. Rows are added
    as they come, so a caller interrupted mid-way keeps the ones done."""
    stopped = False
    for item in items:
        done: list[Row] = []
        try:
            why = "skipped (time budget): the suite stopped at its deadline" if stopped else None
            if why is None:
                left = deadline - clock()
                guess = item.estimate_s()
                if left <= 0 or (guess is not None and guess > left):
                    why = (f"skipped (time budget): {max(left, 0):.0f} s left" if guess is None
                           else f"skipped (time budget): ~{guess:.0f} s by scaling measured "
                                f"rows, {max(left, 0):.0f} s left")
            if why is None:
                print(f"[gpu_suite] {item.section} T={item.tokens} B={item.batch}: "
                      f"{', '.join(item.methods)} ({left:.0f} s left)", file=sys.stderr,
                      flush=True)
                _run_one(item, done, device)
        except SuiteTimeout:
            stopped = True
            why = "aborted (time budget): ran past the deadline"
        if why is not None:
            _fill(item, done, why)
        rows.extend(done)
        for r in done:
            print(f"[gpu_suite]   {r.method}: {r.status}", file=sys.stderr, flush=True)
        if any(r.status.startswith("aborted") for r in done):
            stopped = True


def _run_one(item: Item, done: list[Row], device: torch.device) -> None:
    """One group; a failure becomes the status of the rows it did not produce."""
    failure = None
    try:
        item.run(done.append)
    except SuiteTimeout:
        raise
    except Exception as e:  # noqa: BLE001  (reported in its row, the suite goes on)
        if is_oom(e):
            failure = f"OOM: {_short(e)}"
        else:
            failure = f"ERROR {_short(e)}"
            traceback.print_exc(file=sys.stderr)
    # Outside the except block: the traceback's frames (and their tensors) are gone.
    free_memory(device)
    if failure is not None:
        _fill(item, done, failure)


def _fill(item: Item, done: list[Row], status: str) -> None:
    """A row for each method of ``item`` not in ``done``: the first gets ``status``."""
    names = {r.method for r in done}
    first = True
    for m in item.methods:
        if m not in names:
            done.append(Row(item.section, item.tokens, item.batch, m,
                            status if first or status.startswith("skipped")
                            else "not run: " + status))
            first = False


@contextlib.contextmanager
def watchdog(deadline_s: float) -> Iterator[None]:
    """Raise :class:`SuiteTimeout` in the main thread ``deadline_s`` from now (a group that
    would otherwise overrun the loan); a no-op where signals cannot be set."""
    try:
        old = signal.signal(signal.SIGALRM, _on_alarm)
    except (ValueError, AttributeError):  # not the main thread, or no SIGALRM
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, max(deadline_s, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _on_alarm(signum: int, frame: Any) -> None:
    raise SuiteTimeout()


# ---------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------


class Timer:
    """CUDA events on a GPU, ``perf_counter`` on CPU (where timings mean nothing here)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def median_s(self, fn: Callable[[], object], warmup: int, reps: int) -> float:
        """Median seconds of one call of ``fn`` after ``warmup`` calls."""
        for _ in range(warmup):
            fn()
        self.sync()
        if self.cuda:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(reps)]
            for a, b in events:
                a.record()
                fn()
                b.record()
            torch.cuda.synchronize()
            return statistics.median(a.elapsed_time(b) for a, b in events) / 1e3
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def span_s(self, fn: Callable[[], object]) -> float:
        """Seconds of one call of ``fn`` (all it enqueues finished)."""
        self.sync()
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            return a.elapsed_time(b) / 1e3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def wall_s(self, fn: Callable[[], object]) -> float:
        """Host seconds of ``fn`` until its work is done (first calls: autotune, compile)."""
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t


def copy_bandwidth(device: torch.device, nbytes: int, timer: Timer) -> float:
    """Bytes/s of a device-to-device copy: (read + written bytes) / median time."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    t = timer.median_s(lambda: dst.copy_(src), warmup=3, reps=10)
    return 2 * nbytes / t


def nominal_bandwidth(name: str) -> tuple[float, str] | None:
    """The maker's memory bandwidth for a device name, where the table knows it."""
    for part, value, label in NOMINAL_BYTES_PER_S:
        if part in name:
            return value, label
    return None


def rotary(theta: float, d: int, positions: int, device: torch.device, dtype: torch.dtype):
    """A rotate_half table of ``positions`` rows in ``dtype``."""
    from kvpolicy.kernels.layout import RotarySpec

    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
    ang = torch.arange(positions, dtype=torch.float64, device=device)[:, None] * inv[None]
    ang = torch.cat((ang, ang), dim=-1)
    return RotarySpec("rotate_half", d, ang.cos().to(dtype), ang.sin().to(dtype))


# ---------------------------------------------------------------------------------------
# The suite's state
# ---------------------------------------------------------------------------------------


class SuitePolicy(NamedTuple):
    """The 2-bit policy the rows run: ``compile_model(bits=2)``'s specs for the suite's
    model, and the group quanto runs at (the preset's fp16-metadata group: the same stored
    bits as kvpolicy's 8-bit metadata at half of it)."""

    key: Any  # kvpolicy.kernels.layout.QuantSpec
    value: Any
    residual: int
    sinks: int
    quanto_group: int
    value_rotation: str = "none"  # applied around the layer (runtime.attend), not inside


@dataclass
class Context:
    """What the rows share: device, shapes, the measured peak, the models built once."""

    device: torch.device
    shapes: Shapes
    backend: str  # kvpolicy backend name for PackedKVLayer / compile_model
    timer: Timer
    dtype: torch.dtype = torch.float16
    peak_bytes_per_s: float | None = None
    quanto_unpack: str = "auto"
    quanto_axes: tuple[int, int] = (0, 0)
    notes: list[str] = field(default_factory=list)
    _rope: Any = None
    _policy: SuitePolicy | None = None
    _models: dict[str, Any] = field(default_factory=dict)
    _quanto_label: str | None = None
    fp_logits: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    fp_rows: dict[tuple[int, int], Row] = field(default_factory=dict)
    measured: dict[str, tuple[int, int, float, float]] = field(default_factory=dict)
    kernel_wall: float | None = None  # seconds of the last kernel group

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def policy(self) -> SuitePolicy:
        """What ``compile_model(bits=2)`` gives the suite's model (its first layer's
        tensors, as ``derive_policy`` builds them), and the preset's own group for quanto."""
        if self._policy is None:
            import kvpolicy
            from kvpolicy.policies import load_spec

            pol = kvpolicy.derive_policy(self.base_model(), bits=2,
                                         calibration=self.calibration_ids(), progress=False)
            key, value = pol.get(pol.layers[0], "key"), pol.get(pol.layers[0], "value")
            self._policy = SuitePolicy(key.quant_spec(), value.quant_spec(), key.residual,
                                       key.sinks, load_spec(None, bits=2).defaults.group_size,
                                       value.rotation)
        return self._policy

    def calibration_ids(self) -> torch.Tensor:
        """``[1, CALIBRATION_TOKENS]`` random token ids (seeded) that the 2-bit compile places
        its per-channel key widths from (``channel_widths: auto``, the default): the random
        model has no tokenizer, and without calibration text the default keeps one width per
        key, which is not the path ``compile_model(bits=2)`` gives a model with one."""
        from kvpolicy.calibrate.budget import CALIBRATION_TOKENS

        gen = torch.Generator().manual_seed(7)
        ids = torch.randint(3, self.shapes.vocab, (1, CALIBRATION_TOKENS), generator=gen)
        return ids.to(self.device)

    def rope(self, positions: int):
        """The rotary table a compiled model's cache hands its layers: in the model's dtype
        for the Triton kernels, fp32 for the torch backend (runtime.cache.rope_rows)."""
        if self._rope is None or self._rope.max_positions < positions:
            s = self.shapes
            dtype = self.dtype if self.backend == "triton" else torch.float32
            self._rope = rotary(s.rope_theta, s.head_dim, positions, self.device, dtype)
        return self._rope

    # ------------------------------------------------------------------ models

    def base_model(self) -> torch.nn.Module:
        """The random-weight fp16 Llama every model row uses (built once)."""
        if "fp" not in self._models:
            from transformers import AutoModelForCausalLM, LlamaConfig

            s = self.shapes
            config = LlamaConfig(
                vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                num_hidden_layers=s.layers, num_attention_heads=s.q_heads,
                num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                max_position_embeddings=max(s.model_lengths + (s.check_length,))
                + s.decode_warmup + s.decode_steps + 8,
                rope_theta=s.rope_theta, tie_word_embeddings=False,
            )
            with torch.random.fork_rng(devices=[self.device.index or 0] if self.cuda else []):
                torch.manual_seed(0)
                with torch.device(self.device):
                    model = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
            self._models["fp"] = model.eval()
        return self._models["fp"]

    def compiled(self, bits: int) -> torch.nn.Module:
        """A copy of the base model compiled by ``kvpolicy.compile_model(bits=bits)``."""
        key = f"kvpolicy-{bits}"
        if key not in self._models:
            self._models[key] = self._compile(bits)
        return self._models[key]

    def _compile(self, bits: int) -> torch.nn.Module:
        import kvpolicy

        return kvpolicy.compile_model(copy.deepcopy(self.base_model()), bits=bits,
                                      backend=self.backend, progress=False,
                                      calibration=self.calibration_ids())

    def quanto_label(self) -> str:
        """Prepare quanto's unpack kernel once; the label its rows carry."""
        if self._quanto_label is None:
            self._quanto_label = prepare_quanto(self.device, self.quanto_unpack)
        return self._quanto_label


_QUANTO_LIBS: list[Any] = []  # keeps the torch.library registration below alive


def _unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """quanto's ``unpack`` contract in plain torch: ``8 // bits`` codes per byte, lowest
    bits first, the code planes stacked along dim 0."""
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (bits * i)) & mask for i in range(8 // bits)]).to(torch.uint8)


def prepare_quanto(device: torch.device, mode: str) -> str:
    """Make sure quanto's ``unpack`` will not JIT-build its C++/CUDA extension mid-suite.

    quanto dequantizes 2-bit codes with ``torch.ops.quanto.unpack``, whose CPU and CUDA
    kernels come from extensions that ``torch.utils.cpp_extension.load`` builds on first use
    (nvcc and ninja, minutes for the CUDA one, which also compiles Marlin and AWQ kernels).
    ``auto`` uses an extension already built for this torch and registers the plain torch
    version of the op otherwise; ``extension`` lets quanto build it; ``torch`` always uses
    the plain one. Returns the label of the quanto rows.
    """
    import optimum.quanto  # noqa: F401  (registers quanto's ops)
    from optimum.quanto.library import extensions

    name = "quanto_cuda" if device.type == "cuda" else "quanto_cpp"
    key = "CUDA" if device.type == "cuda" else "CPU"
    built = False
    if extensions.is_extension_available(name):
        ext = extensions.get_extension(name)
        version = os.path.join(ext.build_directory, "pytorch_version.txt")
        so = os.path.join(ext.build_directory, f"{name}.so")
        if os.path.exists(version) and os.path.exists(so):
            with open(version) as f:
                built = f.read().strip() == torch.__version__
    if mode == "extension" or (mode == "auto" and built):
        return f"unpack: quanto's {name} extension" + ("" if built else " (built on first use)")
    lib = torch.library.Library("quanto", "IMPL")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        lib.impl("unpack", _unpack_bits, key)
    _QUANTO_LIBS.append(lib)
    why = "" if mode == "torch" else f", its {name} extension is not built"
    return f"unpack: plain torch{why}"


# ---------------------------------------------------------------------------------------
# Kernel rows
# ---------------------------------------------------------------------------------------


KERNEL_METHODS = ("SDPA fp16", "kvpolicy attend", "kvpolicy decode_attention")


def _sdpa_runner(q, k, v, scale):
    """The fp16 SDPA call with flash pinned; falls back (and says so) if flash refuses."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call(kk, vv, gqa):
        return F.scaled_dot_product_attention(q, kk, vv, scale=scale, enable_gqa=gqa)

    rep = q.shape[1] // k.shape[1]
    tries = [(SDPBackend.FLASH_ATTENTION, False), (SDPBackend.FLASH_ATTENTION, True),
             (SDPBackend.MATH, False)]
    errors = []
    for backend, expand in tries:
        kk = k.repeat_interleave(rep, dim=1) if expand else k
        vv = v.repeat_interleave(rep, dim=1) if expand else v
        try:
            with sdpa_kernel(backend):
                call(kk, vv, not expand)
        except RuntimeError as e:
            errors.append(f"{backend.name}{' expanded' if expand else ''}: {_short(e, 80)}")
            continue
        label = backend.name + (", K/V expanded to the query heads" if expand else "")
        nbytes = (kk.numel() + vv.numel()) * kk.element_size()

        def run(kk=kk, vv=vv, gqa=not expand, backend=backend):
            with sdpa_kernel(backend):
                return call(kk, vv, gqa)

        return run, label, nbytes, errors
    raise RuntimeError("SDPA refused every backend: " + "; ".join(errors))


def _reference_rows(ctx: Context, k, v, q, rows: list[int], scale: float) -> torch.Tensor:
    """fp32 attention over the cache the torch backend packs from K/V rows ``rows``."""
    from kvpolicy.kernels import reference

    layer = _layer(ctx, "torch", ctx.rope(k.shape[2] + 1))
    layer.append(k[rows], v[rows])
    kd, vd = layer.dequantized(torch.float32)
    kr = reference.apply_rope(kd, layer.positions(), layer.rope)
    del kd
    out, _ = reference.attention_partial(q[rows].float(), kr, vd, scale=scale)
    return out


def _layer(ctx: Context, backend: str, rope):
    from kvpolicy.runtime.layer import PackedKVLayer

    p = ctx.policy()
    return PackedKVLayer(
        p.key, p.value, residual=p.residual, sinks=p.sinks, rope=rope, backend=backend,
        dtype=ctx.dtype,
    )


def kernel_bytes(layer) -> int:
    """Bytes one attend must read: the cache, plus the positions and rotary rows of the
    held tokens (once; every head reads them, from L2 after the first)."""
    m = layer.memory_report()
    cache = sum(m[k] for k in ("code_bytes", "scale_bytes", "zero_bytes", "sink_bytes",
                               "residual_bytes", "position_bytes"))
    rope = layer.rope
    # The Triton kernels read the first channel of each rotated pair of cos and sin (both
    # channels of a pair share the angle); positions are int64.
    rope_bytes = m["tokens"] * (rope.rotary_dim // 2) * 2 * rope.cos.element_size()
    return cache + rope_bytes + m["tokens"] * 8


def kernel_group(ctx: Context, t: int, b: int, emit: Callable[[Row], None]) -> None:
    """SDPA, ``layer.attend`` and ``decode_attention`` at ``t`` tokens, batch ``b``."""
    from kvpolicy.kernels import reference
    from kvpolicy.kernels.backend import select
    from kvpolicy.kernels.contract import quantize_in_blocks

    s, dev, dt = ctx.shapes, ctx.device, ctx.dtype
    started = time.monotonic()
    gen = torch.Generator(device=dev).manual_seed(1000 * b + t % 997)
    q = torch.randn(b, s.q_heads, 1, s.head_dim, device=dev, dtype=dt, generator=gen)
    k = torch.randn(b, s.kv_heads, t, s.head_dim, device=dev, dtype=dt, generator=gen)
    k[..., :4] *= 8.0  # a few outlier channels, as real keys have
    v = torch.randn(b, s.kv_heads, t, s.head_dim, device=dev, dtype=dt, generator=gen)
    rope = ctx.rope(t + 1)
    scale = 1.0 / math.sqrt(s.head_dim)
    check = sorted({0, b - 1})

    # Baseline: fp16 SDPA over post-RoPE keys.
    pos = torch.arange(t, device=dev).expand(b, t)
    k_post = reference.apply_rope(k, pos, rope)
    sdpa, label, sdpa_bytes, refused = _sdpa_runner(q, k_post, v, scale)
    first = ctx.timer.wall_s(sdpa)
    want = reference.attention_partial(q[check].float(), k_post[check], v[check], scale=scale)[0]
    err = (sdpa()[check].float() - want).abs().max().item()
    del want
    t_sdpa = ctx.timer.median_s(sdpa, s.warmup, s.reps)
    note = f"; refused: {'; '.join(refused)}" if refused else ""
    emit(_kernel_row(ctx, "kernel", t, b, f"SDPA fp16 ({label})", t_sdpa, sdpa_bytes, t_sdpa,
                     err, f"ok; first call {first:.2f} s{note}", method="SDPA fp16"))
    del sdpa, k_post

    # kvpolicy: the layer a compiled model would hold, filled with the same K/V.
    layer = _layer(ctx, ctx.backend, rope)
    layer.append(k, v)
    want = _reference_rows(ctx, k, v, q, check, scale)
    first = ctx.timer.wall_s(lambda: layer.attend(q))
    out = layer.attend(q)
    err = (out[check].float() - want).abs().max().item()
    t_attend = ctx.timer.median_s(lambda: layer.attend(q), s.warmup, s.reps)
    nbytes = kernel_bytes(layer)
    status = "ok" if err <= ATOL else f"FAIL (max error above {ATOL:g})"
    emit(_kernel_row(ctx, "kernel", t, b, "kvpolicy attend", t_attend, nbytes, t_sdpa, err,
                     f"{status}; first call {first:.2f} s (autotune, compile); "
                     f"{layer.n_packed} packed + {layer.n_sinks + layer.n_residual} fp16 tokens; "
                     f"{ctx.backend} backend"))

    # The backend's decode_attention alone, on the same segments (packed again here: the
    # quantizer is deterministic, so these are the layer's bytes; checked below).
    kern = select(ctx.backend, dev)
    ns, npk = layer.n_sinks, layer.n_packed
    kspec, vspec = layer.key_spec, layer.value_spec
    pk = quantize_in_blocks(kern.quantize, k[:, :, ns : ns + npk], kspec, dt, 4096)
    pv = quantize_in_blocks(kern.quantize, v[:, :, ns : ns + npk], vspec, dt, 4096)
    fk = torch.cat((k[:, :, :ns], k[:, :, ns + npk :]), dim=2)
    fv = torch.cat((v[:, :, :ns], v[:, :, ns + npk :]), dim=2)
    kpos = torch.arange(ns, ns + npk, device=dev).expand(b, npk)
    fpos = torch.cat((torch.arange(ns, device=dev), torch.arange(ns + npk, t, device=dev)))
    fpos = fpos.expand(b, fpos.numel())
    del k, v

    def decode():  # the query in its own dtype, as attend hands it over
        return kern.decode_attention(q, pk, pv, kspec, vspec, fk, fv, scale=scale, rope=rope,
                                     k_positions=kpos, fp_positions=fpos,
                                     check_positions=False)

    got = decode()[0].to(dt)
    err = (got[check].float() - want).abs().max().item()
    same = (got.float() - out.float()).abs().max().item()
    t_dec = ctx.timer.median_s(decode, s.warmup, s.reps)
    status = "ok" if err <= ATOL else f"FAIL (max error above {ATOL:g})"
    emit(_kernel_row(ctx, "kernel", t, b, "kvpolicy decode_attention", t_dec, nbytes, t_sdpa,
                     err, f"{status}; differs from attend by {same:.1e}; {kern.name} backend"))
    ctx.kernel_wall = time.monotonic() - started


def _kernel_row(ctx: Context, section: str, t: int, b: int, label: str, secs: float,
                nbytes: int, base_s: float | None, err: float | None, status: str,
                method: str | None = None) -> Row:
    row = Row(section, t, b, method or label, status)
    row.values = {"time_s": secs, "bytes": nbytes, "gbps": nbytes / secs / 1e9,
                  "vs": (base_s / secs) if base_s else None, "err": err, "label": label}
    if ctx.peak_bytes_per_s:
        row.values["share"] = nbytes / secs / ctx.peak_bytes_per_s
    return row


# ---------------------------------------------------------------------------------------
# Model rows
# ---------------------------------------------------------------------------------------


def model_methods(ctx: Context) -> tuple[str, ...]:
    return ("DynamicCache fp16", "kvpolicy-2", "quanto-2")


def _decode_run(ctx: Context, model, cache, t: int, b: int) -> dict[str, Any]:
    """Prefill ``t`` tokens, then warm-up and timed decode steps; what was measured."""
    from kvpolicy.evaluation import cache_keyword

    s, dev = ctx.shapes, ctx.device
    gen = torch.Generator(device=dev).manual_seed(t + b)
    ids = torch.randint(3, s.vocab, (b, t), device=dev, generator=gen)
    steps = torch.randint(3, s.vocab, (b, s.decode_warmup + s.decode_steps), device=dev,
                          generator=gen)
    kw = cache_keyword(model)
    given = {} if cache is None else {kw: cache}
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    logits = []
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1, **given)
        ctx.timer.sync()
        prefill = time.perf_counter() - t0
        peak_prefill = torch.cuda.max_memory_allocated() if ctx.cuda else None
        cache = out.past_key_values
        logits.append(out.logits[:, -1].float())
        del out, ids
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()

        def step(i: int) -> None:
            nonlocal cache
            o = model(steps[:, i : i + 1], use_cache=True, logits_to_keep=1, **{kw: cache})
            cache = o.past_key_values
            logits.append(o.logits[:, -1].float())

        for i in range(s.decode_warmup):
            step(i)

        def timed() -> None:
            for i in range(s.decode_warmup, s.decode_warmup + s.decode_steps):
                step(i)

        decode = ctx.timer.span_s(timed)
        peak_decode = torch.cuda.max_memory_allocated() if ctx.cuda else None
    if hasattr(cache, "memory_report"):
        held = cache.memory_report()["bytes"]
    else:
        from kvpolicy.evaluation.peers import cache_bytes

        held = cache_bytes(cache).total
    return {"prefill_s": prefill, "decode_s": decode, "step_s": decode / s.decode_steps,
            "tok_s": b * s.decode_steps / decode, "peak": _max(peak_prefill, peak_decode),
            "decode_peak": peak_decode, "kv_bytes": held, "logits": torch.stack(logits)}


def _max(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else max(a, b)


def _agreement(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Logit differences [steps, B, V] against the DynamicCache run on the same tokens."""
    d = (got - ref).abs()
    return {"first_err": d[0].max().item(), "err": d[1:].max().item() if len(d) > 1 else 0.0,
            "top1": (got[1:].argmax(-1) == ref[1:].argmax(-1)).float().mean().item()
            if len(d) > 1 else 1.0,
            "top1_first": (got[0].argmax(-1) == ref[0].argmax(-1)).float().mean().item(),
            "logit_std": ref.std().item()}


def model_group(ctx: Context, kind: str, t: int, b: int, emit: Callable[[Row], None]) -> None:
    """One cache kind at ``t`` tokens, batch ``b`` (DynamicCache first: the others compare)."""
    from kvpolicy.evaluation.peers import peer_cache

    s = ctx.shapes
    p = ctx.policy()
    group, residual = p.quanto_group, p.residual
    base = ctx.base_model()
    label = {"fp": "DynamicCache fp16", "kvpolicy": "kvpolicy-2", "quanto": "quanto-2"}[kind]
    note = ""
    if kind == "fp":
        model, cache = base, peer_cache(base, "fp")
    elif kind == "kvpolicy":
        model, cache = ctx.compiled(2), None
        note = f"; {ctx.backend} backend"
    else:
        note = f"; {ctx.quanto_label()}; axes {ctx.quanto_axes}, G={group}, R={residual}"
        model = base
        cache = peer_cache(base, "quanto", bits=2, group_size=group, residual=residual,
                           axis_key=ctx.quanto_axes[0], axis_value=ctx.quanto_axes[1])
    r = _decode_run(ctx, model, cache, t, b)
    logits = r.pop("logits")
    row = Row("model", t, b, label, "ok", values=r)
    ctx.measured[kind] = (t, b, r["prefill_s"], r["step_s"])
    if kind == "fp":
        ctx.fp_logits[(t, b)] = logits.cpu()
        ctx.fp_rows[(t, b)] = row
    elif (t, b) in ctx.fp_logits:
        row.values.update(_agreement(logits.cpu(), ctx.fp_logits[(t, b)]))
    _compare_to_fp(ctx, row)
    row.status = (f"ok; prefill {r['prefill_s']:.2f} s; {s.decode_warmup} + "
                  f"{s.decode_steps} steps{note}")
    emit(row)


def _compare_to_fp(ctx: Context, row: Row) -> None:
    fp = ctx.fp_rows.get((row.tokens, row.batch))
    if fp is None or fp is row:
        return
    v, f = row.values, fp.values
    v["vs"] = v["tok_s"] / f["tok_s"]
    if f.get("kv_bytes") and v.get("decode_peak") is not None and f.get("decode_peak"):
        v["saved_decode"] = (f["decode_peak"] - v["decode_peak"]) / f["kv_bytes"]
        v["saved_all"] = (f["peak"] - v["peak"]) / f["kv_bytes"]


def exactness_group(ctx: Context, emit: Callable[[Row], None]) -> None:
    """kvpolicy compiled at 16 bits against DynamicCache: equal up to fp16 rounding."""
    from kvpolicy.evaluation.peers import peer_cache

    s = ctx.shapes
    t, b = s.check_length, s.check_batch
    base = ctx.base_model()
    fp = _decode_run(ctx, base, peer_cache(base, "fp"), t, b)
    got = _decode_run(ctx, ctx.compiled(16), None, t, b)
    agree = _agreement(got.pop("logits").cpu(), fp.pop("logits").cpu())
    row = Row("model", t, b, "kvpolicy-16 vs DynamicCache (exactness)", values={**got, **agree})
    row.values["vs"] = got["tok_s"] / fp["tok_s"]
    worst = max(agree["first_err"], agree["err"])
    row.status = ("ok" if worst <= EXACT_ATOL else f"FAIL (logits differ by more than "
                  f"{EXACT_ATOL:g})") + f"; prefill {got['prefill_s']:.2f} s"
    emit(row)


# ---------------------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------------------

GRAPH_METHODS = ("CUDA graph: SDPA fp16", "CUDA graph: kvpolicy attend")
STEP_GRAPH_METHOD = "CUDA graph: compiled model decode step"


def _capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Warm ``fn`` up on a side stream (as torch asks), then capture it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _capture_error(e: BaseException) -> str:
    """The error that broke a capture: the first of the chain (ending a broken capture
    raises a second one), and the last where it differs."""
    chain = [e]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 8:
        chain.append(nxt)
    root = chain[-1]
    return _short(root, 200) + ("" if root is e else f" (then {_short(e, 80)})")


def graph_group(ctx: Context, emit: Callable[[Row], None]) -> None:
    """Replay times of SDPA and ``layer.attend`` captured in CUDA graphs."""
    s = ctx.shapes
    t, b = s.graph_length, s.graph_batch
    if not ctx.cuda:
        for m in GRAPH_METHODS:
            emit(Row("graph", t, b, m, "n/a (no CUDA)"))
        return
    from kvpolicy.kernels import reference

    dev, dt = ctx.device, ctx.dtype
    gen = torch.Generator(device=dev).manual_seed(7)
    q = torch.randn(b, s.q_heads, 1, s.head_dim, device=dev, dtype=dt, generator=gen)
    q2 = torch.randn(b, s.q_heads, 1, s.head_dim, device=dev, dtype=dt, generator=gen)
    k = torch.randn(b, s.kv_heads, t, s.head_dim, device=dev, dtype=dt, generator=gen)
    v = torch.randn(b, s.kv_heads, t, s.head_dim, device=dev, dtype=dt, generator=gen)
    rope = ctx.rope(t + 1)
    scale = 1.0 / math.sqrt(s.head_dim)
    k_post = reference.apply_rope(k, torch.arange(t, device=dev).expand(b, t), rope)
    sdpa, label, sdpa_bytes, _ = _sdpa_runner(q, k_post, v, scale)
    layer = _layer(ctx, ctx.backend, rope)
    layer.append(k, v)
    del k
    nbytes = kernel_bytes(layer)
    q0 = q.clone()
    for method, fn, nb in ((GRAPH_METHODS[0], sdpa, sdpa_bytes),
                           (GRAPH_METHODS[1], lambda: layer.attend(q), nbytes)):
        q.copy_(q0)  # captured with q0; replayed below with q2
        eager = ctx.timer.median_s(fn, s.warmup, s.reps)
        try:
            graph, out = _capture(fn)
        except Exception as e:  # noqa: BLE001  (the capture's outcome is the measurement)
            if is_oom(e):
                raise
            free_memory(dev)
            emit(Row("graph", t, b, method, f"not captured: {_capture_error(e)}"))
            continue
        q.copy_(q2)  # a new query through the captured graph vs an eager call
        graph.replay()
        got, want = out.clone(), fn()
        diff = (got.float() - want.float()).abs().max().item()
        replay = ctx.timer.median_s(graph.replay, s.warmup, s.reps)
        row = _kernel_row(ctx, "graph", t, b, method, replay, nb, eager, None,
                          f"captured; replay = eager call within {diff:.1e}; eager "
                          f"{eager * 1e6:.1f} us" + (f"; {label}" if "SDPA" in method else ""))
        row.values["graph_diff"] = diff
        emit(row)
        del graph, out


def step_graph_group(ctx: Context, emit: Callable[[Row], None]) -> None:
    """Try to capture one decode step of the compiled model (its append included).

    If it captures, the capture ran the step's Python once (the cache counts the token)
    and one replay does its GPU work: the replay's logits must then equal an eager step
    on a second cache filled the same way. (Later replays would rewrite the same token:
    the cache's Python-side state advances only when the step runs in Python.)
    """
    s = ctx.shapes
    t, b = s.step_graph_length, 1
    if not ctx.cuda:
        emit(Row("graph", t, b, STEP_GRAPH_METHOD, "n/a (no CUDA)"))
        return
    from kvpolicy.evaluation import cache_keyword

    model = ctx.compiled(2)
    kw = cache_keyword(model)
    dev = ctx.device
    ids = torch.randint(3, s.vocab, (b, t), device=dev,
                        generator=torch.Generator(device=dev).manual_seed(3))
    nxt = torch.full((b, 1), 5, device=dev, dtype=torch.long)

    def filled():
        c = model(ids, use_cache=True, logits_to_keep=1).past_key_values
        for _ in range(2):
            c = model(nxt, use_cache=True, logits_to_keep=1, **{kw: c}).past_key_values
        return c

    with torch.no_grad():
        captured, reference = filled(), filled()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = model(nxt, use_cache=True, logits_to_keep=1, **{kw: captured}).logits
        except Exception as e:  # noqa: BLE001  (the capture's outcome is the measurement)
            if is_oom(e):
                raise
            emit(Row("graph", t, b, STEP_GRAPH_METHOD, f"not captured: {_capture_error(e)}"))
            return
        graph.replay()
        want = model(nxt, use_cache=True, logits_to_keep=1, **{kw: reference}).logits
        diff = (out.float() - want.float()).abs().max().item()
    head = ("captured; one replay = one eager step" if diff <= ATOL else
            f"FAIL: captured, but one replay differs from an eager step (above {ATOL:g})")
    emit(Row("graph", t, b, STEP_GRAPH_METHOD,
             f"{head}: logits within {diff:.1e} (later replays would rewrite the same "
             "token: the cache's Python-side state advances only when the step runs in "
             "Python)", values={"graph_diff": diff}))


# ---------------------------------------------------------------------------------------
# Plan, table, main
# ---------------------------------------------------------------------------------------


def plan(ctx: Context, sections: tuple[str, ...]) -> list[Item]:
    """The groups in the order they run: the important shape first, then by cost."""
    s = ctx.shapes
    imp, bmax = s.important_length, max(s.batches)
    kernel = [(t, b) for t in s.kernel_lengths for b in s.batches]
    kernel.sort(key=lambda tb: (tb != (imp, bmax), -tb[0], -tb[1]))
    models = [(t, b) for t in s.model_lengths for b in s.batches]
    models.sort(key=lambda tb: (tb != (imp, bmax), tb[1] * tb[0] ** 2))
    items: list[Item] = []

    def kernel_item(t: int, b: int) -> Item:
        return Item("kernel", t, b, KERNEL_METHODS,
                    lambda emit: kernel_group(ctx, t, b, emit), lambda: _kernel_guess(ctx))

    def model_items(t: int, b: int) -> list[Item]:
        return [Item("model", t, b, (label,),
                     lambda emit, kind=kind: model_group(ctx, kind, t, b, emit),
                     lambda kind=kind: _model_guess(ctx, kind, t, b))
                for kind, label in zip(MODEL_KINDS, model_methods(ctx), strict=True)]

    if "kernel" in sections and kernel:
        items.append(kernel_item(*kernel[0]))
    if "model" in sections and models and models[0] == (imp, bmax):
        items += model_items(*models.pop(0))
    if "kernel" in sections:
        items += [kernel_item(t, b) for t, b in kernel[1:]]
    if "model" in sections:
        items.append(Item("model", s.check_length, s.check_batch,
                          ("kvpolicy-16 vs DynamicCache (exactness)",),
                          lambda emit: exactness_group(ctx, emit),
                          lambda: _model_guess(ctx, "kvpolicy", s.check_length, s.check_batch,
                                               runs=2)))
    # The kernel captures are cheap: before the long model rows, which may not fit. The
    # capture of a whole decode step goes last: a capture that breaks mid-way is the likeliest
    # thing here to leave the device in a state later rows would not survive.
    if "graph" in sections:
        items.append(Item("graph", s.graph_length, s.graph_batch, GRAPH_METHODS,
                          lambda emit: graph_group(ctx, emit), lambda: _kernel_guess(ctx)))
    if "model" in sections:
        for t, b in models:
            items += model_items(t, b)
    if "graph" in sections:
        items.append(Item("graph", s.step_graph_length, 1, (STEP_GRAPH_METHOD,),
                          lambda emit: step_graph_group(ctx, emit),
                          lambda: _model_guess(ctx, "kvpolicy", s.step_graph_length, 1)))
    return items


def _kernel_guess(ctx: Context) -> float | None:
    if ctx.kernel_wall is None:
        return ctx.shapes.reserve_s or None
    return max(ctx.shapes.reserve_s, ctx.kernel_wall)


def _model_guess(ctx: Context, kind: str, t: int, b: int, runs: int = 1) -> float | None:
    """Seconds a model run may take, scaled from the last measured run of its kind: the
    prefill as batch x tokens² (attention-bound, an upper bound), the steps as batch x
    tokens. Used only to decide whether to start it."""
    s = ctx.shapes
    if kind not in ctx.measured:
        return s.reserve_s or None
    t0, b0, prefill, step = ctx.measured[kind]
    steps = s.decode_warmup + s.decode_steps
    guess = prefill * (b * t * t) / (b0 * t0 * t0) + steps * step * (b * t) / (b0 * t0)
    return runs * (guess + s.reserve_s / 4)


def _num(x: float | None, fmt: str, unit: str = "") -> str:
    return "—" if x is None else f"{x:{fmt}}{unit}"


def _bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _sig(x: float) -> str:
    """Three significant digits without exponents for the usual range."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def cells(row: Row) -> dict[str, str]:
    """The row's cells, with units (a model row and a kernel row share the columns)."""
    v = row.values
    out = dict.fromkeys(COLUMNS[5:-1], "—")
    if "time_s" in v:  # kernel and graph rows
        out["time"] = f"{v['time_s'] * 1e6:.1f} µs"
        out["throughput"] = f"{_sig(v['gbps'])} GB/s"
        out["% peak"] = _num(100 * v["share"] if "share" in v else None, ".1f", "%")
        out["vs baseline"] = _num(v.get("vs"), ".2f", "×")
        out["memory"] = f"reads {_bytes(v['bytes'])}"
        if v.get("err") is not None:
            out["error"] = f"{v['err']:.1e}"
    elif "tok_s" in v:  # model rows
        out["time"] = f"{v['step_s'] * 1e3:.2f} ms/step"
        out["throughput"] = f"{_sig(v['tok_s'])} tok/s"
        out["vs baseline"] = _num(v.get("vs"), ".2f", "×")
        held = f"KV {_bytes(v['kv_bytes'])}"
        out["memory"] = (f"peak {_bytes(v['peak'])}, decode {_bytes(v['decode_peak'])}; {held}"
                         if v.get("peak") is not None else f"not measured on CPU; {held}")
        if "saved_decode" in v:
            out["saved"] = (f"{100 * v['saved_decode']:.0f}% decode, "
                            f"{100 * v['saved_all']:.0f}% whole run")
        if "err" in v:
            out["error"] = (f"first {v['first_err']:.1e}, steps {v['err']:.1e} "
                            f"(logit std {v['logit_std']:.2f}); top-1 {100 * v['top1']:.0f}%")
    out.update(row.cells)
    return out


COLUMNS = ("#", "section", "T", "B", "method", "time", "throughput", "% peak", "vs baseline",
           "memory", "saved", "error", "status")


def table(rows: list[Row]) -> str:
    """One markdown table of every row."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for i, r in enumerate(rows, 1):
        c = cells(r)
        method = r.values.get("label", r.method)
        vals = [str(i), r.section, str(r.tokens), str(r.batch), method,
                *(c[k] for k in COLUMNS[5:-1]), r.status]
        lines.append("| " + " | ".join(x.replace("|", "/") for x in vals) + " |")
    return "\n".join(lines)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False):
            return action.help or ""
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Sections, columns and the time budget are described at the top of "
               "bench/gpu_suite.py (its docstring).",
        formatter_class=_Help,
    )
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda: the suite; cpu: needs --tiny (the code paths, no timings)")
    p.add_argument("--tiny", action="store_true",
                   help="toy shapes (256/512 tokens, 2 layers, head_dim 64, 4/2 heads): "
                        "exercises every row quickly; timings mean nothing")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="deadline in seconds from the start; groups that do not fit are "
                        "printed as skipped")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                   help="which sections to run (rows keep their order)")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"),
                   help="kvpolicy backend; auto: triton on CUDA, on CPU triton when "
                        "TRITON_INTERPRET=1 is set, else torch")
    p.add_argument("--quanto-unpack", default="auto", choices=("auto", "extension", "torch"),
                   help="quanto's unpack kernel: auto uses its extension if already built, "
                        "else plain torch (its first use would build it with nvcc for minutes)")
    p.add_argument("--quanto-axes", type=int, nargs=2, default=[0, 0], metavar=("KEY", "VALUE"),
                   help="quanto's axis_key and axis_value (0 per token, -1 per channel)")
    p.add_argument("--kernel-lengths", type=int, nargs="+",
                   help=f"kernel-row lengths (default {' '.join(map(str, FULL.kernel_lengths))}, "
                        f"tiny {' '.join(map(str, TINY.kernel_lengths))})")
    p.add_argument("--model-lengths", type=int, nargs="+",
                   help=f"model-row lengths (default {' '.join(map(str, FULL.model_lengths))}, "
                        f"tiny {' '.join(map(str, TINY.model_lengths))})")
    p.add_argument("--batches", type=int, nargs="+",
                   help=f"batch sizes of kernel and model rows (default "
                        f"{' '.join(map(str, FULL.batches))}, tiny "
                        f"{' '.join(map(str, TINY.batches))})")
    p.add_argument("--warmup", type=int,
                   help=f"untimed calls before a kernel row's timed ones (default "
                        f"{FULL.warmup}, tiny {TINY.warmup})")
    p.add_argument("--reps", type=int,
                   help=f"timed calls per kernel row (default {FULL.reps}, tiny {TINY.reps})")
    p.add_argument("--decode-steps", type=int,
                   help=f"timed decode steps per model row (default {FULL.decode_steps}, "
                        f"tiny {TINY.decode_steps})")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    return p


def _backend(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "triton"
    interpret = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    return "triton" if interpret else "torch"


def header(ctx: Context, args: argparse.Namespace, tiny: bool) -> list[str]:
    import transformers
    import triton

    name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else platform.processor() or "CPU"
    lines = [
        f"# kvpolicy GPU suite — {datetime.datetime.now().astimezone().isoformat(' ', 'seconds')}",
        f"device: {name} ({ctx.device})"
        + (f", CUDA {torch.version.cuda}" if ctx.cuda else ""),
        f"torch {torch.__version__}, triton {triton.__version__}, transformers "
        f"{transformers.__version__}, python {platform.python_version()}",
        "command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
    ]
    if tiny:
        lines.append(f"TINY MODE on {ctx.device}: toy shapes; the timings below mean nothing, "
                     "the rows only show that every code path runs")
    nominal = nominal_bandwidth(name) if ctx.cuda else None
    measured = ctx.peak_bytes_per_s
    lines.append(
        "peak bandwidth: measured "
        + (f"{measured / 1e9:.0f} GB/s" if measured else "nothing (the copy did not finish)")
        + " (device-to-device copy of "
        f"{ctx.shapes.copy_bytes >> 20} MiB, read + write bytes); nominal "
        + (f"{nominal[0] / 1e9:.0f} GB/s ({nominal[1]})" if nominal else
           "unknown for this device name")
        + "; '% peak' uses the measured figure")
    s = ctx.shapes
    p = ctx.policy()
    lines.append(
        f"shapes: {s.q_heads} query heads, {s.kv_heads} KV heads, head_dim {s.head_dim}; "
        f"kvpolicy: 2-bit keys per channel (pre-RoPE, rotate_half), 2-bit values per token, "
        f"keys in groups of {p.key.group_size} tokens"
        + (f" with per-channel widths (placed from {ctx.calibration_ids().shape[1]} random "
           "token ids)"
           if p.key.widths is not None else "")
        + f", values in groups of {p.value.group_size} channels"
        + (f" ({p.value_rotation}-rotated in the model rows)"
           if p.value_rotation != "none" else "")
        + f", {p.key.meta_bits}-bit scales and zeros, residual "
        f"{p.residual}, sinks {p.sinks} (compile_model(bits=2)'s defaults), "
        f"{ctx.backend} backend, rotary table in "
        f"{str(ctx.rope(1).cos.dtype).replace('torch.', '')}")
    lines.append(
        f"model: random-weight LlamaForCausalLM, {s.layers} layers, hidden {s.hidden}, "
        f"vocabulary {s.vocab} and MLP {s.intermediate} (small on purpose: attention and the "
        f"cache dominate), {str(ctx.dtype).replace('torch.', '')}; prefill of T tokens, "
        f"{s.decode_warmup} warm-up + {s.decode_steps} timed decode steps")
    return lines


def run(argv: list[str] | None = None) -> tuple[int, list[Row], str]:
    """The suite: ``(exit status, rows, printed text)``; prints as it goes."""
    args = _parser().parse_args(argv)
    start = time.monotonic()
    if args.device == "cuda" and not torch.cuda.is_available():
        text = (f"{NO_CUDA} (torch {torch.__version__}, torch.cuda.is_available() is False). "
                "Run it where a GPU is, or `--device cpu --tiny` to exercise its code paths.")
        print(text)
        return 0, [], text
    if args.device == "cpu" and not args.tiny:
        _parser().error("--device cpu runs only with --tiny (full shapes would take hours)")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    shapes = TINY if args.tiny else FULL
    given = {"kernel_lengths": args.kernel_lengths, "model_lengths": args.model_lengths,
             "batches": args.batches, "warmup": args.warmup, "reps": args.reps,
             "decode_steps": args.decode_steps}
    shapes = replace(shapes, **{k: tuple(v) if isinstance(v, list) else v
                                for k, v in given.items() if v is not None})
    if min(shapes.batches + shapes.kernel_lengths + shapes.model_lengths) < 1 or (
            shapes.reps < 1 or shapes.warmup < 0 or shapes.decode_steps < 1):
        _parser().error("lengths, batches, --reps and --decode-steps must be positive")
    timer = Timer(device)
    ctx = Context(device, shapes, _backend(args.backend, device), timer,
                  quanto_unpack=args.quanto_unpack,
                  quanto_axes=tuple(args.quanto_axes))
    deadline = start + args.budget_s
    rows: list[Row] = []
    with watchdog(deadline + GRACE_S - time.monotonic()):
        try:
            ctx.peak_bytes_per_s = copy_bandwidth(device, shapes.copy_bytes, timer)
            free_memory(device)
            run_items(plan(ctx, tuple(args.sections)), deadline, device, rows)
        except SuiteTimeout:  # outside any group (the copy): the rows so far stand
            ctx.notes.append("the watchdog fired outside a group; the rows so far stand")
    lines = header(ctx, args, args.tiny)
    lines += ["", table(rows), ""]
    lines += [f"note: {n}" for n in ctx.notes]
    lines.append(
        f"columns: time = median µs per call (kernel, graph; "
        f"{'CUDA events' if device.type == 'cuda' else 'perf_counter'}, {shapes.reps} calls "
        f"after {shapes.warmup}) or ms per decode step (mean of the timed steps); vs baseline "
        "= SDPA time / this time (kernel), tok/s / DynamicCache tok/s (model), eager / replay "
        "(graph); memory = bytes read (kernel) or torch.cuda.max_memory_allocated peaks "
        "(model, weights included); saved = (DynamicCache peak - peak) / DynamicCache KV "
        f"bytes; error = max |out - fp32 reference| (kernel; FAIL above {ATOL:g}) or logit "
        "differences to DynamicCache (model)")
    lines.append(f"total {time.monotonic() - start:.0f} s of a {args.budget_s:.0f} s budget")
    text = "\n".join(lines)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"section": r.section, "tokens": r.tokens, "batch": r.batch,
                        "method": r.method, "status": r.status,
                        "values": {k: v for k, v in r.values.items()
                                   if isinstance(v, (int, float, str)) or v is None}}
                       for r in rows], f, indent=2)
    return (1 if any(r.failed for r in rows) else 0), rows, text


def main(argv: list[str] | None = None) -> int:
    return run(argv)[0]


if __name__ == "__main__":
    sys.exit(main())
