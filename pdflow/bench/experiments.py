"""What the experiment scripts share: a report printed as it goes and kept for summary.md, and
``pdflow bench serve`` run in-process against a server."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path


class Report:
    """Lines printed at once and kept, to be written as one markdown file at the end."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def write(self, path: Path) -> None:
        path.write_text("\n".join(self.lines) + "\n")

    def run(self, title: str, parts: dict[str, Callable], opts) -> int:
        """Run the parts named in ``opts.parts`` (comma-separated), each ``part(opts, opts.out)``
        under its own heading, then write ``opts.out/summary.md``."""
        opts.out.mkdir(parents=True, exist_ok=True)
        self.say(f"# {title} ({time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.2f}, "
                 f"{os.cpu_count()} cores)")
        self.say(f"command: {' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}")
        for name in opts.parts.split(","):
            self.say()
            self.say(f"## {name}")
            parts[name](opts, opts.out)
        self.write(opts.out / "summary.md")
        self.say()
        self.say(f"written: {opts.out / 'summary.md'}")
        return 0


def figure(value, spec: str = ".0f") -> str:
    """A figure for a table; "-" where a cell has none (e.g. every request of it failed)."""
    return "-" if value is None else format(value, spec)


def bench(url: str, out: Path, argv: list[str]) -> dict:
    """``pdflow bench serve --base-url url ... argv``; the result JSON (also written to ``out``)."""
    from pdflow.bench.serve import main, parse_args

    args = parse_args(["--base-url", url, "--no-progress", "--result-json", str(out), *argv])
    main(args)
    return json.loads(out.read_text())


def one_prompt_timeline(url: str, tokens: int) -> dict:
    """Send one ``tokens``-token prompt (plain token ids, no special tokens) for two tokens; its
    timeline (``/debug/timeline``): what KV-tail measurements read."""
    import httpx

    prompt = [(i * 7919) % 40000 + 1000 for i in range(tokens)]
    reply = httpx.post(f"{url}/v1/completions", timeout=900,
                       json={"model": "smollm2", "prompt": prompt, "max_tokens": 2, "temperature": 0,
                             "ignore_eos": True}).json()
    if "id" not in reply:
        raise RuntimeError(f"the {tokens}-token request failed: {reply}")
    return httpx.get(f"{url}/debug/timeline/{reply['id']}", timeout=30).json()
