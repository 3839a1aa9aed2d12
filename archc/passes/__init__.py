"""Passes: Graph → Graph rewrites from the unfused graph to kernel-level ops, each registered by
name (``PASSES``) and exact: the function is kept up to rounding. ``run_pipeline(program,
"default")`` runs the default pipeline over every graph of a program, verifying after each pass;
``optimize`` returns just the result.
"""

from archc.passes import (  # noqa: F401  (each module registers its passes)
    attention,
    bias,
    cleanup,
    cross_kv,
    kernels,
    norms,
    projections,
    recurrent,
)
from archc.passes.manager import (
    DEFAULT_PIPELINE,
    PASSES,
    PIPELINES,
    Decision,
    PassContext,
    PassFailure,
    PassStep,
    PipelineRun,
    optimize,
    register_pass,
    register_program_pass,
    resolve_pipeline,
    run_pipeline,
)

__all__ = [
    "DEFAULT_PIPELINE", "PASSES", "PIPELINES", "Decision", "PassContext", "PassFailure",
    "PassStep", "PipelineRun", "optimize", "register_pass", "register_program_pass",
    "resolve_pipeline", "run_pipeline",
]
