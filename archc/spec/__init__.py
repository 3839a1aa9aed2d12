"""Specs: frozen, validated descriptions of transformer architectures."""

from archc.spec.load import dump_yaml, from_dict, gated_d_ff, load_yaml, to_dict
from archc.spec.schema import Spec
from archc.spec.zoo import ZOO_DIR, load_spec, resolve_spec_path, zoo_names

__all__ = [
    "Spec", "ZOO_DIR", "dump_yaml", "from_dict", "gated_d_ff", "load_spec", "load_yaml",
    "resolve_spec_path", "to_dict", "zoo_names",
]
