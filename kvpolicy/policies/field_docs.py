"""What every field of the policy models means: a description and an example per field.

``documented`` (a class decorator in schema.py and spec.py) puts each entry on its pydantic
field (``Field.description``, ``Field.examples``, and ``json_schema_extra["allowed"]``
where a validator, not the annotation, says which values pass), so the models' JSON schema
and the reference page docs/reference/policy-file.md (``docs/gen_reference.py``) read
them from the schema. Kept apart from the models so that schema.py and spec.py stay
small; tests/test_docs.py fails for a field without an entry, or with an example its field
refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from .rules import BUDGET_WIDTHS, FULL_PRECISION, GROUP_CHOICES, SUPPORTED_BITS, join_or

__all__ = ["FieldDoc", "FIELD_DOCS", "documented"]

M = TypeVar("M", bound=type[BaseModel])


@dataclass(frozen=True)
class FieldDoc:
    """One field's entry: ``text`` says what it does, ``example`` is a value it accepts,
    ``allowed`` the values a validator allows where the annotation does not say."""

    text: str
    example: Any
    allowed: str | None = None


_WIDTHS = join_or(SUPPORTED_BITS)
_BUDGET = f"a float in [{BUDGET_WIDTHS[0]}, {FULL_PRECISION}]"
_GROUPS = list(GROUP_CHOICES)
_ERRORS = "one number per entry of `widths` (null: that width does not fit the tensor)"
_GROUP_ERRORS = "one row per entry of `groups`, each with " + _ERRORS

# A calibration and a key/value pair small enough to read, valid against their models.
_CALIBRATION = {
    "source": "pydoc text, last 2048 tokens", "tokens": 512, "rows": 4,
    "settings": "5d41402abc4b2a76", "widths": [1, 2, 3, 4, 8],
    "layers": [{"layer": 0, "key": [0.91, 0.12, 0.031, 0.0082, 0.0001],
                "value": [2.4, 0.53, 0.12, 0.029, 0.0004]}],
}
_KEY = {
    "layer": 0, "tensor": "key", "axis": "channel", "bits": 2, "group_size": 32,
    "pre_rope": True, "residual": 128, "sinks": 4, "head_dim": 64, "num_kv_heads": 3,
    "contraction": "q·kᵀ over head_dim=64 (scaled_dot_product_attention)",
    "rope": "rotate_half 64/64", "rope_style": "rotate_half", "rotary_dim": 64,
    "derived_axis": "channel", "derived_pre_rope": True,
    "reason": "q·kᵀ sums over channels, so each channel gets its own scale (groups of 32 "
              "tokens); quantized before rotate_half RoPE",
}
_VALUE = {
    "layer": 0, "tensor": "value", "axis": "token", "bits": 2, "group_size": 32,
    "pre_rope": False, "residual": 128, "sinks": 4, "head_dim": 64, "num_kv_heads": 3,
    "contraction": "softmax·V over tokens (scaled_dot_product_attention)",
    "derived_axis": "token", "derived_pre_rope": False,
    "reason": "softmax·V sums over tokens, so each token gets its own scale (groups of 32 "
              "channels)",
}

_SETTINGS: dict[str, FieldDoc] = {
    "bits": FieldDoc(
        "The code width of every tensor: an int is one width for all of them (16 keeps them "
        "in full precision). A float is a budget: the average code bits per cached element "
        "over all layers and both tensors, spread over the tensors by their measured "
        "sensitivity (one calibration forward and backward per row of text), so `3.0` is a "
        "budget and `3` a width. Scales and zeros are not counted; `stored_bits` counts "
        "them. Left out of a file, it is the `bits=` of the call (2 by default).",
        2.5,
        f"a width: {_WIDTHS} (16 = full precision); or {_BUDGET}, a budget allocated among "
        f"the widths {join_or(BUDGET_WIDTHS)}",
    ),
    "stored_bits": FieldDoc(
        "A budget of average *stored* bits per element: the codes plus a scale and a zero "
        "per group (2-bit codes store 3.0 in groups of 32 with fp16 scales and zeros, 2.5 in "
        "groups of 64). Widths, group sizes (where `group_size` is not given) and metadata "
        "widths are allocated together per tensor from measured costs. The full-precision "
        "sink and residual windows are not counted unless `budget_context` is given. Give "
        "it or a float `bits`, not both, and leave `bits` out.",
        3.0,
        f"a number in [{BUDGET_WIDTHS[0]}, {FULL_PRECISION}] (3 and 3.0 alike); null: no "
        "stored-bits budget",
    ),
    "budget_context": FieldDoc(
        "Where `stored_bits` counts: null counts the packed body alone; a number of tokens "
        "counts the whole cache every layer holds after that many (a local layer: its "
        "window): codes, scales and zeros, and the sinks, the residual window and the "
        "incomplete chunk in full precision, as `inspect`'s last line counts them, per "
        "element of what an fp16 cache keeps (a local layer: its last window - 1 tokens). The "
        "allocator then prices each layer's key and value choices together, since the key "
        "group sets how many recent tokens wait in full precision. Unless `residual` is "
        "written, the residual window becomes 32 tokens (every full-precision token is paid "
        "from the budget).",
        4096,
        "an int >= 1 (needs `stored_bits`); null: the packed body only",
    ),
    "budget_pages": FieldDoc(
        "Where `stored_bits` counts when the cache is served in pages (vLLM): null, or the "
        "tokens of a page. Each layer's page, its codes, scales and zeros and the full-"
        "precision stage of one chunk and sink area every page carries, then holds at most "
        "`stored_bits` per element of its tokens, every layer on its own (the engine gives "
        "all layers the largest page). Groups whose chunk does not divide the page are not "
        "candidates; the vLLM plugin's block size becomes the page. On SmolLM2 at 3.0 bits "
        "per 512-token page this holds 5.50x bf16's tokens at 1.26x its perplexity: each "
        "page pays about 20 fp16 tokens, and most layers' values fall to 1 bit.",
        512,
        "a multiple of 16 (needs `stored_bits`, excludes `budget_context`); null",
    ),
    "group_size": FieldDoc(
        "Elements per quantization group, which share one scale and one zero: consecutive "
        "tokens of one channel (axis `channel`) or channels of one token (axis `token`, "
        "where it must divide head_dim). Not given: 32, except that at a fixed 2 bits with "
        "`meta_bits: auto` keys take groups of 12 and values groups of 32 with 8-bit "
        "metadata, and that a per-token group not dividing head_dim shrinks to the largest "
        "byte-aligned divisor below it (said in the reason); under `stored_bits`, `auto`. "
        "`auto` or a list of candidates lets a stored-bits budget choose each tensor's "
        "group; a given int stays fixed.",
        64,
        "an int > 0 with group_size × bits a multiple of 8; `auto` (a stored-bits budget "
        f"chooses among {_GROUPS}, and 16 where 8-bit metadata is measured); or a list of "
        "candidates such as [32, 64]",
    ),
    "residual": FieldDoc(
        "The most recent tokens kept out of the packed body, in full precision unless "
        "`residual_bits` says otherwise (KIVI's residual window); older "
        "tokens are packed in groups as they leave it. Key and value of a layer share it. "
        "Left out, a local (sliding-window) layer keeps `residual × window / 4096` of "
        "them (16 of a 512-token window): it holds about a window of tokens, where a "
        "global layer spreads its residual over the whole context. Left out under a "
        "whole-cache budget (`budget_context`), it is 64 held at 8 bits (`residual_bits`), "
        "32 at 16: the same bytes. `auto` (a whole-cache budget only, without "
        "`residual_bits`): the budget chooses each global layer's window, 32, 64 or 128 "
        "tokens at 8 bits or 32 at 16, with that layer's body, from measured costs.",
        128,
        "an int ≥ 0, or `auto`",
    ),
    "residual_bits": FieldDoc(
        "How the residual window's tokens (and the incomplete group waiting in it) are "
        "held: 16, full precision; 8 or 4, packed per token, each token's channels one group "
        "with a scale and a zero in the cache dtype (8.5 bits per element at 8 bits and "
        "head_dim 64). The whole-cache accounting (`budget_context`, `inspect`, "
        "`memory_report()`) counts them at this width, so a whole-cache budget gives the "
        "bytes saved to the packed body; left out under a whole-cache budget, it is 8. "
        "Sinks stay at 16; a full-precision tensor keeps 16. "
        "vLLM serves the residual as its pages' full-precision stage whatever this says.",
        8,
    ),
    "sinks": FieldDoc(
        "The first tokens of the sequence kept in full precision (attention sinks). Key and "
        "value of a layer share it.",
        4,
    ),
    "pre_rope": FieldDoc(
        "true: keys are quantized before RoPE and RoPE is re-applied after dequantization, "
        "wherever a layer's key path has RoPE (a layer without RoPE is not an error here). "
        "false: keys are cached after RoPE, as KIVI caches them.",
        False,
    ),
    "axis": FieldDoc(
        "The axis along which scales vary, for keys and values alike: `channel` (one scale "
        "per channel, groups of consecutive tokens) or `token` (one scale per token, groups "
        "of consecutive channels). null: the axis the analysis derives from how each tensor "
        "is contracted (keys per channel, values per token on standard attention); set, it "
        "counts as an override wherever it differs from the derived one.",
        "token",
    ),
    "rotation": FieldDoc(
        "An orthogonal rotation of the head dim before quantization, for values only (the "
        "keys' RoPE does not commute with it). `hadamard` stores every value rotated by a "
        "sign-flipped Walsh-Hadamard matrix and rotates the attention output back once per "
        "step (needs a power-of-two head_dim). `auto` (a budget only): the calibration "
        "measures both and keeps the rotation where it cuts the measured cost below 0.95x. "
        "`none`: not rotated, except that at a fixed 2 bits with `meta_bits: auto` kvpolicy "
        "rotates values where head_dim is a power of two.",
        "hadamard",
    ),
    "levels": FieldDoc(
        "The quantization levels: `uniform` spans each group's min to max; `normal` places "
        "the Lloyd-Max levels of a unit Gaussian by the group's mean and standard deviation "
        "(the same bytes; tables for 1-4 bits; not with 8-bit metadata); `vq` (values "
        "only; in the defaults it means the values') codes each sub-vector of 8 / bits "
        "channels (1 or 2 bits) as one byte, an index into 256 centroids per kv head fitted "
        "by k-means on calibration text, times one scale per group and no zero (by default "
        "an 8-bit scale per token and head, Hadamard-rotated: 2.125 stored bits at 2 bits); "
        "`auto` is uniform at a fixed width, and under a budget the calibration measures "
        "both and keeps normal levels where they cost under 0.95x; under a stored-bits "
        "budget it also prices vq values at 1 and 2 bits.",
        "uniform",
    ),
    "meta_bits": FieldDoc(
        "The width of each group's stored scale and zero: 16 (the cache dtype) or 8 (a scale "
        "index into a table of powers of 2^(1/8) and an int8 zero point; uniform levels "
        "only), which halves the group at the same stored bits (2 bits in groups of 16: 3.0 "
        "bits per element, as groups of 32 with 16). `auto`: 8 at a fixed 2 bits where "
        "kvpolicy picks the group (no `group_size` written, uniform levels), keys then in "
        "groups of 12 and values in groups of 32; under a stored-bits budget measured both "
        "ways and chosen per tensor; 16 otherwise.",
        16,
    ),
    "fit": FieldDoc(
        "How a group's 8-bit grid is fitted: `minmax` puts the outer levels on the group's "
        "extremes; `mse` also tries the grids one to three table steps finer and keeps the "
        "one of least squared error (8-bit metadata only); `auto` is mse for keys whose "
        "metadata is, or may become, 8-bit, and minmax otherwise.",
        "minmax",
    ),
    "channel_widths": FieldDoc(
        "Per-channel key widths (keys grouped per channel): `auto` gives each key channel "
        "1-4 bits, `bits` on average per kv head, where the queries look (`E[q²]·range²` "
        "measured on 512 tokens of calibration text), in the bytes of one width; `uniform` "
        "is one width per tensor. Left at `auto`, a model without calibration text (no "
        "tokenizer beside it) keeps one width; written, it is an error there.",
        "uniform",
    ),
}

_RULE: dict[str, FieldDoc] = {
    "layers": FieldDoc(
        "The attention layers the rule applies to: an index, a list, an inclusive range "
        '"a-b" or "*" (every layer). A layer the model does not have is an error that names '
        "the model's layers.",
        "0-3",
        'an int ≥ 0; a range "a-b" with a ≤ b; a list of ints and ranges; or "*"',
    ),
    "tensor": FieldDoc("The tensor of the selected layers: `key`, `value` or `*` (both).",
                       "key"),
    "bits": FieldDoc(
        "The code width of the selected tensors. Under a budget the rule pins them: they are "
        "not allocated, and the rest of the budget is spread over the others (a float budget "
        "is a key of `defaults` only).",
        4,
        f"{_WIDTHS} (16 = full precision)",
    ),
    "group_size": FieldDoc(
        "The group size of the selected tensors (as `defaults.group_size`); `auto` or a list "
        "of candidates for a stored-bits budget to choose from.",
        64,
        _SETTINGS["group_size"].allowed,
    ),
    "axis": FieldDoc(
        "Pins the scale axis of the selected tensors; marked overridden where it differs from "
        "the derived one (the kivi presets pin keys to `channel` and values to `token`).",
        "channel",
    ),
    "pre_rope": FieldDoc(
        "Keys of the selected layers quantized before (true) or after (false) RoPE; true on "
        "a layer without RoPE, or on values, is an error.",
        False,
    ),
    "residual": FieldDoc(
        "The full-precision window of recent tokens of the selected layers. Key and value of "
        "a layer share it: set it with `tensor: '*'`.",
        64,
    ),
    "sinks": FieldDoc(
        "The full-precision first tokens of the selected layers. Key and value of a layer "
        "share them: set them with `tensor: '*'`.",
        0,
    ),
    "rotation": FieldDoc("The rotation of the selected values (as `defaults.rotation`); "
                         "on keys it is an error.", "hadamard"),
    "levels": FieldDoc("The levels of the selected tensors (as `defaults.levels`).", "normal"),
    "meta_bits": FieldDoc("The metadata width of the selected tensors (as "
                          "`defaults.meta_bits`).", 8),
    "residual_bits": FieldDoc("How the selected tensors hold their residual window (as "
                              "`defaults.residual_bits`).", 8),
    "fit": FieldDoc("The fit of the selected tensors' 8-bit grids (as `defaults.fit`).", "mse"),
    "channel_widths": FieldDoc("Per-channel widths of the selected keys (as "
                               "`defaults.channel_widths`).", "uniform"),
}

_SPEC: dict[str, FieldDoc] = {
    "version": FieldDoc("The version of the policy file format; optional.", 1),
    "source": FieldDoc(
        "Not a key of the file: where the spec came from (the file path, `<dict>` or a "
        "preset name), set by the loader and named in every error message.",
        "my-policy.yaml",
    ),
    "defaults": FieldDoc(
        "Settings for every cached tensor before the overrides. A key left out takes "
        "kvpolicy's own value.",
        {"bits": 2, "sinks": 4},
    ),
    "overrides": FieldDoc(
        "Rules applied in order after the defaults, each to the layers and tensor it "
        "selects; where two set the same field, the later wins. A value that differs from "
        "the derived one is kept, marked `overridden` and explained in the tensor's reason.",
        [{"layers": "0-3", "tensor": "key", "bits": 4}],
    ),
    "calibration": FieldDoc(
        "For a bit budget: the measured sensitivity the widths are allocated from. "
        "`save_policy` writes it so that compiling from the saved file skips calibrating; it "
        "is refused once the settings it was measured with change. Absent: a budget "
        "calibrates when it is compiled.",
        _CALIBRATION,
    ),
}

_CALIBRATION_DOCS: dict[str, FieldDoc] = {
    "metric": FieldDoc(
        "What each error measures: the cost of the change Δo of one attention output when "
        "one tensor of one layer is quantized and everything else is exact; by default "
        "the squared first-order change of the calibration text's loss, "
        "`Σ_t (∂L/∂o_t · Δo_t)²`.",
        "loss-weighted attention-output error",
    ),
    "model": FieldDoc("The name of the model measured, for a reader.", "SmolLM2-135M"),
    "source": FieldDoc("Which tokens were measured.", "pydoc text, last 2048 tokens"),
    "tokens": FieldDoc("Tokens per row of calibration text.", 512),
    "rows": FieldDoc("Rows of calibration text; the costs add over rows.", 4),
    "seconds": FieldDoc("How long the calibration took, for a reader.", 58.2),
    "settings": FieldDoc(
        "A fingerprint of everything the errors depend on besides the width (per tensor: "
        "axis, group size and its candidates, pre-RoPE, residual, sinks, rotation, levels, "
        "metadata width, fit): a saved calibration is refused once these change.",
        "5d41402abc4b2a76",
    ),
    "widths": FieldDoc("The widths measured: the columns of every row of errors.",
                       [1, 2, 3, 4, 8], f"each of {join_or(BUDGET_WIDTHS)}"),
    "groups": FieldDoc(
        "The candidate group sizes measured for tensors whose group a stored-bits budget "
        "chooses (the rows of the `*_groups` tables); empty when every group is fixed.",
        [32, 64],
        "increasing ints > 0",
    ),
    "layers": FieldDoc("The errors of each attention layer's key and value.",
                       _CALIBRATION["layers"]),
    "recent": FieldDoc("The recent-window choices measured, `[residual tokens, "
                       "residual_bits]` each (the rows of `key_recent` / `value_recent`); "
                       "empty when the budget chooses no window.", [[32, 8], [64, 8]],
                       "pairs of an int ≥ 0 and 16, 8 or 4"),
}

_K, _V = _CALIBRATION["layers"][0]["key"], _CALIBRATION["layers"][0]["value"]


def _scaled(row: list[Any], *factors: float) -> list[Any]:
    return [None if e is None else round(e * f, 5) for e, f in zip(row, factors, strict=True)]


def _per_group(row: list[Any]) -> list[list[Any]]:
    """An example table for groups [32, 64]: the larger group errs more."""
    return [row, _scaled(row, *[1.3] * len(row))]


# Normal levels have no 8-bit table: null there.
_KN = _scaled(_K, 0.9, 0.85, 1.1, 1.1, 1)[:4] + [None]
_VN = _scaled(_V, 0.9, 0.9, 1.1, 1.1, 1)[:4] + [None]
_SENSITIVITY: dict[str, FieldDoc] = {
    "layer": FieldDoc("The attention layer measured.", 0),
    "key": FieldDoc("The key's error at each width, at its own group size.", _K, _ERRORS),
    "value": FieldDoc("The value's error at each width, at its own group size.", _V, _ERRORS),
    "value_rotated": FieldDoc("For `rotation: auto`: the value's errors with the Hadamard "
                              "rotation.", _scaled(_V, *[0.85] * 5), _ERRORS),
    "key_groups": FieldDoc("For a group a stored-bits budget chooses: the key's errors at "
                           "each candidate group and width.", _per_group(_K), _GROUP_ERRORS),
    "value_groups": FieldDoc("The value's errors at each candidate group and width.",
                             _per_group(_V), _GROUP_ERRORS),
    "value_rotated_groups": FieldDoc("The rotated value's errors at each candidate group and "
                                     "width.", _per_group(_scaled(_V, *[0.85] * 5)),
                                     _GROUP_ERRORS),
    "key_normal": FieldDoc("For `levels: auto` under a budget: the key's errors with normal "
                           "levels (null at widths without a normal table).", _KN, _ERRORS),
    "value_normal": FieldDoc("The value's errors with normal levels.", _VN, _ERRORS),
    "key_normal_groups": FieldDoc("The key's errors with normal levels at each candidate group "
                                  "and width.", _per_group(_KN), _GROUP_ERRORS),
    "value_normal_groups": FieldDoc("The value's errors with normal levels at each candidate "
                                    "group and width.", _per_group(_VN), _GROUP_ERRORS),
    "key_meta8": FieldDoc("For `meta_bits: auto` under a stored-bits budget: the key's errors "
                          "with 8-bit scales and zeros (uniform levels).",
                          _scaled(_K, *[1.05] * 5), _ERRORS),
    "value_meta8": FieldDoc("The value's errors with 8-bit scales and zeros.",
                            _scaled(_V, *[1.05] * 5), _ERRORS),
    "key_meta8_groups": FieldDoc("The key's errors with 8-bit scales and zeros at each "
                                 "candidate group and width.",
                                 _per_group(_scaled(_K, *[1.05] * 5)), _GROUP_ERRORS),
    "value_meta8_groups": FieldDoc("The value's errors with 8-bit scales and zeros at each "
                                   "candidate group and width.",
                                   _per_group(_scaled(_V, *[1.05] * 5)), _GROUP_ERRORS),
    "value_vq": FieldDoc("For vq values under a stored-bits budget (`levels: auto`, "
                         "`meta_bits: auto`): the value's errors vector-quantized at 1 and 2 "
                         "bits, one 8-bit scale per token and head, Hadamard-rotated where "
                         "head_dim is a power of two.", [_V[0] * 0.5, _V[1] * 0.6, None, None,
                                                         None], _ERRORS),
    "value_vq_books": FieldDoc("The codebook each `value_vq` error was measured with (a "
                               "`codebook` text; empty where not measured): the one the "
                               "policy takes where the allocator chooses vq.",
                               ["", "", "", "", ""], "one text per entry of `widths`"),
    "key_recent": FieldDoc("For a recent window a whole-cache budget chooses: per entry of "
                           "`recent`, the error of a 2-bit body with that many recent tokens "
                           "exact, and the error of those tokens alone at that width (0 at "
                           "16 bits); null where the layer's window is fixed.",
                           [[_K[1], 2e-7], [_K[1] * 0.9, 3e-7]],
                           "one [body, window] pair per entry of `recent`"),
    "value_recent": FieldDoc("The same for the value.", [[_V[1], 1e-7], [_V[1] * 0.9, 2e-7]],
                             "one [body, window] pair per entry of `recent`"),
}

_MODEL_POLICY: dict[str, FieldDoc] = {
    "version": FieldDoc("The version of the format.", 1),
    "model": FieldDoc("The name of the model the policy was derived for.", "SmolLM2-135M"),
    "source": FieldDoc("The spec it was built from: a preset name, a file path or `<dict>`.",
                       "kvpolicy-2"),
    "tensors": FieldDoc("Every cached tensor's policy, in layer order, each layer's key "
                        "then its value.", [_KEY, _VALUE]),
    "budget": FieldDoc("The bit budget the widths were allocated under, in `budget_unit`; "
                       "null for widths set per tensor.", 2.5),
    "budget_unit": FieldDoc("The unit of `budget`: `code`, average code bits per cached "
                            "element (a float `bits`), or `stored`, average stored bits "
                            "(`stored_bits`: scales and zeros counted).", "code"),
    "budget_context": FieldDoc("The context length a stored-bits budget counted the whole "
                               "cache at (`defaults.budget_context`); null: the packed body "
                               "alone, or no stored-bits budget.", 4096),
    "budget_pages": FieldDoc("The page a stored-bits budget counted (`defaults.budget_"
                             "pages`); null: not a paged count.", 512),
    "calibration": FieldDoc("The measured sensitivity a budget was allocated from; null "
                            "without a budget.", _CALIBRATION),
    "windows": FieldDoc("Per layer, the sliding window of a local layer (null: a global "
                        "layer), as the model's config says; empty for a model without "
                        "local layers. Read by the whole-cache figure (`inspect`'s last "
                        "line): a local layer holds about a window of tokens.",
                        [512, 512, 512, 512, 512, None]),
    "window_choices": FieldDoc("The `[residual, residual_bits]` pairs a whole-cache budget "
                               "chooses among for each global layer's recent window (written "
                               "when a `budget_context` budget writes neither `residual` nor "
                               "`residual_bits`); empty: every window is as the policy says.",
                               [[32, 8], [64, 8], [128, 8], [32, 16]],
                               "pairs of an int ≥ 0 and 16, 8 or 4"),
}

_TENSOR: dict[str, FieldDoc] = {
    "layer": FieldDoc("The attention layer.", 0),
    "tensor": FieldDoc("Which cached tensor: `key` or `value`.", "key"),
    "axis": FieldDoc("The axis along which scales vary: `channel` (groups of consecutive "
                     "tokens of one channel) or `token` (groups of consecutive channels of "
                     "one token).", "channel"),
    "bits": FieldDoc("The code width (16: stored in full precision).", 2,
                     f"{_WIDTHS} (16 = full precision)"),
    "group_size": FieldDoc("Elements per group, sharing one scale and one zero.", 32,
                           "an int > 0 with group_size × bits a multiple of 8; dividing "
                           "head_dim on axis `token`"),
    "pre_rope": FieldDoc("Keys cached before RoPE; RoPE is re-applied after dequantization "
                         "(needs `rope`).", True),
    "residual": FieldDoc("The most recent tokens kept out of the packed body, at "
                         "`residual_bits`.", 128),
    "sinks": FieldDoc("The first tokens kept in full precision.", 4),
    "head_dim": FieldDoc("Channels per head.", 64),
    "num_kv_heads": FieldDoc("Cached heads: a token holds num_kv_heads × head_dim elements "
                             "of this tensor.", 3),
    "contraction": FieldDoc("How the attention consumes this tensor, as the analysis found "
                            "it.", _KEY["contraction"]),
    "rope": FieldDoc("The RoPE found on the key path (style and rotated channels); null: "
                     "none, always for values.", "rotate_half 64/64"),
    "rope_style": FieldDoc("The RoPE style: `rotate_half` (Llama, NeoX), `interleaved` "
                           "(GPT-J) or `complex` (Meta Llama, gpt-fast); null without RoPE.",
                           "rotate_half"),
    "rotary_dim": FieldDoc("The channels RoPE rotates; null without RoPE.", 64,
                           "an int from 1 to head_dim"),
    "derived_axis": FieldDoc("The axis the analysis derived, kept so that a reason "
                             "survives an override.", "channel"),
    "derived_pre_rope": FieldDoc("Whether the analysis derived pre-RoPE keys (RoPE found on "
                                 "the key path).", True),
    "overridden": FieldDoc("A rule or the defaults changed what was derived (axis, pre-RoPE, "
                           "bits, group size, residual or sinks).", False),
    "bits_from": FieldDoc("Who chose `bits`: the defaults (a width), an override rule, or a "
                          "bit budget's allocator.", "budget"),
    "rotation": FieldDoc("The rotation of the head dim before quantization (values only); "
                         "`auto` before a budget's calibration chose.", "hadamard"),
    "group_sizes": FieldDoc("The candidates a stored-bits budget chose `group_size` from; "
                            "empty: the group size was fixed by the spec.", [32, 64, 128],
                            "at least two increasing ints, among them `group_size`"),
    "levels": FieldDoc("The levels setting; the cache uses normal levels at a width with a "
                       "table (1-4 bits) where it is `normal`, vector-quantized codes "
                       "(`codebook`) where it is `vq`, uniform ones otherwise.", "uniform"),
    "meta_bits": FieldDoc("The width of the stored scale and zero: 16, 8, or `auto` under a "
                          "stored-bits budget before allocation.", 8),
    "residual_bits": FieldDoc("How the residual window's tokens are held: 16 (full "
                              "precision), or 8 or 4 bits per element packed per token.", 16),
    "fit": FieldDoc("How the group's 8-bit grid is fitted: `minmax`, or `mse` (8-bit "
                    "metadata only).", "mse"),
    "channel_widths": FieldDoc("`auto`: each kv head's key channels take 1-4 bits, `bits` on "
                               "average (`widths`); `uniform`: one width.", "uniform"),
    "widths": FieldDoc("Per-channel key widths once allocated, `[kv heads][head_dim]`; "
                       "empty for one width.", [[2, 2, 1, 3]],
                       "each 1-4, averaging `bits` per kv head (keys on axis `channel` only)"),
    "codebook": FieldDoc("For `levels: vq`: the centroids, base64 of little-endian fp16 "
                         "`[kv heads][256][8 / bits]`, fitted by k-means on calibration text; "
                         "empty until fitted (and for every other tensor).", "",
                         "base64 text of kv heads x 256 x 8 / bits fp16 numbers"),
    "reason": FieldDoc("Why this tensor is quantized so: the analysis, the rule or budget "
                       "that set each value, and what was measured.", _KEY["reason"]),
}

FIELD_DOCS: dict[str, dict[str, FieldDoc]] = {
    "PolicySpec": _SPEC,
    "Defaults": _SETTINGS,
    "OverrideRule": _RULE,
    "Calibration": _CALIBRATION_DOCS,
    "LayerSensitivity": _SENSITIVITY,
    "ModelPolicy": _MODEL_POLICY,
    "TensorPolicy": _TENSOR,
}
"""Per model (by class name), per field: its entry."""


def documented(model: M) -> M:
    """Give each field of ``model`` its entry of :data:`FIELD_DOCS` (a field without one
    stays undocumented: tests/test_docs.py names it), then rebuild the model so that its
    JSON schema carries them."""
    docs = FIELD_DOCS.get(model.__name__, {})
    for name, info in model.model_fields.items():
        doc = docs.get(name)
        if doc is None:
            continue
        info.description = doc.text
        info.examples = [doc.example]
        if doc.allowed is not None:
            info.json_schema_extra = {"allowed": doc.allowed}
    model.model_rebuild(force=True)
    return model
