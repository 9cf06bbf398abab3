"""Weight formats: how the engine stores and multiplies linear layers' weights.

``[model] weights`` in a topology names one; third-party formats register under the entry-point
group ``pdflow.weights`` (a :class:`WeightFormat` subclass). The built-in names are
:mod:`pdflow.plugins`'s.
"""

from pdflow.engine.weights.base import PackedLinear, WeightFormat
from pdflow import plugins

registry = plugins.weight_formats
BUILTIN, ENTRY_POINT_GROUP = registry.builtin, registry.group

__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "PackedLinear", "WeightFormat", "registry"]
