"""Where a run's records go: :class:`MetricsWriter` (``metrics.jsonl`` and TensorBoard under
``tb/``, tags :data:`TB_TAGS`), written by the main process only (:func:`is_main_process`), and the FLOP count behind MFU (:func:`mfu`
of :func:`flops_per_token`; the formula: docs/training.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax

from jaxpar.errors import LoopError


#: JSONL record key -> TensorBoard tag.
TB_TAGS = {
    "loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr", "skipped": "train/skipped_steps",
    "step_time": "perf/step_time_s", "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu",
    "data_wait": "perf/data_wait_s", "memory_peak": "perf/memory_peak_bytes",
    "eval_loss": "eval/loss",
}


def mfu(tokens_per_s: float, flops_per_tok: float, *, peak_flops: float, devices: int) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over ``devices x peak_flops``.

    Args:
      tokens_per_s: the measured throughput, all devices together.
      flops_per_tok: training FLOPs per token (:func:`flops_per_token`).
      peak_flops: the peak FLOP/s of one device.
      devices: how many devices ran it.

    Returns:
      The MFU as a fraction (0.284 is 28.4 %).
    """
    if peak_flops <= 0 or devices < 1:
        raise LoopError(f"mfu(peak_flops={peak_flops!r}, devices={devices!r}): both must be positive.")
    return tokens_per_s * flops_per_tok / (peak_flops * devices)


def flops_per_token(n_params: int, *, layers: int, seq_len: int, embed: int, tables: int = 0) -> float:
    """Training (forward + backward) FLOPs per token: ``6 N + 12 L T d`` (PaLM, appendix B; docs/training.md),
    the FLOPs behind MFU (:func:`mfu`).

    Args:
      n_params: the model's parameters.
      layers: ``L``, the attention layers.
      seq_len: ``T``, tokens per sequence.
      embed: ``d``, the attention width (heads x head size).
      tables: parameters in embedding tables (no matrix multiply): ``N = n_params - tables``.

    Returns:
      FLOPs per token.

    Example:
      >>> round(flops_per_token(85_000_000, layers=12, seq_len=1024, embed=768) / 1e6)  # 6 x 85M + 12 x 12 x 1024 x 768
      623
      >>> flops_per_token(10_000, layers=2, seq_len=8, embed=32, tables=(16 + 8) * 32)   # a GPT's token + position
      61536.0
    """
    for name, value in (("n_params", n_params), ("layers", layers), ("seq_len", seq_len), ("embed", embed),
                        ("tables", tables)):
        if value < 0:
            raise LoopError(f"flops_per_token({name}={value!r}): must be >= 0.")
    return 6.0 * (n_params - tables) + 12.0 * layers * seq_len * embed


def is_main_process() -> bool:
    """Whether this is the one process that logs and writes files.

    Returns:
      ``jax.process_index() == 0``.
    """
    return jax.process_index() == 0


class MetricsWriter:
    """``metrics.jsonl`` (one JSON object per line) and optionally TensorBoard scalars under ``<out_dir>/tb``.

    Args:
      out_dir: the folder of ``metrics.jsonl`` and ``tb/`` (None: write nothing).
      tensorboard: also write TensorBoard scalars (tags from :data:`TB_TAGS`).
      resume_step: continue an earlier run's files: JSONL records after that step (written by a run that
        died before its next checkpoint) are dropped (read into ``dropped``) and TensorBoard events after it
        are purged.
      enabled: False writes nothing (processes other than 0).
    """

    def __init__(self, out_dir: str | Path | None, *, tensorboard: bool = False, resume_step: int | None = None,
                 enabled: bool = True):
        self.path = self.tb_dir = None
        self._file = self._tb = None
        self.history: list[dict] = []    # earlier records kept on resume
        self.dropped: list[dict] = []    # earlier records after resume_step (a run that died later), dropped
        if out_dir is None or not enabled:
            return
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue       # a line cut by a crash
                (self.history if rec.get("step", 0) <= resume_step else self.dropped).append(rec)
        self._file = open(self.path, "w")
        for rec in self.history:
            self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.tb_dir = out / "tb"
            self._tb = SummaryWriter(str(self.tb_dir), purge_step=resume_step + 1 if resume_step else None)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` to the JSONL file and its numbers to TensorBoard.

        Args:
          record: a JSON-able dict with a ``step``; keys with a ``/`` also become TensorBoard tags.
        """
        if self._file is None:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            tags = {**TB_TAGS, **{k: k for k in record if "/" in k}}    # a loss's own metrics: their names
            for key, tag in tags.items():
                value = record.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
