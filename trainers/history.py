"""A job's step metrics over time, kept in storage for the API, the web page and TensorBoard.

Rank 0 buffers a row at every log step and writes the buffer as one small file per
reported checkpoint (``<job>/metrics/<first step>-<last step>.jsonl``), so a run writes
O(steps) bytes in all and nothing is appended in place (S3 cannot append). A checkpoint carries
the rows not yet written, and the attempt that restores it writes them. Steps re-done after an
interruption appear twice; readers keep the row written last.
"""

from __future__ import annotations

import json
import re
import time

from cluster.storage import StorageRoot
from trainers.job_folder import HISTORY_DIR

ROW_KEYS = ("step", "target_step", "epochs_done", "loss", "learning_rate", "samples_per_s", "tokens_per_s", "world_size",
            "data_wait_fraction", "step_time_s", "goodput", "cost_usd", "savings_usd", "checkpoint_save_s", "checkpoint_report_s")


class MetricsHistory:
    def __init__(self, root: StorageRoot, job: str):
        self.root, self.job = root, job
        self.rows: list[dict] = []

    def add(self, metrics: dict) -> None:
        self.rows.append({"time": time.time(), **{k: metrics[k] for k in ROW_KEYS if k in metrics}})

    def carry(self, row: dict) -> None:
        """A row from before a restart (a restored checkpoint carried it), as it was recorded."""
        self.rows.append(dict(row))

    def pending(self) -> list[dict]:
        """The rows not yet written, for a checkpoint to carry (its snapshot copies them; a row is never changed)."""
        return list(self.rows)

    def flush(self) -> None:
        """Write the rows since the last flush as one file; called at reported checkpoints and at the end."""
        self.write(self.take())

    def take(self) -> list[dict]:
        """The rows since the last flush, handed over (the training thread takes, a background thread writes)."""
        rows, self.rows = self.rows, []
        return rows

    def write(self, rows: list[dict]) -> None:
        if not rows:
            return
        name = f"{rows[0]['step']:010d}-{rows[-1]['step']:010d}-{int(rows[-1]['time'] * 1000)}.jsonl"
        self.root.write_bytes("".join(json.dumps(r) + "\n" for r in rows).encode(), self.job, HISTORY_DIR, name)


# The most of a job's history one read takes (its newest files): ~200,000 rows, far past what a chart
# shows; the job (so its tenant) writes these files, and readers such as the service must stay bounded.
HISTORY_MAX_BYTES = 32 << 20


def read_history(root: StorageRoot, job: str, max_bytes: int = HISTORY_MAX_BYTES) -> list[dict]:
    """Every recorded step of a job, in step order; a step recorded twice keeps its latest row.
    At most ``max_bytes`` of files are read, the newest steps' (older files beyond are left out)."""
    import pyarrow.fs as pafs

    if not root.exists(job, HISTORY_DIR):
        return []
    infos = [i for i in root.fs.get_file_info(pafs.FileSelector(root.path(job, HISTORY_DIR)))
             if i.path.endswith(".jsonl") and i.type == pafs.FileType.File]
    kept, budget = [], max_bytes
    for info in sorted(infos, key=lambda i: i.path, reverse=True):
        if info.size > budget:
            break
        budget -= info.size
        kept.append(info)
    by_step: dict[int, dict] = {}
    for info in reversed(kept):
        with root.fs.open_input_stream(info.path) as f:
            for line in f.read().decode(errors="replace").splitlines():
                row = _row(line)
                if row and (row["step"] not in by_step or row["time"] >= by_step[row["step"]]["time"]):
                    by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


FILE_NAME = re.compile(r"^(\d+)-(\d+)-\d+\.jsonl$")  # <first step>-<last step>-<ms>.jsonl, as ``write`` names it
TAIL_BYTES = 256 * 1024  # of one file, enough for hundreds of rows at its end
TAIL_BUDGET_BYTES = 4 << 20  # of all files one tail reads: files of no valid rows must not make it read them all


def read_history_tail(root: StorageRoot, job: str, rows: int) -> list[dict]:
    """The last ``rows`` recorded steps, as ``read_history`` would end, at the cost of a few files'
    ends: files are read newest steps first (by the last step in their name) until no file left
    can hold a step among those, each only its last ``TAIL_BYTES`` (a file's rows go up in step).
    A file not named as ``write`` names them is not read (the job writes this folder)."""
    import pyarrow.fs as pafs

    if not root.exists(job, HISTORY_DIR):
        return []
    named = []
    for info in root.fs.get_file_info(pafs.FileSelector(root.path(job, HISTORY_DIR))):
        m = FILE_NAME.match(info.base_name)
        if m and info.type == pafs.FileType.File:
            named.append((int(m[2]), info))
    by_step: dict[int, dict] = {}
    budget = TAIL_BUDGET_BYTES
    for last_step, info in sorted(named, key=lambda n: (-n[0], n[1].path)):
        if (len(by_step) >= rows and last_step < sorted(by_step)[-rows]) or budget <= 0:
            break
        budget -= min(info.size, TAIL_BYTES)
        with root.fs.open_input_file(info.path) as f:
            start = max(0, info.size - TAIL_BYTES)
            f.seek(start)
            lines = f.read().decode(errors="replace").splitlines()
        for line in lines[1:] if start else lines:
            row = _row(line)
            if row and (row["step"] not in by_step or row["time"] >= by_step[row["step"]]["time"]):
                by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)[-rows:]] if rows > 0 else []


def _row(line: str) -> dict | None:
    """A history row, or None for a line that is not one (the job writes these files: readers,
    the service among them, must not trip over a damaged or hostile line)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    ok = (isinstance(row, dict) and type(row.get("step")) is int and isinstance(row.get("time"), (int, float))
          and not isinstance(row.get("time"), bool))
    return row if ok else None
