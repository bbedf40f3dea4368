"""The graph passes: trace one attention block per kind, find how it consumes its cached
tensors, and rewrite it onto the packed cache.

``trace`` finds the attention blocks and exports one per kind; ``contraction`` finds the
attention consumer and walks each operand back to the tensor the block would cache;
``rope`` finds a rotary embedding on the key path; ``analyse`` runs them over a model and
returns the facts (``facts``) that policy derivation reads, leaving in ``node.meta`` the
records the rewrite reads; ``rewrite`` replaces the block's cache writes and attention
with kvpolicy's ops. ``config`` reads the attention facts of the model's config;
``fx_graph`` holds the FX helpers they share and the ``networkx`` view of a graph their
walks run on (docs/design.md §4).
"""
