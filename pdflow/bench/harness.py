"""``pdflow bench lm-eval``: lm-evaluation-harness scoring the served model, beside its own
Hugging Face backend on the same model, and through each KV codec.

The task is ``pdflow_facts`` (``pdflow/bench/lm_eval_data/facts.jsonl``: fifty questions written
for this benchmark), in two parts:

- ``pdflow_facts_mc``: multiple choice by loglikelihood, sent by lm-eval's ``local-completions``
  (``echo`` with prompt logprobs, token ids as the prompt), scored ``acc`` / ``acc_norm``;
- ``pdflow_facts_gen``: the answer generated (greedy, at most 8 tokens) by lm-eval's
  ``local-chat-completions``, its last word scored by exact match (case and punctuation ignored:
  the model tends to answer "The capital of France is Paris.").

lm-eval's ``hf`` backend runs both on the same model directory, in float32; pdflow serves it with
``weights = "fp32"`` (so that loglikelihoods can agree to the last digits) through each codec of
``--codecs`` on every link. Printed: each backend's accuracies side by side, and the largest
per-item loglikelihood difference from the HF backend. A loglikelihood is computed by prefill
over the whole prompt (no KV crosses a link for it), so the codecs change only the generated part.

Needs ``pip install 'pdflow[eval]'`` (lm-eval with its API models).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

DESCRIPTION = __doc__
DATA = Path(__file__).parent / "lm_eval_data" / "facts.jsonl"
TASKS = ("pdflow_facts_mc", "pdflow_facts_gen")

_COMMON = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
_MC = _COMMON + """task: pdflow_facts_mc
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
"""
_GEN = _COMMON + """task: pdflow_facts_gen
output_type: generate_until
doc_to_text: "{{{{question}}}} Answer with one word."
doc_to_target: target
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
filter_list:
  - name: last-word
    filter:
      - function: regex
        regex_pattern: "([A-Za-z][A-Za-z-]*)[^A-Za-z]*$"
      - function: take_first
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
"""


def write_tasks(where: Path) -> Path:
    """The task files, pointing at the shipped data by absolute path."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "pdflow_facts_mc.yaml").write_text(_MC.format(data=DATA.resolve()))
    (where / "pdflow_facts_gen.yaml").write_text(_GEN.format(data=DATA.resolve()))
    return where


def _evaluate(model: str, model_args: str, task: str, tasks_dir: Path, chat: bool, limit: int | None) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task],
                                  task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True,
                                  apply_chat_template=chat, limit=limit, batch_size=1)
    return {"metrics": out["results"][task], "samples": out["samples"][task]}


def _loglikelihoods(samples: list[dict]) -> dict[tuple[int, int], float]:
    """(document, choice) -> the loglikelihood lm-eval read for it."""
    found = {}
    for sample in samples:
        for choice, response in enumerate(sample["resps"]):
            found[(sample["doc_id"], choice)] = float(response[0][0])
    return found


def _metric(result: dict, name: str) -> float:
    return next(v for k, v in result["metrics"].items() if k.split(",")[0] == name)


def _served(model_dir: Path, codec: str, workdir: Path):
    from pdflow.testing.server import PdflowServer

    return PdflowServer(workdir, codec=codec, args=("--model", str(model_dir), "--set", 'model.weights="fp32"',
                                                    "--served-model-name", "model"))


def run(args: argparse.Namespace) -> dict:
    from pdflow.models import resolve

    model_dir = resolve(args.model, progress=sys.stderr.isatty())
    work = Path(tempfile.mkdtemp(prefix="pdflow-lm-eval-"))
    tasks_dir = write_tasks(work / "tasks")
    tokenizer = f"tokenizer={model_dir},tokenizer_backend=huggingface"
    rows = {}
    if not args.skip_hf:
        started = time.monotonic()
        hf = f"pretrained={model_dir},dtype=float32,device=cpu"
        rows["hf"] = {"mc": _evaluate("hf", hf, "pdflow_facts_mc", tasks_dir, False, args.limit),
                      "gen": _evaluate("hf", hf, "pdflow_facts_gen", tasks_dir, True, args.limit),
                      "seconds": time.monotonic() - started}
    for codec in args.codecs:
        (work / codec).mkdir()
        started = time.monotonic()
        with _served(model_dir, codec, work / codec) as server:
            completions = f"model=model,base_url={server.url}/v1/completions,{tokenizer},num_concurrent=1"
            chat = f"model=model,base_url={server.url}/v1/chat/completions,num_concurrent=1"
            rows[f"pdflow {codec}"] = {
                "mc": _evaluate("local-completions", completions, "pdflow_facts_mc", tasks_dir, False, args.limit),
                "gen": _evaluate("local-chat-completions", chat, "pdflow_facts_gen", tasks_dir, True, args.limit),
                "seconds": time.monotonic() - started}
    return {"model": str(model_dir), "rows": rows}


def report(result: dict) -> str:
    rows = result["rows"]
    reference = rows.get("hf")
    lines = [f"lm-eval on pdflow_facts ({result['model']}); loglikelihood gap: largest |pdflow - hf| per item",
             f"{'backend':<16}{'mc acc':>8}{'acc_norm':>10}{'gen exact':>11}{'loglik gap':>12}{'seconds':>9}"]
    for name, row in rows.items():
        gap = ""
        if reference is not None and name != "hf":
            ours, theirs = _loglikelihoods(row["mc"]["samples"]), _loglikelihoods(reference["mc"]["samples"])
            gap = f"{max(abs(ours[k] - theirs[k]) for k in theirs):.2e}"
        lines.append(f"{name:<16}{_metric(row['mc'], 'acc'):>8.3f}{_metric(row['mc'], 'acc_norm'):>10.3f}"
                     f"{_metric(row['gen'], 'exact_match'):>11.3f}{gap:>12}{row['seconds']:>9.1f}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="a known model, a GGUF file or a model directory "
                   "(default: %(default)s)")
    p.add_argument("--codecs", type=lambda s: [c for c in s.split(",") if c], default=["none", "int8", "int4"],
                   help="the KV codecs to serve through, comma-separated (default: none,int8,int4)")
    p.add_argument("--limit", type=int, default=None, help="only the first N questions of each task")
    p.add_argument("--skip-hf", action="store_true", help="do not run lm-eval's own HF backend")
    p.add_argument("--out", default=None, metavar="JSON", help="also write the metrics (no samples) here")


def main(args: argparse.Namespace) -> int:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        sys.stderr.write("error: lm-eval is not installed: pip install 'pdflow[eval]'\n")
        return 1
    result = run(args)
    sys.stdout.write(report(result) + "\n")
    if args.out:
        slim = {name: {part: row[part]["metrics"] for part in ("mc", "gen")} | {"seconds": row["seconds"]}
                for name, row in result["rows"].items()}
        Path(args.out).write_text(json.dumps({"model": result["model"], "rows": slim}, indent=2, default=str))
    return 0
