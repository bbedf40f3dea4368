"""Runtime: what a compiled model runs. The packed layer (sinks + packed groups + residual),
the transformers ``Cache`` that holds one per attention layer, the attention op the rewritten
graph calls, and the wiring of the model's ``forward`` and ``generate``."""
