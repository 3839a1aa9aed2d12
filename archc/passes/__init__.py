"""Passes: exact Graph → Graph rewrites from the unfused graph to kernel-level ops, registered by
name in ``PASSES``; ``run_pipeline`` runs a pipeline of them (``optimize``: just the result)."""

from archc.passes import (  # noqa: F401  (each module registers its passes)
    attention,
    bias,
    context,
    cross_kv,
    kernels,
    latent,
    logits,
    norms,
    paged,
    projections,
    recurrent,
    shard,
)
from archc.passes.manager import (
    DEFAULT_PIPELINE,
    PASSES,
    Decision,
    PassContext,
    PassFailure,
    optimize,
    register_pass,
    run_pipeline,
)

__all__ = [
    "DEFAULT_PIPELINE", "PASSES", "Decision", "PassContext", "PassFailure", "optimize",
    "register_pass", "run_pipeline",
]
