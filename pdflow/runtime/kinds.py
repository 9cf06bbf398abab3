"""What a pipeline's stage kinds say about it at run time: each stage's class, the messages its
buses must decode, and which stages send to a stage. The kinds themselves are
:data:`pdflow.plugins.stage_kinds` (built-in, entry points, ``"module:Class"``); the pipeline
(:mod:`pdflow.config.pipeline`) is plain data and names them only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdflow.messages import with_plugins
from pdflow.plugins import stage_kinds

if TYPE_CHECKING:
    from pdflow.config.pipeline import Pipeline


def stage_class(pipeline: Pipeline, name: str) -> type:
    """The class of stage ``name`` (LookupError: unknown kind; ImportError: not installed)."""
    return stage_kinds.load(pipeline.stages[name].kind_name)


def message_types(pipeline: Pipeline) -> tuple[type, ...]:
    """The built-in messages plus every plug-in stage's own: what each bus decodes."""
    extra: list[type] = []
    for name in pipeline.stages:
        extra += stage_class(pipeline, name).messages
    return with_plugins(tuple(extra))


def wired_to(pipeline: Pipeline, stage: str, output: str | None = None) -> frozenset[str]:
    """The stages with an output (named ``output``, if given) that the pipeline wires to ``stage``."""
    found = set()
    for name, config in pipeline.stages.items():
        outputs = stage_class(pipeline, name).outputs
        if stage in {config.outputs.get(out) or target for out, target in outputs.items() if output in (None, out)}:
            found.add(name)
    return frozenset(found)
