"""The policy a vLLM engine serves: derived from the checkpoint with kvpolicy's analysis.

``additional_config={"kvpolicy": VALUE}`` names what ``compile_model(policy=VALUE)``
takes: a preset (``"kvpolicy-2"``), a policy file (what ``kvpolicy.save_policy`` writes), a
dict, or an int width (``2``). The policy is derived from the served checkpoint as
``compile_model`` derives it (the transformers model is loaded on the CPU, analysed and,
where the policy asks for it, calibrated on the tokenizer's text; then freed), so the
same file gives the same per-layer policy in both engines. Every process of an engine
(front end, engine core, each tensor-parallel worker) needs it: the first derives it and
writes it to ``$KVPOLICY_CACHE/vllm`` (with the RoPE table of pre-RoPE keys), the others
read it back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from functools import cache
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from ..api import derive_policy
from ..errors import KVPolicyError, PolicyError
from ..kernels.layout import Codebook, QuantSpec, RotarySpec
from ..policies import ModelPolicy
from ..runtime.cache import storage_dtype
from ..runtime.paged import PagedLayout
from ..zoo.models import cache_dir

__all__ = ["ServedPolicy", "config_value", "served_policy"]

log = logging.getLogger("vllm.kvpolicy")  # vLLM's handlers print it

KEY = "kvpolicy"  # the additional_config key
# Smallest block the plugin picks when the user gave none: the stage of each page (one
# key group in full precision) costs (C + sinks) / block_size of a page.
MIN_BLOCK = 512


def config_value(vllm_config: Any) -> Any:
    """The ``kvpolicy`` entry of ``vllm_config.additional_config``, or None."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    if not isinstance(extra, dict):
        return None
    # Other plugins share additional_config: only keys that read as ours are checked.
    near = [k for k in extra if k != KEY and isinstance(k, str)
            and k.lower().replace("_", "").replace("-", "").startswith(KEY)]
    if near:
        raise PolicyError(f"kvpolicy: additional_config key {near[0]!r} is not one kvpolicy "
                          f"reads; name the policy under {KEY!r}, e.g. "
                          f'{{"{KEY}": 2}} or {{"{KEY}": "kvpolicy-2"}}')
    value = extra.get(KEY)
    if isinstance(value, bool):
        raise PolicyError(f"kvpolicy: additional_config[{KEY!r}] is {value!r}, which names no "
                          "policy; give a width (2), a preset (\"kvpolicy-2\"), a policy "
                          f"file or a dict, or leave {KEY!r} out to serve vLLM's own cache")
    return value


