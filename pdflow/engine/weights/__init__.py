"""Weight formats: how the engine stores and multiplies linear layers' weights.

``[model] weights`` in a topology names one; third-party formats register under the entry-point
group ``pdflow.weights`` (a :class:`WeightFormat` subclass).
"""

from pdflow.engine.weights.base import PackedLinear, WeightFormat
from pdflow.registry import Registry

ENTRY_POINT_GROUP = "pdflow.weights"
BUILTIN = {
    "fp32": ("pdflow.engine.weights.formats:Fp32", ""),
    "bf16": ("pdflow.engine.weights.formats:Bf16", ""),
    "int8": ("pdflow.engine.weights.formats:Int8", ""),
    "int4": ("pdflow.engine.weights.formats:Int4", ""),
    "int8-a16": ("pdflow.engine.weights.formats:Int8A16", ""),
    "int4-a16": ("pdflow.engine.weights.formats:Int4A16", ""),
    "int8-a8": ("pdflow.engine.weights.formats:Int8A8", ""),
    "int4-a8": ("pdflow.engine.weights.formats:Int4A8", ""),
    "int4-a16-blocked": ("pdflow.engine.weights.formats:Int4A16Blocked", ""),
}
registry = Registry("weight format", ENTRY_POINT_GROUP, WeightFormat, BUILTIN)

__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "PackedLinear", "WeightFormat", "registry"]
