"""Speculative decoding: a proposer drafts tokens, the target model verifies a whole batch's
drafts in one forward pass, each sequence keeps what the target agrees with (greedy: exactly the
tokens decoding without a draft gives; sampling: rejection sampling keeps the target's
distribution).

Proposers are plug-ins, selected in a topology's ``[speculative]`` table (``method = "ngram"``,
with the method's own parameters beside ``num_tokens`` and the rest) and registered under the
entry-point group ``pdflow.proposers`` (a :class:`Proposer` subclass). Built in: ``ngram``
(prompt lookup) and ``self-draft`` (the model's first layers and its head).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdflow import plugins
from pdflow.speculative.base import NO_DRAFT, Draft, Proposer
from pdflow.speculative.speculation import Speculation

if TYPE_CHECKING:
    from pdflow.config.pipeline import SpeculativeConfig

registry = plugins.proposers
BUILTIN, ENTRY_POINT_GROUP = registry.builtin, registry.group

__all__ = ["BUILTIN", "Draft", "ENTRY_POINT_GROUP", "NO_DRAFT", "Proposer", "Speculation", "proposer", "registry",
           "speculation_for"]


def speculation_for(config: SpeculativeConfig, loaded) -> Speculation | None:
    """The speculation a topology's ``[speculative]`` table asks for, for model ``loaded``
    (None when off)."""
    if not config.enabled:
        return None
    return Speculation(proposer(config.method, loaded, **config.options), config.num_tokens, config.adaptive,
                       config.max_rows, config.row_cost, config.probe_every)


def proposer(name: str, loaded, **params: Any) -> Proposer:
    """The proposer ``name`` for ``loaded`` with ``params`` (LookupError: unknown name;
    TypeError / ValueError: bad parameters, named)."""
    return registry.load(name)(loaded, **params)
