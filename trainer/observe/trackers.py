"""Experiment trackers that receive every metrics.jsonl record on rank 0 (metrics.jsonl itself is
always written). A tracker is a sink: `log(record)` and `close()`; it gets the records as
metrics.jsonl has them (NaN and inf already null), the resolved config when it opens, and the
end-of-run summary record as the run's summary.

A resumed run continues the same tracker run: its id is kept in <run dir>/trackers.json, written
when the tracker run is created."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

from trainer.config.schema import to_dict, tracker_names
from trainer.errors import UserError
from trainer.io import dotted_keys, one_line, write_atomic
from trainer.observe.metrics import METRICS_FILE, TENSORBOARD_DIR, read_metrics, require_tracker

TRACKERS_FILE = "trackers.json"
PROJECT = "dtrain"  # the W&B project and MLflow experiment unless WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME say
# Keys every record has: a record with nothing else is not sent.
_RECORD_KEYS = ("step", "time")


class Sink(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A record's numbers (the non-finite ones are null in metrics.jsonl: not sent, as no tracker
    here shows a null; the step's other numbers still are)."""
    return {k: v for k, v in record.items()
            if k not in _RECORD_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)}


def summary_of(record: dict[str, Any]) -> dict[str, float]:
    """The end-of-run summary record's figures (metrics.jsonl: {"summary": {...}}), numbers only."""
    summary = record.get("summary")
    return scalars(summary) if isinstance(summary, dict) else {}


