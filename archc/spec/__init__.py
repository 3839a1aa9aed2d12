"""Specs: frozen, validated descriptions of transformer architectures."""

from archc.spec.load import ZOO_DIR, dump_yaml, from_dict, load_spec, load_yaml, to_dict, zoo_names
from archc.spec.schema import Spec

__all__ = ["Spec", "ZOO_DIR", "dump_yaml", "from_dict", "load_spec", "load_yaml", "to_dict",
           "zoo_names"]