@dataclass
class ServedPolicy:
    """A derived :class:`ModelPolicy` and what serving it needs beside it."""

    policy: ModelPolicy
    rope: RotarySpec | None  # the table of pre-RoPE keys, None: keys stored as given
    rope_why: str  # why keys are (not) stored before RoPE, for the log and inspect
    model_dtype: torch.dtype
    # per layer, where layer types rotate differently (Gemma3's local and global layers);
    # then ``rope`` is None
    layer_ropes: dict[int, RotarySpec] | None = None

    def rope_for(self, layer: int) -> RotarySpec | None:
        """The rotary table of ``layer``'s pre-RoPE keys, None: its keys stored as given."""
        if self.layer_ropes is not None:
            return self.layer_ropes.get(layer)
        return self.rope

    @property
    def layers(self) -> list[int]:
        return sorted({t.layer for t in self.policy.tensors})

    def specs(self, layer: int, kv_heads: range | None = None) -> tuple[QuantSpec, QuantSpec]:
        """Key and value ``QuantSpec`` of ``layer`` for the kv heads ``kv_heads`` (a
        tensor-parallel rank's share; per-channel key widths are per head)."""
        k, v = self.policy.get(layer, "key"), self.policy.get(layer, "value")
        ks, vs = k.quant_spec(), v.quant_spec()
        if ks.widths is not None and kv_heads is not None:
            ks = replace(ks, widths=tuple(ks.widths[h] for h in kv_heads))
        book = vs.codebook
        if book is not None and kv_heads is not None and len(kv_heads) != book.heads:
            # vq values: the rank's heads' centroids (fp16 both ways: the same values)
            vs = replace(vs, codebook=Codebook.from_tensor(book.tensor()[list(kv_heads)]))
        return ks, vs

    def store_dtype(self, layer: int, cache_dtype: torch.dtype) -> torch.dtype:
        k, v = self.policy.get(layer, "key"), self.policy.get(layer, "value")
        return storage_dtype((k.bits, v.bits), cache_dtype) or cache_dtype

    def chunk(self) -> int:
        """Tokens of the largest key group of any layer (blocks must be multiples)."""
        out = 1
        for layer in self.layers:
            ks, vs = self.specs(layer)
            out = math.lcm(out, ks.token_group, vs.token_group)
        return out

    def full_precision(self) -> bool:
        return all(t.bits == 16 for t in self.policy.tensors)

    def layout(self, layer: int, *, num_kv_heads: int, head_dim: int, v_head_dim: int,
               block_size: int, cache_dtype: torch.dtype,
               kv_heads: range | None = None) -> PagedLayout:
        ks, vs = self.specs(layer, kv_heads)
        k = self.policy.get(layer, "key")
        return PagedLayout(ks, vs, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           v_head_dim=v_head_dim, block_size=block_size, sinks=k.sinks,
                           store_dtype=self.store_dtype(layer, cache_dtype))

    def page_bytes(self, **kw: Any) -> int:
        """The largest page of any layer: vLLM gives every layer of a group one size."""
        return max(self.layout(layer, **kw).page_bytes for layer in self.layers)

    def default_block_size(self) -> int:
        """The page a stored-bits budget was allocated over (``budget_pages``), else the
        smallest multiple of ``lcm(chunk, 32)`` holding at least ``MIN_BLOCK`` tokens and 8
        chunks (a page's stage is then at most an eighth of its tokens)."""
        if self.policy.budget_pages is not None:
            return self.policy.budget_pages
        chunk = self.chunk()
        step = math.lcm(chunk, 32)
        return step * max(1, -(-max(MIN_BLOCK, 8 * chunk) // step))

    def page_count_note(self) -> str | None:
        """What a stored-bits budget that does not count vLLM's pages leaves out (the
        stage and sink area every page carries), for the log; None where it counts them
        or there is no such budget."""
        pol = self.policy
        if pol.budget is None or pol.budget_unit != "stored" or pol.budget_pages is not None:
            return None
        counted = ("the packed body" if pol.budget_context is None else
                   f"the whole cache at {pol.budget_context} tokens")
        return (f"kvpolicy: the stored-bits budget {pol.budget:g} counts {counted}, not the "
                "full-precision stage and sink area every page carries, so vLLM holds fewer "
                f"tokens than {pol.budget:g} bits would; write budget_pages: {MIN_BLOCK} to "
                "count pages (every layer's page within the budget on its own: more tokens, "
                "lower quality, docs/serving.md)")

    def check_model(self, *, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """Refuse a policy that does not fit the served model, naming the mismatch."""
        problems = []
        if self.layers != list(range(num_layers)):
            problems.append(f"the policy covers layers {self.layers[0]}-{self.layers[-1]} "
                            f"({len(self.layers)}), the model has {num_layers}")
        k = self.policy.get(self.layers[0], "key")
        if k.num_kv_heads != num_kv_heads:
            problems.append(f"the policy has {k.num_kv_heads} kv heads per layer, the model "
                            f"{num_kv_heads}")
        if k.head_dim != head_dim:
            problems.append(f"the policy's head_dim is {k.head_dim}, the model's {head_dim}")
        if problems:
            raise PolicyError(f"kvpolicy: the policy {self.policy.source!r} does not fit the "
                              f"served model: {'; '.join(problems)}; derive it from this "
                              "checkpoint (kvpolicy.save_policy after compile_model)")


@cache
def _source_hash() -> bytes:
    """kvpolicy's own source: a derived policy is reused only by the code that derived it
    (the package version does not change between commits of a checkout)."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        h.update(f.read_bytes())
    return h.digest()


def _cache_key(model_path: str, value: Any) -> str:
    cfg = Path(model_path) / "config.json"
    h = hashlib.sha256()
    h.update(version("kvpolicy").encode())
    h.update(_source_hash())
    h.update(str(Path(model_path).resolve()).encode())
    h.update(cfg.read_bytes() if cfg.is_file() else b"")
    if isinstance(value, (str, os.PathLike)) and Path(value).is_file():
        h.update(Path(value).read_bytes())
    h.update(json.dumps(value, sort_keys=True, default=str).encode())
    return h.hexdigest()[:24]


def _rope_table(model: torch.nn.Module, policy: ModelPolicy, max_positions: int
                ) -> tuple[RotarySpec | None, dict[int, RotarySpec] | None, str]:
    """The rotary table of the model's pre-RoPE keys, from the model's own rotary module
    (``model.model.rotary_emb``): one for every layer, or one per layer where the module
    takes a layer type (Gemma3's local and global layers rotate at different bases); or
    None and why."""
    keys = [t for t in policy.tensors if t.tensor.value == "key"]
    pre = [t for t in keys if t.pre_rope and t.bits < 16]
    if not pre:
        return None, None, "no quantized key is cached before RoPE"
    styles = {(t.rope_style, t.rotary_dim) for t in pre}
    if len(styles) != 1:
        return None, None, f"layers rotate keys differently ({sorted(styles, key=str)})"
    style, rdim = styles.pop()
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if style != "rotate_half" or rotary is None:
        return None, None, (f"the rotation ({style}) is not one the plugin can read off "
                            "the model (model.model.rotary_emb, rotate_half)")
    pos = torch.arange(max_positions)[None]
    x = torch.zeros(1, dtype=torch.float32)

    def table(*extra: str) -> RotarySpec:
        cos, sin = rotary(x, pos, *extra)
        cos, sin = cos[0].float(), sin[0].float()
        if cos.shape[-1] != rdim:
            raise ValueError(f"the model's rotary table has {cos.shape[-1]} channels, "
                             f"keys {rdim}")
        return RotarySpec("rotate_half", rdim, cos.contiguous(), sin.contiguous())

    why = f"keys cached before RoPE ({style} {rdim}), rotated back from vLLM's keys"
    try:
        return table(), None, why
    except TypeError as e:  # a rotary module that needs a layer type (Gemma3)
        types = getattr(getattr(model, "config", None), "layer_types", None)
        if not types:
            return None, None, f"the model's rotary module needs more than positions ({e})"
    except ValueError as e:
        return None, None, str(e)
    try:
        by_type = {t: table(t) for t in sorted(set(types))}
    except ValueError as e:  # a table of the wrong width, as above
        return None, None, str(e)
    except (TypeError, AttributeError, KeyError) as e:
        return None, None, f"the model's rotary module takes no layer type ({e})"
    layers = {t.layer for t in pre}
    return None, {i: by_type[types[i]] for i in sorted(layers)}, \
        f"{why}, one table per layer type ({', '.join(sorted(by_type))})"


def _derive(model_path: str, value: Any, max_positions: int) -> ServedPolicy:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        log.warning("kvpolicy: no tokenizer beside %s (%s): policies that calibrate on text "
                    "fall back as compile_model does without one", model_path, e)
        tokenizer = None
    bits = value if isinstance(value, (int, float)) and not isinstance(value, bool) else 2
    policy = None if isinstance(value, (int, float)) else value
    # As compile_model derives it: a stored-bits budget may price vq values, which pages hold
    # (a budget over pages, budget_pages, prices scalar codes only: calibrate.apply)
    pol = derive_policy(model, bits=bits, policy=policy, calibration=tokenizer,
                        progress=False)
    rope, layer_ropes, why = _rope_table(model, pol, max_positions)
    dtype = getattr(model.config, "dtype", None)
    del model
    return ServedPolicy(pol, rope, why, dtype if isinstance(dtype, torch.dtype)
                        else torch.float32, layer_ropes)


_MEMO: dict[tuple, ServedPolicy] = {}


def served_policy(model_path: str, value: Any, max_positions: int) -> ServedPolicy:
    """The policy ``value`` derived for the checkpoint at ``model_path``, with a RoPE
    table of ``max_positions`` rows; derived once per checkpoint and value, then read
    from the disk cache (``$KVPOLICY_CACHE/vllm``) by every later process."""
    # Memoized on the arguments: every layer's impl asks, and the disk key reads files.
    memo = (model_path, json.dumps(value, sort_keys=True, default=str), max_positions)
    if memo in _MEMO:
        return _MEMO[memo]
    where = cache_dir() / "vllm" / f"{_cache_key(model_path, value)}-{max_positions}"
    if not (where / "policy.json").is_file():
        log.info("kvpolicy: deriving the policy %r for %s", value, model_path)
        # In a child process: the analysis and the transformers model stay out of the
        # engine's processes (a front end that derived in-process aborted at exit).
        proc = subprocess.run(
            [sys.executable, "-m", "kvpolicy.vllm.policy", model_path, json.dumps(value),
             str(max_positions), str(where)], capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(_ERROR)]
            why = lines[-1][len(_ERROR):] if lines else proc.stderr[-2000:]
            raise PolicyError(f"kvpolicy: cannot serve the policy {value!r} on "
                              f"{model_path}: {why}")
    served = _read(where)
    _MEMO[memo] = served
    return served


_ERROR = "kvpolicy-error: "


def _read(where: Path) -> ServedPolicy:
    pol = ModelPolicy.model_validate_json((where / "policy.json").read_text())
    meta = json.loads((where / "meta.json").read_text())
    rope, layer_ropes = None, None
    if meta["rope"]:
        t = torch.load(where / "rope.pt")

        def spec(i: int) -> RotarySpec:
            return RotarySpec("rotate_half", meta["rotary_dim"], t["cos"][i], t["sin"][i])
        if meta.get("layers") is None:
            rope = spec(0)
        else:  # per layer: the index of its table
            layer_ropes = {int(layer): spec(i) for layer, i in meta["layers"].items()}
    return ServedPolicy(pol, rope, meta["why"], getattr(torch, meta["dtype"]), layer_ropes)


def _store(served: ServedPolicy, where: Path) -> None:
    tmp = where.with_name(where.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "policy.json").write_text(served.policy.model_dump_json())
    # the distinct tables, stacked, and (per layer) which one each layer rotates with
    tables: list[RotarySpec] = [] if served.rope is None else [served.rope]
    layers = None
    if served.layer_ropes is not None:
        layers = {}
        for layer, r in served.layer_ropes.items():
            if not any(r is t for t in tables):
                tables.append(r)
            layers[layer] = next(i for i, t in enumerate(tables) if t is r)
    (tmp / "meta.json").write_text(json.dumps({
        "rope": bool(tables), "why": served.rope_why, "layers": layers,
        "rotary_dim": tables[0].rotary_dim if tables else None,
        "dtype": str(served.model_dtype).removeprefix("torch.")}))
    if tables:
        torch.save({"cos": torch.stack([t.cos for t in tables]),
                    "sin": torch.stack([t.sin for t in tables])}, tmp / "rope.pt")
    try:
        tmp.rename(where)
    except OSError:  # another process got there first, with the same content
        shutil.rmtree(tmp, ignore_errors=True)


def _main(argv: list[str]) -> int:
    model_path, value, max_positions, where = argv
    try:
        served = _derive(model_path, json.loads(value), int(max_positions))
    except (KVPolicyError, OSError, ValueError) as e:
        print(_ERROR + " ".join(str(e).split()), file=sys.stderr)
        return 2
    _store(served, Path(where))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
