"""FX passes: trace an attention block, analyse how it contracts K and V, find RoPE.

Each pass takes a ``torch.fx.GraphModule`` (an exported ATen graph), writes immutable
records into ``node.meta["kvpolicy.*"]`` and returns what it found. Analysis, policy
derivation (``kvpolicy.policy``) and the rewrite stay separate.
"""
