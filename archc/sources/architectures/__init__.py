"""The Hugging Face architectures archc reads, grouped by family of model types."""

from archc.sources.architectures.encoders import BERT, T5
from archc.sources.architectures.gpt import BLOOM, FALCON, GPT2, GPTJ, MPT, NEOX, OPT, PHI
from archc.sources.architectures.llama import GEMMA, LLAMA
from archc.sources.architectures.mamba import JAMBA, MAMBA
from archc.sources.hf_config import Architecture

ARCHITECTURES: tuple[Architecture, ...] = (
    LLAMA, GEMMA, GPT2, GPTJ, NEOX, FALCON, BLOOM, MPT, OPT, PHI, BERT, T5, MAMBA, JAMBA)
