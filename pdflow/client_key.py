"""The API key of pdflow's client commands (``pdflow top``, ``trace``, ``bench serve``,
``bench output-api``): one flag, ``--api-key``, with ``$PDFLOW_API_KEY`` as its default, sent as
``Authorization: Bearer``."""

from __future__ import annotations

import argparse
import os

ENV = "PDFLOW_API_KEY"


def add_argument(parser: argparse.ArgumentParser, *also_env: str) -> None:
    """``--api-key`` on ``parser``; its default is ``$PDFLOW_API_KEY``, then each of ``also_env``."""
    names = ", ".join(f"${name}" for name in (ENV, *also_env))
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help=f"the API key, when the server wants one (default: {names}, else none)")
    parser.set_defaults(api_key_env=(ENV, *also_env))


def api_key(args: argparse.Namespace) -> str | None:
    """The key the command was given, or the first environment variable of its defaults that is set."""
    if getattr(args, "api_key", None):
        return args.api_key
    return next((os.environ[name] for name in getattr(args, "api_key_env", (ENV,)) if os.environ.get(name)), None)


def headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}
