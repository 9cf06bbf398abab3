"""The stage kinds: built-in ones named as ``"module:Class"`` and imported only when a process
needs one; third-party ones through the ``pdflow.stages`` entry-point group::

    [project.entry-points."pdflow.stages"]
    redact = "mypkg.redact:RedactStage"
"""

from __future__ import annotations

from pdflow.plugins import stage_kinds as registry

BUILTIN, ENTRY_POINT_GROUP = registry.builtin, registry.group
