"""Mixed into the stages that run a decode batch (``self.batch``): its size now and the steps and
rows it ran, reported with each heartbeat (``pdflow_decode_batch_size``, ``pdflow_decode_steps``,
``pdflow_decode_step_rows`` in :mod:`pdflow.serving.metrics`; rows ÷ steps is the mean batch)."""

from __future__ import annotations


class CountsDecodeSteps:
    decode_steps = 0
    decode_step_rows = 0

    def step_batch(self):
        """``self.batch.step()``, counted (on the step thread)."""
        rows = len(self.batch)
        if rows:
            self.decode_steps += 1
            self.decode_step_rows += rows
        return self.batch.step()

    def batch_stats(self) -> dict[str, int]:
        return {"batch_size": len(self.batch), "decode_steps": self.decode_steps,
                "decode_step_rows": self.decode_step_rows}