class TensorBoardSink:
    """Scalars of every record as TensorBoard events in <run dir>/tensorboard/."""

    def __init__(self, run_dir: Path, resume_step: int = 0):
        require_tracker("tensorboard")
        # an optional extra (and it loads torch's writer): imported only for runs that use it
        from torch.utils.tensorboard import SummaryWriter

        # TensorBoard hides events at steps >= purge_step (the resumed step itself is kept), as
        # metrics.jsonl drops the lines past it.
        purge_step = resume_step + 1 if resume_step else None
        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=purge_step)

    def log(self, record: dict[str, Any]) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run: history rows at W&B step = dtrain step, the config, the summary.
    Its files go to <run dir>/wandb/ (or $WANDB_DIR); WANDB_MODE=offline needs no network."""

    def __init__(self, run_dir: Path, config: dict, previous: dict | None):
        require_tracker("wandb")
        # the optional extra dtrain[wandb] (a heavy import): only runs that log to W&B load it
        import wandb

        previous = previous or {}
        try:
            self.run = wandb.init(
                project=previous.get("project") or os.environ.get("WANDB_PROJECT", PROJECT),
                name=run_dir.name,
                id=previous.get("id"),
                resume="allow" if previous else None,  # allow: a run made offline may be unknown online
                dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
                config=config,
                allow_val_change=True,  # a continuation may change how it is launched (world, ...)
            )
        except wandb.Error as err:
            raise UserError(
                f"logger=wandb could not start a W&B run: {one_line(err)}; run `wandb login`, or set "
                "WANDB_MODE=offline and `wandb sync` the run later"
            ) from None
        self.record = {"id": self.run.id, "project": self.run.project}
        self.finished = False

    def log(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if values:
            self.run.log(values, step=record["step"])
        summary = summary_of(record)
        if summary:
            self.run.summary["summary"] = summary
            self.finished = True

    def close(self) -> None:
        # A run that stops before its summary (a signal, an error) is marked failed; its
        # continuation reopens it.
        self.run.finish(exit_code=0 if self.finished else 1)


class MlflowSink:
    """An MLflow run: metrics at MLflow step = dtrain step, the config as parameters, the summary as
    `summary.*` metrics. The store is $MLFLOW_TRACKING_URI, else ./mlruns (a file store)."""

    def __init__(self, run_dir: Path, config: dict, previous: dict | None):
        require_tracker("mlflow")
        # the optional extra dtrain[mlflow] (a heavy import): only runs that log to MLflow load it
        import mlflow

        self.mlflow = mlflow
        uri = (previous or {}).get("tracking_uri") or mlflow_tracking_uri()
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store unless told otherwise, and mlflow-skinny has no SQL
            # store: the file store is the local store that works without a server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(uri)
        try:
            if previous:
                self.run_id = previous["run_id"]
                self.client.update_run(self.run_id, status="RUNNING")
                logged = self.client.get_run(self.run_id).data.params
            else:
                self.run_id = self._create_run(run_dir)
                logged = {}
            self._log_params(config, logged)
        except mlflow.exceptions.MlflowException as err:
            raise UserError(
                f"logger=mlflow could not use the MLflow store {uri}: {one_line(err)}; "
                "check MLFLOW_TRACKING_URI"
            ) from None
        self.record = {"run_id": self.run_id, "tracking_uri": uri}
        self.finished = False

    def _create_run(self, run_dir: Path) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        run = self.client.create_run(experiment_id, run_name=run_dir.name, tags={"dtrain.run_dir": str(run_dir)})
        return run.info.run_id

    def _log_params(self, config: dict, logged: dict[str, str]) -> None:
        """The config as dotted parameters, each cut to MLflow's value length limit. MLflow's
        parameters cannot change: on a continuation only keys the run does not have yet are added
        (resolved_config.json holds the current values)."""
        limit = self.mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
        params = [self.mlflow.entities.Param(key, str(value)[:limit])
                  for key, value in dotted_keys(config).items() if key not in logged]
        batch = self.mlflow.utils.validation.MAX_PARAMS_TAGS_PER_BATCH
        for start in range(0, len(params), batch):
            self.client.log_batch(self.run_id, params=params[start:start + batch])

    def log(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        summary = summary_of(record)
        values.update({f"summary.{key}": value for key, value in summary.items()})
        if values:
            timestamp = int(record.get("time", time.time()) * 1000)
            metric = self.mlflow.entities.Metric
            self.client.log_batch(self.run_id, metrics=[metric(key, float(value), timestamp, record["step"])
                                                        for key, value in values.items()])
        self.finished = self.finished or bool(summary)

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if self.finished else "KILLED")


def mlflow_tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI, else ./mlruns as an absolute file: URI: MLflow's own default folder, so
    `mlflow ui` there compares every run and sweep point (and a continuation from another folder
    reopens the same store: the URI is kept in trackers.json)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or Path("mlruns").absolute().as_uri()


class SentOnce:
    """Sends each (step, key) to a tracker once: a step's records share keys (every one has
    `tokens`), and a continuation starts with the pairs the interrupted run already sent (what
    metrics.jsonl held past the resumed step). MLflow would keep a second value for the step, W&B
    drops a step below its last one."""

    def __init__(self, sink: Sink, sent: dict[int, set[str]]):
        self.sink, self.sent = sink, sent

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for done in [s for s in self.sent if s < step]:  # steps only grow (but for a rollback)
            del self.sent[done]
        sent = self.sent.setdefault(step, set())
        record = {k: v for k, v in record.items() if k in _RECORD_KEYS or k not in sent}
        sent.update(k for k in record if k not in _RECORD_KEYS)
        if set(record) - set(_RECORD_KEYS):
            self.sink.log(record)

    def close(self) -> None:
        self.sink.close()


def already_sent(run_dir: Path, resume_step: int) -> dict[int, set[str]]:
    """The keys per step past `resume_step` that the interrupted run logged (read before
    metrics.jsonl drops those lines)."""
    sent: dict[int, set[str]] = {}
    for record in read_metrics(run_dir / METRICS_FILE):
        if record.get("step", 0) > resume_step:
            sent.setdefault(record["step"], set()).update(set(record) - set(_RECORD_KEYS))
    return sent


def read_tracker_runs(run_dir: Path) -> dict[str, dict]:
    """trackers.json: each tracker's run id (and where it lives), by tracker name."""
    path = run_dir / TRACKERS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


REMOTE_SINKS = {"wandb": WandbSink, "mlflow": MlflowSink}


def open_trackers(cfg, run_dir: Path, resume_step: int) -> list[Sink]:
    """The sinks `logger=` asks for (none for jsonl alone), on rank 0. Each W&B / MLflow run is
    recorded in trackers.json as soon as it exists, and reopened by a continuation."""
    runs = read_tracker_runs(run_dir)
    config = to_dict(cfg)
    sinks: list[Sink] = []
    # what an interrupted run sent past the resumed step, read once for every tracker it had open
    sent_before = already_sent(run_dir, resume_step) if runs else {}
    try:
        for name in tracker_names(cfg.logger):
            if name == "tensorboard":
                sinks.append(TensorBoardSink(run_dir, resume_step))
                continue
            sink = REMOTE_SINKS[name](run_dir, config, runs.get(name))
            sent = {step: set(keys) for step, keys in sent_before.items()} if name in runs else {}
            runs[name] = sink.record
            write_atomic(run_dir / TRACKERS_FILE, json.dumps(runs, indent=2) + "\n")
            sinks.append(SentOnce(sink, sent))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
