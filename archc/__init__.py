"""archc: a compiler for transformer architectures. A declarative spec (or a Hugging Face
checkpoint, or a GGUF file) is lowered to an operator IR, rewritten by passes you can watch one by
one, rendered to Triton kernels, run, and proved against an eager PyTorch interpreter."""

from archc.api import CompiledModel, Model, from_spec, load
from archc.errors import ArchcError, SpecError
from archc.versions import ARCHC

__version__ = ARCHC

__all__ = ["ArchcError", "CompiledModel", "Model", "SpecError", "from_spec", "load"]
