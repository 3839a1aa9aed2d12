"""The Hugging Face architectures archc reads, one module per family of model types."""

from archc.sources.architectures.base import Architecture
from archc.sources.architectures.bert import BERT
from archc.sources.architectures.bloom import BLOOM
from archc.sources.architectures.falcon import FALCON
from archc.sources.architectures.gemma import GEMMA
from archc.sources.architectures.gpt2 import GPT2
from archc.sources.architectures.gptj import GPTJ
from archc.sources.architectures.jamba import JAMBA
from archc.sources.architectures.llama import LLAMA
from archc.sources.architectures.mamba import MAMBA
from archc.sources.architectures.mpt import MPT
from archc.sources.architectures.neox import NEOX
from archc.sources.architectures.opt import OPT
from archc.sources.architectures.phi import PHI
from archc.sources.architectures.t5 import T5

ARCHITECTURES: tuple[Architecture, ...] = (
    LLAMA, GEMMA, GPT2, GPTJ, NEOX, FALCON, BLOOM, MPT, OPT, PHI, BERT, T5, MAMBA, JAMBA)

__all__ = ["ARCHITECTURES", "Architecture"]
